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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..noise import uniform_noise
from ..reference.rejection_sample import RESIDUAL_EPS, RejectionResult, _ragged_maps, rejection_sample_ref
from ._dispatch import resolve_impl
from ._radix_select import LEVELS, bits_key, chunk_count, chunk_histogram, ordered_key, select_digit
from ._sampling import cdf_scan_step, kept_weights
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

__all__ = ["RejectionResult", "candidate_cuts", "radix_cuts", "rejection_noise", "rejection_sample",
           "rejection_sample_triton", "sampling_config"]

# CHUNK_V: vocab columns per program of the row passes (a multiple of BLOCK_V, the tile each loop step loads);
# CANDIDATES: the largest scaled values each chunk keeps for the top-k / top-p cuts (a power of two <= BLOCK_V; 0 = off,
# every filtered row takes the radix select)
_DEFAULTS = {"BLOCK_V": 1024, "CHUNK_V": 8192, "CANDIDATES": 64, "num_warps": 8}  # 8 warps: no spill on sm_80 / sm_90


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_params(row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, row, V,
                HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr):
    """Target row ``row``'s request, its temperature ``t``, the divisor ``t`` or 1 (greedy rows), and whether its
    top-k and its top-p drop tokens (never for a greedy row)."""
    req = tl.load(row_req_ptr + row)
    t = tl.load(temp_ptr + req)
    k_on = t < 0.0  # False, as a tensor
    p_on = t < 0.0
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + req)
        k_on = (t > 0.0) & (k > 0) & (k < V)
    if HAS_TOP_P:
        p_on = (t > 0.0) & (tl.load(top_p_ptr + req) < 1.0)
    return req, t, tl.where(t > 0.0, t, 1.0), k_on, p_on


@triton.jit
def _target_prob(scaled, m, z, keep_key, keep_bits):
    """``p_t`` of a row's entries from their scaled logits, with the row's max ``m``, its kept mass ``z`` and its
    top-k / top-p cuts (keys, 0 = keep all)."""
    return kept_weights(scaled, m, keep_key, keep_bits) / z


@triton.jit
def _chunk_stats_kernel(logits_ptr, row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, cmax_ptr, csum_ptr, carg_ptr,
                        cand_ptr, V, n_chunks, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                        CANDIDATES: tl.constexpr, CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row, chunk): the one read of the target logits. Writes the chunk's max of ``scaled``, its lowest
    argmax and (stochastic rows) ``sum(exp(scaled - chunk max))``, online over the chunk's tiles. With
    ``CANDIDATES > 0``, a row that top-k or top-p filters also keeps the chunk's ``CANDIDATES`` largest scaled
    values (a running ``tl.topk``, merged only when a tile's max passes the running smallest), written descending to
    ``cand [rows, n_chunks, CANDIDATES]`` (-inf where the chunk has fewer entries)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    req, t, t_eff, k_on, p_on = _row_params(row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, row, V, HAS_TOP_K, HAS_TOP_P)
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), dtype=tl.int32)
    total = tl.zeros((), dtype=tl.float32)
    if CANDIDATES > 0:
        cand = tl.full((CANDIDATES,), float("-inf"), tl.float32)
        filtered = k_on | p_on
    for start in range(chunk * CHUNK_V, tl.minimum(chunk * CHUNK_V + CHUNK_V, V), BLOCK_V):
        idx = start + offs
        valid = idx < V
        x = tl.where(valid, tl.load(logits_ptr + row * V + idx, mask=valid, other=0.0).to(tl.float32) / t_eff,
                     float("-inf"))
        tile_max = tl.max(x, 0)
        best_idx = tl.where(tile_max > best, start + tl.argmax(x, 0), best_idx)
        new_best = tl.maximum(best, tile_max)
        if t > 0.0:
            total = total * tl.exp(best - new_best) + tl.sum(tl.exp(x - new_best), 0)
        best = new_best
        if CANDIDATES > 0:
            if filtered & (tile_max > tl.min(cand, 0)):
                both = tl.reshape(tl.join(cand, tl.topk(x, CANDIDATES)), (2 * CANDIDATES,))
                cand = tl.topk(both, CANDIDATES)
    at = row * n_chunks + chunk
    tl.store(cmax_ptr + at, best)
    tl.store(csum_ptr + at, total)
    tl.store(carg_ptr + at, best_idx)
    if CANDIDATES > 0:
        if filtered:
            tl.store(cand_ptr + at * CANDIDATES + tl.arange(0, CANDIDATES), cand)


@triton.jit
def _row_merge_kernel(row_req_ptr, temp_ptr, cmax_ptr, csum_ptr, carg_ptr, row_max_ptr, row_z_ptr, row_arg_ptr,
                      n_chunks, CHUNKS_P2: tl.constexpr):
    """Program per row: merge the chunk statistics into the row's max, lowest argmax and mass
    ``z = sum(exp(scaled - max))`` (stochastic rows; a filtered row's kept mass is set by its cuts' selects)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P2)
    on = c < n_chunks
    cmax = tl.load(cmax_ptr + row * n_chunks + c, mask=on, other=float("-inf"))
    m = tl.max(cmax, 0)
    first = tl.min(tl.where(on & (cmax == m), c, CHUNKS_P2), 0)
    tl.store(row_arg_ptr + row, tl.load(carg_ptr + row * n_chunks + first))
    tl.store(row_max_ptr + row, m)
    if tl.load(temp_ptr + tl.load(row_req_ptr + row)) > 0.0:
        csum = tl.load(csum_ptr + row * n_chunks + c, mask=on, other=0.0)
        tl.store(row_z_ptr + row, tl.sum(tl.where(on, csum * tl.exp(cmax - m), 0.0), 0))


@triton.jit
def _cut_candidates_kernel(row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, cand_ptr, row_max_ptr, row_z_ptr,
                           keep_key_ptr, keep_bits_ptr, resolved_ptr, V, n_chunks,
                           HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, CANDIDATES: tl.constexpr,
                           CHUNKS_P2: tl.constexpr):
    """Program per row: a filtered row's top-k and top-p cuts and kept mass from its chunks' candidates alone.

    The candidates hold every entry above the floor ``F``, the largest ``CANDIDATES``-th value of a full chunk. So
    when the candidates' k-th largest value is above ``F``, it is the row's, and the kept set lies among the
    candidates; without top-k, the same holds when ``exp(F - max)`` is below the top-p cut ``t*``. Such a row stores
    its cuts and kept mass and is marked resolved; any other row (a k deeper than the candidates, ties at the floor,
    a top-p set wider than the candidates) is left to the radix select of :func:`_cut_level_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    req, t, t_eff, k_on, p_on = _row_params(row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, row, V, HAS_TOP_K, HAS_TOP_P)
    if k_on | p_on:
        c = tl.arange(0, CHUNKS_P2)
        j = tl.arange(0, CANDIDATES)
        cand = tl.load(cand_ptr + (row * n_chunks + c[:, None]) * CANDIDATES + j[None, :],
                       mask=c[:, None] < n_chunks, other=float("-inf"))
        floor = tl.max(tl.max(tl.where(j[None, :] == CANDIDATES - 1, cand, float("-inf")), 1), 0)
        vals = tl.sort(tl.reshape(cand, (CHUNKS_P2 * CANDIDATES,)), descending=True)
        pos = tl.arange(0, CHUNKS_P2 * CANDIDATES)
        m = tl.load(row_max_ptr + row)
        ok = t > 0.0  # True, as a tensor
        keep_key = tl.zeros((), dtype=tl.int64)
        in_k = vals > float("-inf")
        z = tl.load(row_z_ptr + row)
        if k_on:
            k = tl.load(top_k_ptr + req)
            kth = tl.max(tl.where(pos == k - 1, vals, float("-inf")), 0)
            ok = kth > floor
            keep_key = ordered_key(kth)
            in_k = vals >= kth
        e = tl.where(in_k, tl.exp(vals - m), 0.0)
        if k_on:
            z = tl.sum(e, 0)
        keep_bits = tl.zeros((), dtype=tl.int64)
        if p_on:
            need = tl.load(top_p_ptr + req) * z
            first = tl.min(tl.where(tl.cumsum(e, 0) >= need, pos, CHUNKS_P2 * CANDIDATES), 0)
            cut = tl.max(tl.where(pos == first, e, 0.0), 0)
            ok = ok & (first < CHUNKS_P2 * CANDIDATES) & (k_on | (tl.exp(floor - m) < cut))
            keep_bits = bits_key(cut)
            z = tl.sum(tl.where(e >= cut, e, 0.0), 0)
        if ok:
            tl.store(keep_key_ptr + row, keep_key)
            tl.store(keep_bits_ptr + row, keep_bits)
            tl.store(row_z_ptr + row, z)
            tl.store(resolved_ptr + row, 1)


@triton.jit
def _cut_level_kernel(logits_ptr, row_map_ptr, row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, row_max_ptr, row_z_ptr,
                      keep_key_ptr, keep_bits_ptr, resolved_ptr, need_ptr, prefix_ptr, above_ptr, hist_in_ptr,
                      hist_out_ptr, rows, V, n_chunks, level,
                      TOP_P: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, LAST: tl.constexpr,
                      ROW_MAP: tl.constexpr, CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """Program (row, chunk), level ``level`` of a row's cut by radix select (:mod:`._radix_select`). The row's
    values are ``logits`` row ``row_map[row]`` (``ROW_MAP``) or ``row``, divided by its temperature.

    Rows the candidates resolved (:func:`_cut_candidates_kernel`) are skipped.
    ``TOP_P = False``: the top-k cut, the key of the k-th largest scaled logit (weights 1, need k).
    ``TOP_P = True``: the kept mass and the top-p cut over the bit patterns of ``e = exp(scaled - max)`` on the
    top-k set (weights e, need ``top_p * sum(e)``); level 0 runs for every filtered row, whose kept mass the level-1
    programs store, and the later levels for the rows with top-p only.

    Levels 1..LEVELS first close the previous level (chunk 0 stores the prefix and ``above``); the last one stores
    the cut (and, for top-p, the kept mass). Levels 0..LEVELS-1 then histogram the chunk.
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    req, t, t_eff, k_on, p_on = _row_params(row_req_ptr, temp_ptr, top_k_ptr, top_p_ptr, row, V, HAS_TOP_K, HAS_TOP_P)
    if TOP_P:
        active = tl.where(level <= 1, k_on | p_on, p_on)
    else:
        active = k_on
    if active & (tl.load(resolved_ptr + row) == 0):
        prefix = tl.zeros((), dtype=tl.int64)
        above = tl.zeros((), dtype=tl.float32)
        hist_row = hist_in_ptr + row * n_chunks * 16
        if level > 0:
            prefix = tl.load(prefix_ptr + (level - 1) * rows + row)
            above = tl.load(above_ptr + (level - 1) * rows + row)
            if TOP_P:
                if level == 1:
                    c = tl.arange(0, CHUNKS_P2)
                    b = tl.arange(0, 16)
                    mass = tl.sum(tl.sum(tl.load(hist_row + c[:, None] * 16 + b[None, :],
                                                 mask=c[:, None] < n_chunks, other=0.0), 0), 0)
                    need = tl.load(top_p_ptr + req, mask=p_on, other=1.0) * mass
                    if chunk == 0:
                        tl.store(row_z_ptr + row, mass)
                        tl.store(need_ptr + row, need)
                else:
                    need = tl.load(need_ptr + row)
            else:
                need = tl.load(top_k_ptr + req).to(tl.float32)
            if p_on | (not TOP_P):
                prefix, above, at_or_above = select_digit(hist_row, n_chunks, prefix, above, need, level, CHUNKS_P2)
                if chunk == 0:
                    tl.store(prefix_ptr + level * rows + row, prefix)
                    tl.store(above_ptr + level * rows + row, above)
                    if LAST:
                        if TOP_P:
                            tl.store(keep_bits_ptr + row, prefix)
                            tl.store(row_z_ptr + row, at_or_above)
                        else:
                            tl.store(keep_key_ptr + row, prefix)
        if (not LAST) & (p_on | (level == 0) | (not TOP_P)):
            src = row
            if ROW_MAP:
                src = tl.load(row_map_ptr + row)
            m = tl.load(row_max_ptr + row)
            keep_key = tl.load(keep_key_ptr + row)
            offs = tl.arange(0, BLOCK_V)
            acc = tl.zeros((16,), dtype=tl.float32)
            for start in range(chunk * CHUNK_V, tl.minimum(chunk * CHUNK_V + CHUNK_V, V), BLOCK_V):
                idx = start + offs
                valid = idx < V
                scaled = tl.load(logits_ptr + src * V + idx, mask=valid, other=0.0).to(tl.float32) / t_eff
                if TOP_P:
                    e = tl.where(ordered_key(scaled) >= keep_key, tl.exp(scaled - m), 0.0)
                    acc += chunk_histogram(bits_key(e), e, valid, prefix, level)
                else:
                    acc += chunk_count(ordered_key(scaled), valid, prefix, level)
            tl.store(hist_out_ptr + (row * n_chunks + chunk) * 16 + tl.arange(0, 16), acc)


@triton.jit
def _accept_kernel(draft_ids_ptr, cu_ptr, draft_probs_ptr, logits_ptr, temp_ptr, row_max_ptr, row_z_ptr,
                   row_arg_ptr, keep_key_ptr, keep_bits_ptr, accept_u_ptr, out_ptr, num_acc_ptr, final_row_ptr,
                   accept_cnt_ptr, draft_cnt_ptr, V, stride_out,
                   HAS_DRAFT_PROBS: tl.constexpr, HAS_ACCEPT_COUNTER: tl.constexpr, HAS_DRAFT_COUNTER: tl.constexpr):
    """Program per request: the accept tests of its drafts from the row statistics (one logit and, with
    draft_probs, one draft probability gathered per draft), the accepted tokens, the counters, and the final
    row; a greedy request's last token is that row's argmax, a stochastic one's is drawn by :func:`_draw_kernel`.
    ``stride_out`` (``max_spec_len + 1``) is a runtime argument, so a new draft width compiles nothing."""
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
        row = row0 + j
        x = tl.load(draft_ids_ptr + i).to(tl.int64)
        if t > 0.0:
            if HAS_DRAFT_PROBS:
                pd = tl.load(draft_probs_ptr + i * V + x)
            else:
                pd = 1.0
            scaled = tl.load(logits_ptr + row * V + x).to(tl.float32) / t
            pt = _target_prob(scaled, tl.load(row_max_ptr + row), tl.load(row_z_ptr + row),
                              tl.load(keep_key_ptr + row), tl.load(keep_bits_ptr + row))
            ok = tl.load(accept_u_ptr + i) * pd < pt
        else:
            ok = x == tl.load(row_arg_ptr + row).to(tl.int64)
        alive = alive & ok
        tl.store(out_row + j, x, mask=alive)
        num_acc += alive.to(tl.int64)
        if HAS_DRAFT_COUNTER:
            tl.atomic_add(draft_cnt_ptr + j, 1)
        if HAS_ACCEPT_COUNTER:
            tl.atomic_add(accept_cnt_ptr + j, 1, mask=alive)
    tl.store(num_acc_ptr + r, num_acc.to(tl.int32))
    tl.store(final_row_ptr + r, row0 + num_acc)
    if t == 0.0:
        tl.store(out_row + num_acc, tl.load(row_arg_ptr + row0 + num_acc).to(tl.int64))


@triton.jit
def _last_weights(logits_ptr, draft_probs_ptr, row, i_rej, x_rej, rejected, idx, valid, t, m, z, keep_key,
                  keep_bits, V, HAS_DRAFT_PROBS: tl.constexpr):
    """One vocab tile of the last token's two candidate weights: ``p_t`` of the final row and the residual
    ``max(0, p_t - p_d)`` of the rejected draft (zeros unless ``rejected``)."""
    scaled = tl.load(logits_ptr + row * V + idx, mask=valid, other=0.0).to(tl.float32) / t
    pt = tl.where(valid, _target_prob(scaled, m, z, keep_key, keep_bits), 0.0)
    on = tl.where(rejected, valid, False)  # not `valid & rejected`: the interpreter mistypes that mask
    if HAS_DRAFT_PROBS:
        pd = tl.load(draft_probs_ptr + i_rej * V + idx, mask=on, other=0.0)
    else:
        pd = tl.where(idx == x_rej, 1.0, 0.0)
    return pt, tl.where(on, tl.maximum(pt - pd, 0.0), 0.0)


@triton.jit
def _last_row_params(draft_ids_ptr, cu_ptr, num_acc_ptr, final_row_ptr, row_max_ptr, row_z_ptr, keep_key_ptr,
                     keep_bits_ptr, r):
    """Request ``r``'s final row, its statistics and cuts, and its rejected draft (index, token, whether any)."""
    row = tl.load(final_row_ptr + r)
    i_rej = tl.load(cu_ptr + r).to(tl.int64) + tl.load(num_acc_ptr + r)
    rejected = i_rej < tl.load(cu_ptr + r + 1).to(tl.int64)
    x_rej = tl.load(draft_ids_ptr + i_rej, mask=rejected, other=-1).to(tl.int64)
    return (row, i_rej, x_rej, rejected, tl.load(row_max_ptr + row), tl.load(row_z_ptr + row),
            tl.load(keep_key_ptr + row), tl.load(keep_bits_ptr + row))


@triton.jit
def _last_chunk_sums_kernel(draft_ids_ptr, cu_ptr, draft_probs_ptr, logits_ptr, temp_ptr, num_acc_ptr,
                            final_row_ptr, row_max_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr, sums_ptr, last_ptr,
                            V, n_chunks, HAS_DRAFT_PROBS: tl.constexpr, CHUNK_V: tl.constexpr,
                            BLOCK_V: tl.constexpr):
    """Program (stochastic request, chunk): the chunk's sums of both candidate weights of the last token
    (:func:`_last_weights`) and their last positive indices, the first pass of the vocab-parallel draw."""
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + r)
    if t > 0.0:
        row, i_rej, x_rej, rejected, m, z, keep_key, keep_bits = _last_row_params(
            draft_ids_ptr, cu_ptr, num_acc_ptr, final_row_ptr, row_max_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr, r)
        offs = tl.arange(0, BLOCK_V)
        sum_pt = tl.zeros((), dtype=tl.float32)
        sum_res = tl.zeros((), dtype=tl.float32)
        last_pt = tl.zeros((), dtype=tl.int64) - 1
        last_res = tl.zeros((), dtype=tl.int64) - 1
        for start in range(chunk * CHUNK_V, tl.minimum(chunk * CHUNK_V + CHUNK_V, V), BLOCK_V):
            idx = (start + offs).to(tl.int64)
            pt, res = _last_weights(logits_ptr, draft_probs_ptr, row, i_rej, x_rej, rejected, idx, idx < V, t, m, z,
                                    keep_key, keep_bits, V, HAS_DRAFT_PROBS)
            sum_pt += tl.sum(pt, 0)
            sum_res += tl.sum(res, 0)
            last_pt = tl.maximum(last_pt, tl.max(tl.where(pt > 0.0, idx, -1), 0))
            last_res = tl.maximum(last_res, tl.max(tl.where(res > 0.0, idx, -1), 0))
        at = (r * n_chunks + chunk) * 2
        tl.store(sums_ptr + at, sum_pt)
        tl.store(sums_ptr + at + 1, sum_res)
        tl.store(last_ptr + at, last_pt)
        tl.store(last_ptr + at + 1, last_res)


@triton.jit
def _draw_kernel(draft_ids_ptr, cu_ptr, draft_probs_ptr, logits_ptr, temp_ptr, num_acc_ptr, final_row_ptr,
                 row_max_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr, sums_ptr, last_ptr, sample_u_ptr, out_ptr,
                 V, n_chunks, stride_out,
                 HAS_DRAFT_PROBS: tl.constexpr, RESID_EPS: tl.constexpr, CHUNK_V: tl.constexpr,
                 BLOCK_V: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """Program per stochastic request: the last token by inverse CDF. The residual is used when a draft was rejected
    and its mass exceeds ``RESID_EPS``, else ``p_t``. The chunk sums locate the chunk where the cumulative weight
    passes ``u * total``; the scan then starts there (usually ending inside it), so one chunk is re-read."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + r)
    if t > 0.0:
        row, i_rej, x_rej, rejected, m, z, keep_key, keep_bits = _last_row_params(
            draft_ids_ptr, cu_ptr, num_acc_ptr, final_row_ptr, row_max_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr, r)
        c = tl.arange(0, CHUNKS_P2)
        on = c < n_chunks
        at = (r * n_chunks + c) * 2
        res_sums = tl.load(sums_ptr + at + 1, mask=on, other=0.0)
        use_resid = rejected & (tl.sum(res_sums, 0) > RESID_EPS)
        sums = tl.where(use_resid, res_sums, tl.load(sums_ptr + at, mask=on, other=0.0))
        last = tl.max(tl.where(use_resid, tl.load(last_ptr + at + 1, mask=on, other=-1),
                               tl.load(last_ptr + at, mask=on, other=-1)), 0)
        incl = tl.cumsum(sums, 0)
        target = tl.load(sample_u_ptr + row) * tl.max(incl, 0)
        first = tl.min(tl.where(on & (incl > target), c, n_chunks), 0)
        running = tl.sum(tl.where(c == first, incl - sums, 0.0), 0)
        found = tl.zeros((), dtype=tl.int64) + V
        start = first.to(tl.int64) * CHUNK_V
        offs = tl.arange(0, BLOCK_V)
        while (found == V) & (start < V):
            idx = start + offs
            valid = idx < V
            pt, res = _last_weights(logits_ptr, draft_probs_ptr, row, i_rej, x_rej, rejected, idx, valid, t, m, z,
                                    keep_key, keep_bits, V, HAS_DRAFT_PROBS)
            w = tl.where(use_resid, res, pt)
            running, found, _ = cdf_scan_step(w, idx, valid, V, target, running, found, last)
            start += BLOCK_V
        tl.store(out_ptr + r * stride_out + tl.load(num_acc_ptr + r), tl.where(found < V, found, last))


# -------------------------------------------------------------------------------------------------------- launcher
def _or_dummy(x: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An optional tensor argument of a launch: itself (contiguous), or a one-element stand-in a kernel never reads."""
    return x.contiguous() if x is not None else torch.zeros(1, dtype=dtype, device=device)


class TargetRowStats(NamedTuple):
    """Per target row ``[rows]``: ``row_max`` (max of the scaled logits), ``row_z`` (the kept mass
    ``sum(e)``, stochastic rows), ``row_arg`` (lowest argmax, int32), and the cuts as keys, 0 = keep all:
    ``keep_key`` (top-k: the ordered key of the k-th largest scaled logit) and ``keep_bits`` (top-p: the bit
    pattern of the smallest kept ``e``). ``p_t = e / row_z`` on the entries whose keys pass both cuts.
    ``by_candidates`` (int32): 1 where a filtered row's cuts came from its chunk candidates, 0 where the radix
    select found them (or nothing filters the row)."""

    row_max: torch.Tensor
    row_z: torch.Tensor
    row_arg: torch.Tensor
    keep_key: torch.Tensor
    keep_bits: torch.Tensor
    by_candidates: torch.Tensor


def target_row_stats(logits: torch.Tensor, row_req: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None, cfg: dict) -> TargetRowStats:
    """The row passes of :func:`rejection_sample_triton` over contiguous ``logits [rows, V]`` (``row_req [rows]``
    int32: each row's request; ``temp``, ``top_k``, ``top_p``: per request), parallel over (row, vocab chunk).

    A filtered row's cuts come from its chunks' candidates when they suffice (:func:`_cut_candidates_kernel`), so the
    logits are read once; the radix-select launches then only read the other rows (their programs for resolved rows
    load a few scalars and return)."""
    dev = logits.device
    rows, v = logits.shape
    block_v, chunk_v, warps = cfg["BLOCK_V"], cfg["CHUNK_V"], cfg["num_warps"]
    filtered = top_k is not None or top_p is not None
    cands = cfg.get("CANDIDATES", 0) if filtered else 0
    if cands and (cands > block_v or cands & (cands - 1)):
        raise ValueError(f"rejection_sample config: CANDIDATES {cands} must be a power of two <= BLOCK_V {block_v}")
    n_chunks = triton.cdiv(v, chunk_v)
    chunks_p2 = triton.next_power_of_2(n_chunks)
    f32, i64 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev)
    cmax, csum = torch.empty((rows, n_chunks), **f32), torch.empty((rows, n_chunks), **f32)
    carg = torch.empty((rows, n_chunks), dtype=torch.int32, device=dev)
    cand = torch.empty((rows, n_chunks, max(cands, 1)), **f32)
    stats = TargetRowStats(torch.empty(rows, **f32), torch.ones(rows, **f32),
                           torch.empty(rows, dtype=torch.int32, device=dev), torch.zeros(rows, **i64),
                           torch.zeros(rows, **i64), torch.zeros(rows, dtype=torch.int32, device=dev))
    tk, tp = _or_dummy(top_k, torch.int64, dev), _or_dummy(top_p, torch.float32, dev)
    flags = dict(HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None)
    _chunk_stats_kernel[(rows, n_chunks)](logits, row_req, temp, tk, tp, cmax, csum, carg, cand, v, n_chunks,
                                          **flags, CANDIDATES=cands, CHUNK_V=chunk_v, BLOCK_V=block_v,
                                          num_warps=warps)
    _row_merge_kernel[(rows,)](row_req, temp, cmax, csum, carg, stats.row_max, stats.row_z, stats.row_arg, n_chunks,
                               CHUNKS_P2=chunks_p2, num_warps=1)
    if not filtered:
        return stats
    if cands:
        candidate_cuts(cand, row_req, temp, top_k, top_p, stats, v)
    radix_cuts(logits, None, row_req, temp, top_k, top_p, stats, cfg)
    return stats


def candidate_cuts(cand: torch.Tensor, row_req: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, stats: TargetRowStats, v: int) -> None:
    """The top-k / top-p cuts and kept mass of the filtered rows whose candidates suffice
    (:func:`_cut_candidates_kernel`, one program per row), written in place to ``stats``, which also marks them in
    ``by_candidates``. ``cand [rows, chunks, C]``: each chunk's ``C`` largest values, descending, with the floor
    contract of that kernel; ``row_req [rows]`` int32: each row's request (``temp``, ``top_k``, ``top_p`` are
    per request); ``stats.row_max`` and ``stats.row_z`` (the row's mass) must be set; ``v``: the row length."""
    rows, n_chunks, cands = cand.shape
    dev = cand.device
    _cut_candidates_kernel[(rows,)](row_req, temp, _or_dummy(top_k, torch.int64, dev),
                                    _or_dummy(top_p, torch.float32, dev), cand, stats.row_max, stats.row_z,
                                    stats.keep_key, stats.keep_bits, stats.by_candidates, v, n_chunks,
                                    HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, CANDIDATES=cands,
                                    CHUNKS_P2=triton.next_power_of_2(n_chunks), num_warps=4)


def radix_cuts(values: torch.Tensor, row_map: torch.Tensor | None, row_req: torch.Tensor, temp: torch.Tensor,
               top_k: torch.Tensor | None, top_p: torch.Tensor | None, stats: TargetRowStats, cfg: dict) -> None:
    """The top-k / top-p cuts of the filtered rows that ``stats.by_candidates`` does not mark resolved, by radix
    select over (row, vocab chunk) programs: ``LEVELS + 1`` launches per cut, each reading those rows once (the
    programs of other rows load a few scalars and return). Row ``i`` (``row_req [rows]`` int32: its request) is
    ``values`` row ``row_map[i]`` (``[rows]`` int64; None: row ``i``) divided by its request's ``temp``; its
    ``row_max`` must be set. Writes the rows' ``keep_key`` / ``keep_bits`` (0 where no cut) and kept mass
    ``row_z`` in place."""
    dev = values.device
    rows, v = row_req.numel(), values.shape[1]
    n_chunks = triton.cdiv(v, cfg["CHUNK_V"])
    f32 = dict(dtype=torch.float32, device=dev)
    hist = torch.empty((2, rows, n_chunks, 16), **f32)
    prefix = torch.zeros((LEVELS + 1, rows), dtype=torch.int64, device=dev)  # row 0: level 0's
    above = torch.zeros((LEVELS + 1, rows), **f32)
    need = torch.empty(rows, **f32)
    tk, tp = _or_dummy(top_k, torch.int64, dev), _or_dummy(top_p, torch.float32, dev)
    for top_p_cut in (False, True) if top_k is not None else (True,):
        levels = LEVELS if top_p is not None or not top_p_cut else 1  # top-k only: level 1 stores the kept mass
        for level in range(levels + 1):
            _cut_level_kernel[(rows, n_chunks)](
                values, _or_dummy(row_map, torch.int64, dev), row_req, temp, tk, tp, stats.row_max, stats.row_z,
                stats.keep_key, stats.keep_bits, stats.by_candidates, need, prefix, above, hist[(level + 1) % 2],
                hist[level % 2], rows, v, n_chunks, level, TOP_P=top_p_cut, HAS_TOP_K=top_k is not None,
                HAS_TOP_P=top_p is not None, LAST=level == LEVELS, ROW_MAP=row_map is not None,
                CHUNK_V=cfg["CHUNK_V"], BLOCK_V=cfg["BLOCK_V"], CHUNKS_P2=triton.next_power_of_2(n_chunks),
                num_warps=cfg["num_warps"])


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
    """Triton twin of :func:`rejection_sample_ref` (same signature), with no host sync and no ``[rows, V]``
    workspace. Every row pass runs over (row, vocab chunk) programs:

    1. ``_chunk_stats_kernel`` reads the logits once (chunk max, argmax, online sum-exp), ``_row_merge_kernel``
       merges them per row;
    2. with top-k / top-p, ``_cut_candidates_kernel`` finds the cuts of the rows whose chunk candidates suffice,
       and ``_cut_level_kernel`` those of the others by radix select: ``LEVELS + 1`` launches per cut, each reading
       those rows once;
    3. ``_accept_kernel`` (per request) runs the accept tests from the row statistics;
    4. ``_last_chunk_sums_kernel`` (stochastic request x chunk) and ``_draw_kernel`` (per request) draw the last
       token, re-reading only the final row and the rejected draft's row.
    """
    dev = target_logits.device
    v = target_logits.shape[1]
    r = cu_num_draft_tokens.numel() - 1
    cfg = sampling_config(dev)
    out = torch.full((r, max_spec_len + 1), -1, dtype=torch.int64, device=dev)
    num_acc = torch.zeros(r, dtype=torch.int32, device=dev)
    if r == 0:
        return RejectionResult(out, num_acc)
    logits = target_logits.contiguous()
    temp = temperature.float().contiguous()
    _, row_req, *_ = _ragged_maps(cu_num_draft_tokens.long(), draft_token_ids.numel())
    stats = target_row_stats(logits, row_req.to(torch.int32), temp, top_k, top_p, cfg)
    final_row = torch.empty(r, dtype=torch.int64, device=dev)
    drafts, cu = draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous()
    dprobs = _or_dummy(draft_probs, torch.float32, dev)
    _accept_kernel[(r,)](
        drafts, cu, dprobs, logits, temp, stats.row_max, stats.row_z, stats.row_arg, stats.keep_key, stats.keep_bits,
        _or_dummy(accept_uniforms, torch.float32, dev), out, num_acc, final_row,
        _or_dummy(accept_counter, torch.int64, dev), _or_dummy(draft_counter, torch.int64, dev), v, out.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None, HAS_ACCEPT_COUNTER=accept_counter is not None,
        HAS_DRAFT_COUNTER=draft_counter is not None, num_warps=1,
    )
    if sample_uniforms is None:  # every request is greedy (the op's contract): no draw
        return RejectionResult(out, num_acc)
    _draw_last_tokens(drafts, cu, draft_probs, logits, temp, num_acc, final_row, stats, sample_uniforms.contiguous(),
                      out, cfg)
    return RejectionResult(out, num_acc)


def _draw_last_tokens(drafts: torch.Tensor, cu: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                      temp: torch.Tensor, num_acc: torch.Tensor, final_row: torch.Tensor, stats: TargetRowStats,
                      sample_u: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    """Each stochastic request's last token (``r`` requests: ``num_acc [r]`` accepted drafts, ``final_row [r]`` the
    row to draw from) into ``out[r, num_acc[r]]``: ``_last_chunk_sums_kernel`` over (request, vocab chunk), then
    ``_draw_kernel`` per request."""
    dev = logits.device
    r, v = num_acc.numel(), logits.shape[1]
    n_chunks = triton.cdiv(v, cfg["CHUNK_V"])
    sums = torch.empty((r, n_chunks, 2), dtype=torch.float32, device=dev)
    last = torch.empty((r, n_chunks, 2), dtype=torch.int64, device=dev)
    common = (drafts, cu, _or_dummy(draft_probs, torch.float32, dev), logits, temp, num_acc, final_row,
              stats.row_max, stats.row_z, stats.keep_key, stats.keep_bits)
    tiles = dict(CHUNK_V=cfg["CHUNK_V"], BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
    _last_chunk_sums_kernel[(r, n_chunks)](*common, sums, last, v, n_chunks, HAS_DRAFT_PROBS=draft_probs is not None,
                                          **tiles)
    _draw_kernel[(r,)](*common, sums, last, sample_u, out, v, n_chunks, out.stride(0),
                       HAS_DRAFT_PROBS=draft_probs is not None, RESID_EPS=RESIDUAL_EPS,
                       CHUNKS_P2=triton.next_power_of_2(n_chunks), **tiles)


def sampling_config(device: torch.device) -> dict:
    """The launch config of the row passes (autotune store or defaults), checked."""
    cfg = launch_config("rejection_sample", _DEFAULTS, device)
    if cfg["CHUNK_V"] % cfg["BLOCK_V"]:
        raise ValueError(f"rejection_sample config: CHUNK_V {cfg['CHUNK_V']} must be a multiple of BLOCK_V "
                         f"{cfg['BLOCK_V']}")
    return cfg


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
