"""The op contract's dispatch rule: Triton for CUDA tensors, the PyTorch reference on the CPU.

``impl`` (per call) overrides the environment variable ``DSPARK_IMPL``, which overrides ``"auto"``.
``"triton"`` on CPU tensors is allowed only under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the
test suite checks every kernel against its reference on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "triton", "torch")


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for an op whose tensors live on ``device``."""
    choice = impl if impl is not None else os.environ.get("DSPARK_IMPL", "auto")
    if choice not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (argument impl or env DSPARK_IMPL), got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        if device.type != "cuda" and not triton_interpreted():
            raise RuntimeError(
                f"impl='triton' needs CUDA tensors (got device {device}) or the interpreter (TRITON_INTERPRET=1)"
            )
    return choice


H100_SMS = 132  # the SM count plans assume off a GPU (the interpreter, offline traffic counts): an H100/H200's


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device's own count; :data:`H100_SMS` elsewhere), for grid
    plans that aim at full waves."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_SMS
