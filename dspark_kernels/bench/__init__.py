"""Benchmarks with JSON output: ``python -m dspark_kernels.bench {acceptance,serving,peers,ceiling}``."""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# shipped drafters, by directory name under assets/drafters
DRAFTERS = ("dspark", "dspark_rnn", "dflash", "eagle", "mtp1")


def positive_int(text: str) -> int:
    """argparse ``type`` for counts that must be >= 1 (argparse names the option in its error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type`` for counts that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type`` for finite values > 0 (speeds, rates)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def device_record() -> dict:
    """Where a result was measured: CPU/GPU name, thread count, library versions."""
    rec = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
    return rec
