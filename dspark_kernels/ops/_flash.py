"""Triton building blocks shared by the attention kernels: GQA-packed query tiles, paged K/V tiles, the online-softmax
update, the output store, and split-KV (the plan, the partial states, the log-sum-exp merge)."""

import torch
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


@triton.jit
def store_split_state(MS, LS, AS, m_i, l_i, acc, split, total_q, num_heads, q_start, tok, head, row_ok, d, d_ok,
                      HEAD_DIM: tl.constexpr):
    """Store a split's unnormalised state of a query tile: ``MS``/``LS`` ``[splits, total_q, Hq]`` (running max,
    denominator), ``AS`` ``[splits, total_q, Hq, D]`` (accumulator), fp32."""
    at = (split * total_q + q_start + tok).to(tl.int64) * num_heads + head
    tl.store(MS + at, m_i, mask=row_ok)
    tl.store(LS + at, l_i, mask=row_ok)
    tl.store(AS + at[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(MS, LS, AS, Out, total_q, num_heads, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    """One (token, query head) row: join the splits' partial states by their log-sum-exp (scores in the exp2
    domain) into ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    at = (s * total_q + t) * num_heads + h
    m = tl.load(MS + at, mask=s_ok, other=float("-inf"))
    best = tl.max(m, 0)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - best), 0.0)
    denom = tl.sum(w * tl.load(LS + at, mask=s_ok, other=0.0), 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(AS + at[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def kv_splits(base_programs: int, kv_bound: int, block_n: int, num_sms: int, most: int = 64) -> tuple[int, int]:
    """Split-KV plan: ``(splits, split_len)`` so that ``base_programs`` (query tiles x KV heads x requests) times
    ``splits`` fills about two waves of ``num_sms`` programs, each split a multiple of ``block_n`` keys of the
    ``kv_bound`` a request may hold (at most ``most`` splits; ``(1, kv_bound)`` when one wave is already there)."""
    want = min(most, -(-2 * num_sms // max(base_programs, 1)))
    if base_programs >= num_sms or want <= 1 or kv_bound <= block_n:
        return 1, kv_bound
    split_len = -(-(-(-kv_bound // want)) // block_n) * block_n
    return -(-kv_bound // split_len), split_len


def split_buffers(splits: int, total_q: int, hq: int, head_dim: int, out: torch.Tensor):
    """The partial-state buffers of a split launch (``out`` itself three times, unused, when ``splits == 1``)."""
    if splits == 1:
        return out, out, out
    ms = torch.empty(splits, total_q, hq, dtype=torch.float32, device=out.device)
    return ms, torch.empty_like(ms), torch.empty(splits, total_q, hq, head_dim, dtype=torch.float32, device=out.device)


def merge_splits(ms: torch.Tensor, ls: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """Join a split launch's partial states into ``out [total_q, Hq, D]`` (nothing to do for one split)."""
    if splits == 1:
        return
    total_q, hq, head_dim = out.shape
    _merge_splits_kernel[(total_q, hq)](ms, ls, acc, out, total_q, hq, out.stride(0), out.stride(1),
                                        NUM_SPLITS=splits, HEAD_DIM=head_dim,
                                        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                                        BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
