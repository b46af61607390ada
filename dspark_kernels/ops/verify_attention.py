"""Verify attention: the new tokens of every request attend causally to that request's paged KV cache.

Layout (FlashAttention varlen convention):
    q            [total_q, Hq, D]                     new tokens of all requests, flattened by ``cu_seqlens_q``
    k_cache      [num_pages, page_size, Hkv, D]       paged keys; already holds the new tokens' keys
    v_cache      [num_pages, page_size, Hkv, D]       paged values, same layout
    page_table   [R, max_pages] int32/int64           page ids of each request, in token order
    cu_seqlens_q [R + 1] int32/int64                  offsets of each request's new tokens in ``q``
    seq_lens     [R] int32/int64                      KV length of each request including its new tokens
    out          [total_q, Hq, D]                     same dtype as ``q``

New token i of request r sits at absolute position ``seq_lens[r] - q_len_r + i`` and attends keys ``0..pos``.
This one op serves prefill (q_len = prompt), decode (q_len = 1) and verify (q_len = 1 + draft length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..reference._paged_attention import AttentionPlan
from ..reference.batch_invariant_attention import (
    BatchInvariantPlan,
    batch_invariant_attention,
    plan_batch_invariant_attention,
)
from ..reference.verify_attention import plan_verify_attention as _plan_ref
from ..reference.verify_attention import verify_attention_ref
from ._dispatch import num_sms, resolve_impl, triton_interpreted
from ._flash import (
    gqa_query_tile,
    kv_splits,
    merge_splits,
    online_softmax_step,
    paged_kv_tile,
    split_buffers,
    store_output_tile,
    store_split_state,
)
from ._layout import unit_inner_stride
from ._validate import check_paged_attention, check_plan_args

__all__ = ["PINNED_LAUNCH", "PinnedLaunch", "kv_splits", "plan_verify_attention", "verify_attention",
           "verify_attention_triton"]


def _validate(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, sm_scale, max_seqlen_q, plan) -> None:
    q_lens, lens = check_paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, "seq_lens",
                                         sm_scale, max_seqlen_q, plan)
    if bool((lens < q_lens).any()):
        raise ValueError(f"seq_lens must be >= each request's query length {q_lens.tolist()}, got {lens.tolist()}")


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
    max_seqlen_q: int | None = None,
    plan: AttentionPlan | BatchInvariantPlan | PinnedLaunch | None = None,
) -> torch.Tensor:
    """Ragged causal attention over a paged KV cache; see the module docstring for shapes.

    ``check_inputs=False`` skips validation (it reads ``cu_seqlens_q``/``seq_lens`` on the host) for hot loops and
    CUDA-graph capture; pass ``max_seqlen_q`` too so the Triton launch needs no host sync. ``plan``: from
    :func:`plan_verify_attention` for the same page table, offsets and lengths (every layer of a forward shares one);
    the reference path reuses its index work, the Triton kernel needs none; a batch-invariant plan selects the
    batch-invariant computation of its path. Inputs are never modified.
    """
    if check_inputs:
        _validate(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, sm_scale, max_seqlen_q, plan)
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    if isinstance(plan, BatchInvariantPlan):
        return batch_invariant_attention(q, k_cache, v_cache, plan, scale)
    if isinstance(plan, PinnedLaunch) or resolve_impl(impl, q.device) == "triton":
        return verify_attention_triton(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, max_seqlen_q,
                                       pinned=plan if isinstance(plan, PinnedLaunch) else None)
    return verify_attention_ref(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, plan)


def plan_verify_attention(page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int, num_q_heads: int, *, impl: str | None = None, batch_invariant: bool = False,
                          check_inputs: bool = True) -> AttentionPlan | BatchInvariantPlan | PinnedLaunch | None:
    """Plan once, run per layer: the reference path's index work (cache slots to gather, padding, causal mask) for
    these lengths, to pass as ``verify_attention(..., plan=)`` to every call that shares them; ``None`` when ``impl``
    resolves to the Triton kernel, which plans nothing. Reads the lengths on the host.

    ``batch_invariant``: output rows that do not depend on how many query rows or requests share the call (a decode
    step and a verify forward give a token the same bits); the calls given this plan run that way. On the reference
    path it plans :mod:`reference.batch_invariant_attention`; for the Triton kernel it returns
    :data:`PINNED_LAUNCH`, which launches every call with one fixed config (see :func:`verify_attention_triton`).
    ``check_inputs=False`` skips the checks of the arguments (a forward that has validated its batch already)."""
    if check_inputs:
        check_plan_args(page_table, cu_seqlens_q, seq_lens, "seq_lens", page_size, num_q_heads)
    triton_path = resolve_impl(impl, page_table.device) == "triton"
    if batch_invariant:
        if triton_path:
            return PINNED_LAUNCH
        return plan_batch_invariant_attention(page_table, cu_seqlens_q, seq_lens, page_size, num_q_heads)
    if triton_path:
        return None
    return _plan_ref(page_table, cu_seqlens_q, seq_lens, page_size, num_q_heads)


_DEFAULTS = {
    # decode/verify: few query rows per (request, kv head); prefill: long query tiles. num_stages 7 copies the K/V
    # tiles and their page ids into 3-deep shared-memory rings: two tiles in flight while one is computed
    # (perf/kernel_resources.py: async_buffers 3, no spill on sm_80 / sm_90; 5 stages make 2-deep rings)
    "decode": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 7},
    "prefill": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 7},
}


_MAX_GRID_Z = 65535  # CUDA's limit on grid axis 2 (the request axis of the padded grid)
FLAT_GRID_RATIO = 1.25  # the padded grid's tiles over the enumerated ones above which a launch enumerates


def _tile_ends(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, group: int, block_m: int,
               aligned: bool) -> torch.Tensor:
    """``[R]`` int32: the running total of query tiles after each request (``ceil((q_len + shift) * group /
    block_m)`` tiles each, ``shift`` the aligned tiles' leading padding); device ops, no host sync."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    rows = q_lens
    if aligned:
        rows = rows + (seq_lens.long() - q_lens) % (block_m // group)
    return torch.cumsum(-(-(rows * group) // block_m), 0).to(torch.int32)


@dataclass(frozen=True)
class PinnedLaunch:
    """The Triton kernel's batch-invariant "plan": launch every call with ``config``, whatever its shape."""

    config: Mapping[str, int]


# One config for every call: the autotuned configs differ by bucket (decode vs prefill), and a different BLOCK_M,
# BLOCK_N or warp count changes how a row's sums are blocked. Read-only, so no caller can change it for the others.
PINNED_LAUNCH = PinnedLaunch(MappingProxyType(dict(_DEFAULTS["decode"])))


@triton.jit
def _verify_attention_kernel(
    Q, K, V, Out, PT, CU, SL, MS, LS, AS, TE,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    total_q, num_heads, split_len, num_req,
    NUM_SPLITS: tl.constexpr,
    FLAT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """One program = BLOCK_M rows of (new token, query head in the GQA group) x one KV head x one request.

    Packing the GQA group into the M dimension gives decode (1 token, GROUP heads) a real tile for tl.dot.
    Keys/values are gathered page by page; softmax is online (FlashAttention-style) in fp32, with exp2.
    ``ALIGNED`` (batch-invariant launches, ``BLOCK_M`` a multiple of ``GROUP``): tiles hold the tokens of
    ``BLOCK_M // GROUP`` consecutive absolute positions from a multiple of that, so a token always takes the same
    rows of its tile, whatever else the call holds.

    Split-KV (``NUM_SPLITS > 1``): axis 1 is ``kv head * NUM_SPLITS + split``; the program folds only keys
    ``[split * split_len, (split + 1) * split_len)`` and writes its unnormalised partial state (running max ``MS``,
    denominator ``LS`` ``[NUM_SPLITS, total_q, Hq]``, accumulator ``AS`` ``[NUM_SPLITS, total_q, Hq, D]``, fp32) for
    :func:`~._flash.merge_splits`; a split past the row's last key writes max -inf and zeros.

    ``FLAT`` (ragged batches): axis 0 enumerates every request's query tiles back to back instead of padding each
    request to the longest one; ``TE [R]`` (int32) holds the running total of tiles after each request, and a program
    finds its request by binary search. Otherwise axis 0 is the tile and axis 2 the request.
    """
    kvh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    if FLAT:
        tile = tl.program_id(0)
        if tile >= tl.load(TE + num_req - 1):
            return
        lo = 0
        hi = num_req - 1
        while lo < hi:  # the first request whose running total passes the tile
            mid = (lo + hi) // 2
            past = tl.load(TE + mid) > tile
            hi = tl.where(past, mid, hi)
            lo = tl.where(past, lo, mid + 1)
        r = lo
        mb = tile - tl.load(TE + r - 1, mask=r > 0, other=0)
    else:
        mb = tl.program_id(0)  # query tiles on axis 0 (up to 2^31 - 1 of them: a long prefill has many)
        r = tl.program_id(2)  # requests on axis 2 (CUDA allows 65535 there)
    q_start = tl.load(CU + r).to(tl.int64)
    q_len = tl.load(CU + r + 1).to(tl.int64) - q_start
    kv_len = tl.load(SL + r).to(tl.int64)
    shift = (kv_len - q_len) % (BLOCK_M // GROUP) if ALIGNED else 0
    if mb * BLOCK_M >= (q_len + shift) * GROUP:
        return

    q, tok, head, row_ok, d, d_ok = gqa_query_tile(Q, stride_qt, stride_qh, q_start, q_len, kvh, mb, shift, GROUP,
                                                   HEAD_DIM, BLOCK_D, BLOCK_M, DOT_F32)
    q_pos = kv_len - q_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys past the last row's position are never visible: stop the loop there
    last_tok = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // GROUP - shift, q_len - 1)
    hi = kv_len - q_len + last_tok + 1
    lo = 0
    if NUM_SPLITS > 1:
        lo = split * split_len
        hi = tl.minimum(hi, lo + split_len)
    # whole key tiles every row of the tile sees (below its first token's position) go without the causal mask;
    # only the tiles from there (the diagonal ones) are masked. The tiles start at the same keys either way.
    first_pos = kv_len - q_len + tl.maximum((mb * BLOCK_M) // GROUP - shift, 0)
    open_end = lo + tl.maximum(tl.minimum(first_pos + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
    all_keys = tl.full([BLOCK_N], 1, tl.int1)
    for start in range(lo, open_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        k, v = paged_kv_tile(K, V, PT, r, stride_pt, n, all_keys, kvh, d, d_ok, stride_kp, stride_ks, stride_kh,
                             stride_vp, stride_vs, stride_vh, PAGE_SIZE, DOT_F32)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, all_keys[None, :], qk_scale, PRECISION)
    for start in range(open_end, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        k, v = paged_kv_tile(K, V, PT, r, stride_pt, n, n_ok, kvh, d, d_ok, stride_kp, stride_ks, stride_kh,
                             stride_vp, stride_vs, stride_vh, PAGE_SIZE, DOT_F32)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, PRECISION)

    if NUM_SPLITS > 1:
        store_split_state(MS, LS, AS, m_i, l_i, acc, split, total_q, num_heads, q_start, tok, head, row_ok, d, d_ok,
                          HEAD_DIM)
    else:
        store_output_tile(Out, acc, l_i, q_start, tok, head, row_ok, d, d_ok, stride_ot, stride_oh)


def verify_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_seqlen_q: int | None = None,
    pinned: PinnedLaunch | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel; same contract as :func:`verify_attention_ref`.

    ``max_seqlen_q`` (the longest query of the batch) sizes the grid; when omitted it is read from
    ``cu_seqlens_q`` (one host sync). A ragged batch, whose grid padded to the longest query would hold more than
    ``FLAT_GRID_RATIO`` times the tiles it needs (bounded from ``total_q`` and the request count, no host sync),
    enumerates its tiles instead (the kernel's ``FLAT`` path, with a tile table of a few device ops).
    When query tiles x KV heads x requests would not fill the GPU's SMs, the keys are
    split (:func:`kv_splits`, from the page table's width, no host sync) over more programs whose partial states a
    second launch merges by log-sum-exp.

    ``pinned`` (batch invariance, e.g. :data:`PINNED_LAUNCH`): every call runs its config (not the autotuned one of its
    bucket) with query tiles aligned at absolute positions, so a row's arithmetic is the same in every call: a token
    always takes the same rows of its tile; its keys are folded in ``BLOCK_N`` tiles from position 0, and the tiles a
    longer call adds after the row's last visible key are masked for it (its max stays, the rescale factor is
    ``exp2(0) = 1``, it adds exact zeros); every ``tl.dot`` has one shape. Needs a power-of-two GQA group.
    """
    total_q, hq, head_dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    n_req = seq_lens.shape[0]
    if total_q == 0 or n_req == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    rows = max_seqlen_q * group
    bucket = "decode" if rows <= 16 else "prefill"
    if pinned is None:
        cfg = launch_config("verify_attention", _DEFAULTS[bucket], q.device, bucket)
        block_m = cfg["BLOCK_M"]
    else:  # whole tokens per tile, aligned at absolute positions (a tile of leading padding at most)
        cfg = pinned.config
        block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
        if block_m % group:
            raise ValueError(f"a batch-invariant launch needs a power-of-two GQA group, got {group}")
        rows += block_m - group
    q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens = map(
        unit_inner_stride, (q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens))
    q_tiles = triton.cdiv(rows, block_m)
    # a ragged batch (a prefill among decodes) enumerates its tiles instead of padding every request to the longest:
    # at most one partial tile per request (two with aligned tiles' leading padding)
    flat_tiles = triton.cdiv(total_q * group, block_m) + (2 if pinned is not None else 1) * n_req
    flat = q_tiles * n_req > FLAT_GRID_RATIO * flat_tiles or n_req > _MAX_GRID_Z
    tile_end = _tile_ends(cu_seqlens_q, seq_lens, group, block_m, pinned is not None) if flat else seq_lens
    tiles = flat_tiles if flat else q_tiles * n_req
    splits, split_len = 1, 0
    if pinned is None:  # a batch-invariant launch folds every key in one program, in one order
        splits, split_len = kv_splits(tiles * hkv, page_table.shape[1] * page_size, cfg["BLOCK_N"], num_sms(q.device))
    ms, ls, acc = split_buffers(splits, total_q, hq, head_dim, out)
    grid = (flat_tiles, hkv * splits, 1) if flat else (q_tiles, hkv * splits, n_req)
    _verify_attention_kernel[grid](
        q, k_cache, v_cache, out, page_table, cu_seqlens_q, seq_lens, ms, ls, acc, tile_end,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        total_q, hq, split_len, n_req,
        NUM_SPLITS=splits,
        FLAT=flat,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (it has no bf16 matmul); upcast there only
        DOT_F32=q.dtype == torch.bfloat16 and triton_interpreted(),
        ALIGNED=pinned is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    merge_splits(ms, ls, acc, out, splits)
    return out
