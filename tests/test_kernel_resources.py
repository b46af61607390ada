"""Every kernel, compiled offline at its default config for sm_80 and sm_90 (``perf/kernel_resources.py``: the
``ptxas -v`` Triton bundles, with the arguments specialized as the JIT specializes them at launch), spills no
registers, and the attention kernels' paged loops copy their K/V tiles and page ids asynchronously into rings at
least three deep (two tiles in flight while one is computed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not interpret
    out = tmp_path_factory.mktemp("resources") / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "kernel_resources.py"), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_no_spills_at_the_defaults(rows):
    spills = [(r["kernel"], r["arch"], r["config"], r["spill_bytes"]) for r in rows if r["spill_bytes"]]
    assert spills == [], f"spills at a default config: {spills}"


def test_attention_keeps_two_kv_tiles_in_flight(rows):
    attention = [r for r in rows if "attention_kernel" in r["kernel"]]
    assert len(attention) >= 12
    shallow = [(r["kernel"], r["arch"], r["config"], r["async_buffers"]) for r in attention if r["async_buffers"] < 3]
    assert shallow == [], f"attention K/V rings shallower than 3: {shallow}"


def test_occupancy_model():
    """The resident-warps model the report uses: registers, shared memory and CTA size each bind as on the GPU."""
    sys.path.insert(0, str(ROOT))
    from perf.kernel_resources import warps_per_sm

    assert warps_per_sm(80, regs=32, smem_bytes=0, num_warps=8) == 64  # the warp limit
    assert warps_per_sm(80, regs=128, smem_bytes=0, num_warps=8) == 16  # 4096 registers a warp: 16 warps
    assert warps_per_sm(90, regs=94, smem_bytes=0, num_warps=8) == 16  # 96 rounded: 21 warps, whole CTAs of 8
    assert warps_per_sm(80, regs=32, smem_bytes=70_656, num_warps=4) == 8  # 164 KB holds 2 CTAs of 70 KB
    assert warps_per_sm(90, regs=32, smem_bytes=70_656, num_warps=4) == 12  # 228 KB holds 3
