"""What a kept tensor derived from a weight was made from, to tell when it must be made again."""

from __future__ import annotations

import torch

__all__ = ["tensor_key"]


def tensor_key(t: torch.Tensor) -> tuple:
    """``t``'s storage address, shape, strides, dtype, device and version counter: equal keys mean the same values
    (a replaced tensor changes the address, an in-place update bumps the version). An inference tensor has no version
    counter (``None`` in the key), so an in-place update of it cannot be told: callers that keep copies of inference
    tensors make them per call."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, None if t.is_inference() else t._version)
