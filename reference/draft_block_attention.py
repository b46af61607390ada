"""Reference for the parallel drafter's block attention: block queries over projected context K/V plus the block.

All requests are computed as one padded batch (in groups bounded by the score size), not one by one."""

from __future__ import annotations

import torch

from ._paged_attention import gather_pages, masked_gqa_attention, padded_rows, request_groups, zero_rows


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
    Returns:
        ``[total_q, Hq, D]`` in ``q.dtype``; math in fp32.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.long()
    q_lens_t, ctx_t = cu[1:] - cu[:-1], ctx_lens.long()
    q_lens, ctx = q_lens_t.tolist(), ctx_t.tolist()
    for g in request_groups(q_lens, [c + n for c, n in zip(ctx, q_lens)], q.shape[1]):
        max_q, max_ctx = max(q_lens[g]), max(ctx[g])
        if max_q == 0:
            continue
        rows, valid = padded_rows(cu[:-1][g], q_lens_t[g], max_q, q.shape[0])
        ctx_ok = torch.arange(max_ctx, device=q.device) < ctx_t[g, None]
        key_ok = torch.cat([ctx_ok, valid], dim=1)  # [n, context keys then block keys]
        # the blocks' padding rows are zeros, like the context's
        k = torch.cat([gather_pages(k_cache, page_table[g], ctx_t[g], max_ctx), zero_rows(k_block[rows], ~valid)], 1)
        v = torch.cat([gather_pages(v_cache, page_table[g], ctx_t[g], max_ctx), zero_rows(v_block[rows], ~valid)], 1)
        o = masked_gqa_attention(q[rows], k, v, ~key_ok[:, None, :].expand(-1, max_q, -1), sm_scale)
        out[rows[valid]] = o[valid].to(q.dtype)
    return out
