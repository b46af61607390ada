"""Roofline bookkeeping for the perf suites: device facts, peak numbers, and per-benchmark extra_info."""

from __future__ import annotations

import platform

import torch

# Dense peaks (bytes/s, FLOP/s) by GPU-name substring; datasheet numbers, bf16/fp16 tensor-core FLOPs.
PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "L4": (0.3e12, 121e12),
    "4090": (1.0e12, 165e12),
}


def device_info() -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
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
    if not gpu:
        return None
    for key, peak in PEAKS.items():
        if key in gpu:
            return peak
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record(benchmark, *, shapes: dict, bytes_moved: float, flops: float, impl: str) -> None:
    """Attach shapes, bytes, FLOPs and (after the run, on a GPU) achieved rates and % of peak to the record."""
    info = device_info()
    benchmark.extra_info.update(
        {"shapes": shapes, "bytes": float(bytes_moved), "flops": float(flops), "impl": impl, "device": info}
    )
    stats = getattr(benchmark, "stats", None)
    if stats is None or not info["cuda"]:
        return
    median = stats.stats.median
    peak = peak_for(info.get("gpu"))
    benchmark.extra_info["achieved_GBps"] = bytes_moved / median / 1e9
    benchmark.extra_info["achieved_TFLOPs"] = flops / median / 1e12
    if peak is not None:
        benchmark.extra_info["pct_peak_bw"] = 100 * bytes_moved / median / peak[0]
        benchmark.extra_info["pct_peak_flops"] = 100 * flops / median / peak[1]
