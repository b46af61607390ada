"""Benchmarks with JSON output: ``python -m dspark_kernels.bench {acceptance,serving,peers,ceiling}``."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# shipped drafters, by directory name under assets/drafters
DRAFTERS = ("dspark", "dspark_rnn", "dflash", "eagle", "mtp1")


def git_commit() -> str | None:
    """The git commit of the package's checkout (``HEAD``), or ``None`` outside one."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_record() -> dict:
    """Where and at what commit a result was measured: CPU/GPU name, thread count, library versions, git commit."""
    rec = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available(),
           "commit": git_commit()}
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
    return rec
