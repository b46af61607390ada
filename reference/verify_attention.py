"""Reference for ragged, causal attention of new tokens over a paged KV cache (the target's verify step).

All requests are computed as one padded batch (in groups bounded by the score size), not one by one."""

from __future__ import annotations

import torch

from ._paged_attention import gather_pages, masked_gqa_attention, padded_rows, request_groups


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
    cu = cu_seqlens_q.long()
    q_lens_t, kv_t = cu[1:] - cu[:-1], seq_lens.long()
    q_lens, kv_lens = q_lens_t.tolist(), kv_t.tolist()
    for g in request_groups(q_lens, kv_lens, q.shape[1]):
        max_q, max_kv = max(q_lens[g]), max(kv_lens[g])
        if max_q == 0:
            continue
        rows, valid = padded_rows(cu[:-1][g], q_lens_t[g], max_q, q.shape[0])
        kv = kv_t[g, None, None]
        q_pos = kv - q_lens_t[g, None, None] + torch.arange(max_q, device=q.device)[None, :, None]  # [n, Q, 1]
        key = torch.arange(max_kv, device=q.device)
        masked = (key > q_pos) | (key >= kv)  # causal, and no key past the request's own length
        o = masked_gqa_attention(q[rows], gather_pages(k_cache, page_table[g], kv_t[g], max_kv),
                                 gather_pages(v_cache, page_table[g], kv_t[g], max_kv), masked, sm_scale)
        out[rows[valid]] = o[valid].to(q.dtype)
    return out
