"""Sequential (Markov) draft head: add a low-rank bias of the previous token to every draft slot, sample left to right.

Layout (ragged, R requests, N draft slots in all, vocabulary V, hidden size d, rank r):
    base_logits          [N, V] fp32/bf16/fp16  backbone logits U_k; request i owns rows ``cu[i]:cu[i+1]``
    hidden               [N, d] float           backbone hidden state h_k of each slot
    anchor_tokens        [R] int32/int64        x_0 of each request (the target's last token), a row of ``w1``
    cu_num_draft_tokens  [R + 1] int32/int64    offsets ``cu``; lengths 0..gamma
    weights              SequentialHeadWeights  kind and weight matrices (see the class docstring)
    temperature          [R] float32 >= 0       0 = greedy
    top_k                [R] int | None         0 = off
    top_p                [R] float32 | None     in (0, 1]; 1 = off
    uniforms             [N] float32 in (0, 1)  one u per slot for its inverse-CDF draw (None only if all greedy)
Result (:class:`SequentialHeadResult`): ``tokens [N]`` int64, ``draft_probs [N, V]`` float32 (``None`` without
uniforms: every request is greedy, verification needs only the tokens, and no ``[N, V]`` buffer is written),
``confidence_logits [N]`` float32.

``w1`` may have more rows than ``V`` (``[V_prev, r]``, ``V_prev >= V``): a draft vocabulary drafts over ``V`` tokens
while the anchor comes from the target's larger one (:mod:`~dspark_kernels.drafters.draft_vocab` orders ``w1`` so that
rows ``0..V-1`` are the drafted tokens). Drawn tokens are in ``[0, V)``; anchors in ``[0, V_prev)`` (``[0, V)`` for
kind "none", which never reads them).

Semantics, left to right within a request, k = 1..L, x_0 = anchor, everything in float32:
    e_k = w1[x_{k-1}];  bias_k = lat_k @ w2 with lat_k = e_k (vanilla), sigmoid([h_k; e_k] @ gate_w + gate_b) * e_k
    (gated), tanh(o) (rnn: ``(a, c, o) = split([s_{k-1}; e_k; h_k] @ rnn_w + rnn_b, r)``,
    ``s_k = sigmoid(a) s_{k-1} + (1 - sigmoid(a)) tanh(c)``, s_0 = 0); kind "none" adds nothing.
    logits_k = U_k.float() + bias_k. The draft row is filtered exactly like a target row of
    :mod:`~dspark_kernels.ops.rejection_sample` (temperature, top-k, top-p) and the token is its inverse-CDF draw
    with ``uniforms[k]``; greedy requests take the lowest-index argmax of logits_k and a one-hot draft row.
    confidence_logit_k = [h_k; e_k] . conf_w + conf_b (h_k . conf_w + conf_b for kind "none"): it uses x_{k-1},
    never x_k (non-anticipating); ``c_k = sigmoid(logit)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..reference.sequential_head import (
    KINDS,
    MarkovBiasRows,
    SequentialHeadResult,
    SequentialHeadWeights,
    sequential_head_ref,
)
from ._dispatch import resolve_impl
from ._sampling import filter_row, inverse_cdf_row, row_stats_step
from ._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_finite,
    check_range,
    check_sampling_params,
    check_scaled_logits_finite,
    check_shape,
    check_tensor,
)

__all__ = ["MarkovBiasRows", "SequentialHeadResult", "SequentialHeadWeights", "sequential_head",
           "sequential_head_triton"]

_DEFAULTS = {"BLOCK_V": 512, "BLOCK_R": 16, "BLOCK_D": 64, "num_warps": 8}
_KIND_IDS = {"none": 0, "vanilla": 1, "gated": 2, "rnn": 3}


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gemv_acc(acc, x_ptr, n_in, w_ptr, stride_in, stride_out, cols, col_mask, BLOCK_IN: tl.constexpr):
    """``acc [BLOCK_OUT] += sum_{i < n_in} x[i] * W[i, cols]`` in float32; ``x`` contiguous, ``W`` strided."""
    offs = tl.arange(0, BLOCK_IN)
    for start in range(0, n_in, BLOCK_IN):
        i = start + offs
        m = i < n_in
        x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
        w_ptrs = w_ptr + i.to(tl.int64)[:, None] * stride_in + cols[None, :] * stride_out
        w = tl.load(w_ptrs, mask=m[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * w, 0)
    return acc


@triton.jit
def _dot(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """``sum_{i < n} x[i] * y[i]`` in float32 (both contiguous)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        i = start + offs
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        acc += x * tl.load(y_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    return tl.sum(acc, 0)


@triton.jit
def _rnn_preact(rnn_w_ptr, rnn_b_ptr, s_row, e_row, h_row, col0, cols, col_mask, D, RANK, s_in, s_out,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns ``col0 + cols`` of ``[s; e; h] @ rnn_w + rnn_b`` (rnn_w rows: state, then embedding, then hidden)."""
    c = col0 + cols
    acc = tl.load(rnn_b_ptr + c, mask=col_mask, other=0.0).to(tl.float32)
    acc = _gemv_acc(acc, s_row, RANK, rnn_w_ptr, s_in, s_out, c, col_mask, BLOCK_R)
    acc = _gemv_acc(acc, e_row, RANK, rnn_w_ptr + RANK * s_in, s_in, s_out, c, col_mask, BLOCK_R)
    return _gemv_acc(acc, h_row, D, rnn_w_ptr + 2 * RANK * s_in, s_in, s_out, c, col_mask, BLOCK_D)


@triton.jit
def _write_latent(lat_row, e_row, h_row, s_old, s_new, gate_w_ptr, gate_b_ptr, rnn_w_ptr, rnn_b_ptr, D, RANK,
                  s_gw_in, s_gw_out, s_rw_in, s_rw_out,
                  KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the slot's latent ``lat [r]`` (the vector multiplied by ``w2``) and, for rnn, the new state ``s_new``."""
    offs = tl.arange(0, BLOCK_R)
    for start in range(0, RANK, BLOCK_R):
        cols = (start + offs).to(tl.int64)
        m = cols < RANK
        e = tl.load(e_row + cols, mask=m, other=0.0).to(tl.float32)
        if KIND == 1:
            lat = e
        elif KIND == 2:
            g = tl.load(gate_b_ptr + cols, mask=m, other=0.0).to(tl.float32)
            g = _gemv_acc(g, h_row, D, gate_w_ptr, s_gw_in, s_gw_out, cols, m, BLOCK_D)
            g = _gemv_acc(g, e_row, RANK, gate_w_ptr + D * s_gw_in, s_gw_in, s_gw_out, cols, m, BLOCK_R)
            lat = tl.sigmoid(g) * e
        else:
            a = _rnn_preact(rnn_w_ptr, rnn_b_ptr, s_old, e_row, h_row, 0, cols, m, D, RANK, s_rw_in, s_rw_out,
                            BLOCK_R, BLOCK_D)
            c = _rnn_preact(rnn_w_ptr, rnn_b_ptr, s_old, e_row, h_row, RANK, cols, m, D, RANK, s_rw_in, s_rw_out,
                            BLOCK_R, BLOCK_D)
            o = _rnn_preact(rnn_w_ptr, rnn_b_ptr, s_old, e_row, h_row, 2 * RANK, cols, m, D, RANK, s_rw_in,
                            s_rw_out, BLOCK_R, BLOCK_D)
            gate = tl.sigmoid(a)
            s = tl.load(s_old + cols, mask=m, other=0.0)
            tl.store(s_new + cols, gate * s + (1.0 - gate) * _tanh(c), mask=m)
            lat = _tanh(o)
        tl.store(lat_row + cols, lat, mask=m)


@triton.jit
def _tanh(x):
    """tanh in float32 via ``2 sigmoid(2x) - 1``."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _slot_logits(logits_row, probs_row, lat_row, w2_ptr, s_w2r, s_w2v, V, RANK, t_eff,
                 KIND: tl.constexpr, STORE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Compute ``(U_k.float() + lat @ w2) / t_eff`` tile by tile (written to ``probs_row`` when ``STORE``); return the
    row's max, lowest-index argmax (int64) and min."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), dtype=tl.int32)
    least = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        bias = tl.zeros((BLOCK_V,), dtype=tl.float32)
        if KIND != 0:
            bias = _gemv_acc(bias, lat_row, RANK, w2_ptr, s_w2r, s_w2v, idx.to(tl.int64), valid, BLOCK_R)
        x = (tl.load(logits_row + idx, mask=valid, other=0.0).to(tl.float32) + bias) / t_eff
        if STORE:
            tl.store(probs_row + idx, x, mask=valid)
        best, best_idx, least = row_stats_step(x, start, valid, best, best_idx, least)
    return best, best_idx.to(tl.int64), least


@triton.jit
def _one_hot_row(probs_row, V, token, BLOCK_V: tl.constexpr):
    """Overwrite ``probs_row [V]`` with the one-hot row of ``token``."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        tl.store(probs_row + idx, tl.where(idx == token, 1.0, 0.0), mask=idx < V)


@triton.jit
def _sequential_head_kernel(
    logits_ptr, hidden_ptr, anchor_ptr, cu_ptr,
    w1_ptr, w2_ptr, gate_w_ptr, gate_b_ptr, rnn_w_ptr, rnn_b_ptr, conf_w_ptr, conf_b_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, u_ptr,
    tokens_ptr, probs_ptr, conf_ptr, lat_ptr, state_ptr,
    V, D, RANK, s_w2r, s_w2v, s_gw_in, s_gw_out, s_rw_in, s_rw_out,
    KIND: tl.constexpr, HAS_CONF: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per request, a loop over its slots: latent, confidence, biased logits, filter, draw.

    ``probs[i]`` is the workspace of slot i (scaled logits, then the filtered probabilities); ``lat [R, r]`` holds
    the slot's latent and ``state [R, 2, r]`` the rnn state (ping-pong: slot j reads half ``j % 2``). Without
    ``SAMPLE`` (no uniforms: every request greedy) every slot takes the argmax and ``probs`` is never touched.
    """
    req = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + req).to(tl.int64)
    n = tl.load(cu_ptr + req + 1).to(tl.int64) - start
    t = tl.load(temp_ptr + req)
    t_eff = tl.where(t > 0.0, t, 1.0)
    prev = tl.load(anchor_ptr + req).to(tl.int64)
    lat_row = lat_ptr + req * RANK
    for j in range(0, n):
        i = start + j
        h_row = hidden_ptr + i * D
        e_row = w1_ptr + prev * RANK
        probs_row = probs_ptr + i * V
        if KIND != 0:
            s_old = state_ptr + (req * 2 + j % 2) * RANK
            s_new = state_ptr + (req * 2 + (j + 1) % 2) * RANK
            _write_latent(lat_row, e_row, h_row, s_old, s_new, gate_w_ptr, gate_b_ptr, rnn_w_ptr, rnn_b_ptr, D,
                          RANK, s_gw_in, s_gw_out, s_rw_in, s_rw_out, KIND, BLOCK_R, BLOCK_D)
            tl.debug_barrier()
        if HAS_CONF:
            c = _dot(h_row, conf_w_ptr, D, BLOCK_D) + tl.load(conf_b_ptr).to(tl.float32)
            if KIND != 0:
                c += _dot(e_row, conf_w_ptr + D, RANK, BLOCK_R)
            tl.store(conf_ptr + i, c)
        best, token, least = _slot_logits(logits_ptr + i * V, probs_row, lat_row, w2_ptr, s_w2r, s_w2v, V, RANK,
                                          t_eff, KIND, SAMPLE, BLOCK_V, BLOCK_R)
        tl.debug_barrier()
        if SAMPLE:
            if t > 0.0:
                filter_row(probs_row, V, best, least, top_k_ptr, top_p_ptr, req, HAS_TOP_K, HAS_TOP_P, BLOCK_V)
                tl.debug_barrier()
                token = inverse_cdf_row(probs_row, V, tl.load(u_ptr + i), BLOCK_V)
            else:
                _one_hot_row(probs_row, V, token, BLOCK_V)
        tl.store(tokens_ptr + i, token)
        prev = token
        tl.debug_barrier()


# -------------------------------------------------------------------------------------------------------- launcher
def sequential_head_triton(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    weights: SequentialHeadWeights,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> SequentialHeadResult:
    """Triton twin of :func:`sequential_head_ref` (same signature): one launch, grid ``R``, no host sync.

    Weight matrices are read through their strides (``w2``/``gate_w``/``rnn_w`` may be transposed views of
    ``nn.Linear`` weights); vectors, ``w1`` and the activations are made contiguous.
    """
    dev = base_logits.device
    n, v = base_logits.shape
    d = hidden.shape[1]
    r = cu_num_draft_tokens.numel() - 1
    kind = _KIND_IDS[weights.kind]
    rank = weights.w1.shape[1] if kind else 0
    sample = uniforms is not None
    tokens = torch.zeros(n, dtype=torch.int64, device=dev)
    probs = torch.zeros(n, v, dtype=torch.float32, device=dev) if sample else None
    conf = torch.zeros(n, dtype=torch.float32, device=dev)
    if r == 0 or n == 0:
        return SequentialHeadResult(tokens, probs, conf)
    cfg = launch_config("sequential_head", _DEFAULTS, dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)

    def vec(t: torch.Tensor | None) -> torch.Tensor:
        return t.contiguous() if t is not None else dummy

    def mat(t: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        return (t, t.stride(0), t.stride(1)) if t is not None else (dummy, 0, 0)

    w2, s_w2r, s_w2v = mat(weights.w2)
    gate_w, s_gw_in, s_gw_out = mat(weights.gate_w)
    rnn_w, s_rw_in, s_rw_out = mat(weights.rnn_w)
    lat = torch.zeros(r, max(rank, 1), dtype=torch.float32, device=dev)
    state = torch.zeros(r, 2, max(rank, 1), dtype=torch.float32, device=dev)
    _sequential_head_kernel[(r,)](
        base_logits.contiguous(), hidden.contiguous(), anchor_tokens.contiguous(), cu_num_draft_tokens.contiguous(),
        vec(weights.w1), w2, gate_w, vec(weights.gate_b), rnn_w, vec(weights.rnn_b), vec(weights.conf_w),
        vec(weights.conf_b), temperature.float().contiguous(), vec(top_k), vec(top_p), vec(uniforms),
        tokens, probs if sample else dummy, conf, lat, state,
        v, d, rank, s_w2r, s_w2v, s_gw_in, s_gw_out, s_rw_in, s_rw_out,
        KIND=kind, HAS_CONF=weights.conf_w is not None, HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None,
        SAMPLE=sample, BLOCK_V=cfg["BLOCK_V"], BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
        num_warps=cfg["num_warps"],
    )
    return SequentialHeadResult(tokens, probs, conf)


# ------------------------------------------------------------------------------------------------------ public op
def _check_weight(name: str, t: object, shape: tuple[int, ...], what: str, dev: torch.device) -> None:
    """A weight tensor: float dtype, on ``dev``, of ``shape`` (``what`` explains the expected shape)."""
    if t is None:
        raise ValueError(f"weights.{name} is required for this kind (expected shape {what})")
    check_tensor(f"weights.{name}", t, ndim=len(shape), dtypes=FLOAT_DTYPES, device=dev)
    if tuple(t.shape) != shape:
        raise ValueError(f"weights.{name} must have shape {what} = {shape}, got {tuple(t.shape)}")


def _validate_weights(weights: SequentialHeadWeights, v: int, d: int, dev: torch.device) -> None:
    """Kind, vocab (``w1``/``w2`` against ``base_logits``) and hidden size (gate/rnn/confidence against ``hidden``)."""
    if not isinstance(weights, SequentialHeadWeights):
        raise TypeError(f"weights must be a SequentialHeadWeights, got {type(weights).__name__}")
    if weights.kind not in KINDS:
        raise ValueError(f"weights.kind must be one of {KINDS}, got {weights.kind!r}")
    rank = 0
    if weights.kind != "none":
        check_tensor("weights.w1", weights.w1, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        rank = weights.w1.shape[1]
        if weights.w1.shape[0] < v:
            raise ValueError(f"weights.w1 has {weights.w1.shape[0]} rows: it must have a row for each of the "
                             f"{v} tokens of base_logits (and may have more, see anchor_tokens)")
        if rank < 1:
            raise ValueError(f"weights.w1 must have rank r >= 1 for kind {weights.kind!r}, got shape {(v, rank)}")
        check_tensor("weights.w2", weights.w2, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        if weights.w2.shape[1] != v:
            raise ValueError(f"weights.w2 vocab size {weights.w2.shape[1]} must equal base_logits vocab size {v}")
        _check_weight("w2", weights.w2, (rank, v), "(r, V)", dev)
    if weights.kind == "gated":
        _check_weight("gate_w", weights.gate_w, (d + rank, rank), "(d + r, r) with d = hidden size", dev)
        _check_weight("gate_b", weights.gate_b, (rank,), "(r,)", dev)
    if weights.kind == "rnn":
        _check_weight("rnn_w", weights.rnn_w, (2 * rank + d, 3 * rank), "(2r + d, 3r) with d = hidden size", dev)
        _check_weight("rnn_b", weights.rnn_b, (3 * rank,), "(3r,)", dev)
    if weights.bias_rows is not None:
        if weights.kind != "vanilla":
            raise ValueError(f"weights.bias_rows is for kind 'vanilla' only (its bias depends on the previous token "
                             f"alone), got kind {weights.kind!r}")
        if not isinstance(weights.bias_rows, MarkovBiasRows) or not weights.bias_rows.belongs_to(weights.w1,
                                                                                                weights.w2):
            raise ValueError("weights.bias_rows must be a MarkovBiasRows made from these weights.w1 and weights.w2 "
                             "(unchanged since)")
    if (weights.conf_w is None) != (weights.conf_b is None):
        raise ValueError("weights.conf_w and weights.conf_b must be given together (or both None: no confidence)")
    if weights.conf_w is not None:
        _check_weight("conf_w", weights.conf_w, (d + rank,), "(d + r,) with d = hidden size", dev)
        _check_weight("conf_b", weights.conf_b, (), "() (a scalar tensor)", dev)
    for name in ("w1", "w2", "gate_w", "gate_b", "rnn_w", "rnn_b", "conf_w", "conf_b"):
        if getattr(weights, name) is not None:
            check_finite(f"weights.{name}", getattr(weights, name))


def _validate(
    base_logits, hidden, anchor_tokens, cu_num_draft_tokens, weights, temperature, top_k, top_p, uniforms
) -> None:
    check_tensor("base_logits", base_logits, ndim=2, dtypes=FLOAT_DTYPES)
    dev = base_logits.device
    n, v = base_logits.shape
    if v < 1:
        raise ValueError("base_logits must have a vocabulary of at least 1 token, got 0 columns")
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_shape("hidden", hidden, (n, None))
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_cu_seqlens("cu_num_draft_tokens", cu_num_draft_tokens, n)
    r = cu_num_draft_tokens.shape[0] - 1
    check_tensor("anchor_tokens", anchor_tokens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("anchor_tokens", anchor_tokens, (r,))
    _validate_weights(weights, v, hidden.shape[1], dev)
    v_prev = weights.w1.shape[0] if weights.kind != "none" else v
    check_range("anchor_tokens", anchor_tokens, (anchor_tokens >= 0) & (anchor_tokens < v_prev), f"in [0, {v_prev})")
    check_finite("base_logits", base_logits)
    check_finite("hidden", hidden)
    check_sampling_params(temperature, top_k, top_p, r, dev)
    lens = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
    check_scaled_logits_finite("base_logits", base_logits, temperature.repeat_interleave(lens))
    if uniforms is None:
        if bool((temperature > 0).any()):
            raise ValueError("uniforms is required when any request has temperature > 0")
        return
    check_tensor("uniforms", uniforms, ndim=1, dtypes=(torch.float32,), device=dev)
    check_shape("uniforms", uniforms, (n,))
    check_range("uniforms", uniforms, (uniforms > 0) & (uniforms < 1), "strictly inside (0, 1)")


def sequential_head(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    weights: SequentialHeadWeights,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> SequentialHeadResult:
    """Draft every request's slots with the sequential head; see the module docstring for shapes and semantics.

    ``check_inputs=False`` skips validation (several host syncs) for hot loops and CUDA-graph capture. Inputs are
    never modified. The draft probabilities are exactly the distributions the tokens were drawn from, as
    :func:`~dspark_kernels.ops.rejection_sample` needs them (``None`` without uniforms: all greedy).
    """
    args = (base_logits, hidden, anchor_tokens, cu_num_draft_tokens, weights, temperature, top_k, top_p, uniforms)
    if check_inputs:
        _validate(*args)
    kernel = sequential_head_triton if resolve_impl(impl, base_logits.device) == "triton" else sequential_head_ref
    return kernel(*args)
