"""Reference for the parallel drafter's block attention: block queries over projected context K/V plus the block."""

from __future__ import annotations

import torch


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
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = ctx_lens.tolist()
    for r in range(len(lens)):
        q0, q1 = cu[r], cu[r + 1]
        if q1 == q0:
            continue
        pos = torch.arange(lens[r], device=q.device)
        pages = page_table[r].long()[pos // page_size]
        k = torch.cat([k_cache[pages, pos % page_size], k_block[q0:q1]]).float().repeat_interleave(group, dim=1)
        v = torch.cat([v_cache[pages, pos % page_size], v_block[q0:q1]]).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * sm_scale
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
