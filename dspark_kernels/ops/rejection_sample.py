"""Rejection sampling (lossless speculative sampling): verify every request's drafts against the target model.

Layout (ragged, R requests, N drafts in all, vocabulary V, S = ``max_spec_len``):
    draft_token_ids      [N] int32/int64        drafts of all requests, flattened; request r owns ``cu[r]:cu[r+1]``
    cu_num_draft_tokens  [R + 1] int32/int64    offsets ``cu``; every draft length lies in 0..S
    draft_probs          [N, V] float32 | None  drafter distributions (None = deterministic drafts, one-hot)
    target_logits        [N + R, V] fp32/bf16/fp16  request r owns rows ``cu[r] + r .. cu[r+1] + r`` (inclusive):
                                                one row per draft position plus the bonus position
    temperature          [R] float32 >= 0       0 = greedy
    top_k                [R] int | None         0 = off
    top_p                [R] float32 | None     in (0, 1]; 1 = off
    accept_uniforms      [N] float32 in (0, 1)  one u per draft for its accept test
    sample_uniforms      [N + R] float32 in (0, 1)  one u per target row for the correction/bonus draw
    output_token_ids     [R, S + 1] int64       accepted drafts, then the correction/bonus token, then -1
    num_accepted         [R] int32              accepted drafts (emitted tokens = num_accepted + 1)
    accept_counter, draft_counter  [S] int64    optional, accumulated IN PLACE: ``accept_counter[j] += 1`` for every
                                                request whose draft j was accepted, ``draft_counter[j] += 1`` for
                                                every request that had a draft j

Semantics:
1. Target distribution of a row of request r: ``scaled = logits.float() / T_r``. Top-k (k > 0) keeps tokens with
   ``scaled >=`` the k-th largest value (ties at the boundary kept). With ``m = max(scaled)`` and
   ``e = exp(scaled - m)`` on kept tokens (0 elsewhere), ``p = e / sum(e)``. Top-p keeps tokens with ``p >= t*``,
   ``t*`` the largest t with ``sum_{p_j >= t} p_j >= top_p`` (the smallest top set reaching mass top_p, ties kept;
   computed on ``e`` against ``top_p * sum(e)``); the kept ``e`` are renormalised. ``draft_probs`` must come from
   the drafter with the same temperature/top-k/top-p filters already applied (rows summing to 1); they are used as
   given.
2. Greedy request (T = 0): the target token of a row is ``argmax(logits)`` (lowest index on ties). Draft j is
   accepted iff it equals that token; the first mismatch emits the target token there; if every draft is accepted
   the bonus row's argmax is emitted. No uniforms are read.
3. Stochastic request: draft x at row j is accepted iff ``u_j * p_d(x) < p_t(x)``, i.e. ``u_j < min(1, p_t/p_d)``
   (``p_d(x) = 1`` without draft_probs). On the first rejection the token is drawn from the residual
   ``max(0, p_t - p_d)`` (for one-hot drafts: ``p_t`` with x zeroed), or from ``p_t`` when the residual's mass is
   ``<= 1e-8``; if all drafts are accepted the bonus token is drawn from ``p_t`` of the request's last row.
   A draw with weights w and the row's sample uniform u returns the smallest i with ``w[i] > 0`` and
   ``cumsum(w)[i] > u * sum(w)``, or, if rounding leaves none, the last index with positive weight.
4. A request with no drafts just samples (or argmaxes) its bonus row, so the op is also a plain sampler.

Uniforms may be None only when every request is greedy. :func:`rejection_noise` makes them from per-request seeds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..noise import uniform_noise
from ..reference.rejection_sample import RESIDUAL_EPS, RejectionResult, _ragged_maps, rejection_sample_ref
from ._dispatch import resolve_impl
from ._sampling import cdf_scan_step, filter_row, row_stats_step
from ._validate import (
    FLOAT_DTYPES,
    check_draft_offsets,
    check_finite,
    check_range,
    check_sampling_params,
    check_scaled_logits_finite,
    check_shape,
    check_tensor,
)

__all__ = ["RejectionResult", "rejection_noise", "rejection_sample", "rejection_sample_triton"]

_DEFAULTS = {"BLOCK_V": 1024, "num_warps": 4}


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _target_probs_kernel(
    logits_ptr,
    row_req_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    probs_ptr,
    argmax_ptr,
    V,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per target row: argmax of the logits, and (stochastic rows only) the filtered probabilities.

    The float32 workspace row ``probs[row]`` holds, in turn, the scaled logits, ``e = exp(scaled - max)`` on the
    top-k set, and the final probabilities. Greedy rows only get their argmax.
    """
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(row_req_ptr + row)
    t = tl.load(temp_ptr + req)
    t_eff = tl.where(t > 0.0, t, 1.0)
    in_row = logits_ptr + row * V
    ws_row = probs_ptr + row * V
    offs = tl.arange(0, BLOCK_V)

    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), dtype=tl.int32)
    least = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        x = tl.load(in_row + idx, mask=valid, other=0.0).to(tl.float32) / t_eff
        tl.store(ws_row + idx, x, mask=valid)
        best, best_idx, least = row_stats_step(x, start, valid, best, best_idx, least)
    tl.store(argmax_ptr + row, best_idx)

    if t > 0.0:
        tl.debug_barrier()  # the row's stores above are read back by other threads' loads in filter_row
        filter_row(ws_row, V, best, least, top_k_ptr, top_p_ptr, req, HAS_TOP_K, HAS_TOP_P, BLOCK_V)


@triton.jit
def _final_weights(p_row, d_row, idx, valid, x_rej, use_resid, HAS_DRAFT_PROBS: tl.constexpr):
    """One vocab tile of the last token's weights: ``max(0, p_t - p_d)`` if ``use_resid`` else ``p_t``."""
    pt = tl.load(p_row + idx, mask=valid, other=0.0)
    resid_on = tl.where(use_resid, valid, False)  # not `valid & use_resid`: the interpreter mistypes that mask
    if HAS_DRAFT_PROBS:
        pd = tl.load(d_row + idx, mask=resid_on, other=0.0)
    else:
        pd = tl.where(idx == x_rej, 1.0, 0.0)
    return tl.where(resid_on, tl.maximum(pt - pd, 0.0), pt)


@triton.jit
def _accept_sample_kernel(
    draft_ids_ptr,
    cu_ptr,
    draft_probs_ptr,
    probs_ptr,
    argmax_ptr,
    temp_ptr,
    accept_u_ptr,
    sample_u_ptr,
    out_ptr,
    num_acc_ptr,
    accept_cnt_ptr,
    draft_cnt_ptr,
    V,
    stride_out,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_ACCEPT_COUNTER: tl.constexpr,
    HAS_DRAFT_COUNTER: tl.constexpr,
    RESID_EPS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per request: accept tests over its drafts, then the correction/bonus draw by inverse CDF.
    ``stride_out`` (the output's row stride, ``max_spec_len + 1``) is a runtime argument: the draft width changes
    from round to round, and a constexpr would compile the kernel once per width."""
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + r).to(tl.int64)
    n = tl.load(cu_ptr + r + 1).to(tl.int64) - start
    row0 = start + r
    t = tl.load(temp_ptr + r)
    out_row = out_ptr + r * stride_out

    num_acc = tl.zeros((), dtype=tl.int64)
    alive = n >= 0
    for j in range(0, n):
        i = start + j
        x = tl.load(draft_ids_ptr + i).to(tl.int64)
        if HAS_DRAFT_PROBS:
            pd = tl.load(draft_probs_ptr + i * V + x)
        else:
            pd = 1.0
        if t > 0.0:
            ok = tl.load(accept_u_ptr + i) * pd < tl.load(probs_ptr + (row0 + j) * V + x)
        else:
            ok = x == tl.load(argmax_ptr + row0 + j).to(tl.int64)
        alive = alive & ok
        tl.store(out_row + j, x, mask=alive)
        num_acc += alive.to(tl.int64)
        if HAS_DRAFT_COUNTER:
            tl.atomic_add(draft_cnt_ptr + j, 1)
        if HAS_ACCEPT_COUNTER:
            tl.atomic_add(accept_cnt_ptr + j, 1, mask=alive)
    tl.store(num_acc_ptr + r, num_acc.to(tl.int32))

    row = row0 + num_acc
    token = tl.load(argmax_ptr + row).to(tl.int64)
    if t > 0.0:
        token = _sample_last(draft_ids_ptr, draft_probs_ptr, probs_ptr, sample_u_ptr, row, start + num_acc,
                             num_acc < n, V, HAS_DRAFT_PROBS, RESID_EPS, BLOCK_V)
    tl.store(out_row + num_acc, token)


@triton.jit
def _sample_last(draft_ids_ptr, draft_probs_ptr, probs_ptr, sample_u_ptr, row, i_rej, rejected, V,
                 HAS_DRAFT_PROBS: tl.constexpr, RESID_EPS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw of the last token of a stochastic request (residual after a rejection, else ``p_t``).

    Two passes over the vocabulary: the total mass (of the residual after a rejection, falling back to ``p_t``), then
    the tile-wise cumulative sum with a running total, keeping the first hit and the last positive-weight index.
    """
    offs = tl.arange(0, BLOCK_V)
    p_row = probs_ptr + row * V
    d_row = draft_probs_ptr + i_rej * V
    x_rej = tl.load(draft_ids_ptr + i_rej, mask=rejected, other=-1).to(tl.int64)
    resid_mass = tl.zeros((), dtype=tl.float32)
    if rejected:
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            w = _final_weights(p_row, d_row, idx, idx < V, x_rej, rejected, HAS_DRAFT_PROBS)
            resid_mass += tl.sum(w, 0)
    use_resid = rejected & (resid_mass > RESID_EPS)

    total = resid_mass  # the residual's mass, summed in the same order as the pass below would
    if tl.where(use_resid, False, True):
        total = tl.zeros((), dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            total += tl.sum(_final_weights(p_row, d_row, idx, idx < V, x_rej, use_resid, HAS_DRAFT_PROBS), 0)
    target = tl.load(sample_u_ptr + row) * total

    running = tl.zeros((), dtype=tl.float32)
    found = tl.zeros((), dtype=tl.int64) + V
    last = tl.zeros((), dtype=tl.int64) - 1
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        w = _final_weights(p_row, d_row, idx, valid, x_rej, use_resid, HAS_DRAFT_PROBS)
        running, found, last = cdf_scan_step(w, idx, valid, V, target, running, found, last)
    return tl.where(found < V, found, last)


# -------------------------------------------------------------------------------------------------------- launcher
def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    accept_uniforms: torch.Tensor | None,
    sample_uniforms: torch.Tensor | None,
    *,
    max_spec_len: int,
    accept_counter: torch.Tensor | None = None,
    draft_counter: torch.Tensor | None = None,
) -> RejectionResult:
    """Triton twin of :func:`rejection_sample_ref` (same signature): two launches, no host sync.

    Kernel 1 (grid ``N + R``) fills a float32 workspace ``[N + R, V]`` with filtered target probabilities and an
    int32 ``[N + R]`` argmax; kernel 2 (grid ``R``) runs the accept tests and the correction/bonus draw.
    """
    dev = target_logits.device
    rows, v = target_logits.shape
    r = cu_num_draft_tokens.numel() - 1
    cfg = launch_config("rejection_sample", _DEFAULTS, dev)
    out = torch.full((r, max_spec_len + 1), -1, dtype=torch.int64, device=dev)
    num_acc = torch.zeros(r, dtype=torch.int32, device=dev)
    if r == 0:
        return RejectionResult(out, num_acc)
    logits = target_logits.contiguous()
    temp = temperature.float().contiguous()
    _, row_req, *_ = _ragged_maps(cu_num_draft_tokens.long(), draft_token_ids.numel())
    probs = torch.empty((rows, v), dtype=torch.float32, device=dev)
    argmax = torch.empty(rows, dtype=torch.int32, device=dev)
    dummy_f = torch.zeros(1, dtype=torch.float32, device=dev)
    dummy_i = torch.zeros(1, dtype=torch.int64, device=dev)

    def or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if t is not None else dummy

    _target_probs_kernel[(rows,)](
        logits, row_req.to(torch.int32), temp, or_dummy(top_k, dummy_i), or_dummy(top_p, dummy_f), probs, argmax, v,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
    )
    _accept_sample_kernel[(r,)](
        draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(), or_dummy(draft_probs, dummy_f), probs, argmax,
        temp, or_dummy(accept_uniforms, dummy_f), or_dummy(sample_uniforms, dummy_f), out, num_acc,
        or_dummy(accept_counter, dummy_i), or_dummy(draft_counter, dummy_i), v, out.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None, HAS_ACCEPT_COUNTER=accept_counter is not None,
        HAS_DRAFT_COUNTER=draft_counter is not None, RESID_EPS=RESIDUAL_EPS,
        BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
    )
    return RejectionResult(out, num_acc)


# ------------------------------------------------------------------------------------------------------ public op
def _validate(
    draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, top_k, top_p,
    accept_uniforms, sample_uniforms, max_spec_len, accept_counter, draft_counter,
) -> None:
    check_tensor("target_logits", target_logits, ndim=2, dtypes=FLOAT_DTYPES)
    dev = target_logits.device
    lens = check_draft_offsets(draft_token_ids, cu_num_draft_tokens, max_spec_len, dev)
    n, r = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1
    v = target_logits.shape[1]
    check_shape("target_logits", target_logits, (n + r, None))
    if v < 1:
        raise ValueError("target_logits must have a vocabulary of at least 1 token, got 0 columns")
    check_finite("target_logits", target_logits)
    check_range("draft_token_ids", draft_token_ids, (draft_token_ids >= 0) & (draft_token_ids < v), f"in [0, {v})")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=(torch.float32,), device=dev)
        if draft_probs.shape[1] != v:
            raise ValueError(f"draft_probs vocab size {draft_probs.shape[1]} must equal target_logits vocab size {v}")
        check_shape("draft_probs", draft_probs, (n, v))
        check_finite("draft_probs", draft_probs)
        check_range("draft_probs", draft_probs, draft_probs >= 0, "non-negative")
    check_sampling_params(temperature, top_k, top_p, r, dev)
    check_scaled_logits_finite("target_logits", target_logits, temperature.repeat_interleave((lens + 1).to(dev)))
    needs_uniforms = bool((temperature > 0).any())
    for name, u, size in (("accept_uniforms", accept_uniforms, n), ("sample_uniforms", sample_uniforms, n + r)):
        if u is None:
            if needs_uniforms:
                raise ValueError(f"{name} is required when any request has temperature > 0")
            continue
        check_tensor(name, u, ndim=1, dtypes=(torch.float32,), device=dev)
        check_shape(name, u, (size,))
        check_range(name, u, (u > 0) & (u < 1), "strictly inside (0, 1)")
    for name, c in (("accept_counter", accept_counter), ("draft_counter", draft_counter)):
        if c is not None:
            check_tensor(name, c, ndim=1, dtypes=(torch.int64,), device=dev)
            check_shape(name, c, (max_spec_len,))
            if not c.is_contiguous():
                raise ValueError(f"{name} must be contiguous (it is accumulated in place)")


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    accept_uniforms: torch.Tensor | None,
    sample_uniforms: torch.Tensor | None,
    *,
    max_spec_len: int,
    accept_counter: torch.Tensor | None = None,
    draft_counter: torch.Tensor | None = None,
    impl: str | None = None,
    check_inputs: bool = True,
) -> RejectionResult:
    """Lossless speculative sampling over ragged drafts; see the module docstring for shapes and semantics.

    ``check_inputs=False`` skips validation (several host syncs) for hot loops and CUDA-graph capture. Inputs are
    never modified; only ``accept_counter``/``draft_counter`` are accumulated in place when given.
    """
    args = (draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, top_k, top_p,
            accept_uniforms, sample_uniforms)
    if check_inputs:
        _validate(*args, max_spec_len, accept_counter, draft_counter)
    kernel = rejection_sample_triton if resolve_impl(impl, target_logits.device) == "triton" else rejection_sample_ref
    return kernel(*args, max_spec_len=max_spec_len, accept_counter=accept_counter, draft_counter=draft_counter)


def rejection_noise(
    seeds: torch.Tensor, offsets: torch.Tensor, cu_num_draft_tokens: torch.Tensor, num_tokens: int, *, max_spec_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reproducible ``(accept_uniforms [N], sample_uniforms [N + R])`` from per-request ``seeds``/``offsets`` ``[R]``.

    ``num_tokens`` is N (the number of drafts, so no host sync is needed). Request r draws a block of ``max_spec_len``
    accept uniforms (stream 0) and ``max_spec_len + 1`` sample uniforms (stream 1) from
    :func:`dspark_kernels.noise.uniform_noise`; its ragged rows are gathered from the front of each block, so a
    request's numbers depend only on its own seed, offset and positions.
    """
    cu = cu_num_draft_tokens.to(seeds.device, torch.int64)
    _, row_req, draft_req, draft_pos, _ = _ragged_maps(cu, num_tokens)
    row_pos = torch.arange(row_req.numel(), device=cu.device) - cu[row_req] - row_req
    accept = uniform_noise(seeds, offsets, (max_spec_len,), stream=0)
    sample = uniform_noise(seeds, offsets, (max_spec_len + 1,), stream=1)
    return accept[draft_req, draft_pos], sample[row_req, row_pos]
