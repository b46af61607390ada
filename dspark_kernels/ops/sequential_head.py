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
from ..reference._sampling import top_k_filters, top_p_filters
from ..reference.sequential_head import (
    KINDS,
    MarkovBiasRows,
    SequentialHeadResult,
    SequentialHeadWeights,
    sequential_head_ref,
)
from ._dispatch import resolve_impl, triton_interpreted
from ._radix_select import bits_key, ordered_key
from ._sampling import cdf_scan_step, kept_weights
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
from .rejection_sample import TargetRowStats, candidate_cuts, radix_cuts, sampling_config

__all__ = ["MarkovBiasRows", "SequentialHeadResult", "SequentialHeadWeights", "sequential_head",
           "sequential_head_triton"]

# CANDIDATES: the largest x per (filtered request, vocab tile) the vocab launch keeps for the top-k / top-p cuts (a
# power of two <= BLOCK_V)
_DEFAULTS = {"BLOCK_V": 128, "BLOCK_M": 16, "CANDIDATES": 8, "num_warps": 8}  # no spills on sm_80 / sm_90
# the filtered rows' tile candidates are merged per group of GROUP_V columns (a multiple of BLOCK_V) into its
# GROUP_CANDIDATES largest, the candidates of the cuts
GROUP_V = 8192
GROUP_CANDIDATES = 64
RNN_COLUMNS = 32  # state columns per step of the rnn latent, and the width of the state / embedding slices it
# multiplies: at rank 64, whole [r, r] tiles spilled 488 B; 32 columns from whole [16, r] operands 148-200 B
# the latent launch's pipelining: its next weight / state slices copied one step ahead (3 stages spilled 24 B on sm_90)
LATENT_STAGES = 2
_KIND_IDS = {"none": 0, "vanilla": 1, "gated": 2, "rnn": 3}
# float32 products on tensor cores at about float32 accuracy (three tf32 products); the interpreter computes them in
# float32 whatever the precision
DOT_PRECISION = tl.constexpr("tf32x3")


# --------------------------------------------------------------------------------------------------------- kernels
# The slots of a request depend on each other (slot k's bias needs token k-1), so the launcher walks the slots; each
# slot is vocab-parallel over every request at once:
#   latent  grid (R / BLOCK_M)                  previous tokens -> Markov embedding -> latent [R, r] (+ confidence)
#   vocab   grid (V / BLOCK_V, R / BLOCK_M)     per tile: scaled logits x = (U + lat @ w2) / T through tl.dot (w2
#                                               is read once per slot for all requests); per (request, tile) max,
#                                               argmax and sum of exp(x - tile max); sampled rows keep x in the draft
#                                               rows; filtered rows (top-k / top-p) keep the tile's CANDIDATES largest
#   draw    grid (R)                            merge the tiles' statistics (online max / sum-exp): argmax, or the
#                                               inverse-CDF draw: the tile from the tiles' masses, the index from that
#                                               one tile
#   filtered rows, when any request has filters (_FilteredSlot), without re-reading the rows:
#     group candidates  grid (R, V / GROUP_V)   the GROUP_CANDIDATES largest of a group's tile candidates
#     cuts              grid (R)                top-k / top-p cuts and kept mass from the candidates
#                                               (rejection_sample.candidate_cuts); rows they do not settle take the
#                                               radix select (rejection_sample.radix_cuts, which reads them)
#     group mass        grid (R, V / GROUP_V)   each group's kept mass, from its candidates
#     filtered draw     grid (R)                the group from the groups' masses, the tile from its tile candidates,
#                                               the index from that tile's x; kept mass and cuts for the normalise
# and after the last slot
#   normalise grid (V / BLOCK_V, N / BLOCK_M)   draft rows = exp(x - max) / Z, or one-hot for greedy rows; a
#                                               filtered row reads only the tiles whose max passes its cuts
# The hidden-state terms of every slot (the gate/rnn inputs, the confidence dot) are one GEMM before the slot loop.


@triton.jit
def _weight_tile(w_ptr, s_in, s_out, col0, RANK, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``W[0:RANK, col0:col0 + n_cols]`` of a strided matrix as a zero-padded ``[BLOCK_R, BLOCK_C]`` float32 tile."""
    i = tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_C)
    ok = (i[:, None] < RANK) & (j[None, :] < n_cols)
    ptrs = w_ptr + (i[:, None] * s_in + (col0 + j[None, :]) * s_out)
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _split_bf16_dot(a, b, BF16_DOT: tl.constexpr):
    """``a [M, K]`` float32 @ ``b [K, N]`` bfloat16 -> float32, at float32 accuracy on bf16 tensor cores: ``a`` is
    the sum of three bfloat16 pieces (hi + mid + lo: 3 x 8 significand bits, exact for normal values), each piece
    times ``b`` is exact in float32, and the three products accumulate in float32, smallest first. Cheaper than a
    tf32x3 dot: ``b`` needs no conversion or hi / lo split (a bf16 value is its own tf32 hi, so a third of tf32x3's
    products would be zeros) and a bf16 MMA covers twice the K of a tf32 one. ``BF16_DOT`` False (the interpreter,
    whose bf16 dot is wrong): the same pieces, multiplied in float32."""
    hi = a.to(tl.bfloat16)
    rest = a - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    if BF16_DOT:
        acc = tl.dot(lo, b, out_dtype=tl.float32)
        acc = tl.dot(mid, b, acc)
        acc = tl.dot(hi, b, acc)
    else:
        bf = b.to(tl.float32)
        acc = tl.dot(lo.to(tl.float32), bf, input_precision="ieee")
        acc = tl.dot(mid.to(tl.float32), bf, acc, input_precision="ieee")
        acc = tl.dot(hi.to(tl.float32), bf, acc, input_precision="ieee")
    return acc


@triton.jit
def _rnn_part(pre, on, s_rows, e_rows, active, rnn_w_ptr, e_w_ptr, s_in, s_out, col0, n_cols, RANK,
              BLOCK_C: tl.constexpr):
    """``BLOCK_C`` columns from ``col0`` (``n_cols`` of them real) of the rnn pre-activation: the hidden-state term
    at ``pre + col0`` plus ``s @ rnn_w_s + e @ rnn_w_e`` (``rnn_w``'s state rows, then its embedding rows from
    ``e_w_ptr``), summed over ``BLOCK_C``-wide slices of ``s`` and ``e`` loaded from their rows (``s_rows``,
    ``e_rows``: ``[BLOCK_M, 1]`` pointers), so no whole ``[BLOCK_M, r]`` operand is held in registers."""
    x = tl.load(pre + col0, mask=on, other=0.0)
    kk = tl.arange(0, BLOCK_C)
    for k0 in range(0, RANK, BLOCK_C):
        ok = active[:, None] & (k0 + kk < RANK)[None, :]
        s = tl.load(s_rows + k0 + kk[None, :], mask=ok, other=0.0)
        e = tl.load(e_rows + k0 + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        x += tl.dot(s, _weight_tile(rnn_w_ptr + k0 * s_in, s_in, s_out, col0, RANK - k0, n_cols, BLOCK_C, BLOCK_C),
                    input_precision=DOT_PRECISION)
        x += tl.dot(e, _weight_tile(e_w_ptr + k0 * s_in, s_in, s_out, col0, RANK - k0, n_cols, BLOCK_C, BLOCK_C),
                    input_precision=DOT_PRECISION)
    return x


@triton.jit
def _tanh(x):
    """tanh in float32 via ``2 sigmoid(2x) - 1``."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _block_rows(cu_ptr, R, k, block, BLOCK_M: tl.constexpr):
    """Requests ``m [BLOCK_M]`` of request block ``block``, whether each has a slot ``k``, and that slot's row."""
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_batch = m < R
    start = tl.load(cu_ptr + m, mask=in_batch, other=0).to(tl.int64)
    length = tl.load(cu_ptr + m + 1, mask=in_batch, other=0).to(tl.int64) - start
    return m, in_batch & (k < length), start + k


@triton.jit
def _slot_latent_kernel(
    anchor_ptr, cu_ptr, tokens_ptr, w1_ptr, s_w1, gate_h_ptr, gate_w_ptr, s_gw_in, s_gw_out,
    rnn_h_ptr, rnn_w_ptr, s_rw_in, s_rw_out, state_ptr, conf_h_ptr, conf_w_ptr, lat_ptr, conf_ptr,
    R, D, RANK, k,
    KIND: tl.constexpr, HAS_CONF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Slot ``k`` of ``BLOCK_M`` requests: ``e = w1[x_{k-1}]`` (the anchor at ``k = 0``), the latent ``lat [R, r]``
    (vanilla ``e``; gated ``sigmoid(gate_h + e @ gate_w_e) * e``; rnn ``tanh(o)``, the state ``[2, R, r]`` read
    from buffer ``k % 2`` and updated into the other),
    and the confidence logit ``conf_h + e . conf_w_e``. ``gate_h``/``rnn_h``/``conf_h`` hold the hidden-state terms
    (biases included) of every slot."""
    m, active, row = _block_rows(cu_ptr, R, k, tl.program_id(0), BLOCK_M)
    if k == 0:
        prev = tl.load(anchor_ptr + m, mask=active, other=0).to(tl.int64)
    else:
        prev = tl.load(tokens_ptr + row - 1, mask=active, other=0)
    c = tl.arange(0, BLOCK_R)
    on = active[:, None] & (c < RANK)[None, :]
    e = tl.load(w1_ptr + prev[:, None] * s_w1 + c[None, :], mask=on, other=0.0).to(tl.float32)
    if KIND == 1:
        lat = e
    elif KIND == 2:
        g = tl.load(gate_h_ptr + row[:, None] * RANK + c[None, :], mask=on, other=0.0)
        g += tl.dot(e, _weight_tile(gate_w_ptr + D * s_gw_in, s_gw_in, s_gw_out, 0, RANK, RANK, BLOCK_R, BLOCK_R),
                    input_precision=DOT_PRECISION)
        lat = tl.sigmoid(g) * e
    else:  # rnn: BLOCK_C columns of a, c and o at a time, from BLOCK_C-wide slices of s and e (whole [r, r] tiles
        # and whole [BLOCK_M, r] operands do not fit in registers); the state is double-buffered, slot k reading
        # buffer k % 2 and writing the other, so every slice read is of the previous state
        s_in = state_ptr + (k % 2) * R * RANK + m[:, None].to(tl.int64) * RANK
        s_out = state_ptr + ((k + 1) % 2) * R * RANK + m[:, None].to(tl.int64) * RANK
        e_rows = w1_ptr + prev[:, None] * s_w1
        e_w = rnn_w_ptr + RANK * s_rw_in
        j = tl.arange(0, BLOCK_C)
        for c0 in range(0, RANK, BLOCK_C):
            cols = c0 + j
            on_c = active[:, None] & (cols < RANK)[None, :]
            pre = rnn_h_ptr + row[:, None] * (3 * RANK) + j[None, :]
            n_cols = RANK - c0
            a = _rnn_part(pre, on_c, s_in, e_rows, active, rnn_w_ptr, e_w, s_rw_in, s_rw_out, c0, n_cols, RANK,
                          BLOCK_C)
            cc = _rnn_part(pre, on_c, s_in, e_rows, active, rnn_w_ptr, e_w, s_rw_in, s_rw_out, RANK + c0, n_cols,
                           RANK, BLOCK_C)
            gate = tl.sigmoid(a)
            s_old = tl.load(s_in + cols[None, :], mask=on_c, other=0.0)
            tl.store(s_out + cols[None, :], gate * s_old + (1.0 - gate) * _tanh(cc), mask=on_c)
            o = _rnn_part(pre, on_c, s_in, e_rows, active, rnn_w_ptr, e_w, s_rw_in, s_rw_out, 2 * RANK + c0, n_cols,
                          RANK, BLOCK_C)
            tl.store(lat_ptr + m[:, None] * RANK + cols[None, :], _tanh(o), mask=on_c)
    if KIND != 3:
        tl.store(lat_ptr + m[:, None].to(tl.int64) * RANK + c[None, :], lat, mask=on)
    if HAS_CONF:
        cw = tl.load(conf_w_ptr + D + c, mask=c < RANK, other=0.0).to(tl.float32)
        conf = tl.load(conf_h_ptr + row, mask=active, other=0.0) + tl.sum(e * cw[None, :], 1)
        tl.store(conf_ptr + row, conf, mask=active)


@triton.jit
def _slot_vocab_kernel(
    logits_ptr, cu_ptr, lat_ptr, w2_ptr, s_w2r, s_w2v, temp_ptr, ws_ptr, part_ptr, part_arg_ptr, filt_ptr, cand_ptr,
    tile_max_ptr, R, V, RANK, k, NT,
    KIND: tl.constexpr, STORE: tl.constexpr, FILTERED: tl.constexpr, CANDIDATES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, W2_BF16: tl.constexpr, BF16_DOT: tl.constexpr,
):
    """One vocab tile of slot ``k`` for ``BLOCK_M`` requests: ``x = (U.float() + lat @ w2) / t_eff`` (a bf16 ``w2``
    (``W2_BF16``) through :func:`_split_bf16_dot`, a float32 one through a tf32x3 dot) (``STORE``:
    written to the draft rows of sampled requests), and per request the tile's max, lowest-index argmax and
    ``sum(exp(x - max))`` into ``part [2, R, NT]`` / ``part_arg [R, NT]``. With ``FILTERED``, the requests that
    ``filt [R]`` marks (top-k / top-p) also keep the tile's ``CANDIDATES`` largest ``x``, descending, in
    ``cand [R, NT, CANDIDATES]`` (-inf past the vocabulary), and its max in their rows of ``tile_max [N, NT]``."""
    tile = tl.program_id(0)
    m, active, row = _block_rows(cu_ptr, R, k, tl.program_id(1), BLOCK_M)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    on = active[:, None] & (cols < V)[None, :]
    offs = row[:, None] * V + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=on, other=0.0).to(tl.float32)
    if KIND != 0:
        c = tl.arange(0, BLOCK_R)
        lat = tl.load(lat_ptr + m[:, None].to(tl.int64) * RANK + c[None, :],
                      mask=active[:, None] & (c < RANK)[None, :], other=0.0)
        w = tl.load(w2_ptr + c[:, None].to(tl.int64) * s_w2r + cols[None, :].to(tl.int64) * s_w2v,
                    mask=(c < RANK)[:, None] & (cols < V)[None, :], other=0.0)
        if W2_BF16:
            x += _split_bf16_dot(lat, w, BF16_DOT)
        else:
            x += tl.dot(lat, w.to(tl.float32), input_precision=DOT_PRECISION)
    t = tl.load(temp_ptr + m, mask=active, other=1.0)
    x = x / tl.where(t > 0.0, t, 1.0)[:, None]
    if STORE:
        tl.store(ws_ptr + offs, x, mask=on & (t > 0.0)[:, None])
    xm = tl.where(on, x, float("-inf"))
    t_max = tl.max(xm, 1)
    at = m.to(tl.int64) * NT + tile
    tl.store(part_ptr + at, t_max, mask=active)
    tl.store(part_ptr + R * NT + at, tl.sum(tl.where(on, tl.exp(x - t_max[:, None]), 0.0), 1), mask=active)
    tl.store(part_arg_ptr + at, tl.argmax(xm, 1) + tile * BLOCK_V, mask=active)
    if FILTERED:
        f = active & (tl.load(filt_ptr + m, mask=active, other=0) != 0)
        if tl.max(f.to(tl.int32), 0) > 0:
            j = tl.arange(0, CANDIDATES)
            tl.store(cand_ptr + at[:, None] * CANDIDATES + j[None, :], tl.topk(xm, CANDIDATES), mask=f[:, None])
            tl.store(tile_max_ptr + row * NT + tile, t_max, mask=f)


@triton.jit
def _slot_draw_kernel(
    cu_ptr, temp_ptr, filt_ptr, u_ptr, part_ptr, part_arg_ptr, ws_ptr, tokens_ptr, row_max_ptr, row_z_ptr,
    req_t_ptr, req_row_ptr, req_max_ptr, req_z_ptr, req_key_ptr, req_bits_ptr, req_res_ptr, R, V, k, NT,
    SAMPLE: tl.constexpr, FILTERED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Request ``req``'s slot ``k``: merge the tiles' statistics into the row max ``M`` and argmax; greedy takes the
    argmax. A sampled row without filters draws by inverse CDF against ``u * Z`` (``Z = sum_t s_t exp(m_t - M)``):
    the tile from the tiles' masses, the index from that tile's ``exp(x - M)``. ``row_z``: ``Z`` (the normalise pass
    divides by it) or -1 (greedy: one-hot).

    With ``FILTERED``, a row that ``filt [R]`` marks is left to the filtered-row launches: this program sets the
    request's slot state ``req_* [R]`` (``req_t`` 1, its row, ``M``, ``Z``, no cuts, not resolved); ``req_t`` is 0
    for every other request."""
    req = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + req).to(tl.int64)
    has_slot = k < tl.load(cu_ptr + req + 1).to(tl.int64) - start
    filtered = has_slot & (k < 0)  # False, as a tensor
    if FILTERED:
        filtered = has_slot & (tl.load(filt_ptr + req) != 0)
        tl.store(req_t_ptr + req, tl.where(filtered, 1.0, 0.0))
    if has_slot:
        row = start + k
        ti = tl.arange(0, BLOCK_T)
        tv = ti < NT
        at = req * NT + ti
        plane = R * NT
        p_max = tl.load(part_ptr + at, mask=tv, other=float("-inf"))
        best = tl.max(p_max, 0)
        token = tl.min(tl.where(p_max == best, tl.load(part_arg_ptr + at, mask=tv, other=V), V), 0).to(tl.int64)
        if SAMPLE:
            z = tl.full((), -1.0, tl.float32)
            if tl.load(temp_ptr + req) > 0.0:
                mass = tl.where(tv, tl.load(part_ptr + plane + at, mask=tv, other=0.0) * tl.exp(p_max - best), 0.0)
                z = tl.sum(mass, 0)
                if filtered:
                    tl.store(req_row_ptr + req, row)
                    tl.store(req_max_ptr + req, best)
                    tl.store(req_z_ptr + req, z)
                    tl.store(req_key_ptr + req, 0)
                    tl.store(req_bits_ptr + req, 0)
                    tl.store(req_res_ptr + req, 0)
                else:
                    target = tl.load(u_ptr + row) * z
                    hit = (mass > 0.0) & (tl.cumsum(mass, 0) > target)
                    pick = tl.min(tl.where(hit, ti, NT), 0)
                    pick = tl.where(pick < NT, pick, tl.max(tl.where(mass > 0.0, ti, -1), 0))
                    running = tl.sum(tl.where(ti < pick, mass, 0.0), 0)
                    idx = pick * BLOCK_V + tl.arange(0, BLOCK_V)
                    valid = idx < V
                    e = tl.where(valid, tl.exp(tl.load(ws_ptr + row * V + idx, mask=valid, other=float("-inf")) - best),
                                 0.0)
                    found = tl.zeros((), dtype=tl.int64) + V
                    last = tl.zeros((), dtype=tl.int64) - 1
                    running, found, last = cdf_scan_step(e, idx.to(tl.int64), valid, V, target, running, found, last)
                    token = tl.where(found < V, found, last)
            tl.store(row_max_ptr + row, best)
            tl.store(row_z_ptr + row, z)
        tl.store(tokens_ptr + row, token)


@triton.jit
def _group_candidates_kernel(req_t_ptr, cand_ptr, gcand_ptr, NT, n_groups,
                             CANDIDATES: tl.constexpr, GROUP_TILES: tl.constexpr, GROUP_CANDIDATES: tl.constexpr):
    """Program (request, group of ``GROUP_TILES`` vocab tiles) of a filtered slot: the ``GROUP_CANDIDATES`` largest of
    the group's tile candidates, descending, into ``gcand [R, n_groups, GROUP_CANDIDATES]``, raised to at least the
    largest tile floor (a full tile's smallest candidate). Every entry of the group above the stored smallest value
    is then among the stored ones, the floor contract of :func:`~.rejection_sample._cut_candidates_kernel`."""
    req = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    if tl.load(req_t_ptr + req) > 0.0:
        t = g * GROUP_TILES + tl.arange(0, GROUP_TILES)
        j = tl.arange(0, CANDIDATES)
        c = tl.load(cand_ptr + (req * NT + t[:, None]) * CANDIDATES + j[None, :], mask=(t < NT)[:, None],
                    other=float("-inf"))
        floor = tl.max(tl.max(tl.where(j[None, :] == CANDIDATES - 1, c, float("-inf")), 1), 0)
        top = tl.topk(tl.reshape(c, (GROUP_TILES * CANDIDATES,)), GROUP_CANDIDATES)
        tl.store(gcand_ptr + (req * n_groups + g) * GROUP_CANDIDATES + tl.arange(0, GROUP_CANDIDATES),
                 tl.maximum(top, floor))


@triton.jit
def _group_mass_kernel(req_t_ptr, req_row_ptr, req_max_ptr, req_key_ptr, req_bits_ptr, req_res_ptr, gcand_ptr,
                       ws_ptr, gmass_ptr, V, n_groups,
                       GROUP_CANDIDATES: tl.constexpr, GROUP_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (request, group) of a filtered slot: the kept mass of the group's columns under the row's cuts, into
    ``gmass [R, n_groups]``. A resolved row's kept entries all lie among the group's candidates, so only they are
    read; an unresolved row's group columns of ``x`` are read."""
    req = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    if tl.load(req_t_ptr + req) > 0.0:
        m = tl.load(req_max_ptr + req)
        keep_key = tl.load(req_key_ptr + req)
        keep_bits = tl.load(req_bits_ptr + req)
        if tl.load(req_res_ptr + req) != 0:
            c = tl.load(gcand_ptr + (req * n_groups + g) * GROUP_CANDIDATES + tl.arange(0, GROUP_CANDIDATES))
            mass = tl.sum(kept_weights(c, m, keep_key, keep_bits), 0)
        else:
            row_ptr = ws_ptr + tl.load(req_row_ptr + req) * V
            mass = tl.zeros((), dtype=tl.float32)
            for start in range(g * GROUP_V, tl.minimum(g * GROUP_V + GROUP_V, V), BLOCK_V):
                idx = start + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf"))
                mass += tl.sum(kept_weights(x, m, keep_key, keep_bits), 0)
        tl.store(gmass_ptr + req * n_groups + g, mass)


@triton.jit
def _pick(mass, incl, target, n, ids):
    """The first entry whose inclusive cumulative ``incl`` passes ``target`` with positive ``mass``, else the last
    with positive mass (rounding); ``n`` entries, ``ids`` their positions."""
    first = tl.min(tl.where((mass > 0.0) & (incl > target) & (ids < n), ids, n), 0)
    return tl.where(first < n, first, tl.max(tl.where((mass > 0.0) & (ids < n), ids, -1), 0))


@triton.jit
def _filtered_draw_kernel(req_t_ptr, req_row_ptr, req_max_ptr, req_z_ptr, req_key_ptr, req_bits_ptr, req_res_ptr,
                          gmass_ptr, cand_ptr, ws_ptr, u_ptr, tokens_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr,
                          V, NT, n_groups,
                          CANDIDATES: tl.constexpr, GROUP_TILES: tl.constexpr, GROUPS_P2: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    """Program per request of a filtered slot: the token by inverse CDF over the kept ``exp(x - M)`` in vocabulary
    order. The group from the groups' kept masses; for a resolved row, the tile from that group's tile candidates
    (they hold every kept entry of their tile); the scan reads ``x`` from there (usually one tile; from the group's
    start for an unresolved row). Stores the token and the row's kept mass and cuts for the normalise pass."""
    req = tl.program_id(0).to(tl.int64)
    if tl.load(req_t_ptr + req) > 0.0:
        row = tl.load(req_row_ptr + req)
        m = tl.load(req_max_ptr + req)
        keep_key = tl.load(req_key_ptr + req)
        keep_bits = tl.load(req_bits_ptr + req)
        gi = tl.arange(0, GROUPS_P2)
        gm = tl.load(gmass_ptr + req * n_groups + gi, mask=gi < n_groups, other=0.0)
        incl = tl.cumsum(gm, 0)
        target = tl.load(u_ptr + row) * tl.sum(gm, 0)
        g = tl.maximum(_pick(gm, incl, target, n_groups, gi), 0)
        running = tl.sum(tl.where(gi < g, gm, 0.0), 0)
        start = g.to(tl.int64) * (GROUP_TILES * BLOCK_V)
        if tl.load(req_res_ptr + req) != 0:
            ti = tl.arange(0, GROUP_TILES)
            t = g * GROUP_TILES + ti
            j = tl.arange(0, CANDIDATES)
            c = tl.load(cand_ptr + (req * NT + t[:, None]) * CANDIDATES + j[None, :], mask=(t < NT)[:, None],
                        other=float("-inf"))
            tm = tl.sum(kept_weights(c, m, keep_key, keep_bits), 1)
            tp = tl.maximum(_pick(tm, running + tl.cumsum(tm, 0), target, GROUP_TILES, ti), 0)
            running += tl.sum(tl.where(ti < tp, tm, 0.0), 0)
            start += tp * BLOCK_V
        found = tl.zeros((), dtype=tl.int64) + V
        last = tl.zeros((), dtype=tl.int64) - 1
        offs = tl.arange(0, BLOCK_V)
        while (found == V) & (start < V):
            idx = start + offs
            valid = idx < V
            x = tl.load(ws_ptr + row * V + idx, mask=valid, other=float("-inf"))
            w = kept_weights(x, m, keep_key, keep_bits)
            running, found, last = cdf_scan_step(w, idx, valid, V, target, running, found, last)
            start += BLOCK_V
        tl.store(tokens_ptr + row, tl.where(found < V, found, last))
        tl.store(row_z_ptr + row, tl.load(req_z_ptr + req))
        tl.store(keep_key_ptr + row, keep_key)
        tl.store(keep_bits_ptr + row, keep_bits)


@triton.jit
def _normalise_kernel(ws_ptr, tokens_ptr, row_max_ptr, row_z_ptr, keep_key_ptr, keep_bits_ptr, tile_max_ptr, N, V,
                      NT, FILTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_V]`` tile of the draft rows: ``e / Z`` with ``e = exp(x - max)`` where ``Z > 0`` (with
    ``FILTERED``, 0 outside the row's cuts ``keep_key`` / ``keep_bits``: see
    :class:`~.rejection_sample.TargetRowStats`), the one-hot row of the token where ``Z < 0`` (greedy). A row with
    cuts reads ``x`` only where the tile's max (``tile_max [N, NT]``) passes them: elsewhere it writes zeros."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = rows < N
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    z = tl.load(row_z_ptr + rows, mask=rv, other=0.0)
    best = tl.load(row_max_ptr + rows, mask=rv, other=0.0)
    tok = tl.load(tokens_ptr + rows, mask=rv, other=-1)
    on = rv[:, None] & (cols < V)[None, :]
    offs = rows[:, None].to(tl.int64) * V + cols[None, :]
    norm = (z > 0.0)[:, None]
    read = norm
    if FILTERED:
        keep_key = tl.load(keep_key_ptr + rows, mask=rv, other=0)
        keep_bits = tl.load(keep_bits_ptr + rows, mask=rv, other=0)
        cut = (keep_key > 0) | (keep_bits > 0)
        t_max = tl.load(tile_max_ptr + rows.to(tl.int64) * NT + tl.program_id(0), mask=rv & cut, other=float("inf"))
        read = norm & ((ordered_key(t_max) >= keep_key) & (bits_key(tl.exp(t_max - best)) >= keep_bits))[:, None]
    x = tl.load(ws_ptr + offs, mask=on & read, other=float("-inf"))
    if FILTERED:
        e = kept_weights(x, best[:, None], keep_key[:, None], keep_bits[:, None])
    else:
        e = tl.exp(x - best[:, None])
    one_hot = tl.where(cols[None, :] == tok[:, None], 1.0, 0.0)
    p = tl.where(norm, e / tl.where(z > 0.0, z, 1.0)[:, None], one_hot)
    tl.store(ws_ptr + offs, p, mask=on)


# -------------------------------------------------------------------------------------------------------- launcher
def _hidden_terms(weights: SequentialHeadWeights, hidden: torch.Tensor, rank: int):
    """The hidden-state terms of every slot, one GEMM each (float32): ``conf_h [N]`` (``h . conf_w_h + conf_b``),
    ``gate_h [N, r]`` (``h @ gate_w_h + gate_b``) and ``rnn_h [N, 3r]`` (``h @ rnn_w_h + rnn_b``); None when unused."""
    h = hidden.float()
    d = h.shape[1]
    conf_h = gate_h = rnn_h = None
    if weights.conf_w is not None:
        conf_h = torch.addmv(weights.conf_b.float().expand(h.shape[0]), h, weights.conf_w[:d].float()).contiguous()
    if weights.kind == "gated":
        gate_h = torch.addmm(weights.gate_b.float(), h, weights.gate_w[:d].float()).contiguous()
    if weights.kind == "rnn":
        rnn_h = torch.addmm(weights.rnn_b.float(), h, weights.rnn_w[2 * rank:].float()).contiguous()
    return conf_h, gate_h, rnn_h


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
    """Triton twin of :func:`sequential_head_ref` (same signature): per slot a latent, a vocab-parallel and a draw
    launch (see the kernels' comment), then one normalise launch over the draft rows; one host sync for the longest
    block. Weight matrices are read through their strides; the draft rows are written once by the kernels (no
    memset)."""
    dev = base_logits.device
    n, v = base_logits.shape
    r = cu_num_draft_tokens.numel() - 1
    kind = _KIND_IDS[weights.kind]
    rank = weights.w1.shape[1] if kind else 0
    sample = uniforms is not None
    if r == 0 or n == 0:
        probs = torch.zeros(n, v, dtype=torch.float32, device=dev) if sample else None
        return SequentialHeadResult(torch.zeros(n, dtype=torch.int64, device=dev), probs,
                                    torch.zeros(n, dtype=torch.float32, device=dev))
    cfg = launch_config("sequential_head", _DEFAULTS, dev)
    block_m, block_v = cfg["BLOCK_M"], cfg["BLOCK_V"]
    block_r = max(16, triton.next_power_of_2(max(rank, 1)))
    n_tiles = triton.cdiv(v, block_v)
    cu = cu_num_draft_tokens.contiguous()
    max_len = int((cu[1:] - cu[:-1]).max())
    conf_h, gate_h, rnn_h = _hidden_terms(weights, hidden, rank)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)

    def opt(t: torch.Tensor | None) -> torch.Tensor:  # an unused pointer argument is a dummy
        return t if t is not None else dummy

    def mat(t: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        return (t, t.stride(0), t.stride(1)) if t is not None else (dummy, 0, 0)

    w1, s_w1, _ = mat(weights.w1)
    w2, s_w2r, s_w2v = mat(weights.w2)
    gate_w, s_gw_in, s_gw_out = mat(weights.gate_w)
    rnn_w, s_rw_in, s_rw_out = mat(weights.rnn_w)
    filters = sample and (top_k is not None or top_p is not None)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    probs = torch.empty(n, v, dtype=torch.float32, device=dev) if sample else dummy
    row_max = torch.empty(n, dtype=torch.float32, device=dev) if sample else dummy
    row_z = torch.empty(n, dtype=torch.float32, device=dev) if sample else dummy
    keep_key = torch.zeros(n, dtype=torch.int64, device=dev) if filters else dummy
    keep_bits = torch.zeros(n, dtype=torch.int64, device=dev) if filters else dummy
    tile_max = torch.empty(n, n_tiles, dtype=torch.float32, device=dev) if filters else dummy
    if weights.conf_w is None:
        conf = torch.zeros(n, dtype=torch.float32, device=dev)
    else:
        conf = conf_h if kind == 0 else torch.empty(n, dtype=torch.float32, device=dev)
    lat = torch.empty(r, max(rank, 1), dtype=torch.float32, device=dev)
    state = torch.zeros(2, r, rank, dtype=torch.float32, device=dev) if weights.kind == "rnn" else dummy
    part = torch.empty(2, r, n_tiles, dtype=torch.float32, device=dev)
    part_arg = torch.empty(r, n_tiles, dtype=torch.int32, device=dev)
    logits = base_logits.contiguous()
    temp = temperature.float().contiguous()
    anchors = anchor_tokens.contiguous()
    blocks = triton.cdiv(r, block_m)
    filt = _filtered_requests(temp, top_k, top_p, v).to(torch.int32) if filters else dummy
    slot = _FilteredSlot(r, n_tiles, cfg, dev) if filters else None
    req = slot.req if filters else (dummy,) * 7
    for k in range(max_len):
        if kind:
            _slot_latent_kernel[(blocks,)](
                anchors, cu, tokens, w1, s_w1, opt(gate_h), gate_w, s_gw_in, s_gw_out, opt(rnn_h), rnn_w, s_rw_in,
                s_rw_out, state, opt(conf_h), opt(weights.conf_w), lat, conf,
                r, hidden.shape[1], rank, k,
                KIND=kind, HAS_CONF=weights.conf_w is not None, BLOCK_M=block_m, BLOCK_R=block_r,
                BLOCK_C=min(block_r, RNN_COLUMNS), num_warps=8, num_stages=LATENT_STAGES,
            )
        _slot_vocab_kernel[(n_tiles, blocks)](
            logits, cu, lat, w2, s_w2r, s_w2v, temp, probs, part, part_arg, filt, slot.cand if filters else dummy,
            tile_max, r, v, rank, k, n_tiles,
            KIND=kind, STORE=sample, FILTERED=filters, CANDIDATES=cfg["CANDIDATES"], BLOCK_M=block_m,
            BLOCK_V=block_v, BLOCK_R=block_r, W2_BF16=w2.dtype == torch.bfloat16, BF16_DOT=not triton_interpreted(),
            num_warps=cfg["num_warps"],
        )
        _slot_draw_kernel[(r,)](
            cu, temp, filt, opt(uniforms), part, part_arg, probs, tokens, row_max, row_z, *req, r, v, k, n_tiles,
            SAMPLE=sample, FILTERED=filters, BLOCK_T=triton.next_power_of_2(n_tiles), BLOCK_V=block_v, num_warps=4,
        )
        if filters:
            slot.sample(probs, top_k, top_p, uniforms, tokens, row_z, keep_key, keep_bits)
    if sample:
        _normalise_kernel[(n_tiles, triton.cdiv(n, block_m))](probs, tokens, row_max, row_z, keep_key, keep_bits,
                                                              tile_max, n, v, n_tiles, FILTERED=filters,
                                                              BLOCK_M=block_m, BLOCK_V=block_v, num_warps=4)
    return SequentialHeadResult(tokens, probs if sample else None, conf)


def _filtered_requests(temp: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                       v: int) -> torch.Tensor:
    """``[R]`` bool: the sampled requests whose top-k or top-p may drop tokens of a ``V``-token row."""
    on = torch.zeros_like(temp, dtype=torch.bool)
    if top_k is not None:
        on |= top_k_filters(top_k, v)
    if top_p is not None:
        on |= top_p_filters(top_p)
    return on & (temp > 0)


class _FilteredSlot:
    """Buffers and launches of the filtered rows (top-k / top-p) of one slot, after the vocab and draw launches.

    The vocab launch leaves each filtered request's tile candidates in ``cand [R, NT, CANDIDATES]`` and the draw
    launch its slot state ``req``: ``req_t`` (1 where the request samples a filtered row at this slot, else 0),
    ``req_row`` (int64), ``req_max``, ``req_z`` (the row's mass, then its kept mass), ``req_key`` / ``req_bits``
    (the cuts, int64) and ``req_res`` (int32: resolved by the candidates). :meth:`sample` then runs
    ``_group_candidates_kernel`` (request x group), the candidate cuts and any radix select of
    :mod:`.rejection_sample` on the rows of ``x`` in place in the draft rows, ``_group_mass_kernel`` (request x
    group) and ``_filtered_draw_kernel`` (request). No host sync."""

    def __init__(self, r: int, n_tiles: int, cfg: dict, dev: torch.device) -> None:
        cands, block_v = cfg["CANDIDATES"], cfg["BLOCK_V"]
        self.group_tiles = GROUP_V // block_v
        if cands > block_v or cands & (cands - 1) or GROUP_V % block_v or self.group_tiles * cands < GROUP_CANDIDATES:
            raise ValueError(f"sequential_head config: CANDIDATES {cands} must be a power of two <= BLOCK_V {block_v}, "
                             f"and GROUP_V {GROUP_V} a multiple of BLOCK_V holding >= {GROUP_CANDIDATES} candidates")
        self.n_groups = triton.cdiv(n_tiles, self.group_tiles)
        self.cfg, self.n_tiles = cfg, n_tiles
        f32, i64 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev)
        self.cand = torch.empty(r, n_tiles, cands, **f32)
        self.gcand = torch.empty(r, self.n_groups, GROUP_CANDIDATES, **f32)
        self.gmass = torch.empty(r, self.n_groups, **f32)
        self.stats = TargetRowStats(torch.empty(r, **f32), torch.empty(r, **f32), None, torch.empty(r, **i64),
                                    torch.empty(r, **i64), torch.empty(r, dtype=torch.int32, device=dev))
        self.req_t, self.req_row = torch.zeros(r, **f32), torch.zeros(r, **i64)
        self.req = (self.req_t, self.req_row, self.stats.row_max, self.stats.row_z, self.stats.keep_key,
                    self.stats.keep_bits, self.stats.by_candidates)
        self.row_req = torch.arange(r, dtype=torch.int32, device=dev)

    def sample(self, probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
               uniforms: torch.Tensor, tokens: torch.Tensor, row_z: torch.Tensor, keep_key: torch.Tensor,
               keep_bits: torch.Tensor) -> None:
        """Cut and draw this slot's filtered rows of ``x`` (in ``probs``); write their tokens, kept masses and cuts
        to their rows of ``tokens`` / ``row_z`` / ``keep_key`` / ``keep_bits``."""
        r, v = self.req_t.numel(), probs.shape[1]
        cfg, stats = self.cfg, self.stats
        grid = (r, self.n_groups)
        tiles = dict(CANDIDATES=cfg["CANDIDATES"], GROUP_TILES=self.group_tiles)
        _group_candidates_kernel[grid](self.req_t, self.cand, self.gcand, self.n_tiles, self.n_groups, **tiles,
                                       GROUP_CANDIDATES=GROUP_CANDIDATES, num_warps=4)
        candidate_cuts(self.gcand, self.row_req, self.req_t, top_k, top_p, stats, v)
        radix_cuts(probs, self.req_row, self.row_req, self.req_t, top_k, top_p, stats, sampling_config(probs.device))
        _group_mass_kernel[grid](*self.req[:3], *self.req[4:], self.gcand, probs, self.gmass, v, self.n_groups,
                                 GROUP_CANDIDATES=GROUP_CANDIDATES, GROUP_V=GROUP_V, BLOCK_V=cfg["BLOCK_V"],
                                 num_warps=4)
        _filtered_draw_kernel[(r,)](*self.req, self.gmass, self.cand, probs, uniforms, tokens, row_z, keep_key,
                                    keep_bits, v, self.n_tiles, self.n_groups, **tiles,
                                    GROUPS_P2=triton.next_power_of_2(self.n_groups), BLOCK_V=cfg["BLOCK_V"],
                                    num_warps=4)


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
