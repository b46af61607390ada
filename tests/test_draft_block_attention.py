"""draft_block_attention: Triton (interpreted) vs reference vs a dense oracle; the block is non-causal."""

import pytest
import torch

from dspark_kernels.ops import draft_block_attention, plan_draft_block_attention
from tests.test_verify_attention import assert_close_ratio, every_other, make_paged_batch, poison_unused


def make_block_batch(block_lens, ctx_lens, hq, hkv, d, page_size, dtype=torch.float32, seed=0):
    """Paged context of ``ctx_lens`` tokens plus dense block K/V rows; returns the op's inputs in order."""
    q, k_cache, v_cache, page_table, cu, _ = make_paged_batch(
        block_lens, [max(c, 1) for c in ctx_lens], hq, hkv, d, page_size, dtype, seed
    )
    g = torch.Generator().manual_seed(seed + 1)
    k_block = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    v_block = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    return q, k_block, v_block, k_cache, v_cache, page_table, cu, torch.tensor(ctx_lens, dtype=torch.int32)


def dense_oracle(q, k_block, v_block, k_cache, v_cache, page_table, cu, ctx_lens):
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    for r in range(ctx_lens.numel()):
        q0, q1, n = int(cu[r]), int(cu[r + 1]), int(ctx_lens[r])
        if q1 == q0:
            continue
        flat_k = k_cache[page_table[r].long()].reshape(-1, *k_cache.shape[2:])[:n]
        flat_v = v_cache[page_table[r].long()].reshape(-1, *v_cache.shape[2:])[:n]
        k = torch.cat([flat_k, k_block[q0:q1]]).float().repeat_interleave(group, 1).transpose(0, 1)
        v = torch.cat([flat_v, v_block[q0:q1]]).float().repeat_interleave(group, 1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q[q0:q1].float().transpose(0, 1), k, v)
        out[q0:q1] = o.transpose(0, 1)
    return out


CASES = [
    # block_lens, ctx_lens, hq, hkv, d, page_size
    pytest.param([7], [1], 4, 4, 64, 16, id="ctx1-gamma7"),
    pytest.param([7, 7, 7], [5, 33, 70], 8, 2, 64, 8, id="gqa4-ragged-ctx"),
    pytest.param([16, 1, 4], [100, 0, 9], 8, 1, 128, 16, id="gqa8-d128-empty-ctx"),
    pytest.param([0, 7, 0], [3, 12, 0], 4, 2, 64, 4, id="empty-blocks"),
    pytest.param([15], [200], 2, 1, 64, 32, id="gamma15-long"),
]


@pytest.mark.parametrize("block_lens,ctx_lens,hq,hkv,d,page_size", CASES)
def test_reference_matches_dense_oracle(block_lens, ctx_lens, hq, hkv, d, page_size):
    args = make_block_batch(block_lens, ctx_lens, hq, hkv, d, page_size)
    torch.testing.assert_close(draft_block_attention(*args, impl="torch"), dense_oracle(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_lens,ctx_lens,hq,hkv,d,page_size", CASES)
def test_triton_matches_reference(block_lens, ctx_lens, hq, hkv, d, page_size):
    args = make_block_batch(block_lens, ctx_lens, hq, hkv, d, page_size)
    ref = draft_block_attention(*args, impl="torch")
    tri = draft_block_attention(*args, impl="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,ratio", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_triton_matches_reference_half(dtype, ratio):
    args = make_block_batch([7, 7], [30, 5], 8, 2, 64, 16, dtype=dtype)
    assert_close_ratio(draft_block_attention(*args, impl="torch"), draft_block_attention(*args, impl="triton"), ratio)


def test_block_is_non_causal():
    """Changing the last block slot's K/V changes the output of the first slot (bidirectional block)."""
    args = list(make_block_batch([4], [6], 2, 1, 64, 4))
    out1 = draft_block_attention(*args, impl="triton")
    args[1] = args[1].clone()
    args[1][3] += 3.0
    out2 = draft_block_attention(*args, impl="triton")
    assert not torch.allclose(out1[0], out2[0])


@pytest.mark.parametrize("block_lens,ctx_lens", [([7, 7, 7], [5, 33, 70]), ([16, 1, 4], [100, 0, 9]), ([7], [1])])
def test_one_plan_serves_every_layer(block_lens, ctx_lens):
    q, kb, vb, k, v, pt, cu, ctx = make_block_batch(block_lens, ctx_lens, 8, 2, 64, 8)
    plan = plan_draft_block_attention(pt, cu, ctx, page_size=8, num_q_heads=8, impl="torch")
    for layer in range(3):
        args = (q + layer, kb - layer, vb * 2, k * (layer + 1), v + layer, pt, cu, ctx)
        planned = draft_block_attention(*args, impl="torch", plan=plan)
        assert torch.equal(planned, draft_block_attention(*args, impl="torch"))
    assert plan_draft_block_attention(pt, cu, ctx, page_size=8, num_q_heads=8, impl="triton") is None
    with pytest.raises(ValueError, match="plan was made for"):
        draft_block_attention(q, kb, vb, k[:, :4], v[:, :4], pt, cu, ctx, impl="torch", check_inputs=False, plan=plan)


@pytest.mark.parametrize("block_lens,ctx_lens,masked", [([7, 7], [30, 30], False), ([7], [12], False),
                                                       ([7, 7], [30, 12], True), ([7, 3], [30, 30], True)])
def test_plan_masks_only_when_some_key_is_padding(block_lens, ctx_lens, masked):
    """Equal blocks over equal contexts see every key (no mask: the unmasked fused attention); any ragged length
    makes a mask, and both give the dense oracle's result."""
    args = make_block_batch(block_lens, ctx_lens, 8, 2, 64, 8)
    q, kb, vb, k, v, pt, cu, ctx = args
    plan = plan_draft_block_attention(pt, cu, ctx, page_size=8, num_q_heads=8, impl="torch")
    assert (plan.groups[0].allowed is not None) == masked
    torch.testing.assert_close(draft_block_attention(*args, impl="torch", plan=plan), dense_oracle(*args),
                               rtol=1e-5, atol=1e-5)


def test_inputs_not_mutated():
    args = make_block_batch([3, 2], [9, 4], 4, 2, 64, 4)
    before = [a.clone() for a in args]
    draft_block_attention(*args, impl="triton")
    for a, b in zip(args, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "index,value,match",
    [
        (1, lambda a: a[:, :1], "k_block must have shape"),
        (2, lambda a: a.half(), "v_block must have dtype"),
        (7, lambda a: torch.tensor([-1, 2], dtype=torch.int32), "ctx_lens must be >= 0"),
        (7, lambda a: torch.tensor([99, 2], dtype=torch.int32), "page_table capacity"),
        (6, lambda a: torch.tensor([0, 1], dtype=torch.int32), "cu_seqlens_q must have R . 1 = 3 offsets"),
        (0, lambda a: a[:, :3], "multiple of k_cache kv heads"),
        (5, lambda a: a.index_fill(1, torch.tensor([0]), 10**6), r"page_table\[0, 0\] must be a page id"),
    ],
)
def test_bad_input(index, value, match):
    args = list(make_block_batch([2, 3], [4, 2], 4, 2, 64, 4))
    args[index] = value(args[index])
    with pytest.raises((ValueError, TypeError), match=match):
        draft_block_attention(*args, impl="torch")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unused_pages_and_stale_slots_are_never_read(impl):
    q, kb, vb, k, v, pt, cu, ctx = make_block_batch([7, 0, 3], [9, 3, 0], 4, 2, 64, 4)
    k2, v2, pt2 = poison_unused(k, v, pt, ctx)
    out = draft_block_attention(q, kb, vb, k2, v2, pt2, cu, ctx, impl=impl)
    torch.testing.assert_close(out, draft_block_attention(q, kb, vb, k, v, pt, cu, ctx, impl=impl))


def test_reference_request_groups_do_not_change_the_result(monkeypatch):
    import dspark_kernels.reference._paged_attention as paged

    args = make_block_batch([7, 7, 7], [5, 33, 70], 8, 2, 64, 8)
    whole = draft_block_attention(*args, impl="torch")
    monkeypatch.setattr(paged, "SCORE_BUDGET", 1)
    torch.testing.assert_close(draft_block_attention(*args, impl="torch"), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_strided_inputs_read_like_contiguous_ones(impl):
    """Every tensor as a view whose last dim has stride 2 (the page table transposed) gives the contiguous inputs'
    output: the Triton launcher hands its kernel unit-stride rows."""
    args = make_block_batch([3, 0, 5], [9, 4, 12], 4, 2, 64, 4)
    strided = [every_other(a) for a in args]
    strided[5] = args[5].t().contiguous().t()
    torch.testing.assert_close(draft_block_attention(*strided, impl=impl), draft_block_attention(*args, impl=impl),
                               rtol=0, atol=0)


def test_call_arguments_and_plan_are_checked():
    args = make_block_batch([2, 3], [4, 2], 4, 2, 64, 4)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int >= the longest query \(3 rows\)"):
        draft_block_attention(*args, impl="torch", max_seqlen_q=2)
    with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
        draft_block_attention(*args, -1.0, impl="torch")
    q, kb, vb, k, v, pt, cu, ctx = args
    plan = plan_draft_block_attention(pt, cu, ctx, page_size=4, num_q_heads=4, impl="torch")
    with pytest.raises(ValueError, match="plan was made for query lengths"):
        draft_block_attention(q, kb, vb, k, v, pt, cu, torch.tensor([4, 1], dtype=torch.int32), impl="torch",
                              plan=plan)
    with pytest.raises(ValueError, match="cu_seqlens_q must have R . 1 = 3 offsets"):
        plan_draft_block_attention(pt, cu[:2], ctx, page_size=4, num_q_heads=4, impl="torch")
