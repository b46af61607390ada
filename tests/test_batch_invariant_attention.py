"""Batch-invariant verify attention: parity with the dense oracle, bit-identical rows however the call is batched,
bad input, and greedy speculative decoding (the batch 1..N loop and the engine's policies) equal to greedy AR decoding
with bf16 GEMMs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_kernels.bench import ASSETS
from dspark_kernels.drafters import load_drafter
from dspark_kernels.engine.engine import Engine, run_closed_loop
from dspark_kernels.engine.policies import POLICY_NAMES, make_policy
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.ops import plan_verify_attention, verify_attention
from dspark_kernels.ops.verify_attention import PINNED_LAUNCH
from dspark_kernels.reference.batch_invariant_attention import KEY_BLOCK, QUERY_TILE
from tests.test_engine import linear_profile
from tests.test_verify_attention import CASES, dense_oracle, make_paged_batch, poison_unused


def invariant(q, k_cache, v_cache, page_table, cu, seq_lens, impl="torch"):
    plan = plan_verify_attention(page_table, cu, seq_lens, k_cache.shape[1], q.shape[1], impl=impl,
                                 batch_invariant=True)
    return verify_attention(q, k_cache, v_cache, page_table, cu, seq_lens, impl=impl, plan=plan)


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page_size", CASES)
def test_matches_dense_oracle(q_lens, kv_lens, hq, hkv, d, page_size):
    args = make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size)
    torch.testing.assert_close(invariant(*args), dense_oracle(*args), rtol=1e-5, atol=1e-5)


def test_bf16_inputs_match_the_dense_oracle():
    """bf16 queries and cache: fp32 math inside, the output in bf16."""
    args = make_paged_batch([3, 1, 9], [70, 5, 130], 8, 2, 64, 16, dtype=torch.bfloat16)
    out = invariant(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_oracle(*args), rtol=1e-2, atol=1e-2)


def test_never_reads_outside_the_requests_tokens():
    """Unused page-table entries point nowhere and stale slots hold NaN: the output is finite and unchanged."""
    q, k, v, pt, cu, lens = make_paged_batch([3, 1, 9], [70, 5, 130], 4, 2, 32, 8)
    kp, vp, ptp = poison_unused(k, v, pt, lens)
    out = invariant(q, kp, vp, ptp, cu, lens)
    assert torch.isfinite(out).all()
    assert torch.equal(out, invariant(q, k, v, pt, cu, lens))


def test_bad_input_is_refused():
    """A plan made for other lengths or another page size, and a Triton launch with a GQA group that does not divide
    its tile, raise errors that name the problem."""
    q, k, v, pt, cu, lens = make_paged_batch([3, 1], [70, 5], 4, 2, 32, 8)
    plan = plan_verify_attention(pt, cu, lens, 8, 4, impl="torch", batch_invariant=True)
    with pytest.raises(ValueError, match="plan was made for 4 query rows"):
        verify_attention(q[:3], k, v, pt, cu, lens, impl="torch", plan=plan, check_inputs=False)
    with pytest.raises(ValueError, match="page size 8"):
        verify_attention(q, k.view(-1, 4, 2, 32), v.view(-1, 4, 2, 32), pt, cu, lens, impl="torch", plan=plan,
                         check_inputs=False)
    q3, k3, v3, pt3, cu3, lens3 = make_paged_batch([2], [9], 6, 2, 32, 8)  # 3 query heads per KV head
    with pytest.raises(ValueError, match="power-of-two GQA group"):
        verify_attention(q3, k3, v3, pt3, cu3, lens3, impl="triton", plan=PINNED_LAUNCH)


def _one_request_cache(length, hkv, d, page_size, seed):
    """A single request's keys/values for positions ``0 .. length - 1`` in shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-length // page_size)
    page_table = torch.randperm(pages + 2, generator=g)[:pages].to(torch.int32)[None]
    k = torch.randn(pages + 2, page_size, hkv, d, generator=g)
    v = torch.randn(pages + 2, page_size, hkv, d, generator=g)
    return k, v, page_table


def _assert_row_is_batch_invariant(hq, hkv, page_size, pos, device, impl):
    """The token at ``pos``: decoded alone, verified with 1..15 following tokens (whose keys the row must not
    see), inside a prefill, and verified next to other requests of other lengths, gives bit-identical output."""
    d = 64
    k, v, pt = (t.to(device) for t in _one_request_cache(pos + 16, hkv, d, page_size, seed=pos))
    queries = torch.randn(16, hq, d, generator=torch.Generator().manual_seed(1000 + pos)).to(device)

    def lens(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    alone = invariant(queries[:1], k, v, pt, lens(0, 1), lens(pos + 1), impl)[0]
    for extra in (1, 3, 7, 15):
        block = invariant(queries[: extra + 1], k, v, pt, lens(0, extra + 1), lens(pos + extra + 1), impl)
        assert torch.equal(block[0], alone), f"pos {pos}: verifying {extra} more tokens changed the row"
    # the same row inside a prefill of positions 0 .. pos + 3 (cut into segments when long)
    prompt = torch.randn(pos + 4, hq, d, generator=torch.Generator().manual_seed(2000 + pos)).to(device)
    prompt[pos] = queries[0]
    prefill = invariant(prompt, k, v, pt, lens(0, pos + 4), lens(pos + 4), impl)
    assert torch.equal(prefill[pos], alone), f"pos {pos}: the prefill changed the row"
    # the same row batched after two other requests (their own pages; longer and shorter contexts)
    q2, k2, v2, pt2, _, _ = (t.to(device) for t in make_paged_batch([5, 2], [300, 9], hq, hkv, d, page_size,
                                                                    seed=pos + 7))
    k_all, v_all = torch.cat([k2, k]), torch.cat([v2, v])
    table = torch.zeros(3, max(pt2.shape[1], pt.shape[1]), dtype=torch.int32, device=device)
    table[:2, : pt2.shape[1]] = pt2
    table[2, : pt.shape[1]] = pt[0] + k2.shape[0]
    batched = invariant(torch.cat([q2, queries[:4]]), k_all, v_all, table, lens(0, 5, 7, 11), lens(300, 9, pos + 4),
                        impl)
    assert torch.equal(batched[7], alone), f"pos {pos}: batching with other requests changed the row"


@pytest.mark.parametrize("hq,hkv,page_size", [(4, 2, 16), (4, 1, 8), (8, 8, 4), (8, 2, 32)])
@pytest.mark.parametrize("pos", [0, QUERY_TILE - 1, QUERY_TILE, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 200])
def test_a_row_has_the_same_bits_however_it_is_batched(hq, hkv, page_size, pos):
    _assert_row_is_batch_invariant(hq, hkv, page_size, pos, torch.device("cpu"), "torch")


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_random_ragged_batches_give_every_row_its_solo_bits(data):
    """Random ragged batches (1-4 requests, 0-12 new tokens over 1-200 cached ones, GQA 1/2/4, page sizes 4-32):
    every row equals the row decoded alone at its position."""
    hkv = data.draw(st.sampled_from([1, 2]))
    hq = hkv * data.draw(st.sampled_from([1, 2, 4]))
    page_size = data.draw(st.sampled_from([4, 16, 32]))
    n = data.draw(st.integers(1, 4))
    q_lens = [data.draw(st.integers(0, 12)) for _ in range(n)]
    kv_lens = [q + data.draw(st.integers(0 if q else 1, 200)) for q in q_lens]
    seed = data.draw(st.integers(0, 99))
    q, k, v, pt, cu, lens = make_paged_batch(q_lens, kv_lens, hq, hkv, 32, page_size, seed=seed)
    out = invariant(q, k, v, pt, cu, lens)
    for r in range(n):
        for i in range(q_lens[r]):
            row = int(cu[r]) + i
            pos = kv_lens[r] - q_lens[r] + i
            alone = invariant(q[row: row + 1], k, v, pt[r: r + 1], torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([pos + 1], dtype=torch.int32))
            assert torch.equal(out[row], alone[0]), f"request {r} token {i} (position {pos}) differs from its solo bits"


@pytest.mark.parametrize("pos", [0, 15, 16, 63, 64, 130])
def test_triton_pinned_launch_has_the_same_bits_however_it_is_batched(device, pos):
    """The Triton kernel under ``batch_invariant=True`` (one launch config for every call; interpreted on a CPU, on
    the GPU in ``perf/gpu_check.sh``): the same checks, across its 16-row tiles and 64-key tiles."""
    assert plan_verify_attention(torch.zeros(1, 1, dtype=torch.int32, device=device),
                                 torch.tensor([0, 1], dtype=torch.int32, device=device),
                                 torch.ones(1, dtype=torch.int32, device=device), 16, 4, impl="triton",
                                 batch_invariant=True) is PINNED_LAUNCH
    _assert_row_is_batch_invariant(4, 2, 16, pos, device, "triton")


# Held-out prompts (the acceptance bench's test split, 32 tokens) on which greedy speculative decoding with the fused
# attention and bf16 GEMMs left greedy AR decoding at new token 8, 3 and 13 (measured with one thread).
DIVERGING = [
    [1, 1769, 66, 1663, 15, 944, 365, 7855, 66, 2993, 3115, 2225, 17, 3030, 66, 2993, 320, 272, 323, 801, 66, 1663,
     2219, 365, 7855, 66, 2993, 29, 274, 1949, 2219, 32],
    [1, 17, 202, 202, 66, 657, 315, 289, 611, 371, 597, 973, 546, 17, 202, 202, 66, 5768, 315, 289, 4176, 817, 1681,
     644, 15, 747, 303, 338, 339, 5885, 1151, 202],
    [1, 2427, 287, 472, 30, 202, 96, 202, 6, 1168, 828, 202, 202, 6, 828, 500, 555, 2669, 79, 88, 492, 3720, 202, 96,
     202, 6, 1168, 828, 202, 6, 1168, 828],
]


def test_bf16_speculative_decoding_reproduces_ar_bit_for_bit():
    """The shipped target with bf16 GEMMs and batch-invariant attention: greedy speculative decoding, one prompt at a
    time and all three batched, emits exactly the tokens of greedy AR decoding of each prompt alone."""
    target = load_model(ASSETS / "target", gemm_dtype="bfloat16", batch_invariant=True)
    drafter = load_drafter(ASSETS / "drafters" / "dspark", target, gemm_dtype="bfloat16")
    ar = [generate(target, [p], 20).tokens[0] for p in DIVERGING]
    for prompt, expected in zip(DIVERGING, ar):
        assert speculative_generate(target, drafter, [prompt], 20, 7).tokens[0] == expected
    assert speculative_generate(target, drafter, DIVERGING, 20, 7).tokens == ar


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "oracle"])
def test_bf16_engine_reproduces_ar_for_every_policy(policy):
    """The continuous-batching engine (two requests at a time, ragged verify lengths) with the same setting emits
    each prompt's solo greedy AR tokens under every live policy."""
    target = load_model(ASSETS / "target", gemm_dtype="bfloat16", batch_invariant=True)
    drafter = load_drafter(ASSETS / "drafters" / "dspark", target, gemm_dtype="bfloat16")
    ar = [generate(target, [p], 16).tokens[0] for p in DIVERGING]
    engine = Engine(target, drafter, make_policy(policy), linear_profile(16, 6.0), 7, page_size=16, max_batch=2,
                    max_seq_len=64)
    out = run_closed_loop(engine, DIVERGING, 2, 16)
    assert [engine.requests[i].tokens for i in out["rids"]] == ar
