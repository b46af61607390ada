"""Draft block attention: the parallel drafter's block queries attend to the request's projected target-context K/V
(paged) and to every slot of their own block (non-causal within the block).

Layout:
    q            [total_q, Hq, D]                 block queries of all requests, flattened by ``cu_seqlens_q``
    k_block      [total_q, Hkv, D]                the blocks' own keys (same rows as ``q``)
    v_block      [total_q, Hkv, D]                the blocks' own values
    k_cache      [num_pages, page_size, Hkv, D]   per-request projected context keys (grows with accepted tokens)
    v_cache      [num_pages, page_size, Hkv, D]   same for values
    page_table   [R, max_pages] int32/int64       page ids of each request's context, in position order
    cu_seqlens_q [R + 1]                          block offsets (a request's block length may be 0..gamma)
    ctx_lens     [R]                              context length per request (0 allowed)
    out          [total_q, Hq, D]                 dtype of ``q``

RoPE is applied by the caller (context keys at their absolute positions, block queries/keys at anchor + slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..reference._paged_attention import AttentionPlan
from ..reference.draft_block_attention import draft_block_attention_ref
from ..reference.draft_block_attention import plan_draft_block_attention as _plan_ref
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
from ._validate import check_paged_attention, check_plan_args, check_shape, check_tensor

__all__ = ["draft_block_attention", "draft_block_attention_triton", "plan_draft_block_attention"]

# num_stages 7: the context's K/V tiles and page ids in 3-deep rings, two tiles in flight while one is computed
# (perf/kernel_resources.py: async_buffers 3, no spill on sm_80 / sm_90)
_DEFAULTS = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 7}
MAX_BLOCK_M = 128  # the largest query tile the launcher grows BLOCK_M to (gamma 16 x a GQA group of 8)


@triton.jit
def _draft_block_attention_kernel(
    Q, KB, VB, KC, VC, Out, PT, CU, CL, MS, LS, AS,
    qk_scale,
    stride_qt, stride_qh,
    stride_kbt, stride_kbh,
    stride_vbt, stride_vbh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    total_q, num_heads, split_len,
    NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One program = one request x one KV head x BLOCK_M rows of (block slot, query head in the GQA group).

    First loop: the paged context (all visible). Second loop: the request's own block (all visible).
    Both feed one online softmax in fp32. The launcher sizes ``BLOCK_M`` to the whole block (gamma x GQA group rows),
    so each request's context is read once per KV head. Split-KV (``NUM_SPLITS > 1``, axis 1 = kv head x splits):
    split ``s`` folds context keys ``[s * split_len, (s + 1) * split_len)`` (split 0 also the block's own) and stores
    its partial state for :func:`~._flash.merge_splits`.
    """
    r = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    mb = tl.program_id(2)
    q_start = tl.load(CU + r).to(tl.int64)
    q_len = tl.load(CU + r + 1).to(tl.int64) - q_start
    ctx_len = tl.load(CL + r).to(tl.int64)
    if mb * BLOCK_M >= q_len * GROUP:
        return

    q, tok, head, row_ok, d, d_ok = gqa_query_tile(Q, stride_qt, stride_qh, q_start, q_len, kvh, mb, 0, GROUP,
                                                   HEAD_DIM, BLOCK_D, BLOCK_M, DOT_F32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo = 0
    hi = ctx_len
    if NUM_SPLITS > 1:
        lo = split * split_len
        hi = tl.minimum(ctx_len, lo + split_len)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        k, v = paged_kv_tile(KC, VC, PT, r, stride_pt, n, n_ok, kvh, d, d_ok, stride_kp, stride_ks, stride_kh,
                             stride_vp, stride_vs, stride_vh, PAGE_SIZE, DOT_F32)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, n_ok[None, :], qk_scale, PRECISION)

    block_keys = tl.where(split == 0, q_len, 0)  # the block's own keys: split 0's (so no split-0 row is empty)
    # a block is a tile or two of keys: not worth shared-memory rings (num_stages pipelines the context loop only)
    for start in tl.range(0, block_keys, BLOCK_N, num_stages=1):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < q_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KB + (q_start + n)[:, None] * stride_kbt + kvh * stride_kbh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VB + (q_start + n)[:, None] * stride_vbt + kvh * stride_vbh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, n_ok[None, :], qk_scale, PRECISION)

    if NUM_SPLITS > 1:
        store_split_state(MS, LS, AS, m_i, l_i, acc, split, total_q, num_heads, q_start, tok, head, row_ok, d, d_ok,
                          HEAD_DIM)
    else:
        store_output_tile(Out, acc, l_i, q_start, tok, head, row_ok, d, d_ok, stride_ot, stride_oh)


def draft_block_attention_triton(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel; same contract as :func:`draft_block_attention_ref`. Few requests get split context
    keys (:func:`~._flash.kv_splits`, planned from the page table's width) and a merge launch."""
    total_q, hq, head_dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    n_req = ctx_lens.shape[0]
    if total_q == 0 or n_req == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cfg = launch_config("draft_block_attention", _DEFAULTS, q.device)
    q, k_block, v_block, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens = map(
        unit_inner_stride, (q, k_block, v_block, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens))
    # one M tile holds a whole block (up to MAX_BLOCK_M rows): the context is then read once per (request, KV head)
    block_m = min(MAX_BLOCK_M, max(cfg["BLOCK_M"], triton.next_power_of_2(max_seqlen_q * group)))
    m_tiles = triton.cdiv(max_seqlen_q * group, block_m)
    # a grown tile takes 8 warps, and from 64 rows half-width key tiles: so it compiles without spills on sm_80/sm_90
    block_n = cfg["BLOCK_N"] if block_m < 64 else min(cfg["BLOCK_N"], 16)
    splits, split_len = kv_splits(n_req * hkv * m_tiles, page_table.shape[1] * page_size, block_n,
                                  num_sms(q.device))
    ms, ls, acc = split_buffers(splits, total_q, hq, head_dim, out)
    grid = (n_req, hkv * splits, m_tiles)
    _draft_block_attention_kernel[grid](
        q, k_block, v_block, k_cache, v_cache, out, page_table, cu_seqlens_q, ctx_lens, ms, ls, acc,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1),
        k_block.stride(0), k_block.stride(1),
        v_block.stride(0), v_block.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        total_q, hq, split_len,
        NUM_SPLITS=splits,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter computes bf16 tl.dot wrongly; upcast there only
        DOT_F32=q.dtype == torch.bfloat16 and triton_interpreted(),
        num_warps=cfg["num_warps"] if block_m <= 16 else max(cfg["num_warps"], 8),
        num_stages=cfg["num_stages"],
    )
    merge_splits(ms, ls, acc, out, splits)
    return out


def _validate(q, k_block, v_block, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens, sm_scale, max_seqlen_q,
              plan) -> None:
    check_paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens, "ctx_lens", sm_scale, max_seqlen_q,
                          plan)
    total_q, _, d = q.shape
    for name, t in (("k_block", k_block), ("v_block", v_block)):  # the blocks' own keys/values, the rows of q
        check_tensor(name, t, dtypes=(q.dtype,), device=q.device)
        check_shape(name, t, (total_q, k_cache.shape[2], d))


def draft_block_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
    max_seqlen_q: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Block attention of the parallel drafter; see the module docstring for shapes. ``plan``: from
    :func:`plan_draft_block_attention` for the same page table, offsets and lengths (every draft layer shares one);
    the reference path reuses its index work, the Triton kernel needs none. Inputs are never modified."""
    if check_inputs:
        _validate(q, k_block, v_block, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens, sm_scale, max_seqlen_q,
                  plan)
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    args = (q, k_block, v_block, k_cache, v_cache, page_table, cu_seqlens_q, ctx_lens, scale)
    if resolve_impl(impl, q.device) == "triton":
        return draft_block_attention_triton(*args, max_seqlen_q)
    return draft_block_attention_ref(*args, plan)


def plan_draft_block_attention(page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor,
                               page_size: int, num_q_heads: int, *, impl: str | None = None,
                               check_inputs: bool = True) -> AttentionPlan | None:
    """Plan once, run per layer: the reference path's index work for these lengths, to pass as
    ``draft_block_attention(..., plan=)`` to every draft layer; ``None`` when ``impl`` resolves to the Triton kernel,
    which plans nothing. Reads the lengths on the host. ``check_inputs=False`` skips the checks of the arguments."""
    if check_inputs:
        check_plan_args(page_table, cu_seqlens_q, ctx_lens, "ctx_lens", page_size, num_q_heads)
    if resolve_impl(impl, page_table.device) == "triton":
        return None
    return _plan_ref(page_table, cu_seqlens_q, ctx_lens, page_size, num_q_heads)
