"""Reference for the parallel drafter's block attention: block queries over projected context K/V plus the block.

All requests are computed as one padded batch (in groups bounded by the score size), not one by one. The index work
is planned once per set of lengths (:func:`plan_draft_block_attention`) and reusable by every draft layer."""

from __future__ import annotations

import torch

from . import _paged_attention as paged
from ._paged_attention import AttentionPlan


def plan_draft_block_attention(page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor,
                               page_size: int, num_q_heads: int) -> AttentionPlan:
    """The index work of :func:`draft_block_attention_ref` for these lengths (arguments as there, plus the cache's
    ``page_size`` and the number of query heads, which sizes the request groups). The mask's keys are the context
    (``max ctx`` of the group) then the block (``max q``)."""
    cu = cu_seqlens_q.long()
    q_lens_t, ctx_t = cu[1:] - cu[:-1], ctx_lens.long()
    q_lens, ctx = q_lens_t.tolist(), ctx_t.tolist()
    total = int(cu[-1]) if len(q_lens) else 0
    groups = []
    for g in paged.request_groups(q_lens, [c + n for c, n in zip(ctx, q_lens)], num_q_heads):
        max_q, max_ctx = max(q_lens[g]), max(ctx[g])
        if max_q == 0:
            continue
        block = paged.RaggedRows.of(cu[:-1][g], q_lens_t[g], q_lens[g], max_q, total)
        if all(n == max_q for n in q_lens[g]) and all(c == max_ctx for c in ctx[g]):
            allowed = None  # every request has max_ctx context keys and max_q block keys: nothing to mask
        else:
            ctx_ok = torch.arange(max_ctx, device=cu.device) < ctx_t[g, None]
            key_ok = torch.cat([ctx_ok, block.valid], dim=1)  # [n, context keys then block keys]
            allowed = paged.mask_or_none(key_ok[:, None, :].expand(-1, max_q, -1))
        cached = paged.PagedRead.of(page_table[g], ctx_t[g], max_ctx, page_size)
        groups.append(paged.GroupPlan(block, cached, allowed))
    return AttentionPlan(total, page_size, **AttentionPlan.inputs(q_lens, ctx, page_table), groups=tuple(groups))


def draft_block_attention_ref(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Non-causal attention of each request's block over its whole context cache and its whole block.

    Args:
        q: ``[total_q, Hq, D]`` block queries of all requests, flattened by ``cu_seqlens_q``.
        k_block, v_block: ``[total_q, Hkv, D]`` the blocks' own keys/values (same rows as ``q``).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` paged projected-context K/V (positions 0..ctx_len-1).
        page_table: ``[R, max_pages]`` page ids per request in position order.
        cu_seqlens_q: ``[R + 1]`` block offsets.
        ctx_lens: ``[R]`` context length per request (0 allowed: the block attends only to itself).
        sm_scale: softmax scale.
        plan: :func:`plan_draft_block_attention` of these page table, offsets and lengths (``None``: made here).
    Returns:
        ``[total_q, Hq, D]`` in ``q.dtype``; math in fp32.
    """
    if plan is None:
        plan = plan_draft_block_attention(page_table, cu_seqlens_q, ctx_lens, k_cache.shape[1], q.shape[1])
    plan.check(q, k_cache)
    out = torch.empty_like(q)
    for g in plan.groups:
        # the blocks' padding rows are zeros, like the context's
        k = torch.cat([g.cached.gather(k_cache), g.queries.padded(k_block, zero_padding=True)], 1)
        v = torch.cat([g.cached.gather(v_cache), g.queries.padded(v_block, zero_padding=True)], 1)
        o = paged.masked_gqa_attention(g.queries.padded(q), k, v, g.allowed, sm_scale)
        g.queries.scatter(out, o)
    return out
