"""Triton building blocks shared by the attention kernels: GQA-packed query tiles, paged K/V tiles, the online-softmax
update, the output store."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, PRECISION: tl.constexpr):
    """Fold one key/value tile into the running (max, denominator, accumulator) of a query tile.

    q [BLOCK_M, BLOCK_D], k/v [BLOCK_N, BLOCK_D], visible [BLOCK_M, BLOCK_N] (bool), m_i/l_i [BLOCK_M] fp32,
    acc [BLOCK_M, BLOCK_D] fp32. ``qk_scale`` already includes log2(e): scores are exponentiated with exp2.
    A row that has seen no visible key yet keeps max -inf and zero sums (a split-KV program may hold such rows); over
    the whole loop, or the splits merged, every row must see at least one (else its denominator stays 0).
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # the same as m_new wherever a key was seen
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def gqa_query_tile(Q, stride_qt, stride_qh, q_start, q_len, kvh, mb, shift, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr):
    """Load tile ``mb`` of a request's queries with the GQA group packed into M: row m is token ``m // GROUP - shift``
    and query head ``kvh * GROUP + m % GROUP`` (``shift`` padding tokens lead the first tile; rows outside the
    request's tokens are masked). Returns ``(q [BLOCK_M, BLOCK_D], tok, head, row_ok, d, d_ok)``."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP - shift
    head = kvh * GROUP + rows % GROUP
    row_ok = (tok >= 0) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q, tok, head, row_ok, d, d_ok


@triton.jit
def paged_kv_tile(K, V, PT, r, stride_pt, n, n_ok, kvh, d, d_ok, stride_kp, stride_ks, stride_kh, stride_vp,
                  stride_vs, stride_vh, PAGE_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """Gather the keys and values of request ``r``'s cached positions ``n [BLOCK_N]`` (masked by ``n_ok``) for KV head
    ``kvh`` from the paged cache ``[pages, PAGE_SIZE, Hkv, D]`` through its page-table row; ``(k, v) [BLOCK_N,
    BLOCK_D]``, upcast to fp32 when ``DOT_F32``."""
    page = tl.load(PT + r * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = (n % PAGE_SIZE).to(tl.int64)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def store_output_tile(Out, acc, l_i, q_start, tok, head, row_ok, d, d_ok, stride_ot, stride_oh):
    """Normalise the accumulator by the softmax denominator and store the tile's rows in ``Out``'s dtype."""
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
