"""Adaptive draft length: the cost model's choices, the acceptance estimate, and the loop it drives.

* :class:`AdaptiveDraftLength` picks the most tokens per cost (hand-worked cases), stops drafting when acceptance
  collapses and drafts again after the estimate has relaxed towards the prior;
* ``speculative_generate(..., draft_length=...)``: T = 0 output equals the target's greedy output for every drafter
  kind (plain steps and mixed lengths included); T > 0 is lossless (chi-square) with requests of different draft
  lengths verified in one forward;
* :func:`measure_round_costs` and bad input.
"""

import pytest

from dspark_kernels.engine.draft_length import (
    AdaptiveDraftLength,
    RoundCosts,
    _TimedDecode,
    cli_gamma,
    measure_round_costs,
)
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate
from tests.lossless import assert_follows_target
from tests.test_drafter_engine import KINDS, make_drafter, target  # noqa: F401  (module fixture)


def _expected_tau(alpha: float, k: int) -> float:
    return sum(alpha**j for j in range(k + 1))


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.9, 0.97])
@pytest.mark.parametrize("fixed,per_token", [(0.9, 0.06), (0.2, 0.01), (0.0, 0.0), (3.0, 0.5)])
def test_choice_is_the_brute_force_best_rate(alpha, fixed, per_token):
    costs = RoundCosts(fixed, per_token)
    sched = AdaptiveDraftLength(costs, prior_alpha=alpha)
    sched.start(1)
    assert sched.alpha(0) == pytest.approx(alpha)
    rates = [_expected_tau(alpha, k) / costs.of(k) for k in range(16)]
    best = max(range(16), key=lambda k: (rates[k], -k))
    assert sched.choose(0, 15) == best


def test_hand_worked_cases():
    sched = AdaptiveDraftLength(RoundCosts(fixed=1.0, per_token=0.0), prior_alpha=0.5)
    sched.start(1)
    assert sched.choose(0, 7) == 0  # tau < 2 for every k at alpha 0.5, and a drafted round costs 2 plain steps
    sched = AdaptiveDraftLength(RoundCosts(fixed=1.0, per_token=0.0), prior_alpha=0.9)
    sched.start(1)
    assert sched.choose(0, 4) == 4  # tau(4) = 4.095 > 2: drafting pays and longer is better when tokens are free
    sched = AdaptiveDraftLength(RoundCosts(fixed=0.0, per_token=0.5), prior_alpha=0.5)
    sched.start(1)
    assert sched.choose(0, 7) == 0  # 1.5 / 1.5 ties with a plain step: the shorter wins


def _plain_steps_until_probe(sched, i, gamma=15, limit=200):
    """Plain steps request ``i`` takes (observed as such) before its next drafted round; returns (steps, length)."""
    for steps in range(limit):
        k = sched.choose(i, gamma)
        if k > 0:
            return steps, k
        sched.observe(i, 0, 0)
    raise AssertionError("no probe")


def test_stops_drafting_then_probes_with_doubling_waits():
    costs = RoundCosts(fixed=0.9, per_token=0.06)
    sched = AdaptiveDraftLength(costs, decay=0.8, prior_alpha=0.75, probe_wait=4, max_probe_wait=32)
    sched.start(2)
    prior_k = sched.best_length(0.75, 15)
    assert sched.choose(0, 15) == prior_k > 0
    sched.observe(0, prior_k, 0)
    while (k := sched.choose(0, 15)) > 0:  # every draft rejected until the estimate says stop
        sched.observe(0, k, 0)
    assert sched.alpha(0) < 0.5 and sched.choose(1, 15) == prior_k  # requests are independent
    waits = []
    for _ in range(5):  # plain steps between failed probes: the wait doubles up to the cap
        steps, k = _plain_steps_until_probe(sched, 0)
        waits.append(steps)
        assert k == prior_k  # a probe drafts the prior's length
        sched.observe(0, k, 0)
    assert waits == [4, 8, 16, 32, 32]
    steps, k = _plain_steps_until_probe(sched, 0)
    for _ in range(8):  # a probe that succeeds, then whole blocks: drafting resumes and grows to the maximum
        sched.observe(0, k, k)
        k = sched.choose(0, 15)
        assert k > 0
    assert k == 15 and sched.alpha(0) > 0.9
    while (k := sched.choose(0, 15)) > 0:  # stops again: the wait starts over
        sched.observe(0, k, 0)
    sched.observe(0, 0, 0)
    assert _plain_steps_until_probe(sched, 0)[0] + 1 == 4


def test_a_probe_drafts_even_where_the_prior_would_not():
    """Round costs under which the prior's own best length is 0 (a drafted round costs 4 plain steps): the request
    starts on plain steps and its probes draft the length that pays most at acceptance 1 (7: 8 tokens for 4 steps),
    so acceptance is still observed; a request whose probes are all accepted drafts again."""
    sched = AdaptiveDraftLength(RoundCosts(fixed=3.0, per_token=0.0), prior_alpha=0.75, probe_wait=4,
                                max_probe_wait=8)
    sched.start(1)
    assert sched.best_length(0.75, 7) == 0
    waits = []
    for _ in range(3):
        steps, k = _plain_steps_until_probe(sched, 0, gamma=7)
        waits.append(steps)
        assert k == 7 == sched.best_length(1.0, 7)
        sched.observe(0, k, 0)
    assert waits == [4, 8, 8]
    for _ in range(3):
        steps, k = _plain_steps_until_probe(sched, 0, gamma=7)
        sched.observe(0, k, k)
    assert sched.choose(0, 7) > 0


def test_cli_gamma_defaults_and_range():
    assert cli_gamma(None, "adaptive") == 15 and cli_gamma(None, "fixed") == 7
    assert cli_gamma(1, "fixed") == 1 and cli_gamma(16, "adaptive") == 16
    with pytest.raises(ValueError, match="2..16 with --draft-length adaptive"):
        cli_gamma(1, "adaptive")
    with pytest.raises(ValueError, match="1..16 with --draft-length fixed"):
        cli_gamma(17, "fixed")
    with pytest.raises(ValueError, match="--draft-length must be one of"):
        cli_gamma(7, "sometimes")


def test_bad_arguments():
    with pytest.raises(ValueError, match="per_token"):
        RoundCosts(0.5, -0.1)
    with pytest.raises(ValueError, match="fixed"):
        RoundCosts(float("nan"), 0.1)
    with pytest.raises(TypeError, match="RoundCosts"):
        AdaptiveDraftLength((0.5, 0.1))
    with pytest.raises(ValueError, match="decay"):
        AdaptiveDraftLength(RoundCosts(0.5, 0.1), decay=1.0)
    with pytest.raises(ValueError, match="prior_alpha"):
        AdaptiveDraftLength(RoundCosts(0.5, 0.1), prior_alpha=0.0)
    with pytest.raises(ValueError, match="prior_weight"):
        AdaptiveDraftLength(RoundCosts(0.5, 0.1), prior_weight=0.0)
    with pytest.raises(ValueError, match="probe_wait"):
        AdaptiveDraftLength(RoundCosts(0.5, 0.1), probe_wait=8, max_probe_wait=4)
    with pytest.raises(ValueError, match="fixed"):
        RoundCosts(True, 0.1)
    with pytest.raises(ValueError, match="prior_weight"):
        AdaptiveDraftLength(RoundCosts(0.5, 0.1), prior_weight=float("inf"))
    schedule = AdaptiveDraftLength(RoundCosts(0.5, 0.1))
    with pytest.raises(IndexError, match="call start first"):
        schedule.choose(0, 7)
    schedule.start(1)
    schedule.choose(0, 7)
    for verified, accepted in [(1, -3), (2, 3), (-1, -1)]:
        with pytest.raises(ValueError, match="0 <= accepted <= verified"):
            schedule.observe(0, verified, accepted)
    assert schedule.alpha(0) == 0.75  # nothing was recorded


@pytest.mark.parametrize("kind,rank", KINDS)
@pytest.mark.parametrize("costs", [RoundCosts(0.3, 0.05), RoundCosts(0.0, 0.0), RoundCosts(50.0, 0.0)])
def test_greedy_adaptive_equals_target_greedy(target, kind, rank, costs):  # noqa: F811
    drafter = make_drafter(target, kind, rank)
    prompts = [[1, 5, 9, 13], [1, 40], [1] + list(range(20, 45))]
    ar = generate(target, prompts, 24, temperature=0.0)
    spec = speculative_generate(target, drafter, prompts, 24, 7, temperature=0.0,
                                draft_length=AdaptiveDraftLength(costs, decay=0.7))
    assert spec.tokens == ar.tokens
    plain = sum(spec.round_hist[0])
    if costs.fixed == 50.0:  # drafting never pays: every round is a plain step
        assert plain == spec.rounds and spec.tau == 1.0
    if costs.fixed == 0.0:  # drafting is free: never a plain step, mostly the maximum
        assert plain == 0 and sum(spec.round_hist[7]) > spec.rounds / 2


def test_greedy_adaptive_triton_path_with_eos(target):  # noqa: F811
    drafter = make_drafter(target)
    prompts = [[1, 7, 8], [1, 30, 31, 32]]
    ar = generate(target, prompts, 12, temperature=0.0, eos_token_id=17)
    spec = speculative_generate(target, drafter, prompts, 12, 5, temperature=0.0, eos_token_id=17, impl="triton",
                                draft_length=AdaptiveDraftLength(RoundCosts(0.3, 0.05), decay=0.7))
    assert spec.tokens == ar.tokens and spec.finish_reasons == ar.finish_reasons


def test_sampled_adaptive_is_lossless_with_mixed_lengths(target):  # noqa: F811
    drafter = make_drafter(target)
    prompt, n, steps, gamma = [1, 11, 12], 3000, 4, 4
    sched = AdaptiveDraftLength(RoundCosts(0.3, 0.1), decay=0.5, prior_alpha=0.6)
    spec = speculative_generate(target, drafter, [prompt] * n, steps, gamma, temperature=1.0, seeds=list(range(n)),
                                draft_length=sched)
    by_length = [sum(row) for row in spec.round_hist]
    assert by_length[0] > 0 and sum(1 for c in by_length[1:] if c > 0) >= 2  # plain, and two draft lengths
    assert sum(row[a] for row in spec.round_hist for a in range(1, gamma + 1)) > 0  # some drafts accepted
    assert_follows_target(target, prompt, spec.tokens, 1.0, steps)


def test_acceptance_by_position_counts_only_verified_positions(target):  # noqa: F811
    drafter = make_drafter(target)
    spec = speculative_generate(target, drafter, [[1, 5, 9]], 4, 3)
    spec.round_hist = [[2, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 2]]
    # rows: l = 0 (two plain steps), l = 1 (a = 0, a = 1), l = 3 (a = 0, a = 2, a = 3 twice)
    # position 1: verified in the 6 rounds with l >= 1, accepted in 4 of them
    assert spec.acceptance_by_position[0] == pytest.approx(4 / 6)
    # position 2: reached (l >= 2 and a >= 1) in 3 rounds, accepted (a >= 2) in 3
    assert spec.acceptance_by_position[1] == pytest.approx(3 / 3)
    assert spec.acceptance_by_position[2] == pytest.approx(2 / 3)
    assert spec.accept_hist == [4, 1, 1, 2]


def test_trace_recording_needs_a_fixed_length(target):  # noqa: F811
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="record_traces"):
        speculative_generate(target, drafter, [[1, 2]], 4, 3, record_traces=True,
                             draft_length=AdaptiveDraftLength(RoundCosts(0.5, 0.1)))
    with pytest.raises(TypeError, match="draft_length"):
        speculative_generate(target, drafter, [[1, 2]], 4, 3, draft_length=RoundCosts(0.5, 0.1))


def test_measure_round_costs(target):  # noqa: F811
    drafter = make_drafter(target)
    costs = measure_round_costs(target, drafter, [1, 5, 9, 13], 7, repeats=3)
    assert costs.fixed >= 0 and costs.per_token >= 0
    assert costs.of(7) >= costs.of(1) >= costs.of(0) == 1.0
    with pytest.raises(ValueError, match="gamma"):
        measure_round_costs(target, drafter, [1, 5], 1)
    with pytest.raises(ValueError, match="repeats"):
        measure_round_costs(target, drafter, [1, 5], 4, repeats=0)
    with pytest.raises(ValueError, match="prompt"):
        measure_round_costs(target, drafter, [], 4)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_timed_rounds_decode_the_greedy_text(target, k):  # noqa: F811
    """The rounds measure_round_costs times are a real greedy decode (drafts verified and kept, context taken in)."""
    decode = _TimedDecode(target, make_drafter(target), [1, 5, 9, 13], k, rounds=6)
    for _ in range(6):
        assert decode.round() > 0
    ar = generate(target, [[1, 5, 9, 13]], len(decode.tokens), temperature=0.0)
    assert decode.tokens == ar.tokens[0] and len(decode.tokens) >= 7
