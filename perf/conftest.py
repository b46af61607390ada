"""Benchmark setup: device/version info and roofline figures attached to every pytest-benchmark record.

Each benchmark calls ``record(benchmark, shapes=..., bytes_moved=..., flops=...)``; on a GPU the record also carries
achieved GB/s, TFLOP/s and % of the device's peak (from ``PEAKS``), so a JSON run shows the distance to the roofline.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from perf.roofline import device_info, record  # noqa: E402,F401


@pytest.fixture
def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["dspark_device"] = device_info()


@pytest.fixture
def interpreted_smoke(benchmark) -> torch.device:
    """For a Triton benchmark's smoke run where there is no GPU: its setup, launch and record code run once under the
    interpreter at a tiny shape, only when nothing is timed (``--benchmark-disable``, as CI runs the suite), so the
    GPU benchmarks cannot rot unseen. Skipped with a GPU (the real benchmark runs) and when timing (the interpreter is
    not a speed reference)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real Triton benchmark")
    if not benchmark.disabled:
        pytest.skip("interpreted smoke run only with --benchmark-disable (the interpreter is not a speed reference)")
    return torch.device("cpu")
