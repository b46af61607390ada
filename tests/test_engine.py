"""Continuous-batching engine, verify-length policies and the replay simulator on the tiny random target/drafter.

* requests join and leave mid-run, caches are returned; T = 0 output == the target's greedy output for every policy;
* per-request seeds reproduce across batch compositions (per-request policies);
* T = 1: dspark and dspark_prod are lossless (chi-square against the exact marginals);
* replay: the oracle bounds every policy, ``none`` has tau 1; bad inputs raise clear errors.
"""

import json
import math
import platform

import pytest
import torch

from dspark_kernels.drafters import DraftOutput, NullDrafter
from dspark_kernels.engine.engine import Engine, run_closed_loop
from dspark_kernels.engine.policies import (
    GATED_POLICY_NAMES,
    POLICY_NAMES,
    FixedK,
    PolicyError,
    algorithm1_at_mean,
    best_common_length,
    drafting_gain,
    make_policy,
    step_time_convex,
)
from dspark_kernels.engine.replay import Traces, simulate, sweep
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.engine.sps import SPSProfile, analytic_roofline, profile_drafter, read_profile
from dspark_kernels.models import generate
from dspark_kernels.ops.survival import prefix_survival
from tests.lossless import assert_follows_target
from tests.test_drafter_engine import VOCAB, make_drafter, target, train_block_drafter  # noqa: F401 (fixture)

GAMMA = 4
LIVE_POLICIES = [p for p in POLICY_NAMES if p != "oracle"]


def linear_profile(max_b: int, knee: float) -> SPSProfile:
    """``t(B) = 1 + B / knee``: every extra verified token costs, so Algorithm 1 really stops early."""
    sizes = tuple(range(1, max_b + 1))
    return SPSProfile("test", "tiny", sizes, (tuple(1.0 / (1.0 + b / knee) for b in sizes),), source="modelled")


@pytest.fixture(scope="module")
def drafter(target):  # noqa: F811
    """A briefly trained drafter: accepted often enough that every policy's verify lengths reach the output."""
    return train_block_drafter(target)


def stair_profile(max_b: int, knee: float, tile: int, jump: float) -> SPSProfile:
    """``t(B) = 1 + B / knee + jump * floor((B - 1) / tile)``: :func:`linear_profile` with a GEMM's row tiles."""
    sizes = tuple(range(1, max_b + 1))
    rates = tuple(1.0 / (1.0 + b / knee + jump * ((b - 1) // tile)) for b in sizes)
    return SPSProfile("test", "tiny-tiles", sizes, (rates,), source="modelled")


def engine(target, drafter, policy, max_batch=4, knee=6.0, max_seq_len=64, profile=None):  # noqa: F811
    profile = profile or linear_profile(max_batch * (GAMMA + 1), knee)
    return Engine(target, drafter, make_policy(policy), profile, GAMMA, page_size=8, max_batch=max_batch,
                  max_seq_len=max_seq_len)


PROMPTS = [[1, 5, 9, 13], [1, 40], [1] + list(range(20, 45)), [1, 7, 8], [1, 60, 61]]


def test_requests_join_and_leave_mid_run(target, drafter):  # noqa: F811
    eng = engine(target, drafter, "fixed3", max_batch=2)
    ar = generate(target, PROMPTS[:4], 12, temperature=0.0)
    a = eng.add_request(PROMPTS[0], 12)
    b = eng.add_request(PROMPTS[1], 5)
    finished = eng.step() + eng.step()  # b may finish here already (drafts are accepted)
    c = eng.add_request(PROMPTS[2], 12)  # waits for a free slot (max_batch 2)
    d = eng.add_request(PROMPTS[3], 12)
    while eng.has_work:
        assert len(eng.live) <= 2
        finished += eng.step()
    assert sorted(finished) == [a, b, c, d] and finished.index(b) < finished.index(d)
    assert [eng.requests[i].tokens for i in (a, c, d)] == [ar.tokens[0], ar.tokens[2], ar.tokens[3]]
    assert eng.requests[b].tokens == ar.tokens[1][:5]
    assert eng.tcache.num_free_pages == eng.tcache.num_pages and not eng.tcache.request_ids
    m = eng.metrics()
    assert m["requests"][a]["verified"] == 3 * m["requests"][a]["rounds"]
    assert m["requests"][a]["rejected"] == m["requests"][a]["verified"] - m["requests"][a]["accepted"]
    pairs = m["calibration_pairs"]
    verified = sum(r["verified"] for r in m["requests"].values())
    assert pairs["conf_logits"].shape == pairs["accepted"].shape == (verified,)


def test_acceptance_by_position_is_conditional(target, drafter):  # noqa: F811
    """Position j's acceptance counts the rounds that reached it (drafts 1..j accepted, j + 1 verified), as
    ``SpecResult.acceptance_by_position`` does; it used to divide by every round that verified the position."""
    eng = engine(target, drafter, "fixed3", max_batch=3)
    run_closed_loop(eng, PROMPTS, 3, 16)
    m = eng.metrics()
    hist = [sum(r["accept_hist"][a] for r in m["requests"].values()) for a in range(GAMMA + 1)]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # rounds rejected at the first draft and rounds that went on
    expect = [sum(hist[j + 1:]) / sum(hist[j:]) if sum(hist[j:]) else float("nan") for j in range(3)]
    assert m["acceptance_by_position"][:3] == pytest.approx(expect, nan_ok=True)
    assert all(math.isnan(x) for x in m["acceptance_by_position"][3:])  # fixed3 never verifies a fourth draft


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_greedy_engine_equals_target_greedy(target, drafter, policy):  # noqa: F811
    ar = generate(target, PROMPTS, 16, temperature=0.0, eos_token_id=17)
    eng = engine(target, drafter, policy, max_batch=3)
    out = run_closed_loop(eng, PROMPTS, 3, 16, eos=17)
    assert [eng.requests[i].tokens for i in out["rids"]] == ar.tokens
    assert 1.0 <= out["tau"] <= GAMMA + 1 and out["system_tps"] > 0


def test_closed_loop_takes_a_cap_per_prompt(target, drafter):  # noqa: F811
    eng = engine(target, drafter, "fixed3", max_batch=2)
    caps = [3, 9, 5, 1]
    out = run_closed_loop(eng, PROMPTS[:4], 2, caps)
    assert [len(eng.requests[i].tokens) for i in out["rids"]] == caps
    with pytest.raises(ValueError, match="one cap or one per prompt"):
        run_closed_loop(eng, PROMPTS[:4], 2, caps[:3])


def test_serving_request_caps_spread_around_the_cap():
    from dspark_kernels.bench.serving import request_caps

    caps = request_caps(400, 64, 0.5, seed=3)
    assert caps == request_caps(400, 64, 0.5, seed=3) and min(caps) >= 32 and max(caps) <= 96
    assert len(set(caps)) > 40 and abs(sum(caps) / len(caps) - 64) < 4
    assert request_caps(5, 64, 0.0, seed=3) == [64] * 5
    assert set(request_caps(50, 1, 0.9, seed=0)) == {1, 2}  # never below one token


@pytest.mark.parametrize("policy", ["fixed3", "threshold0.5"])
def test_seeds_reproduce_across_batch_compositions(target, drafter, policy):  # noqa: F811
    alone = engine(target, drafter, policy)
    rid = alone.add_request(PROMPTS[1], 14, temperature=1.0, seed=4)
    while alone.has_work:
        alone.step()
    crowd = engine(target, drafter, policy)
    crowd.add_request(PROMPTS[0], 6, temperature=1.0, seed=3)
    crowd.step()
    crowd.add_request(PROMPTS[2], 14, temperature=0.7, seed=5)
    mine = crowd.add_request(PROMPTS[1], 14, temperature=1.0, seed=4)
    while crowd.has_work:
        crowd.step()
    assert crowd.requests[mine].tokens == alone.requests[rid].tokens


def _sampled_engine(target, drafter, policy):  # noqa: F811
    """3000 requests of one prompt, 3 sampled tokens each, under a scheduled policy whose verify step is cheap
    enough (knee 4n) that it verifies ragged lengths with many accepted and rejected drafts. ``dspark_step`` runs on
    the same profile with 1000-token tiles, whose steps its stop crosses (Algorithm 1 verifies nothing there)."""
    prompt, n, steps = [1, 11, 12], 3000, 3
    tiles = stair_profile(n * (GAMMA + 1), 4.0 * n, 1000, 0.05) if policy == "dspark_step" else None
    eng = engine(target, drafter, policy, max_batch=n, knee=4.0 * n, max_seq_len=16, profile=tiles)
    if policy == "dspark_prod":  # stale rounds of the same batch, so the live rounds take the capacity + top-K path
        for _ in range(2):
            eng.policy.choose(torch.randn(n, GAMMA), list(range(n)), 0)
    out = run_closed_loop(eng, [prompt] * n, n, steps, temperature=1.0)
    return prompt, steps, [eng.requests[i].tokens for i in out["rids"]], out


@pytest.mark.parametrize("policy", ["dspark", "dspark_step", "dspark_prod"])
def test_sampled_engine_is_lossless(target, drafter, policy):  # noqa: F811
    prompt, steps, tokens, out = _sampled_engine(target, drafter, policy)
    assert 0.5 < out["verified_per_round"] < GAMMA - 0.5  # the policy really chose ragged lengths
    hist = torch.tensor([r["accept_hist"] for r in out["requests"].values()]).sum(0)
    assert hist[1:].sum() > 0.1 * hist.sum() and hist[0] > 0.1 * hist.sum()  # accepts and rejects, often
    assert_follows_target(target, prompt, tokens, 1.0, steps)


@pytest.mark.parametrize("policy", ["dspark", "dspark_prod"])
def test_the_engine_lossless_check_catches_a_wrong_residual(target, drafter, monkeypatch, policy):  # noqa: F811
    """The check above can fail: with a rejected position resampled from the target instead of the residual, the
    scheduled policies' sampled output no longer follows the target at this sample size."""
    import importlib

    rs = importlib.import_module("dspark_kernels.reference.rejection_sample")
    monkeypatch.setattr(rs, "_correction_weights", lambda probs, dp, x, rej, final_row, rd: probs[final_row])
    prompt, steps, tokens, _ = _sampled_engine(target, drafter, policy)
    with pytest.raises(AssertionError):
        assert_follows_target(target, prompt, tokens, 1.0, steps)


def test_draft_widths_follow_each_policy():
    profile = linear_profile(4 * (GAMMA + 1), 6.0)
    fixed = make_policy("fixed3")
    fixed.bind(profile, GAMMA, 4)
    assert fixed.drafts([0, 1], 0) and fixed.draft_width([0, 1], 0) == 3  # a fixed-k engine drafts its k
    smart = make_policy("smartspec")
    smart.bind(profile, GAMMA, 4)
    if smart.drafts([0, 1], 0):  # k is decided before the draft, and the draft is k wide
        assert smart.draft_width([0, 1], 0) == int(smart.choose(None, [0, 1], 0)[0]) > 0
    smart.alpha, smart._alpha_dev, smart._step = 0.01, None, None  # acceptance collapsed: k = 0, a plain step
    assert not smart.drafts([0, 1], 20)
    alg1 = make_policy("dspark")
    alg1.bind(profile, GAMMA, 4)
    assert alg1.draft_width([0, 1], 0) == GAMMA  # nothing chosen yet
    # SPS(B) = 1 / (1 + B / 6) and drafting free: two requests at mean survival 0.5, 0.1, 0.05, 0 expect 3 / (5/3) =
    # 1.8, 3.2 / 2 = 1.6, 3.3 / (7/3) = 1.41 tokens per unit time verifying 1, 2, 3 drafts each: one slot
    alg1._mean_survival, alg1._plans = [0.5, 0.1, 0.05, 0.0], {}
    assert alg1.draft_width([0, 1], 1) == 1
    # 0.95, 0.9, 0.85, 0.8: 2.34, 2.85, 3.17, 3.38 for two requests: all four slots
    alg1._mean_survival, alg1._plans = [0.95, 0.9, 0.85, 0.8], {}
    assert alg1.draft_width([0, 1], 2) == 4
    alg1._mean_survival, alg1._plans = [0.05, 0.0, 0.0, 0.0], {}  # a plain step would be best: still one slot
    assert alg1.draft_width([0, 1], 3) == 1
    alg1._remember(torch.full((2 * GAMMA,), 0.9), 2, GAMMA, 4)  # a drafted round moves the mean: widths recomputed
    assert alg1._plans == {} and alg1.draft_width([0, 1], 5) > 1
    threshold = make_policy("threshold0.5")
    threshold.bind(profile, GAMMA, 4)
    threshold.choose(torch.full((2, GAMMA), -5.0), [0, 1], 0)
    assert threshold.draft_width([0, 1], 1) == GAMMA  # per-request: never narrowed by the batch


@pytest.mark.parametrize("name", ["dspark", "dspark_step", "dspark_prod", "threshold0.4"])
def test_calibrated_policies_read_logit_over_temperature_plus_bias(name):
    """A policy given temperatures and biases chooses as the uncalibrated one given ``logit / T + b``, and rejects
    calibrations that are not finite vectors or do not cover gamma."""
    gen = torch.Generator().manual_seed(3)
    temps, biases = 0.5 + torch.rand(GAMMA, generator=gen), torch.randn(GAMMA, generator=gen)
    profile = linear_profile(4 * (GAMMA + 1), 6.0)
    calibrated, plain = make_policy(name, temps, biases=biases), make_policy(name)
    calibrated.bind(profile, GAMMA, 4)
    plain.bind(profile, GAMMA, 4)
    for step in range(4):  # dspark_prod's stale capacity starts from the third round
        conf = 3 * torch.randn(4, GAMMA, generator=gen)
        live = [0, 1, 2, 3]
        assert torch.equal(calibrated.choose(conf, live, step), plain.choose(conf / temps + biases, live, step))
    with pytest.raises(ValueError, match="biases must be a 1-D tensor of finite values"):
        make_policy(name, biases=torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="biases must be a 1-D tensor"):
        make_policy(name, biases=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="temperatures must be a 1-D tensor of positive finite values"):
        make_policy(name, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=f"3 calibration biases for gamma = {GAMMA}"):
        make_policy(name, temps, biases=biases[:3]).bind(profile, GAMMA, 4)
    with pytest.raises(ValueError, match=f"3 calibration temperatures for gamma = {GAMMA}"):
        make_policy(name, temps[:3], biases=biases).bind(profile, GAMMA, 4)


def test_engine_drafts_the_policy_width_and_stays_exact(target, drafter, monkeypatch):  # noqa: F811
    from dspark_kernels.engine import engine as engine_module

    widths = []
    real = engine_module.draft

    def record(drafter_, dstate, live, anchors, gamma, samp, impl, context=None):
        widths.append(gamma)
        return real(drafter_, dstate, live, anchors, gamma, samp, impl, context=context)

    monkeypatch.setattr(engine_module, "draft", record)
    ar = generate(target, PROMPTS, 16, temperature=0.0)
    eng = engine(target, drafter, "dspark", max_batch=3)
    out = run_closed_loop(eng, PROMPTS, 3, 16)
    assert [eng.requests[i].tokens for i in out["rids"]] == ar.tokens
    assert widths[0] == GAMMA and min(widths) < GAMMA  # the width adapts after the first round
    pairs = eng.metrics()["calibration_pairs"]
    assert pairs["position"].max() < GAMMA and pairs["conf_logits"].shape == pairs["accepted"].shape
    widths.clear()
    eng = engine(target, drafter, "fixed3", max_batch=3)
    run_closed_loop(eng, PROMPTS, 3, 16)
    assert set(widths) == {3}


def flat_profile(max_b: int, rate: float) -> SPSProfile:
    sizes = tuple(range(1, max_b + 1))
    return SPSProfile("test", "tiny-plain", sizes, ((rate,) * max_b,), source="modelled")


def test_profile_drafter_times_every_request_count(target):  # noqa: F811
    # each request count keeps its own contexts, so the interleaved timing passes never rebuild them
    drafter, built = make_drafter(target), []
    new_state = drafter.new_state
    drafter.new_state = lambda *a, **k: built.append(a) or new_state(*a, **k)
    prof = profile_drafter(target, drafter, 3, device="cpu", model="tiny-rounds", context=12, gamma=3, warmup=1,
                           repeats=3, sync=lambda: None)
    assert prof.batch_sizes == (1, 2, 3) and all(v > 0 for v in prof.steps_per_s[0])
    assert len(built) == 3  # one drafter state per request count, built before the timed passes


def test_drafting_gain_hand_cases():
    draft = torch.tensor([0.0, 10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0])  # steps/s by verified tokens, B = 0..8
    plain = torch.tensor([0.0, 20.0, 18.0])
    rate = lambda k: draft if k else plain  # noqa: E731 (rate(k): a round that drafts k slots; k = 0, a plain step)
    assert drafting_gain([0.9, 0.8], 1, rate) == pytest.approx(21.6 / 20)  # k = 2: (1 + 0.9 + 0.8) * 8
    assert drafting_gain([0.5, 0.25], 1, rate) == pytest.approx(14 / 20)  # best k = 2: 1.75 * 8
    # best k = 2: 2 * 2.7 * 5 = 27 against 2 * 18 = 36; k = 4 is past B = 8
    assert drafting_gain([0.9, 0.8, 0.7, 0.6], 2, rate) == pytest.approx(27 / 36)
    # best k = 2: 2 * 3 * 5 = 30 against 2 * 10 = 20
    plain = torch.tensor([0.0, 20.0, 10.0])  # rate(0) reads it from here on
    assert drafting_gain([1.0, 1.0, 1.0], 2, rate) == pytest.approx(30 / 20)
    # the best common length itself, plain steps included: k = 0 (2 * 10 = 20) beats k = 1 (2 * 1.1 * 7 = 15.4)
    assert best_common_length([0.1, 0.0], 2, rate) == (0, pytest.approx(20.0))
    assert best_common_length([0.1, 0.0], 2, rate, min_length=1) == (1, pytest.approx(15.4))


def test_algorithm1_at_mean_is_the_op_on_equal_requests():
    """On requests that all have one prefix survival, the scan stops where the op (select_verify_lengths_alg1) does:
    the same expected tokens and rate, on smooth, flat and staircase tables."""
    from dspark_kernels.ops.survival import select_verify_lengths_alg1

    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        r, w = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        mean = torch.rand(w, generator=gen).sort(descending=True).values.cumprod(0)
        if trial % 4 == 0:
            mean[-1] = 0.0  # a zero survival ends the scan
        n = r * (w + 1) + 3
        times = 1 + (torch.rand(n, generator=gen) * [0.02, 0.3, 0.0, 0.05][trial % 4]).cumsum(0)  # 0: flat
        if trial % 4 == 3:  # a staircase: rounds cost the same up to the end of each step of 4 tokens
            times = times[(torch.arange(n) // 4 * 4 + 3).clamp(max=n - 1)]
        table = torch.cat([1 / times[:1], 1 / times])  # index B = 1..n; entry 0 repeats entry 1
        a = mean.repeat(r)
        cu = torch.arange(0, (r + 1) * w, w, dtype=torch.int32)
        lens = select_verify_lengths_alg1(a, cu, table).long()
        tokens = r + sum(float(mean[:k].sum()) for k in lens.tolist())
        got_tokens, got_rate = algorithm1_at_mean(mean.tolist(), r, table.tolist())
        assert got_tokens == pytest.approx(tokens, rel=1e-5), trial
        assert got_rate == pytest.approx(tokens * float(table[r + int(lens.sum())]), rel=1e-5), trial


def test_algorithm1_plans_for_its_early_stop_on_a_staircase():
    """Two requests, first drafts surviving 0.9, on a staircase: the third verified token costs the whole next step
    (10 -> 6 rounds/s), the fourth is then free. A common length of 1 pays (2 * 1.9 * 6 = 22.8 tokens/s against 20),
    but Algorithm 1 stops at the third token (2.9 * 6 = 17.4 < 20) and verifies nothing: its gate stays closed,
    the production variant's opens."""
    rates = (10.0, 10.0) + (6.0,) * (2 * (GAMMA + 1) - 2)
    steps = SPSProfile("test", "tiny-stairs", tuple(range(1, len(rates) + 1)), (rates,), source="modelled")
    mean = [0.9] + [0.0] * (GAMMA - 1)
    assert algorithm1_at_mean(mean, 2, [rates[0], *rates]) == (pytest.approx(2.0), pytest.approx(20.0))
    assert drafting_gain(mean, 2, lambda k: [rates[0], *rates]) == pytest.approx(22.8 / 20)
    for name, drafts in (("dspark+gate", False), ("dspark_prod+gate", True), ("dspark_step+gate", True)):
        policy = make_policy(name, prior_survival=mean)
        policy.bind(steps, GAMMA, 2, flat_profile(2, 1e9))
        assert policy.drafts([0, 1], 0) is drafts, name
        assert policy.draft_width([0, 1], 0) == 1
    # the round itself: Algorithm 1 verifies nothing, the step-aware stop crosses the step (an outlook of
    # (2.9 + 0.9) * 6 = 22.8 > 20 tokens/s) and verifies both first drafts
    logit = math.log(0.9 / 0.1)
    for name, lens in (("dspark", [0, 0]), ("dspark_step", [1, 1])):
        policy = make_policy(name)
        policy.bind(steps, GAMMA, 2)
        assert policy.choose(torch.full((2, 1), logit), [0, 1], 0).tolist() == lens, name


def test_step_time_convex_hand_cases():
    """Convex: the modelled H200 roofline (flat, then affine) read back from float32, with a constant draft round
    added, and from any start; not convex: a staircase, a profile's flat runs, a concave cost. Short tails pass."""
    roof = analytic_roofline("H200", 8e9, max_batch=512).as_table(512)
    assert step_time_convex(roof, 1) and step_time_convex(roof, 300)
    assert step_time_convex(1.0 / (1.0 / roof + 0.004), 8)
    assert not step_time_convex(stair_profile(64, 16.0, 16, 0.05).as_table(64), 1)
    fitted = torch.tensor([1.0, 10.0, 10.0, 10.0, 9.0, 9.0, 9.0, 8.0])  # runs pooled by a non-increasing fit
    assert not step_time_convex(fitted, 1)
    assert not step_time_convex(1.0 / torch.arange(1, 65, dtype=torch.float32).sqrt(), 1)
    assert step_time_convex(fitted, 6) and step_time_convex(fitted[:3], 1)


@pytest.mark.parametrize("profile", ["roofline", "stairs"])
def test_dspark_step_runs_algorithm1_where_the_step_time_is_convex(monkeypatch, profile):
    """``dspark_step`` passes lookahead 1 on a convex table (the modelled roofline, 48 requests: B = 48..240 crosses
    its knee near 206) and the table's size on a staircase; on the convex one it chooses what ``dspark`` does, and on
    both what the op with the whole window chooses."""
    import dspark_kernels.engine.policies as policies

    r = 48 if profile == "roofline" else 4
    prof = (analytic_roofline("H200", 8e9, max_batch=r * (GAMMA + 1)) if profile == "roofline"
            else stair_profile(r * (GAMMA + 1), 2.0, 4, 0.3))
    step, plain = make_policy("dspark_step"), make_policy("dspark")
    step.bind(prof, GAMMA, r)
    plain.bind(prof, GAMMA, r)
    table, live = step.step_table(r, GAMMA), list(range(r))
    cu = torch.arange(0, r * GAMMA + 1, GAMMA)
    want = 1 if profile == "roofline" else table.numel()
    seen = []
    real = policies.select_verify_lengths_alg1
    monkeypatch.setattr(policies, "select_verify_lengths_alg1",
                        lambda *a, lookahead=1, **k: seen.append(lookahead) or real(*a, lookahead=lookahead, **k))
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        conf = torch.randn(r, GAMMA, generator=gen) * 3
        lens = step.choose(conf, live, trial)
        assert seen[-1] == want, trial
        whole = real(prefix_survival(conf.reshape(-1), cu), cu, table, lookahead=table.numel())
        assert lens.tolist() == whole.tolist(), trial
        if profile == "roofline":
            assert lens.tolist() == plain.choose(conf, live, trial).tolist(), trial


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_gate_drafts_only_when_it_pays_and_stays_lossless(target, drafter, monkeypatch, temperature):  # noqa: F811
    """A draft round is modelled 100x slower than a verify step, so the gate closes after the first drafted round
    and reopens only for its probes (every 2nd step here); output stays the target's (greedy: exactly, sampled:
    chi-square on the first 3 tokens of 3000 requests); an open gate (free draft round) drafts every round."""
    calls = []
    real = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda *a, **k: calls.append(1) or real(*a, **k))
    n, steps, prompt = (3000, 3, [1, 11, 12]) if temperature else (len(PROMPTS), 10, None)
    prompts = [prompt] * n if temperature else PROMPTS
    policy = make_policy("dspark+gate")
    policy.GATE_PROBE = policy.GATE_PROBE_MAX = policy._probe_wait = 2
    eng = Engine(target, drafter, policy, flat_profile(n * (GAMMA + 1), 100.0), GAMMA, page_size=8, max_batch=n,
                 max_seq_len=48, draft_profile=flat_profile(n, 1.0))
    out = run_closed_loop(eng, prompts, n, steps, temperature=temperature)
    tokens = [eng.requests[i].tokens for i in out["rids"]]
    assert len(calls) == -(-out["steps"] // 2)  # steps 0, 2, 4, ...: the first round and the probes
    if temperature:
        assert_follows_target(target, prompt, tokens, 1.0, steps)
    else:
        assert tokens == generate(target, PROMPTS, steps, temperature=0.0).tokens
    calls.clear()
    # with a prior (the drafter's held-out mean survival) the gate needs no first round: it probes from step 2 on
    policy = make_policy("dspark+gate", prior_survival=[0.5] * GAMMA)
    policy.GATE_PROBE = policy.GATE_PROBE_MAX = 2
    eng = Engine(target, drafter, policy, flat_profile(n * (GAMMA + 1), 100.0), GAMMA, page_size=8, max_batch=n,
                 max_seq_len=48, draft_profile=flat_profile(n, 1.0))
    out = run_closed_loop(eng, prompts, n, steps, temperature=temperature)
    assert len(calls) == (out["steps"] - 1) // 2  # steps 2, 4, ...
    if not temperature:
        assert [eng.requests[i].tokens for i in out["rids"]] == generate(target, PROMPTS, steps, temperature=0.0).tokens
    calls.clear()
    open_gate = Engine(target, drafter, make_policy("dspark+gate"), flat_profile(n * (GAMMA + 1), 100.0), GAMMA,
                       page_size=8, max_batch=n, max_seq_len=48, draft_profile=flat_profile(n, 1e9))
    out = run_closed_loop(open_gate, prompts, n, steps, temperature=temperature)
    assert len(calls) == out["steps"]


def _gate(draft_rate: float):
    """A gated policy with a constant mean survival of 0.5 per position: two requests draft (1 + 0.5 * 4) = 3 tokens a
    round at ``1 / (1 / 100 + 1 / draft_rate)`` rounds/s against 100 plain steps/s."""
    policy = make_policy("dspark+gate")
    policy.bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA, 4, flat_profile(4, draft_rate))
    policy._mean_survival = [0.5] * GAMMA
    return policy


def _probes(policy, steps):
    out = []
    for s in steps:
        if policy.drafts([0, 1], s):
            out.append(s)
            policy._last_drafted = s
    return out


def test_closed_gate_probes_less_and_less_and_reopens():
    """The mean set before any drafted round is a prior: its first decision (step 1 here) counts as a probe."""
    near = _gate(42.0)  # gain 3 / (1 + 100 / 42) = 0.89: probes back off 8, 16, 32, ... up to 256
    assert _probes(near, range(1, 800)) == [9, 25, 57, 121, 249, 505, 761]
    far = _gate(10.0)  # gain 3 / 11 = 0.27: it waits the longest at once
    assert _probes(far, range(1, 800)) == [257, 513, 769]
    far.bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA, 4, flat_profile(4, 1e9))  # drafting pays now: open
    assert far.drafts([0, 1], 777) and far._probe_wait == far.GATE_PROBE


def test_gate_waits_the_longest_while_one_probe_could_not_open_it():
    """With a prior the next drafted round moves the mean survival by GATE_EMA only, so its best outcome (survival 1 at
    all four positions: 1 + 4 * 0.55 = 3.2 tokens against 3) lifts the gain by 3.2 / 3. At draft rate 42 (gain 0.89,
    at best 0.95) no probe can open the gate: it waits the longest at once; at draft rate 48 (gain 0.97, at best 1.04)
    it backs off 8, 16, ..."""
    def gate(draft_rate):
        policy = make_policy("dspark+gate", prior_survival=[0.5] * GAMMA)
        policy.bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA, 4, flat_profile(4, draft_rate))
        return policy

    far, near = gate(42.0), gate(48.0)
    assert far.gain(2) == pytest.approx(0.89, abs=0.01) and far._best_gain_after_probe(2) == pytest.approx(
        far.gain(2) * 3.2 / 3)
    assert _probes(far, range(1, 800)) == [257, 513, 769]
    assert near.gain(2) == pytest.approx(0.97, abs=0.01) and near._best_gain_after_probe(2) > 1
    assert _probes(near, range(1, 300)) == [9, 25, 57, 121, 249]


def test_gate_decides_on_measured_times_once_it_has_both():
    """Modelled, drafting pays (gain 3 / (1 + 100 / 1e9) ~ 3). Once a drafted round and a plain step of two requests
    are both timed, the gain is the expected tokens per request at the drafted width (1 + 0.5 * 4 = 3) times the plain
    step's time over the drafted round's (running means)."""
    policy = _gate(1e9)
    assert policy.gain(2) == pytest.approx(3.0) and policy.drafts([0, 1], 0)
    policy.observe_round(2, True, 0.06)  # a drafted round alone: still modelled
    assert policy.gain(2) == pytest.approx(3.0)
    policy.observe_round(2, False, 0.04)
    assert policy.gain(2) == pytest.approx(3 * 0.04 / 0.06) and policy.drafts([0, 1], 1)
    policy.observe_round(2, True, 0.56)  # running mean: 0.8 * 0.06 + 0.2 * 0.56 = 0.16 s
    assert policy._seconds[2, True] == pytest.approx(0.16)
    assert policy.gain(2) == pytest.approx(3 * 0.04 / 0.16) and not policy.drafts([0, 1], 2)
    assert policy.gain(1) == pytest.approx(_gate(1e9).gain(1))  # another live count: still modelled
    plain = make_policy("dspark")
    plain.observe_round(2, True, 0.06)  # no gate: nothing kept
    assert plain._seconds == {}


def test_probe_that_measures_a_slow_round_waits_the_longest_next():
    """Modelled gain 0.89 backs off 8, 16, ...; timed rounds giving gain 3 * 0.02 / 0.12 = 0.5 set the next wait to
    the longest at once, at the first decision after the probe: not even a next round whose every draft survived (5
    tokens, at weight 1 with neither a prior nor a drafted round yet) would reach 5 * 0.02 / 0.12 = 0.83."""
    policy = _gate(42.0)
    assert _probes(policy, range(1, 10)) == [9]
    policy.observe_round(2, False, 0.02)
    policy.observe_round(2, True, 0.12)
    assert _probes(policy, range(10, 300)) == [9 + policy.GATE_PROBE_MAX]


SHORT_PROMPTS = [[1, 5, 9, 13], [1, 40], [1, 7, 8]]  # at most gamma + 1 tokens: no drafter backlog at the first round


@pytest.mark.parametrize("prompts", [SHORT_PROMPTS, PROMPTS[:3]], ids=["short", "backlog"])
def test_engine_with_a_clock_times_every_round(target, drafter, prompts):  # noqa: F811
    """``Engine(clock=...)`` hands the policy every round's duration, plain steps and drafted rounds alike (the one
    after six plain steps too). A backlog of pending context (a 26-token prompt; six plain steps) goes to the drafter
    before the round's clock starts: two clock reads per round either way. Without a clock nothing is reported."""
    for clock in ("ticks", None):
        seen, ticks = [], iter(range(10**6))
        policy = _DraftFrom(7, first=True)
        policy.observe_round = lambda r, drafted, seconds: seen.append((drafted, seconds))
        eng = Engine(target, drafter, policy, linear_profile(4 * (GAMMA + 1), 6.0), GAMMA, max_batch=4,
                     max_seq_len=64, clock=None if clock is None else (lambda: float(next(ticks))))
        out = run_closed_loop(eng, prompts, 3, 12)
        if clock is None:
            assert not seen
            continue
        assert [d for d, _ in seen] == [True] + [False] * 6 + [True] * (out["steps"] - 7)
        assert all(sec == 1.0 for _, sec in seen)


def test_backlog_goes_to_the_drafter_before_the_round_is_timed(target, drafter, monkeypatch):  # noqa: F811
    """A request joining a drafting batch brings its whole prompt as pending context: the drafter takes it in a call
    of its own before the round's clock starts (here that call moves the fake clock by 100 s)."""
    now, calls = [0.0], []
    extend = drafter.extend

    def slow_extend(*args):
        calls.append(args[2].numel())
        now[0] += 100.0
        return extend(*args)

    def clock():
        now[0] += 1.0
        return now[0]

    seen = []
    policy = make_policy("fixed3")
    policy.observe_round = lambda r, drafted, seconds: seen.append(seconds)
    monkeypatch.setattr(drafter, "extend", slow_extend)
    eng = Engine(target, drafter, policy, linear_profile(4 * (GAMMA + 1), 6.0), GAMMA, max_batch=1, max_seq_len=64,
                 clock=clock)
    out = run_closed_loop(eng, [[1, 5, 9, 13], PROMPTS[2]], 1, 6)
    assert calls == [26]  # the second request's 26-token prompt, after the first request's rounds
    assert len(seen) == out["steps"] and all(sec == 1.0 for sec in seen)


def test_gate_prior_is_checked_and_moved_by_each_drafted_round():
    with pytest.raises(ValueError, match="prior_survival must hold probabilities"):
        make_policy("dspark+gate", prior_survival=[0.5, 1.2])
    with pytest.raises(ValueError, match="3 prior survival values for gamma = 4"):
        make_policy("dspark_prod+gate", prior_survival=[0.5] * 3).bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA,
                                                                       4, flat_profile(4, 1.0))
    policy = make_policy("dspark+gate", prior_survival=[0.9] * GAMMA)
    policy.bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA, 4, flat_profile(4, 1e9))
    assert policy.drafts([0, 1], 0)  # drafting pays on the prior alone: the first round drafts
    policy._remember(torch.full((2 * GAMMA,), 0.1), 2, GAMMA, 0)
    # the prior stands for the held-out mean of thousands of rounds: one round moves it by GATE_EMA, not replaces it
    assert policy._mean_survival == pytest.approx([0.9 - policy.GATE_EMA * 0.8] * GAMMA)


def test_gate_mean_survival_is_a_plain_mean_before_the_ema():
    policy = make_policy("dspark+gate")
    policy.bind(flat_profile(4 * (GAMMA + 1), 100.0), GAMMA, 4, flat_profile(4, 1.0))
    for i, v in enumerate([0.2, 0.8, 0.5]):
        policy._remember(torch.full((2 * GAMMA,), v), 2, GAMMA, i)
    assert policy._mean_survival == pytest.approx([0.5] * GAMMA)
    for i in range(3, 30):
        policy._remember(torch.full((2 * GAMMA,), 1.0), 2, GAMMA, i)
    # rounds 1..10 (weight 1 / n): the plain mean of 0.5 x 3 and 1 x 7 = 0.85; rounds 11..30 weigh GATE_EMA each
    assert policy._mean_survival[0] == pytest.approx(1 - 0.15 * (1 - policy.GATE_EMA) ** 20)


class _DraftFrom(FixedK):
    """Verifies nothing (greedy output = the target's); drafts only from step ``start`` on (``first``: and at step 0,
    plain steps in between)."""

    def __init__(self, start: int, first: bool = False) -> None:
        super().__init__(0, f"draft_from{start}")
        self.start, self.first = start, first

    def drafts(self, live, step):
        return step >= self.start or (self.first and step == 0)

    def draft_width(self, live, step):
        return self.gamma


class _Width(_DraftFrom):
    """Drafts every round at a fixed (possibly bad) width."""

    def __init__(self, width) -> None:
        super().__init__(0)
        self.width = width

    def draft_width(self, live, step):
        return self.width


@pytest.mark.parametrize("width", [0, GAMMA + 1, True, 2.0, None])
def test_policy_width_outside_the_block_is_refused(target, drafter, width):  # noqa: F811
    eng = Engine(target, drafter, _Width(width), linear_profile(2 * (GAMMA + 1), 6.0), GAMMA, page_size=8, max_batch=2)
    with pytest.raises(ValueError, match=f"asked for draft width {width!r}, outside 1..{GAMMA}"):
        run_closed_loop(eng, PROMPTS[:2], 2, 4)


@pytest.mark.parametrize("which", ["block", "chain"])
def test_deferred_drafter_context_catches_up_exactly(target, drafter, monkeypatch, which):  # noqa: F811
    """Plain steps defer the drafter's context; the next drafting round takes it in, and drafts exactly what a drafter
    given its context at every step drafts from the same context."""
    from dspark_kernels.engine import engine as engine_module
    from tests.test_chain_drafter import make_drafter as make_chain_drafter

    d = drafter if which == "block" else make_chain_drafter(target, max_steps=GAMMA)
    seen = {}
    real = engine_module.draft

    def record(drafter_, dstate, live, anchors, gamma, samp, impl, context=None):
        out = real(drafter_, dstate, live, anchors, gamma, samp, impl, context=context)
        seen.setdefault(id(dstate), []).append(out)
        return out

    monkeypatch.setattr(engine_module, "draft", record)
    outs = []
    for start in (0, 3):
        eng = Engine(target, d, _DraftFrom(start), linear_profile(4 * (GAMMA + 1), 6.0), GAMMA, page_size=8,
                     max_batch=4, max_seq_len=64)
        rids = [eng.add_request(p, 6) for p in PROMPTS[:3]]
        while eng.has_work:
            eng.step()
        outs.append(([eng.requests[i].tokens for i in rids], seen[id(eng.dstate)]))
    (tok_all, drafts_all), (tok_late, drafts_late) = outs
    assert tok_all == tok_late == generate(target, PROMPTS[:3], 6, temperature=0.0).tokens
    assert len(drafts_late) == len(drafts_all) - 3
    for a, b in zip(drafts_all[3:], drafts_late):
        assert torch.equal(a.tokens, b.tokens)
        if a.confidence_logits is not None:
            torch.testing.assert_close(a.confidence_logits, b.confidence_logits, rtol=1e-4, atol=1e-4)


def test_gated_policy_needs_the_draft_profile(target, drafter):  # noqa: F811
    with pytest.raises(ValueError, match="draft-round profile"):
        engine(target, drafter, "dspark_prod+gate")
    with pytest.raises(ValueError, match="measured up to B = 2 requests"):
        Engine(target, drafter, make_policy("dspark+gate"), linear_profile(40, 4.0), GAMMA, max_batch=4,
               draft_profile=flat_profile(2, 1.0))


def test_step_table_adds_the_draft_round_of_the_live_requests():
    """``1 / (1 / SPS(B) + 1 / DPS(R))``: the draft round of R requests is charged at every B, and grows with R, so
    the gate can be open for one request and closed for two."""
    policy = make_policy("dspark+gate")
    sps = SPSProfile("test", "t", (1, 2, 3, 4, 5, 6, 7, 8), ((10.0, 10.0, 5.0, 5.0, 4.0, 4.0, 2.0, 2.0),),
                     source="modelled")
    draft = SPSProfile("test", "d", (1, 2), ((40.0, 5.0),), source="modelled")
    policy.bind(sps, 3, 2, draft)
    torch.testing.assert_close(policy.step_table(1)[1:], 1.0 / (1.0 / torch.tensor(sps.steps_per_s[0]) + 1 / 40.0))
    assert float(policy.step_table(2)[4]) == pytest.approx(1.0 / (1 / 5.0 + 1 / 5.0))
    assert torch.equal(policy.sps_table, sps.as_table(8))  # the plain rate the gate compares with
    policy._mean_survival = [0.9, 0.9, 0.9]
    # r = 1, k = 1: 1.9 * 1 / (0.1 + 0.025) = 15.2 > 10; r = 2: at best 2 * 1.9 * 2.5 = 9.5 < 2 * 10 = 20
    assert policy.drafts([0], 1) and not policy.drafts([0, 1], 1)
    plain = make_policy("dspark")
    plain.bind(sps, 3, 2)
    assert plain.step_table(2) is plain.sps_table  # no draft profile: drafting taken as free


def test_draft_cost_follows_the_width():
    """With the narrow (one-slot) draft profile the draft round of R requests costs ``D(R, w)``, linear in the width
    between the two profiles; a round's verify choice reads its drafted width's cost, and the width rule charges each
    common length the slots it drafts."""
    sps = SPSProfile("test", "t", tuple(range(1, 9)), ((10.0,) * 8,), source="modelled")  # 0.1 s a step
    full = SPSProfile("test", "d", (1, 2), ((10.0, 5.0),), source="modelled")  # 0.1 s / 0.2 s at gamma = 3 slots
    narrow = SPSProfile("test", "d1", (1, 2), ((20.0, 10.0),), source="modelled")  # 0.05 s / 0.1 s at one slot
    charged, flat = make_policy("dspark"), make_policy("dspark")
    charged.bind(sps, 3, 2, full, narrow)
    flat.bind(sps, 3, 2, full)
    for r, seconds in ((1, (0.05, 0.075, 0.1)), (2, (0.1, 0.15, 0.2))):
        assert charged.step_table(r, 0) is charged.sps_table  # a plain step
        for width, d in enumerate(seconds, 1):
            assert charged.draft_seconds(r, width) == pytest.approx(d)
            assert flat.draft_seconds(r, width) == pytest.approx(seconds[-1])
            torch.testing.assert_close(charged.step_table(r, width)[1:], torch.full((8,), 1 / (0.1 + d)))
    # one request, survival 0.9, 0.5, 0.3 at width 3: the slots are drafted, so verifying all three is best (the
    # draft costs the same at every verify length); for the next round, at 0.1 s a step, verifying k drafted slots is
    # rated 1 / 0.1 = 10, 1.9 / 0.15 = 12.7, 2.4 / 0.175 = 13.7, 2.7 / 0.2 = 13.5 tokens/s: two slots; charged the
    # full draft at every width (0.1 s): 9.5, 12, 13.5 for k = 1..3: all three
    conf = torch.logit(torch.tensor([[0.9, 0.5 / 0.9, 0.3 / 0.5]]))
    assert charged.choose(conf, [0], 0).tolist() == [3] and flat.choose(conf, [0], 0).tolist() == [3]
    assert charged.draft_width([0], 1) == 2 and flat.draft_width([0], 1) == 3
    with pytest.raises(ValueError, match="narrow_draft_profile .* needs draft_profile"):
        make_policy("dspark").bind(sps, 3, 2, None, narrow)
    with pytest.raises(ValueError, match="measured up to B = 1 requests"):
        make_policy("dspark").bind(sps, 3, 2, full, SPSProfile("test", "d1", (1,), ((20.0,),), source="modelled"))


@pytest.fixture(scope="module")
def traces(target, drafter):  # noqa: F811
    prompts = [[1, 5 + i, 9, 2 * i + 3] for i in range(12)]
    res = speculative_generate(target, drafter, prompts, 24, GAMMA, temperature=1.0, seeds=list(range(12)),
                               record_traces=True)
    return Traces.from_result(res.extra)


def test_replay_oracle_bounds_every_policy(traces):
    profile = linear_profile(64 * (GAMMA + 1), 16.0)
    points = sweep(POLICY_NAMES, traces, profile, [1, 8, 64])
    for c in (1, 8, 64):
        at = {p["policy"]: p for p in points if p["concurrency"] == c}
        assert at["none"]["tau"] == 1.0 and at["none"]["verified_tokens"] == 0
        assert at["oracle"]["rejected_tokens"] == 0
        for name, p in at.items():
            assert at["oracle"]["system_tps"] >= p["system_tps"] * (1 - 1e-9), (c, name)
            assert p["per_user_tps_p10"] <= p["per_user_tps_median"]


def draft_rounds_profile(max_r: int, seconds_per_request: float) -> SPSProfile:
    """A draft-round profile whose round of R requests takes ``R * seconds_per_request``."""
    sizes = tuple(range(1, max_r + 1))
    return SPSProfile("test", "rounds", sizes, (tuple(1.0 / (r * seconds_per_request) for r in sizes),),
                      source="modelled")


def test_replay_charges_the_draft_rounds(traces):
    """With draft-round profiles each drafted step also takes ``D(R, w)``: a fixed-k point keeps its tokens and steps
    and gains exactly ``steps x D(R, k)`` seconds (free drafting through a profile matches no profile at all); the
    gated policies run, and the oracle, which plans each round's draft knowing its outcome, still bounds every
    policy."""
    profile = linear_profile(16 * (GAMMA + 1), 16.0)
    free = draft_rounds_profile(16, 1e-12)
    full, narrow = draft_rounds_profile(16, 0.05), draft_rounds_profile(16, 0.02)
    for c in (1, 4, 16):
        for name in ("none", "mtp1", "fixed3"):
            plain = simulate(make_policy(name), traces, profile, c)
            through_free = simulate(make_policy(name), traces, profile, c, draft_profile=free,
                                    narrow_draft_profile=free)
            charged = simulate(make_policy(name), traces, profile, c, draft_profile=full, narrow_draft_profile=narrow)
            assert through_free["system_tps"] == pytest.approx(plain["system_tps"], rel=1e-9)
            assert charged["steps"] == plain["steps"] and charged["tau"] == plain["tau"]
            k = int(plain["verified_tokens"])
            d = 0.0 if k == 0 else c * (0.02 + (k - 1) / (GAMMA - 1) * 0.03)
            tokens = plain["tau"] * plain["steps"] * c
            expected = tokens / (tokens / plain["system_tps"] + plain["steps"] * d)
            assert charged["system_tps"] == pytest.approx(expected, rel=1e-9), (c, name)
        points = [simulate(make_policy(n, prior_survival=[0.5] * GAMMA), traces, profile, c, draft_profile=full,
                           narrow_draft_profile=narrow) for n in (*POLICY_NAMES, *GATED_POLICY_NAMES)]
        at = {p["policy"]: p for p in points}
        assert at["oracle"]["rejected_tokens"] == 0 and at["oracle"]["drafted_rounds"] < 1
        for name, p in at.items():
            assert at["oracle"]["system_tps"] >= p["system_tps"] * (1 - 1e-9), (c, name)
        assert at["none"]["drafted_rounds"] == 0 and at["fixed3"]["drafted_rounds"] == 1
    with pytest.raises(ValueError, match="needs draft_profile"):
        simulate(make_policy("dspark"), traces, profile, 2, narrow_draft_profile=narrow)
    with pytest.raises(ValueError, match="draft-round profile"):
        simulate(make_policy("dspark+gate"), traces, profile, 2)


class _PastTheWidth(FixedK):
    """A faulty policy: verifies one draft more than it had drafted."""

    def choose(self, conf_logits, live, step, realised=None):
        return super().choose(conf_logits, live, step, realised) + 1


def test_verify_lengths_past_the_drafted_width_are_refused(target, drafter, traces):  # noqa: F811
    """A policy that asks to verify more drafts than were drafted would verify another request's drafts: the round
    refuses it (its requests fail with the error, the pages balance) and the replay raises, as it does for a draft
    width outside 1..gamma."""
    eng = Engine(target, drafter, _PastTheWidth(2), linear_profile(4 * (GAMMA + 1), 6.0), GAMMA, page_size=8,
                 max_batch=4, max_seq_len=64)
    rids = [eng.add_request(p, 8) for p in PROMPTS[:2]]
    while eng.has_work:
        eng.step()
    for rid in rids:
        assert eng.requests[rid].reason == "error" and "verify_lens must hold 2 ints in 0..2" in eng.requests[rid].error
    assert eng.tcache.num_free_pages == eng.kv_pages
    with pytest.raises(PolicyError, match="chose verify lengths .* at width 2"):
        simulate(_PastTheWidth(2), traces, linear_profile(8 * (GAMMA + 1), 6.0), 2,
                 draft_profile=draft_rounds_profile(2, 0.01))
    wide = FixedK(2)
    wide.draft_width = lambda live, step: GAMMA + 1
    with pytest.raises(PolicyError, match="draft width 5, outside 1..4"):
        simulate(wide, traces, linear_profile(8 * (GAMMA + 1), 6.0), 2, draft_profile=draft_rounds_profile(2, 0.01))


def test_nan_confidences_from_the_drafter_fail_their_requests(target, drafter, monkeypatch):  # noqa: F811
    """A drafter whose confidence head emits NaN fails the requests of that round, with an error naming the policy
    (instead of sorting NaN survivals), frees their pages, and leaves the engine usable."""
    real = drafter.draft

    def nan_confidences(*args, **kwargs):
        out = real(*args, **kwargs)
        return DraftOutput(out.tokens, out.draft_probs, torch.full_like(out.confidence_logits, float("nan")))

    monkeypatch.setattr(drafter, "draft", nan_confidences)
    eng = engine(target, drafter, "dspark")
    rid = eng.add_request(PROMPTS[0], 8)
    for _ in range(3):
        eng.step()
    req = eng.requests[rid]
    assert req.reason == "error" and "policy 'dspark': confidence logits contain NaN" in req.error
    assert not eng.has_work and eng.tcache.num_free_pages == eng.kv_pages


def test_bad_inputs_raise_clear_errors(target, drafter, traces, tmp_path):  # noqa: F811
    bad = tmp_path / "sps.json"
    doc = linear_profile(8, 4.0).to_dict()
    doc["steps_per_s"] = [[1.0] * 7]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="steps_per_s"):
        read_profile(bad)
    with pytest.raises(ValueError, match="fewer than the 8 requests"):
        Engine(target, drafter, make_policy("dspark"), linear_profile(4, 4.0), GAMMA, max_batch=8)
    with pytest.raises(ValueError, match="fewer than the 16 requests"):
        simulate(make_policy("mtp1"), traces, linear_profile(8, 4.0), 16)
    policy = make_policy("dspark")
    policy.bind(linear_profile(20, 4.0), GAMMA, 2)
    with pytest.raises(ValueError, match="NaN"):
        policy.choose(torch.tensor([[0.1, float("nan"), 0.0, 1.0], [0.0] * 4]), [0, 1], 0)
    with pytest.raises(ValueError, match="replay"):
        engine(target, drafter, "oracle")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="max_seq_len"):
        engine(target, drafter, "mtp1").add_request([1] * 60, 10)


@pytest.mark.parametrize("policy", ["none", "fixed3"])
def test_null_drafter_decodes_exactly_without_drafting(target, policy):  # noqa: F811
    """The no-speculation baseline runs with no drafter at all; a policy that does verify its placeholder drafts
    still reproduces the target (they are checked as deterministic proposals and rejected)."""
    eng = Engine(target, NullDrafter(), make_policy(policy), linear_profile(4 * (GAMMA + 1), 6.0), GAMMA,
                 page_size=8, max_batch=4, max_seq_len=64)
    ar = generate(target, PROMPTS, 10, temperature=0.0)
    rids = [eng.add_request(p, 10) for p in PROMPTS]
    while eng.has_work:
        eng.step()
    assert [eng.requests[i].tokens for i in rids] == ar.tokens
    out = speculative_generate(target, NullDrafter(), [[1, 11, 12]] * 2000, 2, 2, temperature=1.0,
                               seeds=list(range(2000)))
    assert_follows_target(target, [1, 11, 12], out.tokens, 1.0, 2)


def test_live_baselines_pay_only_for_their_own_drafts(target, drafter, tmp_path):  # noqa: F811
    import argparse

    from dspark_kernels.bench.serving import baseline_drafter

    args = argparse.Namespace(gamma=5, mtp1_drafter=tmp_path / "missing", gemm_dtype="float32", draft_vocab=None)
    none, g_none = baseline_drafter("none", args, target, drafter)
    assert isinstance(none, NullDrafter) and g_none == 1
    assert baseline_drafter("mtp1", args, target, drafter) == (drafter, 5)  # no MTP-1 drafter: the first draft
    assert baseline_drafter("dspark", args, target, drafter) == (drafter, 5)
    from tests.test_chain_drafter import make_drafter as make_chain_drafter

    make_chain_drafter(target, max_steps=1, name="mtp1").save(tmp_path / "mtp1")
    args.mtp1_drafter = tmp_path / "mtp1"
    mtp, g_mtp = baseline_drafter("mtp1", args, target, drafter)
    assert g_mtp == 1 and mtp.config.name == "mtp1"


@pytest.mark.parametrize("mode", ["replay", "live", "live-invariant"])
def test_serving_cli_writes_json_csv_png(tmp_path, monkeypatch, mode):
    import argparse

    from dspark_kernels.bench import serving
    from dspark_kernels.models import load_model
    from tests.tiny_models import save_tiny_qwen3

    torch.manual_seed(0)
    save_tiny_qwen3(tmp_path / "target", vocab_size=VOCAB, peak=1)
    make_drafter(load_model(tmp_path / "target")).save(tmp_path / "drafter")
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    invariant = mode == "live-invariant"
    mode = "live" if invariant else mode
    args = parser.parse_args(["--mode", mode, "--model", str(tmp_path / "target"), "--drafter",
                              str(tmp_path / "drafter"), "--gamma", "3", "--max-new-tokens", "6", "--prompt-len", "5",
                              "--trace-prompts", "4", "--corpus", str(tmp_path / "none"), "--sps-dir",
                              str(tmp_path / "sps"), "--json", str(tmp_path / "out.json"), "--concurrency", "1", "2",
                              "--policies", "none", "mtp1", "dspark", "dspark+gate", "oracle",
                              "--mtp1-drafter", str(tmp_path / "no_mtp1"), "--repeats", "2"]
                             + (["--batch-invariant"] if invariant else []))
    with pytest.raises(ValueError, match="--length-range must be in"):
        serving.main(argparse.Namespace(**{**vars(args), "length_range": 1.0}))
    with pytest.raises(ValueError, match="--narrow-draft-profile needs --draft-profile"):
        serving.main(argparse.Namespace(**{**vars(args), "narrow_draft_profile": tmp_path / "none.json"}))
    with pytest.raises(ValueError, match="--draft-profile .*: no such file" if mode == "replay" else
                       "--draft-profile are for --mode replay"):
        serving.main(argparse.Namespace(**{**vars(args), "draft_profile": tmp_path / "none.json"}))
    order, closed_loop = [], serving.run_closed_loop
    monkeypatch.setattr(serving, "run_closed_loop", lambda eng, *a, **k: order.append(eng.policy.name) or
                        closed_loop(eng, *a, **k))
    serving.main(args)
    if mode == "live":  # a fixed3 warm-up run per policy, then each concurrency's cycles, every other one reversed
        cycle = ["none", "mtp1", "dspark", "dspark+gate"]
        assert order == ["fixed3"] * 4 + 2 * (cycle + cycle[::-1])
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["mode"] == mode and (tmp_path / "out.csv").exists() and (tmp_path / "out.png").exists()
    names = {"none", "mtp1", "dspark"} | ({"oracle"} if mode == "replay" else {"dspark+gate"})
    assert {p["policy"] for p in data["points"]} == names and len(data["points"]) == 2 * len(names)
    for p in data["points"]:
        assert p["system_tps"] > 0 and p["per_user_tps_p10"] <= p["per_user_tps_median"] and p["tau"] >= 1
    # MTP-1 against itself: exactly 1 at a point on its Pareto frontier; a point that another MTP-1 point dominates
    # (timing noise can make c = 2 faster per user than c = 1 on a tiny model) reads the frontier above it, >= 1
    user, system = serving._frontier([p for p in data["points"] if p["policy"] == "mtp1"])
    for row in data["readouts"]["per_user_at_matched_throughput_vs_mtp1"]:
        own = row["vs_mtp1"]["mtp1"]
        if any(u == row["mtp1_per_user_tps"] and s == row["system_tps"] for u, s in zip(user, system)):
            assert own == pytest.approx(1.0)
        else:
            assert own >= 1.0 - 1e-9
    assert data["profile"]["source"] == ("measured" if mode == "live" else "modelled")
    if mode == "live":
        assert all(len(p["system_tps_runs"]) == 2 and p["system_tps"] in p["system_tps_runs"] for p in data["points"])
        profiles = list((tmp_path / "sps").glob("*.json"))
        assert len(profiles) == 3  # the target's verify steps, the draft rounds at gamma slots and at one
        assert sum("rounds_w1" in p.name for p in profiles) == 1
        assert all(("invariant" in p.name) == invariant for p in profiles)
        assert data["settings"]["batch_invariant"] is invariant
        assert data["settings"]["length_range"] == 0.5
        paired = data["readouts"]["paired_system_tps_ratios"]
        assert set(paired) == {"1", "2"} and all(row["none"] == {"vs_none": 1.0} for row in paired.values())
    else:
        assert "paired_system_tps_ratios" not in data["readouts"]
    if mode == "replay":  # charged the draft rounds, the gated policies run too
        draft = tmp_path / "rounds.json"
        draft.write_text(json.dumps(draft_rounds_profile(2, 0.01).to_dict()))
        serving.main(argparse.Namespace(**{**vars(args), "draft_profile": draft, "narrow_draft_profile": draft}))
        data = json.loads((tmp_path / "out.json").read_text())
        assert {p["policy"] for p in data["points"]} == names | {"dspark+gate"}
        assert str(draft) in data["profile"]["origin"]
        assert all(0 <= p["drafted_rounds"] <= 1 for p in data["points"])


def test_serving_profiles_are_keyed_by_the_device_the_target_runs_on(monkeypatch):
    """A target run on the CPU of a machine that also has a GPU measures and looks up CPU profiles (the key used to
    name the GPU whenever one was visible)."""
    from dspark_kernels.engine.sps import profile_device_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    assert profile_device_name(torch.device("cpu")) == f"cpu-{platform.machine()}-{torch.get_num_threads()}t"


def test_paired_ratios_divide_within_each_round_robin_cycle():
    from dspark_kernels.bench.serving import paired_ratios

    def pt(policy, c, runs):
        return {"policy": policy, "concurrency": c, "system_tps_runs": runs}

    # cycle speeds drift 100 -> 200 -> 50: the gated policy is 1.2x / 0.85x / 0.9x none cycle by cycle (median 0.9),
    # while its median run (120) over none's (100) would say 1.2x
    points = [pt("none", 4, [100.0, 200.0, 50.0]), pt("dspark+gate", 4, [120.0, 170.0, 45.0]),
              pt("fixed3", 4, [50.0, 120.0, 30.0]), pt("fixed7", 4, [60.0, 100.0, 20.0]),
              pt("dspark", 4, [66.0, 108.0, 36.0]), pt("dspark", 8, [10.0, 30.0]), pt("fixed7", 8, [20.0, 10.0])]
    r = paired_ratios(points)
    assert r["4"]["dspark+gate"]["vs_none"] == pytest.approx(0.9)
    # best fixed per cycle: 60, 120, 30 -> dspark 1.1, 0.9, 1.2 -> median 1.1
    assert r["4"]["dspark"] == pytest.approx({"vs_none": 0.66, "vs_best_fixed": 1.1})
    assert r["4"]["fixed7"]["vs_best_fixed"] == pytest.approx(100 / 120)
    assert r["8"]["dspark"] == pytest.approx({"vs_best_fixed": 1.75})  # 0.5 and 3.0; no none at c = 8


def test_serving_reprofile_measures_anew_over_a_stored_profile(tmp_path):
    """A stored CPU profile is reused while it is large enough and a spot check of its first sizes agrees with it
    (within 15%); one that reads slower or faster than the spot check, or any with ``--reprofile``, is measured anew.
    Draft profiles are not spot-checked themselves: they are measured anew when the target's profile went stale."""
    import argparse

    from dspark_kernels.bench.serving import SPOT_SIZES, _live_profile
    from dspark_kernels.engine.sps import SPSProfile, load_profile

    calls = []

    def measure(rate):
        def run(n, model):
            calls.append(n)
            return SPSProfile("cpu-test", model, tuple(range(1, n + 1)), ((rate,) * n,), source="measured")
        return run

    args = argparse.Namespace(sps_dir=tmp_path, reprofile=False)
    first, where, stale = _live_profile(args, "cpu-test", "m", 8, measure(10.0))
    assert where.startswith("measured, saved to") and first.steps_per_s[0][0] == 10.0 and calls == [8] and not stale
    again, where, stale = _live_profile(args, "cpu-test", "m", 8, measure(11.0))  # within the tolerance: kept
    assert where.startswith("loaded (measured ") and "0.91x" in where and again.steps_per_s[0][0] == 10.0
    assert calls == [8, SPOT_SIZES] and not stale
    slow, where, stale = _live_profile(args, "cpu-test", "m", 8, measure(20.0))  # stored: half the machine's speed
    assert where.startswith("measured anew") and "0.50x" in where and slow.steps_per_s[0][0] == 20.0 and stale
    assert calls == [8, SPOT_SIZES, SPOT_SIZES, 8]
    args.reprofile = True  # a smaller run measures anew as far as the stored profile went
    fresh, where, stale = _live_profile(args, "cpu-test", "m", 2, measure(21.0))
    assert where.startswith("measured, saved") and fresh.steps_per_s[0][0] == 21.0 and calls[-1] == 8 and not stale
    assert load_profile("cpu-test", "m", tmp_path).steps_per_s[0] == (21.0,) * 8

    sparse = SPSProfile("cpu-test", "s", (8, 16), ((3.0, 2.0),), source="measured")  # shares no size with a spot check
    sparse.save(tmp_path)
    args.reprofile = False
    _, where, stale = _live_profile(args, "cpu-test", "s", 16, measure(3.0))
    assert stale and "shares no size with a spot check" in where

    # a draft profile: loaded without a spot check, measured anew when the target's was stale
    _live_profile(args, "cpu-test", "d", 4, measure(5.0))
    calls.clear()
    kept, where, _ = _live_profile(args, "cpu-test", "d", 4, measure(50.0), spot_check=False)
    assert kept.steps_per_s[0][0] == 5.0 and where.startswith("loaded") and calls == []
    anew, where, _ = _live_profile(args, "cpu-test", "d", 4, measure(50.0), spot_check=False, stale=True)
    assert anew.steps_per_s[0][0] == 50.0 and "failed its spot check" in where and calls == [4]
