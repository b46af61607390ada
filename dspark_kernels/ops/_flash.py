"""Triton building block shared by the attention kernels: one FlashAttention (online softmax) update."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, visible, qk_scale, PRECISION: tl.constexpr):
    """Fold one key/value tile into the running (max, denominator, accumulator) of a query tile.

    q [BLOCK_M, BLOCK_D], k/v [BLOCK_N, BLOCK_D], visible [BLOCK_M, BLOCK_N] (bool), m_i/l_i [BLOCK_M] fp32,
    acc [BLOCK_M, BLOCK_D] fp32. ``qk_scale`` already includes log2(e): scores are exponentiated with exp2.
    Every row must see at least one visible key over the whole loop (else its denominator stays 0).
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
