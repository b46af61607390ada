"""Memory layout the Triton launchers hand to their kernels."""

from __future__ import annotations

import torch


def unit_inner_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1 (what the kernels' pointer arithmetic assumes: they take
    the outer strides as arguments but step the last dimension, and every 1-D tensor, one element at a time), else a
    contiguous copy. Views such as a transposed ``page_table`` or ``cu[::2]`` are therefore read correctly."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
