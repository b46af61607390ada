"""Column-major storage of fp32 linear weights on the CPU: the layout that makes few-row GEMMs fast there.

``F.linear(x, w)`` with ``w [out, in]`` stored row-major runs ``x @ w.T`` with a transposed B operand. On the CPUs
measured here (Intel MKL / oneDNN in torch's CPU build), that case picks a much slower kernel for 8..48 rows than a
B operand stored ``[in, out]`` row-major, i.e. ``w`` stored column-major: ``perf/test_weight_layout_bench.py``
measures 2-4x at the shapes of a decode or verify step (a 576 x 3072 projection at 16 rows), and the same time at one
row and from 64 rows on. Speculative decoding lives in that range: a verify step of a 7-token block is 8 rows per
request.

:func:`column_major_weights` re-stores each fp32 CPU linear weight as the transpose of a contiguous ``[in, out]``
matrix. The parameter keeps its shape ``[out, in]``, its values and its name, so ``state_dict`` and every caller see
the same tensor; only the memory order changes. A weight tied to the input embedding gets its own copy (the
embedding's row gathers stay row-major), which adds ``vocab x hidden`` fp32 to the model. Each output row is the same
dot products as before; the GEMM's blocking, so the fp32 rounding, may differ. From two rows on a row's bits do not
depend on the row count (tested), which batch-invariant decoding relies on (:func:`.gemm_dtype.pad_single_row_gemms`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["column_major_weights", "is_column_major"]


def is_column_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D ``weight`` is stored as the transpose of a contiguous matrix."""
    return weight.dim() == 2 and weight.t().is_contiguous() and weight.shape[1] > 1


def column_major_weights(module: nn.Module) -> nn.Module:
    """Store every fp32 CPU ``nn.Linear`` weight inside ``module`` column-major (in place; returns it). Inference
    only: the new weights do not require gradients. Run it before :func:`.fused_linear.fuse_projections`, which keeps
    the parts' layout."""
    for linear in module.modules():
        w = linear.weight if isinstance(linear, nn.Linear) else None
        if w is None or w.dtype != torch.float32 or w.device.type != "cpu" or is_column_major(w):
            continue
        linear.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
    return module
