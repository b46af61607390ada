"""Inference-time fusion of linear layers that read the same input: one GEMM instead of several.

A decoder layer runs q/k/v projections on one input and the SwiGLU gate/up projections on another. On the CPU path
a small GEMM costs mostly its fixed launch cost (about 15 us for a bf16 one here, however few its rows), so three
projections cost about three times what one GEMM over the concatenated weight costs; on a GPU the fused GEMM also
fills the device better. :func:`fuse_projections` concatenates the weights once and turns the original layers'
weights into views of the fused one, so memory does not grow and ``state_dict`` keeps the checkpoint's names and
values. Each output column is the same dot product as before; only the GEMM's blocking (so the fp32 summation order)
may differ.

Fuse after the weights are final: ``load_state_dict(..., assign=True)`` or re-casting the layers afterwards would
replace the views and leave the fused weight stale (:meth:`FusedLinear.forward` checks for that and raises).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .gemm_dtype import PackedWeight, low_precision_linear
from .weight_layout import is_column_major

__all__ = ["FusedLinear", "fuse_projections"]


class FusedLinear:
    """Layers ``parts`` (``nn.Linear`` or :class:`~.gemm_dtype.CastGemmLinear`, same input size, same weight dtype,
    all with or all without bias) as one GEMM. Not a module: it owns no parameters of its own, and the parts' weights
    become views of its fused ``[sum(out_i), in]`` weight."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        weights = [p.weight for p in parts]
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            raise ValueError("fused layers must share the input size, weight dtype and device")
        biases = [p.bias for p in parts]
        if any(b is None for b in biases) != all(b is None for b in biases):
            raise ValueError("fused layers must all have a bias or all have none")
        self.sizes = [w.shape[0] for w in weights]
        self.weight = torch.cat([w.detach() for w in weights])
        if all(is_column_major(w) for w in weights):  # keep the parts' layout (:mod:`.weight_layout`)
            self.weight = self.weight.t().contiguous().t()
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.parts = list(parts)
        start = 0
        for part, size in zip(parts, self.sizes):
            part.weight = nn.Parameter(self.weight[start: start + size], requires_grad=False)
            if self.bias is not None:
                part.bias = nn.Parameter(self.bias[start: start + size], requires_grad=False)
            start += size
        self._views = [part.weight.data_ptr() for part in parts]
        # per ``first``: views of the weight and bias rows of the parts from ``first`` on, and their prepacked copy
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor | None, PackedWeight]] = {}
        self.min_rows = 1  # gemm_dtype.pad_single_row_gemms sets 2

    def output(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        """``x [T, in]`` (any float dtype) -> ``[T, sum(out_i)]``: the outputs of the parts from ``first`` on side by
        side (a GEMM over those parts' rows only), in ``x``'s dtype (the GEMM runs in the weight dtype, like
        :class:`~.gemm_dtype.CastGemmLinear`)."""
        if any(part.weight.data_ptr() != view for part, view in zip(self.parts, self._views)):
            raise RuntimeError("a fused layer's weight was replaced after fusion; fuse again after loading")
        rows = self._rows.get(first)
        if rows is None:
            skip = sum(self.sizes[:first])
            rows = self._rows[first] = (self.weight[skip:], None if self.bias is None else self.bias[skip:],
                                        PackedWeight())
        return low_precision_linear(x, *rows, self.min_rows)

    def forward(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """:meth:`output` as one ``[T, out_i]`` view per part from part ``first`` on."""
        return self.output(x, first).split(self.sizes[first:], dim=-1)

    __call__ = forward


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v (attention) and gate/up (SwiGLU) projections of every decoder layer in ``model`` (in place;
    returns it), the layers that declare a ``fused_qkv`` / ``fused_gate_up`` slot. Inference only: the weights stop
    requiring gradients. The fused weights are plain tensors: move the model to its device before fusing."""
    for module in model.modules():
        if hasattr(module, "fused_qkv"):  # transformer.Attention
            module.fused_qkv = FusedLinear([module.q_proj, module.k_proj, module.v_proj])
        elif hasattr(module, "fused_gate_up"):  # transformer.MLP
            module.fused_gate_up = FusedLinear([module.gate_proj, module.up_proj])
    return model.requires_grad_(False)
