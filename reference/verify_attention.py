"""Reference for ragged, causal attention of new tokens over a paged KV cache (the target's verify step)."""

from __future__ import annotations

import torch


def verify_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole paged KV.

    Args:
        q: ``[total_q, Hq, D]`` queries of the new tokens of all requests, flattened (request r owns rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` paged cache that already holds the new tokens' K/V.
        page_table: ``[R, max_pages]`` int page ids; token t of request r lives at
            ``(page_table[r, t // page_size], t % page_size)``.
        cu_seqlens_q: ``[R + 1]`` offsets of the new tokens.
        seq_lens: ``[R]`` total KV length of each request including its new tokens (>= its query length).
        sm_scale: softmax scale (usually ``D ** -0.5``).
    Returns:
        ``[total_q, Hq, D]`` in ``q.dtype``; new token i of request r (0-based) sits at absolute position
        ``seq_lens[r] - q_len_r + i`` and attends keys ``0..`` that position. Math in fp32.
    """
    out = torch.empty_like(q)
    page_size = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for r in range(len(lens)):
        q0, q1, kv_len = cu[r], cu[r + 1], lens[r]
        n_q = q1 - q0
        if n_q == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        pages = page_table[r].long()[pos // page_size]
        k = k_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        v = v_cache[pages, pos % page_size].float().repeat_interleave(group, dim=1)
        qr = q[q0:q1].float()  # [n_q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * sm_scale
        q_pos = torch.arange(kv_len - n_q, kv_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
