"""Property-based parity: each Triton kernel (interpreted on the CPU) against its PyTorch reference on shapes drawn by
hypothesis rather than picked by hand: ragged requests with empty ones, vocabularies at and around tile edges (and a
vocabulary of 1), odd head dims, GQA ratios 1-8, page sizes 1-32, greedy and sampled rows mixed with top-k/top-p.

The per-op files hold the hand-worked cases; these tests look for the combinations nobody wrote down. Examples are
derandomized (the same draws every run), so a failure reproduces and CI stays deterministic; each test's
``max_examples`` keeps the interpreted kernels within a few seconds per test.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_kernels.ops import (
    draft_block_attention,
    prefix_survival,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
    verify_attention,
)
from tests import test_rejection_sample as rs
from tests import test_sequential_head as sh
from tests.test_draft_block_attention import make_block_batch
from tests.test_survival import cu_of, decreasing_sps
from tests.test_verify_attention import make_paged_batch

SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# vocabularies at the sampling kernels' tile edges (BLOCK_V 512 / 1024 in the default and tuned configs) and tiny ones
VOCABS = [1, 2, 3, 511, 512, 513, 1023, 1024, 1025]
TEMPERATURES = [0.0, 0.0, 0.5, 1.0, 1.7]


@st.composite
def ragged_lens(draw, max_requests: int, max_len: int) -> list[int]:
    """1..max_requests lengths in 0..max_len (empty requests included)."""
    return draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_requests))


@st.composite
def sampling_params(draw, r: int, v: int) -> dict:
    """Per-request temperature (greedy rows mixed in), and optionally top-k (up to past the vocabulary) / top-p."""
    temps = draw(st.lists(st.sampled_from(TEMPERATURES), min_size=r, max_size=r))
    top_k = draw(st.none() | st.lists(st.sampled_from([0, 1, 2, v, v + 3]), min_size=r, max_size=r))
    top_p = draw(st.none() | st.lists(st.sampled_from([1.0, 0.9, 0.3, 1e-6]), min_size=r, max_size=r))
    return dict(temps=temps, top_k=top_k, top_p=top_p)


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), lens=ragged_lens(5, 8), v=st.sampled_from(VOCABS), with_draft_probs=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_rejection_sample_parity(data, lens, v, with_draft_probs, dtype, seed):
    torch.manual_seed(seed)
    params = data.draw(sampling_params(len(lens), v))
    batch = rs.make_batch(lens, v, with_draft_probs=with_draft_probs, dtype=dtype, **params)
    rs.run_both(batch)  # bit-equal tokens, accepted counts and counters; structural invariants


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), lens=ragged_lens(4, 8), v=st.sampled_from(VOCABS), kind=st.sampled_from(sh.KINDS),
       d=st.sampled_from([1, 12, 65]), r=st.sampled_from([1, 8, 17]), greedy_only=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sequential_head_parity(data, lens, v, kind, d, r, greedy_only, seed):
    torch.manual_seed(seed)
    params = data.draw(sampling_params(len(lens), v))
    if greedy_only:
        params["temps"] = [0.0] * len(lens)
    args = sh.make_args(lens, v, kind, d=d, r=r, **params)
    if greedy_only and data.draw(st.booleans()):
        args["uniforms"] = None  # an all-greedy batch may omit the noise
    sh.run_both(args)  # bit-equal tokens, fp32-close draft rows and confidences; structural invariants


@st.composite
def heads(draw) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim): GQA ratios 1, 2, 4, 8 and head dims off the powers of two."""
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    return hkv * group, hkv, draw(st.sampled_from([1, 24, 64, 80]))


@settings(max_examples=20, **SETTINGS)
@given(data=st.data(), head=heads(), page_size=st.sampled_from([1, 4, 16, 32]), seed=st.integers(0, 2**16))
def test_verify_attention_parity(data, head, page_size, seed):
    q_lens = data.draw(ragged_lens(4, 9))
    # each request's cached length covers its queries (its new tokens are the last ones), 1 token at least
    kv_lens = [q + data.draw(st.integers(0 if q else 1, 70)) for q in q_lens]
    args = make_paged_batch(q_lens, kv_lens, *head, page_size, seed=seed)
    ref = verify_attention(*args, impl="torch")
    tri = verify_attention(*args, impl="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, **SETTINGS)
@given(block_lens=ragged_lens(4, 16), data=st.data(), head=heads(), page_size=st.sampled_from([1, 4, 16, 32]),
       seed=st.integers(0, 2**16))
def test_draft_block_attention_parity(block_lens, data, head, page_size, seed):
    ctx_lens = [data.draw(st.integers(0, 70)) for _ in block_lens]
    args = make_block_batch(block_lens, ctx_lens, *head, page_size, seed=seed)
    ref = draft_block_attention(*args, impl="torch")
    tri = draft_block_attention(*args, impl="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, **SETTINGS)
@given(lens=ragged_lens(12, 16), data=st.data(), ties=st.booleans(), with_temps=st.booleans(),
       with_biases=st.booleans(), seed=st.integers(0, 2**16))
def test_survival_and_scheduling_parity(lens, data, ties, with_temps, with_biases, seed):
    gen = torch.Generator().manual_seed(seed)
    n, gamma = sum(lens), max(max(lens), 1)
    logits = (torch.randint(-2, 3, (n,), generator=gen).float() if ties else 4 * torch.randn(n, generator=gen))
    logits[torch.rand(n, generator=gen) < 0.1] = -1e4  # confidences of exactly 0
    temps = 0.5 + torch.rand(gamma, generator=gen) if with_temps else None
    biases = 2 * torch.randn(gamma, generator=gen) if with_biases else None
    cu = cu_of(lens)
    ref = prefix_survival(logits, cu, temps, biases, impl="torch")
    tri = prefix_survival(logits, cu, temps, biases, impl="triton")
    torch.testing.assert_close(tri, ref, rtol=1e-6, atol=1e-7)
    sps = decreasing_sps(len(lens) + data.draw(st.integers(0, n + 4)), gen)
    assert torch.equal(select_verify_lengths_alg1(ref, cu, sps, impl="triton"),
                       select_verify_lengths_alg1(ref, cu, sps, impl="torch"))
    budget = data.draw(st.integers(0, n + 2))
    assert torch.equal(select_verify_lengths_topk(ref, cu, torch.tensor([budget]), impl="triton"),
                       select_verify_lengths_topk(ref, cu, budget, impl="torch"))
