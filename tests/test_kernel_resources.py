"""Every kernel, compiled offline at its default config for sm_80 and sm_90 (``perf/kernel_resources.py``: the
``ptxas -v`` Triton bundles), spills no registers, except the compiles listed in ``KNOWN_SPILLS``: those still spill
(the measured bytes are in ``results/kernel_resources.json``). The list is exact: a new spill fails, and so does a
listed compile that stops spilling (take it off the list)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KNOWN_SPILLS = {
    # a 128-row draft block tile (gamma 16 x GQA group 8) on sm_80 (152 B)
    ("draft_block_attention._draft_block_attention_kernel", "sm_80", "BLOCK_M=128"),
}


def _tag(row: dict) -> str:
    cfg = row["config"]
    return f"KIND={cfg['KIND']}" if "KIND" in cfg and "STORE" not in cfg else f"BLOCK_M={cfg.get('BLOCK_M')}"


def test_no_spills_at_the_defaults(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not interpret
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "kernel_resources.py"), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    spills = {(row["kernel"], row["arch"], _tag(row)) for row in rows if row["spill_bytes"]}
    assert spills - KNOWN_SPILLS == set(), f"new spills at a default config: {sorted(spills - KNOWN_SPILLS)}"
    assert KNOWN_SPILLS - spills == set(), f"no longer spilling, take off the list: {sorted(KNOWN_SPILLS - spills)}"
