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
