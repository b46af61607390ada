"""Weight-only low-precision GEMMs: keep a model's linear weights in bf16, everything else in the activation dtype.

The shipped checkpoints store bf16 weights, so ``weight.to(torch.bfloat16)`` loses nothing; what changes is that each
linear layer's input is rounded to bf16, the GEMM accumulates in fp32 (oneDNN's avx512_bf16 / AMX kernels on a CPU,
tensor cores on a GPU) and its output is rounded to bf16 before it is cast back to the activation dtype. Norms,
RoPE, attention, the KV cache, softmax and sampling stay in the activation dtype (fp32 on the CPU path).

Why it exists: on a CPU, an fp32 GEMM over a few rows (a verify block of 8 tokens, a draft block of 7) is
compute-bound, so verifying 8 tokens costs about twice one decode step; bf16 GEMMs make the multi-row case nearly as
cheap as one row (see ``perf/test_gemm_dtype_bench.py``), which is the regime speculative decoding relies on. Every
method compared in one run must use the same setting: the numerics differ from fp32 GEMMs, so the target's greedy
text may differ between the two settings (it is identical across methods within one setting).

Prepacked weights (:func:`low_precision_linear`): ``F.linear`` on a bf16 CPU weight hands oneDNN a plain row-major
matrix, which it reorders into its blocked layout on every call. At inference (no autograd) on a CPU with oneDNN bf16
support, the weight is reordered once and kept with its module (``torch.ops.mkldnn._reorder_linear_weight``), and
every call runs ``torch.ops.mkldnn._linear_pointwise`` on the packed copy: the same kernel, bit-identical outputs
(tested), and faster at the few rows of a decode or verify step (the shipped target's LM head over 8 rows: 69 instead
of 108 us in the committed ``perf/test_gemm_dtype_bench.py`` run). The packed copy doubles the memory of the bf16
linear weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..reference._tensor_key import tensor_key

__all__ = ["GEMM_DTYPES", "CastGemmLinear", "PackedWeight", "cast_gemm_weights", "low_precision_linear",
           "pad_single_row_gemms", "parse_gemm_dtype"]

GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_gemm_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/``"float32"``-style names or dtypes -> a dtype of :data:`GEMM_DTYPES` (``None`` stays ``None``)."""
    if name is None or isinstance(name, torch.dtype) and name in GEMM_DTYPES.values():
        return name
    if isinstance(name, str) and name in GEMM_DTYPES:
        return GEMM_DTYPES[name]
    raise ValueError(f"gemm_dtype must be one of {sorted(GEMM_DTYPES)} or None, got {name!r}")


# whether oneDNN runs bf16 GEMMs on this CPU (the condition for prepacking)
_ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
_linear_pointwise = torch.ops.mkldnn._linear_pointwise if _ONEDNN_BF16 else None


def _packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` may run from a oneDNN-prepacked copy: bf16 on a CPU with oneDNN bf16 support, autograd off,
    and a version counter to detect in-place updates (an inference tensor has none)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not torch.is_grad_enabled()
            and not weight.is_inference() and _ONEDNN_BF16)


class PackedWeight:
    """The oneDNN-prepacked copy of one linear weight for :func:`low_precision_linear`, made on first use and made again
    when the weight is replaced or updated in place.

    A call with the tensor it saw last (the same object, version counter and storage address) returns the kept copy
    after three attribute reads; any other weight is compared by its full :func:`tensor_key` (storage, layout, dtype,
    device and version), and packed again when that differs. Only the current weight's copy is kept."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self._seen: tuple = (None, -1, 0)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        seen, version, ptr = self._seen
        if weight is seen and weight._version == version and weight.data_ptr() == ptr:
            return self.packed
        key = tensor_key(weight)
        if key != self.key:
            self.key, self.packed = key, torch.ops.mkldnn._reorder_linear_weight(weight)
        self._seen = (weight, weight._version, weight.data_ptr())
        return self.packed


def low_precision_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         pack: PackedWeight, min_rows: int = 1) -> torch.Tensor:
    """``F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)``: ``x [..., in]``, ``weight [out, in]``, ``bias
    [out]`` (in the weight's dtype) -> ``[..., out]`` in ``x``'s dtype.

    Where :func:`_packable`, through the caller's :class:`PackedWeight` of ``weight`` (see the module docstring), so
    a replaced or updated weight is packed again. Bit-identical to the plain call. ``min_rows``: a 2-D ``x`` with
    fewer rows runs padded with zero rows to that many (:func:`pad_single_row_gemms`)."""
    if x.dim() == 2 and x.shape[0] < min_rows:
        pad = x.new_zeros(min_rows - x.shape[0], x.shape[1])
        return low_precision_linear(torch.cat((x, pad)), weight, bias, pack)[: x.shape[0]]
    xw = x.to(weight.dtype)
    if not _packable(weight):
        return F.linear(xw, weight, bias).to(x.dtype)
    return _linear_pointwise(xw, pack.of(weight), bias, "none", [], "").to(x.dtype)


class CastGemmLinear(nn.Module):
    """``y = (x.to(w) @ w.T + b).to(x.dtype)``: a linear layer whose weight ``[out, in]`` (and bias ``[out]``) live in
    a GEMM dtype; inputs ``[..., in]`` of any floating dtype, output ``[..., out]`` in the input's dtype. Called
    directly (``__call__`` is :meth:`forward`: no module hooks), like :class:`~.fused_linear.FusedLinear`, which saves
    a module call's bookkeeping (several us) at each of a forward's few-row GEMMs."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        self._pack = PackedWeight()
        self.min_rows = 1  # pad_single_row_gemms sets 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return low_precision_linear(x, self.weight, self.bias, self._pack, self.min_rows)

    __call__ = forward

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemm_dtype={self.weight.dtype}"


def cast_gemm_weights(module: nn.Module, dtype: torch.dtype | str | None,
                      skip: Iterable[nn.Module] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (in place; returns it) by a :class:`CastGemmLinear` holding its
    weight in ``dtype``, except inside the modules of ``skip`` and where the weight already has that dtype (so
    ``float32`` on an fp32 model, or ``None``, changes nothing). A weight tied to an embedding is copied, so the
    embedding keeps its dtype. Inference only: the new weights do not require gradients."""
    dtype = parse_gemm_dtype(dtype)
    if dtype is None:
        return module
    skipped = {id(m) for m in skip}

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in skipped:
                continue
            if isinstance(child, nn.Linear) and child.weight.dtype != dtype:
                setattr(parent, name, CastGemmLinear(child, dtype))
            elif not isinstance(child, nn.Linear):
                visit(child)

    visit(module)
    return module


def pad_single_row_gemms(module: nn.Module) -> nn.Module:
    """Make every linear layer in ``module`` (in place; returns it) run a one-row input as two rows (the second zero,
    dropped), so that a row's output does not depend on how many rows share its GEMM.

    CPU BLAS and oneDNN pick another kernel for a single row (a GEMV, whose reduction order differs from the GEMM's):
    a token decoded alone then rounds differently from the same token verified among others, which breaks greedy
    speculative decoding's bit-equality with greedy decoding. From two rows on, the kernels tested here
    (``tests/test_batch_invariant_attention.py``) give each row the same bits whatever the row count. Plain
    ``nn.Linear`` layers become :class:`CastGemmLinear` layers of their own dtype (the same GEMM; a tied weight stays
    shared); fused projections (:class:`~.fused_linear.FusedLinear`) are padded too. The cost is the second row's
    arithmetic: the weight is read once either way."""
    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                child = CastGemmLinear(child, child.weight.dtype)
                setattr(parent, name, child)
            if isinstance(child, CastGemmLinear):
                child.min_rows = 2
            else:
                visit(child)
            for attr in ("fused_qkv", "fused_gate_up"):
                fused = getattr(child, attr, None)
                if fused is not None:
                    fused.min_rows = 2

    visit(module)
    return module
