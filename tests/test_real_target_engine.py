"""Every live policy of the continuous-batching engine is lossless on the real target, SmolLM2-135M-Instruct, with
its shipped drafters (draft vocabulary 8192): at T = 0 each emits greedy AR's tokens (batch-invariant target), and at
T = 0.7 the first two tokens of many seeded requests follow the target's exact distribution (chi-square of both
marginals and of the pair). The first token comes from the prefill, the second from the first verified round."""

from __future__ import annotations

import pytest

from dspark_kernels.drafters import NullDrafter, load_drafter
from dspark_kernels.engine.engine import Engine, run_closed_loop
from dspark_kernels.engine.policies import GATED_POLICY_NAMES, POLICY_NAMES, make_policy
from dspark_kernels.engine.sps import SPSProfile
from dspark_kernels.models import generate, load_model
from dspark_kernels.models.registry import shipped_drafter
from dspark_kernels.models.target_tokenizer import load_target_tokenizer
from dspark_kernels.train.calibration import load_calibration
from tests.lossless import assert_follows_marginals, exact_marginals

MODEL = "smollm2-135m-instruct"
GAMMA = 7
POLICIES = [p for p in (*POLICY_NAMES, *GATED_POLICY_NAMES) if p != "oracle"]
SAMPLES, TEMPERATURE, CONCURRENCY = 160, 0.7, 80


def modelled(max_b: int, knee: float) -> SPSProfile:
    """``t(B) = 1 + B / knee``: verification costs, so the confidence policies really choose lengths."""
    sizes = tuple(range(1, max_b + 1))
    return SPSProfile("test", MODEL, sizes, (tuple(1.0 / (1.0 + b / knee) for b in sizes),), source="modelled")


@pytest.fixture(scope="module")
def target(smollm2_gguf):
    return load_model(MODEL, batch_invariant=True)


@pytest.fixture(scope="module")
def drafters(target):
    return {name: load_drafter(shipped_drafter(MODEL, name), target, draft_vocab=8192) for name in ("dspark", "mtp1")}


@pytest.fixture(scope="module")
def prompts(smollm2_gguf):
    tok = load_target_tokenizer(MODEL)
    return [tok.encode_chat([{"role": "user", "content": m}]) for m in ("Name a primary colour.", "What is 7 + 5?")]


def make_engine(target, drafters, policy: str, max_batch: int) -> Engine:
    path = shipped_drafter(MODEL, "dspark")
    baselines = {"none": (NullDrafter(), 1), "mtp1": (drafters["mtp1"], 1)}
    drafter, gamma = baselines.get(policy, (drafters["dspark"], GAMMA))
    scheduler = make_policy(policy, *load_calibration(path, GAMMA).policy_args())
    return Engine(target, drafter, scheduler, modelled(max_batch * (GAMMA + 1), 12.0), gamma, max_batch=max_batch,
                  max_seq_len=96, draft_profile=modelled(max_batch, 40.0),
                  narrow_draft_profile=modelled(max_batch, 80.0))


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_engine_equals_ar_on_the_real_target(target, drafters, prompts, policy):
    eng = make_engine(target, drafters, policy, max_batch=2)
    out = run_closed_loop(eng, prompts, 2, 12)
    assert [eng.requests[i].tokens for i in out["rids"]] == generate(target, prompts, 12, temperature=0.0).tokens


@pytest.fixture(scope="module")
def exact(target, prompts):
    pairs: dict = {}
    return exact_marginals(target, prompts[0], 2, TEMPERATURE, pairs, min_mass=1e-4), pairs


@pytest.mark.parametrize("policy", POLICIES)
def test_sampled_engine_follows_the_target_on_the_real_target(target, drafters, prompts, exact, policy):
    eng = make_engine(target, drafters, policy, max_batch=CONCURRENCY)
    out = run_closed_loop(eng, [prompts[0]] * SAMPLES, CONCURRENCY, 2, temperature=TEMPERATURE,
                          seeds=list(range(SAMPLES)))
    marginals, pairs = exact
    assert_follows_marginals(marginals, pairs, [eng.requests[i].tokens for i in out["rids"]])
