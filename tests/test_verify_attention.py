"""verify_attention: Triton (interpreted on CPU) vs the PyTorch reference, a dense oracle, and bad input."""

import importlib
import math

import pytest
import torch

from dspark_kernels.ops import plan_verify_attention, verify_attention


def make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype=torch.float32, seed=0):
    """Random ragged batch with pages scattered in a shuffled pool; returns the op's inputs."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per_req) + 3  # a few unused pages
    perm = torch.randperm(num_pages, generator=g)
    max_pages = max(max(pages_per_req), 1)
    page_table = torch.zeros(len(kv_lens), max_pages, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_per_req):
        page_table[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, v_cache, page_table, cu, seq_lens


def dense_oracle(q, k_cache, v_cache, page_table, cu, seq_lens):
    """Independent check: unpage into contiguous K/V per request and use torch's SDPA with an explicit mask."""
    out = torch.empty_like(q, dtype=torch.float32)
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for r in range(seq_lens.numel()):
        q0, q1, n = int(cu[r]), int(cu[r + 1]), int(seq_lens[r])
        if q1 == q0:
            continue
        pages = page_table[r, : math.ceil(n / page_size)].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n].float()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n].float()
        k = k.repeat_interleave(group, 1).transpose(0, 1)
        v = v.repeat_interleave(group, 1).transpose(0, 1)
        qq = q[q0:q1].float().transpose(0, 1)
        qpos = torch.arange(n - (q1 - q0), n)[:, None]
        mask = torch.arange(n)[None, :] <= qpos
        o = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
        out[q0:q1] = o.transpose(0, 1)
    return out


def assert_close_ratio(ref, tri, ratio):
    """FLA-style: RMS(diff) / RMS(ref) below ratio, and no NaN."""
    assert not torch.isnan(tri).any()
    diff = (ref.float() - tri.float()).pow(2).mean().sqrt()
    base = ref.float().pow(2).mean().sqrt().clamp_min(1e-12)
    assert float(diff / base) <= ratio, f"relative RMS error {float(diff / base):.3e} > {ratio}"


CASES = [
    # q_lens, kv_lens, hq, hkv, d, page_size
    pytest.param([1], [1], 4, 4, 64, 16, id="ctx1-decode-mha"),
    pytest.param([1, 1, 1], [1, 17, 40], 8, 4, 64, 16, id="decode-gqa2"),
    pytest.param([5, 8, 1, 3], [5, 30, 64, 3], 8, 2, 64, 8, id="ragged-verify-gqa4"),
    pytest.param([8, 2], [100, 2], 8, 1, 128, 16, id="verify-gqa8-d128"),
    pytest.param([0, 4, 0, 1], [7, 4, 3, 1], 4, 2, 64, 4, id="empty-requests"),
    pytest.param([37], [37], 2, 2, 64, 16, id="prefill-odd"),
    pytest.param([16, 1], [300, 513], 4, 1, 128, 32, id="long-context"),
    pytest.param([8, 1], [2500, 1200], 8, 2, 128, 16, id="thousands-of-tokens"),
    pytest.param([40, 1, 1, 0, 1, 1], [60, 5, 17, 3, 1, 9], 8, 2, 64, 8, id="prefill-among-decodes"),
]


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page_size", CASES)
@pytest.mark.parametrize("ratio", [0.0, 1e9], ids=["enumerated-tiles", "padded-grid"])
def test_both_grids_match_the_reference(q_lens, kv_lens, hq, hkv, d, page_size, ratio, monkeypatch):
    """The enumerated-tile grid (the kernel's FLAT path, forced with ratio 0) and the padded grid (forced with a huge
    ratio) give the reference's output on every case, ragged ones included."""
    module = importlib.import_module("dspark_kernels.ops.verify_attention")

    monkeypatch.setattr(module, "FLAT_GRID_RATIO", ratio)
    args = make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size)
    torch.testing.assert_close(verify_attention(*args, impl="triton"), verify_attention(*args, impl="torch"),
                               rtol=1e-5, atol=1e-5)


def test_pinned_launch_bits_do_not_depend_on_the_grid(monkeypatch):
    """Batch-invariant (aligned) launches give the same bits on the enumerated and the padded grid."""
    module = importlib.import_module("dspark_kernels.ops.verify_attention")

    args = make_paged_batch([13, 1, 2, 1], [40, 7, 20, 33], 8, 2, 64, 8)
    outs = []
    for ratio in (0.0, 1e9):
        monkeypatch.setattr(module, "FLAT_GRID_RATIO", ratio)
        outs.append(verify_attention(*args, impl="triton", plan=module.PINNED_LAUNCH))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page_size", CASES)
def test_reference_matches_dense_oracle(q_lens, kv_lens, hq, hkv, d, page_size):
    args = make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size)
    ref = verify_attention(*args, impl="torch")
    oracle = dense_oracle(*args)
    torch.testing.assert_close(ref, oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page_size", CASES)
def test_triton_matches_reference_fp32(q_lens, kv_lens, hq, hkv, d, page_size):
    args = make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size)
    ref = verify_attention(*args, impl="torch")
    tri = verify_attention(*args, impl="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,ratio", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_triton_matches_reference_half(dtype, ratio):
    args = make_paged_batch([3, 1, 8], [40, 9, 70], 8, 2, 64, 16, dtype=dtype)
    ref = verify_attention(*args, impl="torch")
    tri = verify_attention(*args, impl="triton")
    assert tri.dtype == dtype
    assert_close_ratio(ref, tri, ratio)


def test_sm_scale_and_max_seqlen_hint():
    args = make_paged_batch([2, 3], [10, 6], 4, 2, 64, 4)
    ref = verify_attention(*args, sm_scale=0.3, impl="torch")
    tri = verify_attention(*args, sm_scale=0.3, impl="triton", max_seqlen_q=3, check_inputs=False)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_causality_future_keys_do_not_leak():
    """Changing K/V at positions after a query's own position must not change its output."""
    q, k, v, pt, cu, sl = make_paged_batch([4], [10], 2, 1, 64, 4)
    out1 = verify_attention(q, k, v, pt, cu, sl, impl="triton")
    k2, v2 = k.clone(), v.clone()
    # position 9 (the last new token) lives in page pt[0, 2], slot 1
    k2[pt[0, 2], 1] += 5.0
    v2[pt[0, 2], 1] -= 5.0
    out2 = verify_attention(q, k2, v2, pt, cu, sl, impl="triton")
    torch.testing.assert_close(out1[:3], out2[:3])
    assert not torch.allclose(out1[3], out2[3])


def poison_unused(k_cache, v_cache, page_table, lens):
    """Copies whose unused page-table entries point nowhere (out of range, negative) and whose cache slots past every
    request's ``lens`` hold NaN: what a live paged cache may contain outside the tokens the op may read."""
    page_size = k_cache.shape[1]
    pt, k, v = page_table.clone(), k_cache.clone(), v_cache.clone()
    live = torch.zeros(k.shape[:2], dtype=torch.bool)
    for r, n in enumerate(lens.tolist()):
        used = math.ceil(n / page_size)
        pt[r, used:] = torch.tensor([10**6, -7] * pt.shape[1], dtype=pt.dtype)[: pt.shape[1] - used]
        for t in range(n):
            live[pt[r, t // page_size], t % page_size] = True
    k[~live], v[~live] = float("nan"), float("nan")
    return k, v, pt


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unused_pages_and_stale_slots_are_never_read(impl):
    q, k, v, pt, cu, sl = make_paged_batch([5, 0, 2, 1], [9, 3, 30, 2], 4, 2, 64, 4)
    k2, v2, pt2 = poison_unused(k, v, pt, sl)
    out = verify_attention(q, k2, v2, pt2, cu, sl, impl=impl)
    torch.testing.assert_close(out, verify_attention(q, k, v, pt, cu, sl, impl=impl))


def test_reference_request_groups_do_not_change_the_result(monkeypatch):
    """Under a tiny score budget every request forms its own group (the loop a long prefill takes)."""
    import dspark_kernels.reference._paged_attention as paged

    args = make_paged_batch([5, 8, 1, 3], [5, 30, 64, 3], 8, 2, 64, 8)
    whole = verify_attention(*args, impl="torch")
    monkeypatch.setattr(paged, "SCORE_BUDGET", 1)
    assert [g.stop - g.start for g in paged.request_groups([5, 8, 1, 3], [5, 30, 64, 3], 8)] == [1, 1, 1, 1]
    torch.testing.assert_close(verify_attention(*args, impl="torch"), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [1, 17, 40]), ([5, 0, 8, 1], [5, 3, 30, 64]), ([6], [6])])
def test_one_plan_serves_every_layer(q_lens, kv_lens):
    """A plan made once for the lengths gives each "layer" (another K/V cache, other queries) the unplanned result."""
    q, k, v, pt, cu, sl = make_paged_batch(q_lens, kv_lens, 8, 2, 64, 8)
    plan = plan_verify_attention(pt, cu, sl, page_size=8, num_q_heads=8, impl="torch")
    for layer in range(3):
        q2, k2, v2 = (q + layer, k * (layer + 1), v - layer) if layer else (q, k, v)
        planned = verify_attention(q2, k2, v2, pt, cu, sl, impl="torch", plan=plan)
        assert torch.equal(planned, verify_attention(q2, k2, v2, pt, cu, sl, impl="torch"))
    assert plan_verify_attention(pt, cu, sl, page_size=8, num_q_heads=8, impl="triton") is None
    with pytest.raises(ValueError, match="plan was made for"):
        verify_attention(q[:-1], k, v, pt, cu, sl, impl="torch", check_inputs=False, plan=plan)


def test_inputs_not_mutated():
    args = make_paged_batch([3, 2], [9, 4], 4, 2, 64, 4)
    before = [a.clone() for a in args]
    verify_attention(*args, impl="triton")
    verify_attention(*args, impl="torch")
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_impl_env_override(monkeypatch):
    args = make_paged_batch([1], [3], 2, 2, 64, 4)
    monkeypatch.setenv("DSPARK_IMPL", "bogus")
    with pytest.raises(ValueError, match="DSPARK_IMPL"):
        verify_attention(*args)
    monkeypatch.setenv("DSPARK_IMPL", "triton")
    torch.testing.assert_close(verify_attention(*args), verify_attention(*args, impl="torch"), rtol=1e-5, atol=1e-5)


def _bad(fn):
    q, k, v, pt, cu, sl = make_paged_batch([2, 1], [5, 3], 4, 2, 64, 4)
    kw = dict(q=q, k_cache=k, v_cache=v, page_table=pt, cu_seqlens_q=cu, seq_lens=sl)
    fn(kw)
    return kw


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda kw: kw.update(q=kw["q"][0]), "q must be 3-D"),
        (lambda kw: kw.update(q=kw["q"].long()), "q must have dtype"),
        (lambda kw: kw.update(k_cache=kw["k_cache"].half()), "k_cache must have dtype"),
        (lambda kw: kw.update(v_cache=kw["v_cache"][:, :2]), "v_cache must have shape"),
        (lambda kw: kw.update(k_cache=kw["k_cache"][..., :32], v_cache=kw["v_cache"][..., :32]), "head_dim"),
        (lambda kw: kw.update(q=kw["q"][:, :3]), "multiple of k_cache kv heads"),
        (lambda kw: kw.update(page_table=kw["page_table"].float()), "page_table must have dtype"),
        (lambda kw: kw.update(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), r"cu_seqlens_q\[-1\]"),
        (lambda kw: kw.update(cu_seqlens_q=torch.tensor([1, 2, 3], dtype=torch.int32)), r"cu_seqlens_q\[0\]"),
        (lambda kw: kw.update(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32)), "cu_seqlens_q must have R . 1"),
        (lambda kw: kw["page_table"].__setitem__((1, 0), kw["k_cache"].shape[0]), r"page_table\[1, 0\] must be a page"),
        (lambda kw: kw["page_table"].__setitem__((0, 1), -1), r"page_table\[0, 1\] must be a page id in \[0, "),
        (lambda kw: kw.update(max_seqlen_q=1), r"max_seqlen_q must be an int >= the longest query \(2 rows\)"),
        (lambda kw: kw.update(max_seqlen_q=2.0), "max_seqlen_q must be an int"),
        (lambda kw: kw.update(sm_scale=float("nan")), "sm_scale must be a finite number > 0"),
        (lambda kw: kw.update(sm_scale=0.0), "sm_scale must be a finite number > 0"),
        (lambda kw: kw.update(**{n: kw[n][..., :0] for n in ("q", "k_cache", "v_cache")}), "head_dim must be >= 1"),
        (lambda kw: kw.update(seq_lens=torch.tensor([1, 3], dtype=torch.int32)), "seq_lens must be >="),
        (lambda kw: kw.update(seq_lens=torch.tensor([50, 3], dtype=torch.int32)), "page_table capacity"),
        (lambda kw: kw.update(q=kw["q"].to("meta")), "must be on device"),
    ],
)
def test_bad_input(mutate, match):
    kw = _bad(mutate)
    with pytest.raises((ValueError, TypeError), match=match):
        verify_attention(**kw, impl="torch")


def test_bad_impl_name():
    q, k, v, pt, cu, sl = make_paged_batch([1], [1], 2, 2, 64, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        verify_attention(q, k, v, pt, cu, sl, impl="cuda")


@pytest.mark.parametrize("kv_len,page_size", [(37, 8), (1, 16), (64, 16)])
def test_single_request_on_consecutive_pages_reads_a_slice(kv_len, page_size):
    """A request decoding alone gets consecutive pages from the pool: the reference then reads its K/V as a slice of
    the cache (no gather), with the same bits as the gather of the same contents on scattered pages."""
    from dspark_kernels.reference._paged_attention import PagedRead

    g = torch.Generator().manual_seed(1)
    n_pages = math.ceil(kv_len / page_size)
    k, v = (torch.randn(n_pages + 5, page_size, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(3, 4, 64, generator=g)
    run = torch.arange(2, 2 + n_pages, dtype=torch.int32)[None]  # consecutive pages 2, 3, ...
    scattered = torch.randperm(n_pages + 5, generator=g)[:n_pages].to(torch.int32)[None]
    if n_pages > 1 and bool((scattered[0, 1:] - scattered[0, :-1] == 1).all()):
        scattered = scattered.flip(1)
    k2, v2 = k.clone(), v.clone()
    k2[scattered[0].long()], v2[scattered[0].long()] = k[run[0].long()], v[run[0].long()]  # same contents elsewhere
    sl, cu = torch.tensor([kv_len], dtype=torch.int32), torch.tensor([0, min(3, kv_len)], dtype=torch.int32)
    q = q[: min(3, kv_len)]
    read = PagedRead.of(run, sl.long(), kv_len, page_size)
    assert read.start == 2 * page_size and read.slots is None
    other = PagedRead.of(scattered, sl.long(), kv_len, page_size)
    assert other.start is None or n_pages == 1
    assert torch.equal(read.gather(k), other.gather(k2)) and read.gather(k).data_ptr() == k[2].data_ptr()
    assert torch.equal(read.gather_heads_first(v), other.gather_heads_first(v2))
    assert read.gather_heads_first(v).is_contiguous()
    out = verify_attention(q, k, v, run, cu, sl, impl="torch")
    assert torch.equal(out, verify_attention(q, k2, v2, scattered, cu, sl, impl="torch"))
    torch.testing.assert_close(out, dense_oracle(q, k, v, run, cu, sl), rtol=1e-5, atol=1e-5)


def test_a_read_past_a_request_length_or_of_several_requests_gathers():
    from dspark_kernels.reference._paged_attention import PagedRead

    pages = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    assert PagedRead.of(pages, torch.tensor([20]), 20, 8).start == 0
    assert PagedRead.of(pages, torch.tensor([12]), 20, 8).start is None  # positions 12..19 are outside: zeroed
    assert PagedRead.of(pages.repeat(2, 1), torch.tensor([20, 20]), 20, 8).start is None
    assert PagedRead.of(torch.tensor([[0, 2, 1]], dtype=torch.int32), torch.tensor([20]), 20, 8).start is None


@pytest.mark.parametrize("q_lens,kv_lens,masked", [([1], [40], False), ([1, 1, 1], [9, 9, 9], False),
                                                   ([1, 1], [9, 17], True), ([2], [9], True), ([1, 3], [9, 9], True)])
def test_plan_masks_only_when_some_query_cannot_see_some_key(q_lens, kv_lens, masked):
    """One new token per request over equal lengths sees every key (no mask: the unmasked fused attention); a longer
    query (causal) or unequal lengths make a mask; both give the dense oracle's result."""
    args = make_paged_batch(q_lens, kv_lens, 8, 2, 64, 8)
    q, k, v, pt, cu, sl = args
    plan = plan_verify_attention(pt, cu, sl, page_size=8, num_q_heads=8, impl="torch")
    assert (plan.groups[0].allowed is not None) == masked
    torch.testing.assert_close(verify_attention(*args, impl="torch", plan=plan), dense_oracle(*args), rtol=1e-5,
                               atol=1e-5)


def test_unused_page_table_entries_may_hold_padding():
    """Only the pages that cover a request's length are read, so entries past them may hold -1 or any value."""
    q, k, v, pt, cu, sl = make_paged_batch([2, 1], [5, 3], 4, 2, 64, 4)
    wide = torch.cat([pt, torch.full((2, 2), -1, dtype=pt.dtype)], dim=1)
    wide[1, 1] = 10**6
    for impl in ("torch", "triton"):
        torch.testing.assert_close(verify_attention(q, k, v, wide, cu, sl, impl=impl),
                                   verify_attention(q, k, v, pt, cu, sl, impl=impl), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_strided_inputs_read_like_contiguous_ones(impl):
    """Views the checks accept (a transposed page table, every other offset, a cache whose last dim has stride 2)
    give the contiguous inputs' output: the Triton launcher hands its kernel unit-stride rows."""
    q, k, v, pt, cu, sl = make_paged_batch([3, 1, 4], [9, 4, 12], 4, 2, 64, 4)
    strided = (q, *(every_other(t) for t in (k, v)), pt.t().contiguous().t(), *(every_other(t) for t in (cu, sl)))
    assert strided[3].stride(-1) != 1
    torch.testing.assert_close(verify_attention(*strided, impl=impl), verify_attention(q, k, v, pt, cu, sl, impl=impl),
                               rtol=0, atol=0)


def every_other(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view whose last dim has stride 2, the other elements of its storage holding other values."""
    return torch.stack([t, t * 3 + 5], dim=-1)[..., 0]


def test_plan_must_match_the_call():
    """A plan checks, with validation on, that it was made for the call's lengths and page table; its own arguments
    are checked like the op's."""
    q, k, v, pt, cu, sl = make_paged_batch([2, 1], [5, 3], 4, 2, 64, 4)
    plan = plan_verify_attention(pt, cu, sl, 4, 4, impl="torch")
    verify_attention(q, k, v, pt, cu, sl, impl="torch", plan=plan)
    with pytest.raises(ValueError, match="plan was made for query lengths"):
        verify_attention(q, k, v, pt, cu, torch.tensor([6, 3], dtype=torch.int32), impl="torch", plan=plan)
    other = pt.clone()
    other[0, 0] = k.shape[0] - 1 if int(pt[0, 0]) != k.shape[0] - 1 else 0
    with pytest.raises(ValueError, match="another page_table"):
        verify_attention(q, k, v, other, cu, sl, impl="torch", plan=plan)
    with pytest.raises(ValueError, match="page_table must have shape"):
        plan_verify_attention(pt[:1], cu, sl, 4, 4, impl="torch")
    with pytest.raises(TypeError, match="page_table must be a torch.Tensor"):
        plan_verify_attention(pt.tolist(), cu, sl, 4, 4, impl="torch")
    with pytest.raises(ValueError, match="num_q_heads must be an int >= 1"):
        plan_verify_attention(pt, cu, sl, 4, 0, impl="torch")
    with pytest.raises(ValueError, match="page_size"):
        plan_verify_attention(pt, cu, sl, 0, 4, impl="torch")


@pytest.mark.parametrize("base,kv_bound,expect_split", [(8, 4096, True), (64, 4096, True), (200, 4096, False),
                                                        (8, 64, False), (1, 100_000, True)])
def test_kv_split_plan_fills_the_gpu(base, kv_bound, expect_split):
    """Few programs (decode of one request: 8 KV heads) get split keys up to about two waves of 132 SMs; each split is
    a whole number of key tiles and the splits cover the longest request; a full grid or a one-tile context stays
    whole."""
    from dspark_kernels.ops.verify_attention import kv_splits

    splits, split_len = kv_splits(base, kv_bound, 64, 132)
    assert (splits > 1) == expect_split
    assert splits * split_len >= kv_bound and (splits - 1) * split_len < kv_bound
    if expect_split:
        assert split_len % 64 == 0 and splits <= 64
        assert splits >= min(64, -(-132 // base)) - 1  # about one wave at least (rounding to whole tiles)
    if base == 8 and kv_bound == 4096:
        assert base * splits >= 132
