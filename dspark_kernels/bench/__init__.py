"""Benchmarks with JSON output: ``python -m dspark_kernels.bench {acceptance,serving,peers,ceiling}``."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# shipped drafters, by directory name under assets/drafters
DRAFTERS = ("dspark", "dspark_rnn", "dflash", "eagle", "mtp1")


def device_record() -> dict:
    """Where a result was measured: CPU/GPU name, thread count, library versions."""
    rec = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
    return rec
