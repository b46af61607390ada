"""rejection_sample: Triton (interpreted on CPU) vs reference parity, structural invariants, statistical losslessness
of the reference (the CPU path; parity carries it to Triton), the seeded-noise helper, and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import dspark_kernels.reference.rejection_sample as ref_module
from dspark_kernels.ops import rejection_sample
from dspark_kernels.ops.rejection_sample import rejection_noise

# ----------------------------------------------------------------------------------------------------------- helpers


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)


def make_batch(
    lens: list[int],
    v: int,
    *,
    temps: list[float] | None = None,
    with_draft_probs: bool = True,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    dtype: torch.dtype = torch.float32,
    scale: float = 2.0,
) -> dict:
    """A random ragged batch as keyword arguments of ``rejection_sample`` (drafts sampled from ``draft_probs``)."""
    r, n = len(lens), sum(lens)
    max_spec_len = max(lens, default=0)
    draft_probs = torch.softmax(torch.randn(n, v) * scale, dim=-1)
    ids = torch.multinomial(draft_probs, 1).squeeze(1) if n else torch.zeros(0, dtype=torch.int64)
    temps = temps if temps is not None else [1.0] * r
    return dict(
        draft_token_ids=ids,
        cu_num_draft_tokens=_cu(lens),
        draft_probs=draft_probs if with_draft_probs else None,
        target_logits=(torch.randn(n + r, v) * scale).to(dtype),
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64) if top_k is not None else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        accept_uniforms=torch.rand(n).clamp(1e-7, 1 - 1e-7),
        sample_uniforms=torch.rand(n + r).clamp(1e-7, 1 - 1e-7),
        max_spec_len=max_spec_len,
    )


def run_both(batch: dict) -> tuple:
    """Run both implementations with fresh counters; assert bit-equal outputs and counters; return the Triton one."""
    results = []
    for impl in ("triton", "torch"):
        s = batch["max_spec_len"]
        counters = {name: torch.zeros(s, dtype=torch.int64) for name in ("accept_counter", "draft_counter")}
        results.append((rejection_sample(**batch, **counters, impl=impl), counters))
    (tri, tri_c), (ref, ref_c) = results
    assert torch.equal(tri.output_token_ids, ref.output_token_ids)
    assert torch.equal(tri.num_accepted, ref.num_accepted)
    assert torch.equal(tri_c["accept_counter"], ref_c["accept_counter"])
    assert torch.equal(tri_c["draft_counter"], ref_c["draft_counter"])
    check_structure(batch, tri, tri_c)
    return tri


def check_structure(batch: dict, res, counters: dict | None = None) -> None:
    """-1 padding after the emitted tokens, emitted == num_accepted + 1, accepted tokens equal the drafts."""
    out, acc = res.output_token_ids, res.num_accepted.long()
    cu = batch["cu_num_draft_tokens"].long()
    lens = cu[1:] - cu[:-1]
    r, cols = out.shape
    assert res.num_accepted.dtype == torch.int32 and out.dtype == torch.int64
    assert bool((acc >= 0).all()) and bool((acc <= lens).all())
    pos = torch.arange(cols)
    emitted = pos[None, :] <= acc[:, None]
    assert bool((out[~emitted] == -1).all())
    assert bool((out[emitted] >= 0).all()) and bool((out[emitted] < batch["target_logits"].shape[1]).all())
    for i in range(r):
        k = int(acc[i])
        assert torch.equal(out[i, :k], batch["draft_token_ids"][cu[i] : cu[i] + k].long())
    if counters is not None:
        s = batch["max_spec_len"]
        assert torch.equal(counters["draft_counter"], (lens[:, None] > torch.arange(s)).sum(0))
        assert torch.equal(counters["accept_counter"], (acc[:, None] > torch.arange(s)).sum(0))


def one_hot_logits(ids: torch.Tensor, v: int) -> torch.Tensor:
    """Logits whose softmax is exactly one-hot at ``ids`` (finite: exp(-1e4) underflows to 0)."""
    return torch.where(torch.nn.functional.one_hot(ids, v).bool(), 0.0, -1e4)


# ----------------------------------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("v", [1023, 1024, 1025, 4095, 4096, 4097])
def test_parity_vocab_edges(v):
    batch = make_batch([3, 0, 2, 4, 1], v, temps=[1.0, 0.7, 0.0, 1.3, 1.0])
    run_both(batch)


@pytest.mark.parametrize("v", [151936, 151937])
def test_parity_large_vocab(v):
    run_both(make_batch([2, 1], v, temps=[1.0, 0.0], dtype=torch.bfloat16))


@pytest.mark.parametrize("lens", [[0, 0, 0], [0, 3, 0, 1]])
def test_parity_empty_drafts(lens):
    run_both(make_batch(lens, 257, temps=[1.0, 0.0, 0.8, 1.0][: len(lens)]))


def test_zero_max_spec_len_is_a_plain_sampler():
    batch = make_batch([0, 0], 100, temps=[0.0, 1.0])
    res = run_both(batch)
    assert res.output_token_ids.shape == (2, 1)
    assert int(res.output_token_ids[0, 0]) == int(batch["target_logits"][0].argmax())


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_all_accepted_with_one_hot_targets(with_draft_probs):
    lens, v = [3, 1, 2], 300
    batch = make_batch(lens, v, temps=[1.0, 0.0, 0.5], with_draft_probs=with_draft_probs)
    target_ids = torch.randint(0, v, (sum(lens) + len(lens),))
    cu = batch["cu_num_draft_tokens"]
    draft_rows = torch.arange(sum(lens)) + torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    batch["draft_token_ids"] = target_ids[draft_rows]
    batch["target_logits"] = one_hot_logits(target_ids, v)
    if with_draft_probs:
        batch["draft_probs"] = torch.nn.functional.one_hot(batch["draft_token_ids"], v).float()
    res = run_both(batch)
    assert torch.equal(res.num_accepted.long(), cu[1:] - cu[:-1])
    bonus_rows = cu[1:] + torch.arange(len(lens))
    emitted = torch.arange(4)[None, :] <= res.num_accepted[:, None].long()
    expected = torch.full_like(res.output_token_ids, -1)
    for i in range(len(lens)):
        expected[i, : lens[i] + 1] = target_ids[cu[i] + i : bonus_rows[i] + 1]
    assert torch.equal(res.output_token_ids[emitted], expected[emitted])


def test_one_hot_targets_output_equals_target_ids():
    lens, v = [4, 2, 0, 3], 64
    batch = make_batch(lens, v, temps=[1.0, 0.0, 1.0, 2.0])
    target_ids = torch.randint(0, v, (sum(lens) + len(lens),))
    batch["target_logits"] = one_hot_logits(target_ids, v)
    res = run_both(batch)
    cu = batch["cu_num_draft_tokens"]
    for i in range(len(lens)):
        k = int(res.num_accepted[i])
        assert torch.equal(res.output_token_ids[i, : k + 1], target_ids[cu[i] + i : cu[i] + i + k + 1])


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_disjoint_supports_reject_at_position_zero(with_draft_probs):
    lens, v = [3, 2, 4], 128
    n, r = sum(lens), len(lens)
    batch = make_batch(lens, v, with_draft_probs=with_draft_probs)
    half = torch.arange(v) < v // 2
    draft_probs = torch.softmax(torch.where(half, torch.randn(n, v), -1e4), dim=-1)
    batch["draft_token_ids"] = torch.multinomial(draft_probs, 1).squeeze(1)
    if with_draft_probs:
        batch["draft_probs"] = draft_probs
    batch["target_logits"] = torch.where(half, -1e4, torch.randn(n + r, v))
    res = run_both(batch)
    assert bool((res.num_accepted == 0).all())
    assert bool((res.output_token_ids[:, 0] >= v // 2).all())


def test_residual_fallback_when_residual_mass_vanishes():
    """draft_probs >= p_t everywhere (here 2 * p_t): rejections leave no residual, so the draw falls back to p_t."""
    lens, v = [3, 2, 4], 30
    batch = make_batch(lens, v, scale=1.0)
    draft_rows = torch.arange(sum(lens)) + torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    batch["draft_probs"] = 2 * torch.softmax(batch["target_logits"][draft_rows], dim=-1)
    batch["accept_uniforms"] = torch.full((sum(lens),), 0.75)  # u * 2 p_t(x) < p_t(x) fails: reject at 0
    res = run_both(batch)
    assert bool((res.num_accepted == 0).all())


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_parity_mixed_greedy_and_stochastic(with_draft_probs):
    lens = [5, 0, 3, 2, 1, 4, 2, 0]
    temps = [0.0, 1.0, 0.0, 0.5, 1.0, 2.0, 0.0, 0.9]
    # draft from the target itself often, so acceptance is high and later positions are exercised
    run_both(make_batch(lens, 40, temps=temps, with_draft_probs=with_draft_probs, scale=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_parity_top_k_top_p(dtype):
    lens = [2, 3, 0, 1, 2, 3]
    batch = make_batch(
        lens, 48, temps=[1.0, 0.7, 1.0, 0.0, 1.5, 1.0],
        top_k=[5, 0, 1, 3, 48, 10], top_p=[1.0, 0.8, 0.5, 0.9, 0.95, 0.3],
        dtype=dtype, scale=1.0,
    )
    run_both(batch)


def test_parity_top_k_ties_kept():
    lens, v = [1, 1], 33
    batch = make_batch(lens, v, top_k=[2, 3], top_p=[1.0, 0.6])
    logits = torch.zeros(4, v)
    logits[:, :5] = 1.0  # five-way tie at the top: top-k 2/3 keeps all five
    batch["target_logits"] = logits
    res = run_both(batch)
    last = res.output_token_ids.gather(1, res.num_accepted.long()[:, None])
    assert bool((last < 5).all())  # the top-5 tie survives top-k 2/3 and top-p 0.6 whole


def _ordered_key(x: torch.Tensor) -> torch.Tensor:
    """The kernels' ordered int64 key of float32 values (``_radix_select.ordered_key``), in torch."""
    b = x.view(torch.int32)
    signed = torch.where(b < 0, b ^ 0x7FFFFFFF, b).masked_fill(x == 0, 0)
    return signed.long() + 2**31


@pytest.mark.parametrize("block_v, chunk_v, candidates", [(16, 16, 0), (16, 32, 0), (8, 64, 0), (16, 16, 4),
                                                          (8, 64, 8), (16, 32, 16)])
def test_kernel_row_stats_match_reference_filters(block_v, chunk_v, candidates):
    """The row passes' statistics and cuts give the reference's filtered probabilities, row by row (vocab 40 over 1,
    2 and 3 chunks, so the chunk merges and the cross-chunk histograms are exercised). Without candidates every cut
    is a radix select; with them the rows they cover take their cuts from the candidates and the rest (k above the
    candidates, ties at the floor, wide top-p sets) still the radix select, so both paths are compared."""
    from dspark_kernels.ops.rejection_sample import target_row_stats
    from dspark_kernels.reference.rejection_sample import target_probs_ref

    rows, v = 12, 40
    logits = torch.randn(rows, v) * 2
    logits[3, :6] = 4.0  # ties at the top-k boundary
    logits[5, 20:26] = -1.5  # ties at the top-p boundary
    temp = torch.tensor([1.0, 0.5, 2.0] * 4)
    top_k = torch.tensor([0, 1, 3, 5, 6, 39, 40, 2, 0, 7, 0, 10])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.3, 0.99, 0.1, 1.0, 0.6, 0.8, 1e-6, 0.95])
    stats = target_row_stats(logits, torch.arange(rows, dtype=torch.int32), temp, top_k, top_p,
                             {"BLOCK_V": block_v, "CHUNK_V": chunk_v, "CANDIDATES": candidates, "num_warps": 4})
    scaled = logits / temp[:, None]
    e = torch.exp(scaled - stats.row_max[:, None])
    kept = (_ordered_key(scaled) >= stats.keep_key[:, None]) & (e.view(torch.int32).long() >= stats.keep_bits[:, None])
    probs = torch.where(kept, e / stats.row_z[:, None], 0.0)
    expected = target_probs_ref(logits, temp, top_k, top_p)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(stats.row_arg.long(), logits.argmax(dim=1))
    assert torch.equal(stats.row_max, scaled.amax(dim=1))
    by_cand = stats.by_candidates.bool()
    if candidates:
        assert 0 < int(by_cand.sum()) < rows, by_cand  # both paths ran
    else:
        assert not bool(by_cand.any())
    for i in range(rows):
        model = filtered_target(logits[i].numpy(), float(temp[i]), int(top_k[i]), float(top_p[i]))
        assert np.array_equal(model > 0, expected[i].numpy() > 0), i


def test_greedy_argmax_ties_take_lowest_index_across_tiles():
    v = 2100
    batch = make_batch([1], v, temps=[0.0])
    batch["target_logits"] = torch.zeros(2, v)
    batch["target_logits"][:, [2050, 5, 1500]] = 3.0
    batch["draft_token_ids"] = torch.tensor([2050])
    res = run_both(batch)
    assert res.output_token_ids.tolist() == [[5, -1]]


def test_counters_accumulate_in_place():
    batch = make_batch([2, 3, 1], 50, temps=[0.0, 1.0, 1.0])
    acc = torch.zeros(3, dtype=torch.int64)
    drafts = torch.zeros(3, dtype=torch.int64)
    for _ in range(2):
        res = rejection_sample(**batch, accept_counter=acc, draft_counter=drafts, impl="triton")
    assert drafts.tolist() == [6, 4, 2]
    assert torch.equal(acc, 2 * (res.num_accepted[:, None].long() > torch.arange(3)).sum(0))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_inputs_unchanged(impl):
    batch = make_batch([2, 0, 3], 70, temps=[1.0, 0.0, 0.8], top_k=[3, 0, 5], top_p=[0.9, 1.0, 0.7])
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    rejection_sample(**batch, impl=impl)
    for k, v in batch.items():
        assert (torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]), k


def test_greedy_needs_no_uniforms_and_matches_argmax():
    lens, v = [3, 1, 0, 2], 200
    batch = make_batch(lens, v, temps=[0.0] * 4)
    batch["accept_uniforms"] = batch["sample_uniforms"] = None
    tri = run_both(batch)
    cu = batch["cu_num_draft_tokens"]
    argmax = batch["target_logits"].argmax(dim=1)
    for i in range(len(lens)):
        k = int(tri.num_accepted[i])
        assert torch.equal(tri.output_token_ids[i, : k + 1], argmax[cu[i] + i : cu[i] + i + k + 1])


# ------------------------------------------------------------------------------------------------- losslessness


def filtered_target(logits: np.ndarray, t: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Independent float64 model of the target filters: temperature, top-k (ties kept), softmax, top-p, renormalise."""
    scaled = logits.astype(np.float64) / t
    if 0 < top_k < scaled.size:
        scaled = np.where(scaled >= np.sort(scaled)[::-1][top_k - 1], scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    if top_p < 1:
        desc = np.sort(p)[::-1]
        cut = min(int(np.searchsorted(np.cumsum(desc), top_p)), p.size - 1)
        p = np.where(p >= desc[cut], p, 0.0)  # ties with the last needed token are kept
        p /= p.sum()
    return p


def chi_square_p(tokens: torch.Tensor, expected: np.ndarray) -> float:
    """p-value of ``tokens`` against ``expected``; tokens in zero-probability categories fail outright."""
    counts = np.bincount(tokens.numpy(), minlength=expected.size).astype(np.float64)
    support = expected > 0
    if counts[~support].sum() > 0:
        return 0.0
    return float(stats.chisquare(counts[support], expected[support] * counts.sum()).pvalue)


def big_fixed_batch(
    r: int, gamma: int, p_t_logits: torch.Tensor, p_d: torch.Tensor | None, t: float, top_k: int = 0, top_p: float = 1.0
) -> dict:
    """``r`` requests sharing per-position target logits ``[gamma + 1, V]`` and draft distributions ``[gamma, V]``;
    every request drafts ``gamma`` tokens, each position sampled independently from its ``p_d``."""
    v = p_t_logits.shape[1]
    if p_d is None:
        ids = torch.randint(0, v, (r, gamma))
    else:
        ids = torch.stack([torch.multinomial(p_d[j], r, replacement=True) for j in range(gamma)], dim=1)
    return dict(
        draft_token_ids=ids.reshape(-1),
        cu_num_draft_tokens=torch.arange(r + 1, dtype=torch.int64) * gamma,
        draft_probs=p_d.repeat(r, 1) if p_d is not None else None,
        target_logits=p_t_logits.repeat(r, 1),
        temperature=torch.full((r,), t),
        top_k=torch.full((r,), top_k, dtype=torch.int64) if top_k else None,
        top_p=torch.full((r,), top_p) if top_p < 1 else None,
        accept_uniforms=torch.rand(r * gamma).clamp(1e-7, 1 - 1e-7),
        sample_uniforms=torch.rand(r * (gamma + 1)).clamp(1e-7, 1 - 1e-7),
        max_spec_len=gamma,
    )


def position_p_values(batch: dict, res, p_t_logits: torch.Tensor, t: float, top_k: int, top_p: float) -> list[float]:
    """Chi-square p-value per position j, over the requests where position j is emitted."""
    out = []
    for j in range(p_t_logits.shape[0]):
        tokens = res.output_token_ids[:, j][res.num_accepted.long() >= j]
        assert tokens.numel() > 10_000, f"position {j} emitted too rarely for the test ({tokens.numel()})"
        out.append(chi_square_p(tokens, filtered_target(p_t_logits[j].numpy(), t, top_k, top_p)))
    return out


def random_dists(gamma: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position target logits ``[gamma + 1, V]`` and draft probabilities ``[gamma, V]``."""
    p_t_logits = torch.randn(gamma + 1, v) * 1.5
    p_d = torch.softmax(torch.randn(gamma, v) * 1.5, dim=-1)
    return p_t_logits, p_d


@pytest.mark.parametrize(
    "t, top_k, top_p",
    [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.8, 4, 0.8)],
)
def test_lossless_emitted_tokens_follow_target(t, top_k, top_p):
    gamma, v, r = 3, 6, 1_000_000
    p_t_logits, p_d = random_dists(gamma, v)
    batch = big_fixed_batch(r, gamma, p_t_logits, p_d, t, top_k, top_p)
    res = rejection_sample(**batch, impl="torch", check_inputs=False)
    p_values = position_p_values(batch, res, p_t_logits, t, top_k, top_p)
    assert min(p_values) > 1e-3, p_values


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_lossless_residual_path(with_draft_probs):
    """Draft mass sits where the target's is small, so most requests reject at position 0 and use the residual."""
    gamma, v, r = 1, 8, 1_000_000
    p_t_logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -1.0, -2.0, -3.0]] * 2)
    p_d = torch.softmax(torch.tensor([[-3.0, -2.0, -1.0, 0.5, 2.0, 2.5, 3.0, 1.0]]), dim=-1)
    batch = big_fixed_batch(r, gamma, p_t_logits, p_d if with_draft_probs else None, 1.0)
    if not with_draft_probs:  # one-hot drafts of the low-target tokens only
        batch["draft_token_ids"] = torch.randint(4, v, (r,))
    res = rejection_sample(**batch, impl="torch", check_inputs=False)
    assert float((res.num_accepted == 0).float().mean()) > 0.5
    if with_draft_probs:
        p_values = position_p_values(batch, res, p_t_logits, 1.0, 0, 1.0)
        assert min(p_values) > 1e-3, p_values
    else:  # drafts not drawn from a distribution: check the residual law directly, per draft token
        p_t = filtered_target(p_t_logits[0].numpy(), 1.0)
        rejected = res.num_accepted == 0
        for x in range(4, v):
            tokens = res.output_token_ids[:, 0][rejected & (batch["draft_token_ids"] == x)]
            resid = p_t.copy()
            resid[x] = 0.0
            assert chi_square_p(tokens, resid / resid.sum()) > 1e-3


def test_chi_square_catches_a_wrong_residual(monkeypatch):
    """Mutation check: sampling the correction from p_t instead of the residual must fail the losslessness test."""
    gamma, r = 1, 400_000
    p_t_logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -1.0, -2.0, -3.0]] * 2)
    p_d = torch.softmax(torch.tensor([[-3.0, -2.0, -1.0, 0.5, 2.0, 2.5, 3.0, 1.0]]), dim=-1)
    batch = big_fixed_batch(r, gamma, p_t_logits, p_d, 1.0)

    def wrong_weights(probs, draft_probs, x, rejected, final_row, rej_draft):
        return probs[final_row]

    monkeypatch.setattr(ref_module, "_correction_weights", wrong_weights)
    res = rejection_sample(**batch, impl="torch", check_inputs=False)
    assert position_p_values(batch, res, p_t_logits, 1.0, 0, 1.0)[0] < 1e-6


def test_residual_mean_within_six_standard_errors():
    """A residual spread over many indices: the mean emitted index matches the analytic target mean."""
    gamma, v, r = 1, 256, 50_000
    idx = torch.arange(v, dtype=torch.float32)
    p_t_logits = torch.stack([-((idx - 160) / 40) ** 2] * 2)
    p_d = torch.softmax(-((idx - 90) / 30) ** 2, dim=0)[None]
    batch = big_fixed_batch(r, gamma, p_t_logits, p_d, 1.0)
    res = rejection_sample(**batch, impl="torch", check_inputs=False)
    assert float((res.num_accepted == 0).float().mean()) > 0.3
    p_t = filtered_target(p_t_logits[0].numpy(), 1.0)
    mean = float((p_t * np.arange(v)).sum())
    sd = float(np.sqrt((p_t * (np.arange(v) - mean) ** 2).sum()))
    tokens = res.output_token_ids[:, 0].double()
    assert abs(float(tokens.mean()) - mean) < 6 * sd / np.sqrt(r)


def test_greedy_equals_target_argmax_at_scale():
    gamma, v, r = 3, 6, 200_000
    p_t_logits, p_d = random_dists(gamma, v)
    batch = big_fixed_batch(r, gamma, p_t_logits, p_d, 0.0)
    batch["accept_uniforms"] = batch["sample_uniforms"] = None
    res = rejection_sample(**batch, impl="torch", check_inputs=False)
    argmax = p_t_logits.argmax(dim=1)
    for j in range(gamma + 1):
        emitted = res.num_accepted.long() >= j
        assert bool((res.output_token_ids[emitted, j] == argmax[j]).all())
    expected_acc = (batch["draft_token_ids"].reshape(r, gamma) == argmax[:gamma]).long().cumprod(1).sum(1)
    assert torch.equal(res.num_accepted.long(), expected_acc)


# ---------------------------------------------------------------------------------------------------- seeded noise


def test_rejection_noise_reproducible():
    lens = [3, 0, 2]
    cu, n = _cu(lens), sum(lens)
    seeds, offsets = torch.tensor([11, 12, 13]), torch.tensor([0, 5, 7])
    a1, s1 = rejection_noise(seeds, offsets, cu, n, max_spec_len=4)
    a2, s2 = rejection_noise(seeds, offsets, cu, n, max_spec_len=4)
    assert a1.shape == (n,) and s1.shape == (n + len(lens),)
    assert torch.equal(a1, a2) and torch.equal(s1, s2)
    assert bool(((a1 > 0) & (a1 < 1)).all()) and bool(((s1 > 0) & (s1 < 1)).all())
    a3, s3 = rejection_noise(seeds, offsets + 1, cu, n, max_spec_len=4)
    assert not torch.equal(a1, a3) and not torch.equal(s1, s3)
    # a request's numbers depend only on its own seed/offset, not on its neighbours
    a4, s4 = rejection_noise(seeds[:1], offsets[:1], _cu(lens[:1]), 3, max_spec_len=4)
    assert torch.equal(a4, a1[:3]) and torch.equal(s4, s1[:4])

    batch = make_batch(lens, 30)
    batch["accept_uniforms"], batch["sample_uniforms"] = a1, s1
    first = rejection_sample(**batch, impl="torch")
    again = rejection_sample(**batch, impl="torch")
    assert torch.equal(first.output_token_ids, again.output_token_ids)


# ------------------------------------------------------------------------------------------------------- bad input


def _nan_row(key, row, value):
    return _set(key, lambda b: b[key].index_fill(0, torch.tensor([row]), value))


def _set(key, value):
    return lambda b: b.__setitem__(key, value(b) if callable(value) else value)


BAD_INPUTS = [
    ("draft_token_ids", _set("draft_token_ids", lambda b: b["draft_token_ids"].float())),
    ("draft_token_ids", _set("draft_token_ids", lambda b: b["draft_token_ids"][None])),
    ("draft_token_ids", _set("draft_token_ids", lambda b: torch.full_like(b["draft_token_ids"], 20))),
    ("draft_token_ids", _set("draft_token_ids", lambda b: torch.full_like(b["draft_token_ids"], -1))),
    ("cu_num_draft_tokens", _set("cu_num_draft_tokens", torch.tensor([0, 3, 2, 5]))),
    ("cu_num_draft_tokens", _set("cu_num_draft_tokens", torch.tensor([0, 1, 5]))),
    ("max_spec_len", _set("max_spec_len", 2)),
    ("max_spec_len", _set("max_spec_len", -1)),
    ("target_logits", _set("target_logits", lambda b: b["target_logits"][:-1])),
    ("target_logits", _set("target_logits", lambda b: b["target_logits"].double())),
    ("target_logits", _nan_row("target_logits", 1, float("nan"))),
    ("target_logits", _nan_row("target_logits", 0, float("inf"))),
    ("draft_probs", _set("draft_probs", lambda b: b["draft_probs"][:, :-1])),
    ("draft_probs", _set("draft_probs", lambda b: b["draft_probs"][:-1])),
    ("draft_probs", _set("draft_probs", lambda b: b["draft_probs"].half())),
    ("draft_probs", _nan_row("draft_probs", 0, float("nan"))),
    ("draft_probs", _set("draft_probs", lambda b: -b["draft_probs"])),
    ("temperature", _set("temperature", torch.tensor([1.0, -0.5, 1.0]))),
    ("temperature", _set("temperature", torch.tensor([1.0, float("inf"), 1.0]))),
    ("temperature", _set("temperature", torch.tensor([1.0, 1.0]))),
    ("temperature", _set("temperature", torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))),
    ("temperature 1e-38 is too small for target_logits row 3", _set("temperature", torch.tensor([1.0, 1e-38, 1.0]))),
    ("top_k", _set("top_k", torch.tensor([1, -1, 0]))),
    ("top_k", _set("top_k", torch.tensor([1.0, 1.0, 0.0]))),
    ("top_k", _set("top_k", torch.tensor([1, 2]))),
    ("top_p", _set("top_p", torch.tensor([0.5, 0.0, 1.0]))),
    ("top_p", _set("top_p", torch.tensor([0.5, 1.5, 1.0]))),
    ("top_p", _set("top_p", torch.tensor([0.5, 1.0]))),
    ("accept_uniforms", _set("accept_uniforms", None)),
    ("accept_uniforms", _set("accept_uniforms", lambda b: torch.zeros_like(b["accept_uniforms"]))),
    ("accept_uniforms", _set("accept_uniforms", lambda b: b["accept_uniforms"][:-1])),
    ("sample_uniforms", _set("sample_uniforms", None)),
    ("sample_uniforms", _set("sample_uniforms", lambda b: torch.ones_like(b["sample_uniforms"]))),
    ("sample_uniforms", _set("sample_uniforms", lambda b: b["sample_uniforms"].double())),
    ("accept_counter", _set("accept_counter", torch.zeros(2, dtype=torch.int64))),
    ("accept_counter", _set("accept_counter", torch.zeros(3, dtype=torch.int32))),
    ("draft_counter", _set("draft_counter", torch.zeros(4, dtype=torch.int64))),
    ("draft_counter", _set("draft_counter", torch.zeros(6, dtype=torch.int64)[::2])),
]


@pytest.mark.parametrize("name, mutate", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input(name, mutate):
    batch = make_batch([2, 0, 3], 20, top_k=[0, 1, 2], top_p=[1.0, 0.5, 0.9])
    batch["accept_counter"] = torch.zeros(3, dtype=torch.int64)
    batch["draft_counter"] = torch.zeros(3, dtype=torch.int64)
    mutate(batch)
    with pytest.raises((ValueError, TypeError), match=name):
        rejection_sample(**batch, impl="torch")


def test_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        rejection_sample(**make_batch([1], 10), impl="cuda")


def test_greedy_host_scan_equals_the_tensor_path(monkeypatch):
    """The CPU's host scan for small all-greedy batches against the vectorised path, bit for bit: ragged and empty
    drafts, no requests, argmax ties (integer logits), long accepted runs (few distinct tokens), both counters."""
    g = torch.Generator().manual_seed(11)
    host_rows = ref_module.HOST_ROWS
    for case in range(300):
        r = int(torch.randint(0, 6, (), generator=g))
        s = int(torch.randint(1, 8, (), generator=g))
        v = int(torch.randint(1, 5, (), generator=g)) if case % 2 else 50
        lens = torch.randint(0, s + 1, (r,), generator=g)
        n = int(lens.sum())
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        logits = torch.randint(0, 3, (n + r, v), generator=g).float()
        drafts = torch.randint(0, v, (n,), generator=g)
        out = {}
        for rows in (host_rows, 0):  # the host scan, then the tensor path
            monkeypatch.setattr(ref_module, "HOST_ROWS", rows)
            acc, dft = torch.full((s,), 5, dtype=torch.int64), torch.zeros(s, dtype=torch.int64)
            res = rejection_sample(drafts, cu, None, logits, torch.zeros(r), None, None, None, None, max_spec_len=s,
                                   accept_counter=acc, draft_counter=dft, impl="torch")
            out[rows] = (res.output_token_ids, res.num_accepted, acc, dft)
        for host, tensor in zip(*out.values()):
            assert host.dtype == tensor.dtype and torch.equal(host, tensor), case
