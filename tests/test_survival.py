"""Prefix survival, Algorithm 1, top-K and the production capacity: Triton (interpreted) vs reference, brute force,
hand-worked cases, the Appendix A losslessness counterexample, SPS profiles and bad inputs."""

import itertools
import json

import pytest
import torch
from scipy.stats import chisquare

from dspark_kernels.engine.sps import (
    SPSProfile,
    analytic_roofline,
    load_profile,
    profile_path,
    profile_target,
    read_profile,
)
from dspark_kernels.ops import (
    capacity_unconstrained,
    prefix_survival,
    rejection_sample,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
)
from dspark_kernels.reference.survival import (
    alg1_host,
    alg1_vectorised,
    candidate_order,
    prefix_survival_ragged,
    prefix_survival_ref,
    sps_runs,
    theta_path,
)

IMPLS = ["torch", "triton"]


def cu_of(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)


def table(values, unused=1.0) -> torch.Tensor:
    """sps_table with SPS(B) = values[B - 1] (entry 0 unused)."""
    return torch.tensor([unused, *values], dtype=torch.float32)


def survival_of(rows) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([a for row in rows for a in row], dtype=torch.float32), cu_of([len(row) for row in rows])


def decreasing_sps(bmax: int, gen: torch.Generator) -> torch.Tensor:
    """A random steps/s curve: a flat memory-bound part, then t(B) growing like B^p (p in [1, 2])."""
    b = torch.arange(bmax + 1, dtype=torch.float64)
    knee = float(torch.randint(1, bmax + 1, (1,), generator=gen))
    p = 1.0 + float(torch.rand(1, generator=gen))
    slope = 0.02 + 0.3 * float(torch.rand(1, generator=gen))
    t = 1.0 + slope * (b.clamp(min=knee) - knee + 1).pow(p)
    return (1.0 / t).float()


def stair_sps(bmax: int, tile: int, jump: float = 0.4, slope: float = 0.01) -> torch.Tensor:
    """A staircase steps/s curve, ``1 / SPS(B) = 1 + slope B + jump floor((B - 1) / tile)``: a GEMM's row tiles."""
    b = torch.arange(bmax + 1, dtype=torch.float64).clamp(min=1)
    return (1.0 / (1.0 + slope * b + jump * torch.div(b - 1, tile, rounding_mode="floor"))).float()


def flat_runs_sps(bmax: int, gen: torch.Generator, rising: bool = False) -> torch.Tensor:
    """A non-increasing steps/s curve of flat runs of random widths (a fitted profile pools its noise into runs);
    ``rising``: the same runs in random order (a raw measured table may rise)."""
    levels = torch.randint(1, max(2, bmax // 3), (bmax + 1,), generator=gen).sort(descending=True).values
    if rising:
        runs = torch.unique_consecutive(levels, return_counts=True)
        order = torch.randperm(runs[0].numel(), generator=gen)
        levels = runs[0][order].repeat_interleave(runs[1][order])
    return (levels.double() / 7.0).float()


def random_batch(r: int, gamma: int, gen: torch.Generator, quantized: bool):
    """Random ragged confidence logits (some empty requests, some zero confidences, ties when quantized)."""
    lens = torch.randint(0, gamma + 1, (r,), generator=gen)
    lens[0] = gamma
    n = int(lens.sum())
    if quantized:
        logits = torch.randint(-2, 4, (n,), generator=gen).float()  # many equal logits -> ties
    else:
        logits = 3 * torch.randn(n, generator=gen)
    logits[torch.rand(n, generator=gen) < 0.05] = -1e4  # sigmoid underflows to exactly 0
    temps = 0.5 + torch.rand(gamma, generator=gen)
    return logits, cu_of(lens.tolist()), temps


def random_survivals(max_requests: int, gen: torch.Generator, quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated survivals ``a`` and offsets ``cu`` of :func:`random_batch` with 1..max_requests requests of up to
    7 slots."""
    logits, cu, temps = random_batch(int(torch.randint(1, max_requests + 1, (1,), generator=gen)), 7, gen, quantized)
    return prefix_survival(logits, cu, temps, impl="torch"), cu


# ------------------------------------------------------------------------------------------- Triton vs reference
CONFIGS = [(1, 1), (1, 16), (3, 1), (5, 4), (16, 7), (64, 16)]


def check_kernels_match_reference(r: int, gamma: int, quantized: bool, device: torch.device) -> None:
    """The survival and scheduling kernels on ``device`` (their inputs moved there, the outputs read back) against the
    reference on the CPU, on one random batch; the schedulers of both sides read the reference's survivals."""
    gen = torch.Generator().manual_seed(1000 * r + gamma + quantized)
    logits, cu, temps = random_batch(r, gamma, gen, quantized)
    biases = torch.randn(gamma, generator=gen)
    cu_dev = cu.to(device)
    on = lambda x: None if x is None else x.to(device)  # noqa: E731
    for t, b in ((temps, biases), (None, biases), (temps, None), (None, None)):
        ref = prefix_survival(logits, cu, t, b, impl="torch")
        tri = prefix_survival(logits.to(device), cu_dev, on(t), on(b), impl="triton").cpu()
        torch.testing.assert_close(tri, ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(tri == 0, ref == 0)
    a = ref.to(device)
    n = logits.numel()
    for bmax in (r, r + n // 3, r + n + 5):  # tables ending at B = R, mid-path, and past every candidate
        sps = decreasing_sps(bmax, gen)
        tile = max(1, (bmax - r) // 3 + 1)
        stairs, steps = stair_sps(bmax, tile), stair_sps(bmax, tile, slope=0.0)
        runs = flat_runs_sps(bmax, gen)
        for table_, lookahead in ((sps, 1), (sps, n + 2), (stairs, 1), (stairs, 3), (stairs, n + 2), (steps, 2),
                                  (steps, n + 2), (runs, 4), (runs, n + 2)):
            lens_ref = select_verify_lengths_alg1(ref, cu, table_, lookahead=lookahead, impl="torch")
            lens_tri = select_verify_lengths_alg1(a, cu_dev, table_.to(device), lookahead=lookahead, impl="triton")
            assert torch.equal(lens_tri.cpu(), lens_ref), lookahead
            assert bool((lens_ref <= cu[1:] - cu[:-1]).all()) and int(lens_ref.sum()) <= bmax - r
        k_ref = capacity_unconstrained(ref, cu, sps, impl="torch")
        assert torch.equal(capacity_unconstrained(a, cu_dev, sps.to(device), impl="triton").cpu(), k_ref)
    for k in (0, 1, n // 2, n + 3):
        lens_ref = select_verify_lengths_topk(ref, cu, k, impl="torch")
        assert torch.equal(select_verify_lengths_topk(a, cu_dev, torch.tensor([k], device=device), impl="triton").cpu(),
                           lens_ref)
        assert int(lens_ref.sum()) == min(k, int((ref > 0).sum()))


@pytest.mark.parametrize("quantized", [False, True], ids=["continuous", "ties"])
@pytest.mark.parametrize("r,gamma", CONFIGS)
def test_triton_matches_reference(r, gamma, quantized):
    check_kernels_match_reference(r, gamma, quantized, torch.device("cpu"))


@pytest.mark.parametrize("impl", IMPLS)
def test_survival_never_rises_within_a_request(impl):
    """Confidences near 1 (logits 2..18) make long runs of products that differ in the last bits: each request's
    survival must still be non-increasing (the ops' own validation and Algorithm 1's candidate order rely on it)."""
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 17, (400,), generator=gen)
    cu = cu_of(lens.tolist())
    a = prefix_survival(2 + 16 * torch.rand(int(lens.sum()), generator=gen), cu, impl=impl)
    req = torch.repeat_interleave(torch.arange(len(lens)), lens)
    assert not bool(((req[1:] == req[:-1]) & (a[1:] > a[:-1])).any())
    select_verify_lengths_alg1(a, cu, decreasing_sps(len(lens) + 8, gen), impl=impl)  # validation passes


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_sps_table_is_used_at_full_precision(impl):
    """SPS(2) = 1 - 2^-29 in float64 makes admitting a survival of 2^-30 lose (Theta 1 - 2^-30 < 1); rounded to
    float32 it would read 1.0 and admit the slot."""
    a = torch.tensor([2.0**-30])
    sps = torch.tensor([1.0, 1.0, 1.0 - 2.0**-29], dtype=torch.float64)
    assert select_verify_lengths_alg1(a, cu_of([1]), sps, impl=impl).tolist() == [0]
    assert capacity_unconstrained(a, cu_of([1]), sps, impl=impl).tolist() == [0]


def test_triton_matches_reference_exact_ties():
    # c in {0, 0.5, 1}: survival values are powers of two, tied across requests and inside a request (c = 1)
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(0, 9, (48,), generator=gen)
    cu = cu_of(lens.tolist())
    c = torch.tensor([0.0, 0.5, 1.0, 1.0])[torch.randint(0, 4, (int(lens.sum()),), generator=gen)]
    a = prefix_survival(torch.logit(c.double()).float().clamp(-1e4, 1e4), cu, impl="torch")
    assert bool((a == 1.0).any()) and bool((a == 0.0).any())
    for bmax in (48, 80, 48 * 9):
        sps = decreasing_sps(bmax, gen)
        lens_ref = select_verify_lengths_alg1(a, cu, sps, impl="torch")
        assert torch.equal(select_verify_lengths_alg1(a, cu, sps, impl="triton"), lens_ref)
        assert torch.equal(capacity_unconstrained(a, cu, sps, impl="triton"), capacity_unconstrained(a, cu, sps))
    for k in (1, 7, 30, 500):
        assert torch.equal(select_verify_lengths_topk(a, cu, k, impl="triton"), select_verify_lengths_topk(a, cu, k))


@pytest.mark.parametrize("impl", IMPLS)
def test_survival_values_and_temperatures(impl):
    # request 0: logits (0, ln 3) at T = (1, 0.5) -> c = (1/2, sigmoid(2 ln 3) = 9/10) -> a = (0.5, 0.45)
    # request 1: empty; request 2: logit -1e4 -> c = 0 exactly
    logits = torch.tensor([0.0, float(torch.tensor(3.0).log()), -1e4])
    a = prefix_survival(logits, cu_of([2, 0, 1]), torch.tensor([1.0, 0.5]), impl=impl)
    torch.testing.assert_close(a, torch.tensor([0.5, 0.45, 0.0]))
    assert a[2] == 0
    # biases (ln 3, -ln 9) after the temperatures: c = (sigmoid(ln 3) = 3/4, sigmoid(2 ln 3 - ln 9) = 1/2)
    ln3 = float(torch.tensor(3.0).log())
    a = prefix_survival(logits, cu_of([2, 0, 1]), torch.tensor([1.0, 0.5]), torch.tensor([ln3, -2 * ln3]), impl=impl)
    torch.testing.assert_close(a, torch.tensor([0.75, 0.375, 0.0]))
    a = prefix_survival(logits, cu_of([2, 0, 1]), None, torch.tensor([ln3, 0.0]), impl=impl)  # biases alone
    torch.testing.assert_close(a, torch.tensor([0.75, 0.75 * 0.75, 0.0]))


@pytest.mark.parametrize("r, width", [(1, 7), (16, 3), (5, 1), (64, 16)])
@pytest.mark.parametrize("temps", [False, True])
@pytest.mark.parametrize("biases", [False, True])
def test_uniform_blocks_take_the_dense_path_bit_for_bit(r, width, temps, biases):
    gen = torch.Generator().manual_seed(r * width)
    logits = torch.randn(r * width, generator=gen) * 3
    t = torch.rand(width + 1, generator=gen) + 0.5 if temps else None
    b = torch.randn(width + 1, generator=gen) if biases else None
    cu = cu_of([width] * r)
    assert torch.equal(prefix_survival_ref(logits, cu, t, b), prefix_survival_ragged(logits, cu, t, b))
    ragged = cu_of([width] * (r - 1) + [width + 1]) if r > 1 else None  # not uniform: the tensor path
    if ragged is not None:
        more = torch.cat([logits, torch.zeros(1)])
        assert torch.equal(prefix_survival_ref(more, ragged, t, b), prefix_survival_ragged(more, ragged, t, b))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_requests_and_no_slots(impl):
    empty = torch.zeros(0)
    assert prefix_survival(empty, cu_of([]), impl=impl).numel() == 0
    assert select_verify_lengths_alg1(empty, cu_of([]), table([1.0]), impl=impl).numel() == 0
    lens = select_verify_lengths_alg1(empty, cu_of([0, 0]), table([1.0, 1.0]), impl=impl)
    assert lens.tolist() == [0, 0] and lens.dtype == torch.int32
    assert select_verify_lengths_topk(empty, cu_of([0, 0]), 5, impl=impl).tolist() == [0, 0]


# ------------------------------------------------------------------------------------------- hand-worked cases
@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked_tie_break_and_stop(impl):
    # r0: a = (0.5, 0.25), r1: a = (0.5). Order: (r0, j1) and (r1, j1) tie at 0.5 -> lower j, then lower r: r0 first;
    # then (r0, j2). SPS(2..5) = 1.0, 0.9, 0.625, 0.5.
    # Theta0 = 2 * 1.0 = 2.0; admit (r0,1): B=3, tau=2.5, 2.5*0.9 = 2.25 > 2.0 keep;
    # admit (r1,1): B=4, tau=3.0, 3.0*0.625 = 1.875 <= 2.25 stop -> l = (1, 0).
    a, cu = survival_of([[0.5, 0.25], [0.5]])
    assert select_verify_lengths_alg1(a, cu, table([1.0, 1.0, 0.9, 0.625, 0.5]), impl=impl).tolist() == [1, 0]
    # with SPS(4) = 0.8: 3.0*0.8 = 2.4 > 2.25 keep; admit (r0,2): B=5, tau=3.25, 3.25*0.5 = 1.625 stop -> (1, 1).
    assert select_verify_lengths_alg1(a, cu, table([1.0, 1.0, 0.9, 0.8, 0.5]), impl=impl).tolist() == [1, 1]
    # top-2 of the same order admits (r0,1), (r1,1)
    assert select_verify_lengths_topk(a, cu, 2, impl=impl).tolist() == [1, 1]
    assert select_verify_lengths_topk(a, cu, 1, impl=impl).tolist() == [1, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked_early_stop_vs_capacity(impl):
    # App. A numbers, R = 1, a = (0.8, 0.72), SPS(1, 2, 3) = 1.0, 0.5, 0.45:
    # Theta0 = 1.0; Theta1 = 1.8 * 0.5 = 0.9 <= 1.0 -> Algorithm 1 stops at l = 0;
    # Theta2 = 2.52 * 0.45 = 1.134 is the global maximum -> capacity K = 2.
    a, cu = survival_of([[0.8, 0.72]])
    sps = table([1.0, 0.5, 0.45])
    assert select_verify_lengths_alg1(a, cu, sps, impl=impl).tolist() == [0]
    assert capacity_unconstrained(a, cu, sps, impl=impl).tolist() == [2]


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked_table_end_ties_and_zeros(impl):
    flat = table([1.0] * 8)  # memory-bound: every a > 0 improves Theta
    # Bmax = 3, R = 2: Theta0 = 2; (r0,1): B=3, 2.9 > 2 keep; next B=4 is past the table -> stop.
    a, cu = survival_of([[0.9], [0.9]])
    assert select_verify_lengths_alg1(a, cu, table([1.0, 1.0, 1.0]), impl=impl).tolist() == [1, 0]
    # equal survival inside a request keeps prefix order; flat SPS admits all of it
    a, cu = survival_of([[0.5, 0.5, 0.5], [0.5]])
    assert select_verify_lengths_alg1(a, cu, flat, impl=impl).tolist() == [3, 1]
    # order (r0,1), (r1,1), (r0,2), (r0,3): top-3 -> (2, 1)
    assert select_verify_lengths_topk(a, cu, 3, impl=impl).tolist() == [2, 1]
    # zero survival is never admitted, by either rule, even with budget to spare
    a, cu = survival_of([[0.5, 0.0, 0.0], [0.0], []])
    assert select_verify_lengths_alg1(a, cu, flat, impl=impl).tolist() == [1, 0, 0]
    assert select_verify_lengths_topk(a, cu, 10, impl=impl).tolist() == [1, 0, 0]
    assert capacity_unconstrained(a, cu, flat, impl=impl).tolist() == [1]


# ------------------------------------------------------------------------------------------------- brute force
def theta_of(lens, rows, sps) -> float | None:
    b = len(rows) + sum(lens)
    if b >= sps.numel():
        return None
    tau = len(rows) + sum(sum(row[:n]) for row, n in zip(rows, lens))
    return tau * float(sps[b])


def test_alg1_equals_brute_force_when_unimodal():
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for _ in range(150):
        r = int(torch.randint(1, 4, (1,), generator=gen))
        gamma = int(torch.randint(1, 4, (1,), generator=gen))
        rows = [torch.rand(gamma, generator=gen).clamp(min=0.05).cumprod(0).tolist() for _ in range(r)]
        a, cu = survival_of(rows)
        rows = [[float(x) for x in a[cu[i]:cu[i + 1]]] for i in range(r)]  # the float32 values the op sees
        sps = decreasing_sps(r * (gamma + 1) + int(torch.randint(-r, 2, (1,), generator=gen)), gen)
        path = theta_path(candidate_order(a, cu)[0], r, sps)
        stop = int((path[1:] > path[:-1]).long().cumprod(0).sum())
        if stop + 1 < path.numel() and float(path[stop + 1:].max()) > float(path[stop]):
            continue  # Theta is not unimodal along the greedy path: Algorithm 1 may stop early by design
        best = max(t for lens in itertools.product(range(gamma + 1), repeat=r) if (t := theta_of(lens, rows, sps)))
        for impl in IMPLS:
            lens = select_verify_lengths_alg1(a, cu, sps, impl=impl).tolist()
            assert theta_of(lens, rows, sps) == pytest.approx(best, rel=1e-9)
        checked += 1
    assert checked >= 50


# ------------------------------------------------------------------------------------------------- Appendix A
P_TARGET = torch.tensor([0.7, 0.3], dtype=torch.float64)  # tokens A = 0, B = 1
P_DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float64)
SPS_APP_A = table([1.0, 0.5, 0.45])


def live_survival(x1: int) -> torch.Tensor:
    """a1 = 0.8 for any draft; c2 = 0.9 after x1 = A, 0 after x1 = B."""
    return torch.tensor([0.8, 0.8 * (0.9 if x1 == 0 else 0.0)], dtype=torch.float32)


def first_token(x1: torch.Tensor, verify_len: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """First emitted token of each sample, through the library's verification op (:func:`rejection_sample`).

    l = 0: the target is sampled; l >= 1: x1 is verified against the draft distribution (accepted with probability
    min(1, p/q), else the residual normalize(max(0, p - q)) is sampled). Drafts after x1 do not change the first
    token, so each sample verifies x1 alone when its length is >= 1."""
    n = x1.numel()
    verified = (verify_len >= 1).long()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), verified.cumsum(0)]).to(torch.int32)
    drafts = x1[verified.bool()]
    rows = n + drafts.numel()  # (verified + 1) target rows per sample
    logits = P_TARGET.log().float().expand(rows, 2).contiguous()
    res = rejection_sample(drafts, cu, P_DRAFT.float().expand(drafts.numel(), 2).contiguous(), logits,
                           torch.ones(n), None, None, torch.rand(drafts.numel(), generator=gen).clamp(1e-7, 1 - 1e-7),
                           torch.rand(rows, generator=gen).clamp(1e-7, 1 - 1e-7), max_spec_len=1)
    return res.output_token_ids[:, 0]


def chi2_p(tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    counts = torch.bincount(tokens, minlength=2).double()
    return float(chisquare(counts.numpy(), (P_TARGET * counts.sum()).numpy()).pvalue), counts / counts.sum()


def run_rounds(schedule, n: int = 400_000, seed: int = 3):
    """Draw x1 from the draft, look up the verify length the scheduler picks for it, emit the first token."""
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(P_DRAFT, n, replacement=True, generator=gen)
    lens = torch.tensor([schedule(x) for x in (0, 1)])
    return chi2_p(first_token(x1, lens[x1], gen))


@pytest.mark.parametrize("impl", IMPLS)
def test_appendix_a_global_search_is_biased_alg1_is_lossless(impl):
    cu = cu_of([2])

    def global_search(x1):  # searches past the first non-improvement using the live c2
        k = capacity_unconstrained(live_survival(x1), cu, SPS_APP_A, impl=impl)
        return int(select_verify_lengths_topk(live_survival(x1), cu, k, impl=impl)[0])

    def alg1(x1):
        return int(select_verify_lengths_alg1(live_survival(x1), cu, SPS_APP_A, impl=impl)[0])

    assert [global_search(0), global_search(1)] == [2, 0]  # x1 decides whether x1 itself is verified
    p_global, freq_global = run_rounds(global_search)
    assert p_global < 1e-12
    torch.testing.assert_close(freq_global, torch.tensor([0.85, 0.15], dtype=torch.float64), atol=5e-3, rtol=0)
    assert [alg1(0), alg1(1)] == [0, 0]
    p_alg1, freq_alg1 = run_rounds(alg1)
    assert p_alg1 > 1e-3, freq_alg1

    # a cheaper second token (SPS(2) = 0.95): Algorithm 1 verifies x1 whatever it is, and stops before slot 2
    # (Theta 1.8 * 0.95 = 1.71, then at most 2.52 * 0.45), so x1 goes through the accept/residual path
    sps = table([1.0, 0.95, 0.45])

    def alg1_cheap(x1):
        return int(select_verify_lengths_alg1(live_survival(x1), cu, sps, impl=impl)[0])

    assert [alg1_cheap(0), alg1_cheap(1)] == [1, 1]
    p_cheap, freq_cheap = run_rounds(alg1_cheap)
    assert p_cheap > 1e-3, freq_cheap


@pytest.mark.parametrize("impl", IMPLS)
def test_step_aware_stop_crosses_the_step_and_stays_lossless(impl):
    """App. A's numbers: Algorithm 1 stops before x1 (Theta 1.8 * 0.5 = 0.9 <= 1.0), the step-aware stop admits it
    from a1 alone (outlook (1.8 + 0.8) * 0.45 = 1.17 > 1.0, as if slot 2 survived 0.8 too), then slot 2 only when
    it pays (2.52 * 0.45 = 1.134 after x1 = A; a2 = 0 after x1 = B). x1 is verified whatever it is, so the first
    token follows the target, where the global search of the same table does not (the test above)."""
    cu = cu_of([2])

    def step_aware(x1):
        return int(select_verify_lengths_alg1(live_survival(x1), cu, SPS_APP_A, lookahead=2, impl=impl)[0])

    assert [step_aware(0), step_aware(1)] == [2, 1]
    p_step, freq_step = run_rounds(step_aware)
    assert p_step > 1e-3, freq_step


def admitted_after_lowering_the_tail(select, rows, sps, r, j, factor):
    """Whether slot j (0-based) of request r is admitted, with the survivals of r's later slots scaled by ``factor``
    (<= 1: they stay non-increasing and rank after slot j)."""
    rows = [list(row) for row in rows]
    rows[r][j + 1:] = [x * factor for x in rows[r][j + 1:]]
    a, cu = survival_of(rows)
    return bool(select(a, cu, sps)[r] > j)


def test_whether_a_slot_is_verified_never_reads_the_slots_after_it():
    """The stopping-rule property behind losslessness, checked directly: lowering the survivals of request r's slots
    after j (which depend on the sampled x[r, j]) never changes whether slot j is verified, for Algorithm 1 and the
    step-aware stop on staircase and random tables. The same check catches the global search (capacity over the
    live survivals, then top-K)."""
    gen = torch.Generator().manual_seed(17)
    rules = {
        "alg1": lambda a, cu, sps: select_verify_lengths_alg1(a, cu, sps),
        "step": lambda a, cu, sps: select_verify_lengths_alg1(a, cu, sps, lookahead=a.numel()),
        "global": lambda a, cu, sps: select_verify_lengths_topk(a, cu, capacity_unconstrained(a, cu, sps)),
    }
    changed = dict.fromkeys(rules, 0)
    for trial in range(60):
        r_count = int(torch.randint(1, 5, (1,), generator=gen))
        rows = [(torch.rand(5, generator=gen) ** 0.4).cumprod(0).tolist() for _ in range(r_count)]
        bmax = r_count * 6
        sps = stair_sps(bmax, max(2, r_count)) if trial % 2 else decreasing_sps(bmax, gen)
        for name, select in rules.items():
            for r in range(r_count):
                for j in range(4):
                    base = admitted_after_lowering_the_tail(select, rows, sps, r, j, 1.0)
                    for factor in (0.5, 0.05, 0.0):
                        changed[name] += admitted_after_lowering_the_tail(select, rows, sps, r, j, factor) != base
    assert changed["alg1"] == 0 and changed["step"] == 0, changed
    assert changed["global"] > 0, changed


@pytest.mark.parametrize("impl", IMPLS)
def test_step_aware_stop_is_algorithm1_on_convex_step_times(impl):
    """Where ``1 / SPS(B)`` is convex in B (the random curves: flat, then growing like B^p with p >= 1) no outlook
    beats Theta where Theta does not: any lookahead gives Algorithm 1's lengths. On a staircase it verifies at least
    Algorithm 1's lengths, and more in some batches."""
    gen = torch.Generator().manual_seed(5)
    crossed = 0
    for trial in range(40):
        a, cu = random_survivals(16, gen, trial % 2 == 1)
        r, n = cu.numel() - 1, a.numel()
        sps = decreasing_sps(r + n, gen)
        plain = select_verify_lengths_alg1(a, cu, sps, impl=impl)
        for lookahead in (2, 7, n + 1):
            assert torch.equal(select_verify_lengths_alg1(a, cu, sps, lookahead=lookahead, impl=impl), plain)
        stairs = stair_sps(r + n, max(r, 2))
        step = select_verify_lengths_alg1(a, cu, stairs, lookahead=n + 1, impl=impl)
        base = select_verify_lengths_alg1(a, cu, stairs, impl=impl)
        assert bool((step >= base).all())
        crossed += int(step.sum() > base.sum())
    assert crossed >= 5


def test_sps_runs_hand_worked():
    """Runs of equal steps/s numbered along B, each with its last B and its SPS (rows past the last run unused)."""
    sps = torch.tensor([9.0, 5.0, 5.0, 5.0, 4.0, 3.0, 3.0, 2.0], dtype=torch.float64)
    run_index, runs = sps_runs(sps)
    assert run_index.tolist() == [0, 1, 1, 1, 2, 3, 3, 4]
    assert runs[:5].tolist() == [[0, 9.0], [3, 5.0], [4, 4.0], [6, 3.0], [7, 2.0]]
    run_index, runs = sps_runs(torch.ones(4))
    assert run_index.tolist() == [0, 0, 0, 0] and runs[0].tolist() == [3, 1.0]


def test_first_drop_kernel_visits_one_term_per_run_bit_for_bit():
    """The first-drop kernel (one term per run of equal SPS in each window) against the tensor path's every-term
    outlook, on tables of flat runs where the outlook decides: runs that a candidate crosses, windows that end inside
    a run, tables that end before the last candidate, runs that rise."""
    gen = torch.Generator().manual_seed(11)
    crossed = 0
    for trial in range(60):
        a, cu = random_survivals(12, gen, trial % 3 == 0)
        r, n = cu.numel() - 1, a.numel()
        sps = flat_runs_sps(r + n + int(torch.randint(-n // 2, 3, (1,), generator=gen)), gen, rising=trial % 4 == 1)
        base = alg1_vectorised(a, cu, sps, 1)
        for lookahead in (2, 5, n + 1):
            want = alg1_vectorised(a, cu, sps, lookahead)
            got = select_verify_lengths_alg1(a, cu, sps, lookahead=lookahead, impl="triton")
            assert torch.equal(got, want), (trial, lookahead)
        crossed += int(want.sum() > base.sum())
    assert crossed >= 10


@pytest.mark.parametrize("impl", IMPLS)
def test_production_capacity_from_stale_confidences_is_lossless(impl):
    cu = cu_of([2])
    gen = torch.Generator().manual_seed(11)
    n = 400_000
    # the stale round's first draft token (two rounds back, independent of the live one) sets K
    stale_x1 = torch.multinomial(P_DRAFT, n, replacement=True, generator=gen)
    ks = [int(capacity_unconstrained(live_survival(x), cu, SPS_APP_A, impl=impl)) for x in (0, 1)]
    assert ks == [2, 0]
    lens = torch.tensor(
        [[int(select_verify_lengths_topk(live_survival(x), cu, k, impl=impl)[0]) for x in (0, 1)] for k in ks]
    )
    assert lens.tolist() == [[2, 1], [0, 0]]  # with K = 2, x1 = B still verifies x1 (slot 2 has a = 0)
    x1 = torch.multinomial(P_DRAFT, n, replacement=True, generator=gen)
    p, freq = chi2_p(first_token(x1, lens[stale_x1, x1], gen))
    assert p > 1e-3, freq


@pytest.mark.parametrize("impl", IMPLS)
def test_capacity_does_not_depend_on_the_live_draft(impl):
    gen = torch.Generator().manual_seed(5)
    logits, cu, temps = random_batch(16, 7, gen, quantized=False)
    stale = prefix_survival(logits, cu, temps, impl=impl)
    sps = decreasing_sps(16 * 8, gen)
    k = capacity_unconstrained(stale, cu, sps, impl=impl)
    for _ in range(5):  # any live draft: the budget is the same K, and top-K spends exactly min(K, candidates)
        live = prefix_survival(3 * torch.randn(logits.numel(), generator=gen), cu, temps, impl=impl)
        assert torch.equal(capacity_unconstrained(stale, cu, sps, impl=impl), k)
        lens = select_verify_lengths_topk(live, cu, k, impl=impl)
        assert int(lens.sum()) == min(int(k), int((live > 0).sum()))


# ------------------------------------------------------------------------------------------------ SPS profiles
def test_sps_profile_round_trip(tmp_path):
    prof = SPSProfile("NVIDIA H200", "qwen3-8b", (1, 2, 4, 8), ((90.0, 89.0, 80.0, 60.0),))
    path = prof.save(tmp_path)
    assert path.name == "NVIDIA_H200__qwen3_8b.json"
    assert load_profile("NVIDIA H200", "qwen3-8b", tmp_path) == prof
    # staircase kept as measured: B = 3 runs in the B = 4 bucket; nothing past B = 8
    assert prof.as_table(6).tolist() == [90.0, 90.0, 89.0, 80.0, 80.0, 60.0, 60.0]
    assert prof.as_table(100).numel() == 9


def test_sps_table_never_rises_with_batch():
    # a noisy measurement (B = 2 slower than B = 3 and 4) is pooled with them: their mean, 95
    prof = SPSProfile("cpu", "m", (1, 2, 3, 4, 6), ((100.0, 93.0, 97.0, 95.0, 80.0),))
    assert prof.as_table(6).tolist() == [100.0, 100.0, 95.0, 95.0, 95.0, 80.0, 80.0]


def test_sps_table_outlier_does_not_lift_the_smaller_sizes():
    # one fast outlier at B = 6 is averaged with B = 2..5 (least-squares non-increasing fit); taking the best rate
    # of any larger size instead made B = 2..5 read 120 steps/s, so Algorithm 1 filled them for free
    prof = SPSProfile("cpu", "m", tuple(range(1, 9)), ((100.0, 90.0, 90.0, 90.0, 90.0, 120.0, 80.0, 80.0),))
    assert prof.as_table(8).tolist() == [100.0, 100.0] + [96.0] * 5 + [80.0, 80.0]
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):  # the fit of random rates never rises, keeps their sum and is idempotent
        rates = tuple((50 + 100 * torch.rand(12, generator=rng)).tolist())
        fitted = SPSProfile("cpu", "m", tuple(range(1, 13)), (rates,)).as_table(12)[1:]
        assert bool((fitted[1:] <= fitted[:-1]).all())
        assert float(fitted.sum()) == pytest.approx(sum(rates), rel=1e-5)
        again = SPSProfile("cpu", "m", tuple(range(1, 13)), (tuple(fitted.tolist()),)).as_table(12)[1:]
        assert torch.allclose(again, fitted)


def test_sps_profile_context_buckets(tmp_path):
    prof = SPSProfile("A100", "m", (1, 2), ((50.0, 40.0), (20.0, 15.0)), context_buckets=(1024, 8192))
    assert read_profile(prof.save(tmp_path)) == prof
    assert prof.as_table(2, context_len=512).tolist() == [50.0, 50.0, 40.0]
    assert prof.as_table(2, context_len=4096).tolist() == [20.0, 20.0, 15.0]


def _valid_dict() -> dict:
    return SPSProfile("H100", "m", (1, 2), ((10.0, 9.0),)).to_dict()


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d.pop("model"), "model"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(steps_per_s=[[10.0, -1.0]]), "steps_per_s"),
        (lambda d: d.update(steps_per_s=[[10.0, float("nan")]]), "steps_per_s"),
        (lambda d: d.update(steps_per_s=[[10.0]]), "steps_per_s"),
        (lambda d: d.update(batch_sizes=[2, 1]), "batch_sizes"),
        (lambda d: d.update(batch_sizes=[0, 1]), "batch_sizes"),
        (lambda d: d.update(source="guessed"), "source"),
        (lambda d: d.update(context_buckets=[1, 2]), "steps_per_s"),
    ],
)
def test_sps_profile_malformed_rejected(tmp_path, edit, field):
    d = _valid_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=field) as err:
        read_profile(path)
    assert str(path) in str(err.value)


def test_sps_profile_not_json_and_missing(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_profile(path)
    with pytest.raises(FileNotFoundError, match="profile_target") as err:
        load_profile("NVIDIA H200", "nomodel", tmp_path)
    assert str(tmp_path / "NVIDIA_H200__nomodel.json") in str(err.value)
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_profile(path)


def test_sps_profile_must_be_the_one_requested(tmp_path):
    prof = analytic_roofline("NVIDIA H200", 8e9, max_batch=64, model="m8b")
    prof.save(tmp_path)
    assert load_profile("NVIDIA H200", "m8b", tmp_path) == prof
    copy = profile_path("NVIDIA H100", "m8b", tmp_path)
    copy.write_text(profile_path("NVIDIA H200", "m8b", tmp_path).read_text())
    with pytest.raises(ValueError, match="is for device 'NVIDIA H200'.*not the requested 'NVIDIA H100'"):
        load_profile("NVIDIA H100", "m8b", tmp_path)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        prof.as_table(2.5)


def test_analytic_roofline_is_modelled_staircase():
    prof = analytic_roofline("NVIDIA H200", 8e9, max_batch=512)
    assert prof.source == "modelled" and "max(" in prof.formula
    t = prof.as_table(512)
    assert bool((t[1:] > 0).all()) and bool((t[2:] <= t[1:-1]).all())
    assert t[1] == t[16]  # memory-bound: weights streamed once per step
    assert t[512] < t[1]  # compute-bound at large B
    with pytest.raises(ValueError, match="gpu"):
        analytic_roofline("TPU", 8e9)


def test_profile_target_measures_each_size():
    calls = []
    prof = profile_target(calls.append, 3, device="cpu", model="fake", warmup=1, repeats=2, sync=lambda: None)
    assert prof.source == "measured" and prof.batch_sizes == (1, 2, 3)
    assert calls == [1, 2, 3, 1, 2, 3, 3, 2, 1]  # warm-up, then timed passes up and down
    assert all(v > 0 for v in prof.steps_per_s[0])


def test_profile_target_survives_a_burst_of_machine_speed():
    # a step of B tokens takes B seconds, except during one pass's worth of calls in the middle of the profile
    # (another process left the machine, or a clock boost), when it takes B / 2: measured size after size, the
    # sizes timed then would read twice as fast; interleaved, each size sees at most one fast call of five
    clock, calls = [0.0], [0]

    def step(b: int) -> None:
        fast = 12 <= calls[0] < 18
        calls[0] += 1
        clock[0] += b / 2 if fast else b

    prof = profile_target(step, 6, device="cpu", model="fake", warmup=0, repeats=5, sync=lambda: None,
                          clock=lambda: clock[0])
    assert prof.steps_per_s[0] == pytest.approx([1 / b for b in range(1, 7)])



# -------------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs():
    logits, cu = torch.zeros(3), cu_of([2, 1])
    with pytest.raises(ValueError, match="conf_logits.*NaN"):
        prefix_survival(torch.tensor([0.0, float("nan"), 0.0]), cu)
    with pytest.raises(ValueError, match="conf_logits.*Inf"):
        prefix_survival(torch.tensor([0.0, float("inf"), 0.0]), cu)
    with pytest.raises(ValueError, match="position_temperatures must be > 0"):
        prefix_survival(logits, cu, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="position_temperatures has 1"):
        prefix_survival(logits, cu, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="position_biases has 1"):
        prefix_survival(logits, cu, None, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="position_biases.*NaN"):
        prefix_survival(logits, cu, None, torch.tensor([0.5, float("nan")]))
    with pytest.raises(TypeError, match="position_biases"):
        prefix_survival(logits, cu, None, torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"cu_num_draft_tokens\[-1\]"):
        prefix_survival(logits, cu_of([2, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        prefix_survival(logits, torch.tensor([0, 2, 1, 3]))
    with pytest.raises(TypeError, match="conf_logits"):
        prefix_survival(logits.long(), cu)

    a, sps = torch.tensor([0.5, 0.25, 0.5]), table([1.0, 1.0, 0.5])
    for bad, what in [([0.5, 1.5, 0.5], r"\[0, 1\]"), ([0.5, -0.1, 0.5], r"\[0, 1\]"),
                      ([0.5, float("nan"), 0.5], "NaN"), ([0.25, 0.5, 0.5], "non-increasing")]:
        with pytest.raises(ValueError, match=f"survival.*{what}"):
            select_verify_lengths_alg1(torch.tensor(bad), cu, sps)
    with pytest.raises(ValueError, match="sps_table must cover B = R = 2"):
        select_verify_lengths_alg1(a, cu, table([1.0]))
    with pytest.raises(ValueError, match="sps_table entries"):
        select_verify_lengths_alg1(a, cu, table([1.0, 0.0, 0.5]))
    with pytest.raises(ValueError, match="sps_table contains NaN"):
        select_verify_lengths_alg1(a, cu, table([1.0, float("nan"), 0.5]))
    with pytest.raises(ValueError, match="survival_stale"):
        capacity_unconstrained(torch.tensor([0.5, 2.0, 0.5]), cu, sps)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        select_verify_lengths_topk(a, cu, -1)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        select_verify_lengths_topk(a, cu, torch.tensor([-2]))
    with pytest.raises(TypeError, match="budget"):
        select_verify_lengths_topk(a, cu, 1.5)
    for bad in (0, -3, 1.5, True, None):
        with pytest.raises(ValueError, match="lookahead must be an int >= 1"):
            select_verify_lengths_alg1(a, cu, sps, lookahead=bad)
    for op, first in ((select_verify_lengths_alg1, a), (capacity_unconstrained, a)):
        with pytest.raises(TypeError, match="cu_num_draft_tokens must be a torch.Tensor"):
            op(first, [0, 2, 3], sps)


def test_alg1_host_scan_equals_the_tensor_path(monkeypatch):
    """The CPU's host scans (Algorithm 1, and the production variant's capacity and top-K) give the vectorised
    paths' results bit for bit: ties in survival (the (j, r) tie-break), zero survivals, empty requests, equal Theta
    steps (strict improvement; first maximum), tables shorter than R + N, non-monotone tables, budgets past the
    candidates."""
    from dspark_kernels.reference import survival as ref

    host_slots = ref.HOST_SLOTS
    gen = torch.Generator().manual_seed(11)
    levels = torch.tensor([0.0, 0.125, 0.25, 0.5, 0.75, 1.0])
    for trial in range(600):
        r = int(torch.randint(1, 9, (1,), generator=gen))
        lens = torch.randint(0, 9, (r,), generator=gen).tolist()
        rows = []
        for n in lens:
            if trial % 2:  # few distinct values: many ties
                c = levels[torch.randint(0, len(levels), (n,), generator=gen)]
            else:
                c = torch.rand(n, generator=gen) ** 0.3
            rows.append(c.cumprod(0).tolist())
        a, cu = survival_of(rows)
        bmax = int(torch.randint(1, r + a.numel() + 3, (1,), generator=gen))
        if trial % 3 == 0:
            sps = torch.rand(bmax + 1, generator=gen) + 0.5  # jagged
        elif trial % 3 == 1:
            sps = torch.ones(bmax + 1)  # flat: Theta steps tie exactly when a = 0
        else:
            sps = decreasing_sps(bmax, gen).float()
        for lookahead in (1, 2, 5, 100):
            want = alg1_vectorised(a, cu, sps, lookahead)
            got = alg1_host(a, cu, sps, lookahead)
            assert got.dtype == torch.int32 and torch.equal(got, want), (rows, sps.tolist(), lookahead)
        budget = torch.randint(0, a.numel() + 3, (1,), generator=gen)
        host = (ref.capacity_unconstrained_ref(a, cu, sps), ref.select_verify_lengths_topk_ref(a, cu, budget))
        monkeypatch.setattr(ref, "HOST_SLOTS", -1)  # the tensor paths
        tensor = (ref.capacity_unconstrained_ref(a, cu, sps), ref.select_verify_lengths_topk_ref(a, cu, budget))
        monkeypatch.setattr(ref, "HOST_SLOTS", host_slots)
        for got, want in zip(host, tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), (rows, sps.tolist(), budget)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_offsets_temperatures_and_biases(impl):
    """``cu``, the temperatures and the biases as stride-2 views give the contiguous inputs' survival (the Triton
    launcher hands its kernel unit-stride vectors)."""
    from tests.test_verify_attention import every_other

    logits, cu, temps = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0]), torch.tensor([0, 3, 5]), torch.tensor([1.0, 2.0, 0.5])
    biases = torch.tensor([0.25, -1.0, 0.5])
    torch.testing.assert_close(prefix_survival(logits, every_other(cu), every_other(temps), every_other(biases),
                                               impl=impl),
                               prefix_survival(logits, cu, temps, biases, impl=impl), rtol=0, atol=0)
