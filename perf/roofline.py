"""Roofline bookkeeping for the perf suites: device facts, peak numbers, and per-benchmark extra_info."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

import torch

import dspark_kernels

# Dense peaks (bytes/s, FLOP/s) by GPU-name substring; datasheet numbers, bf16/fp16 tensor-core FLOPs. The longest
# key contained in the device name wins ("NVIDIA L40S" is an L40S, not an L4); None marks names whose variants differ
# too much to guess (GH200 ships with 4.0 or 4.9 TB/s), which get no roofline percentages.
PEAKS: dict[str, tuple[float, float] | None] = {
    "H200": (4.8e12, 989e12),
    "GH200": None,
    "H100": (3.35e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "A100": (2.0e12, 312e12),
    "A100-SXM4-40GB": (1.555e12, 312e12),
    "A100-PCIE-40GB": (1.555e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "L40": (0.864e12, 181e12),
    "L4": (0.3e12, 121e12),
    "4090": (1.0e12, 165e12),
}


@functools.cache
def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the platform's processor or machine string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _commit() -> str | None:
    """The repository's commit, when the suite runs from a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_info() -> dict:
    info = {
        "dspark_kernels": dspark_kernels.__version__,
        "commit": _commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        from dspark_kernels.autotune import device_name

        info["gpu"] = device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def peak_for(gpu: str | None) -> tuple[float, float] | None:
    """The device's ``(bytes/s, FLOP/s)`` peaks by the longest :data:`PEAKS` key in its name (``None``: unknown)."""
    keys = [key for key in PEAKS if gpu and key in gpu]
    return PEAKS[max(keys, key=len)] if keys else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record(benchmark, *, shapes: dict, bytes_moved: float, flops: float, impl: str,
           min_bytes: float | None = None) -> None:
    """Attach shapes, bytes, FLOPs and (after the run, for a Triton benchmark on a GPU) achieved rates and % of peak
    to the record. ``device.ran_on`` says where the timed op ran: the Triton benchmarks on the GPU when there is one,
    the PyTorch reference ones (``impl="torch"``) on the CPU, also on a GPU machine, so they get no GPU roofline.
    ``min_bytes``: the traffic the op cannot avoid; on a GPU ``pct_min_bytes_roofline`` is the bandwidth floor of that
    traffic as a % of the measured time (100 = at the roofline)."""
    info = device_info()
    on_gpu = info["cuda"] and impl == "triton"
    info["ran_on"] = info.get("gpu", "cuda") if on_gpu else info["cpu"]
    benchmark.extra_info.update(
        {"shapes": shapes, "bytes": float(bytes_moved), "flops": float(flops), "impl": impl, "device": info}
    )
    if min_bytes is not None:
        benchmark.extra_info["min_bytes"] = float(min_bytes)
    stats = getattr(benchmark, "stats", None)
    if stats is None or not on_gpu:
        return
    median = stats.stats.median
    peak = peak_for(info.get("gpu"))
    benchmark.extra_info["achieved_GBps"] = bytes_moved / median / 1e9
    benchmark.extra_info["achieved_TFLOPs"] = flops / median / 1e12
    if peak is not None:
        benchmark.extra_info["pct_peak_bw"] = 100 * bytes_moved / median / peak[0]
        benchmark.extra_info["pct_peak_flops"] = 100 * flops / median / peak[1]
        if min_bytes is not None:
            benchmark.extra_info["pct_min_bytes_roofline"] = 100 * min_bytes / median / peak[0]
