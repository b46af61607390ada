"""The drafters shipped for SmolLM2-135M-Instruct: they load for the real target, greedy speculative decoding with
each reproduces greedy AR decoding token for token (batch-invariant mode, so a token's logits do not depend on how
many tokens share its forward), sampled decoding emits valid tokens, and the demo runs on the real target by default
with the JSON it promises."""

from __future__ import annotations

import json

import pytest

from dspark_kernels import demo
from dspark_kernels.drafters import load_drafter
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.models.registry import shipped_drafter
from dspark_kernels.models.target_tokenizer import load_target_tokenizer

MODEL = "smollm2-135m-instruct"
DRAFTERS = ("dspark", "dflash")
MESSAGES = ["Write a Python function that returns the largest of three numbers.", "What is 12 times 9?"]


@pytest.fixture(scope="module")
def target(smollm2_gguf):
    return load_model(MODEL, batch_invariant=True)


@pytest.fixture(scope="module")
def prompts(smollm2_gguf):
    tok = load_target_tokenizer(MODEL)
    return [tok.encode_chat([{"role": "user", "content": m}]) for m in MESSAGES], list(tok.eos_token_ids)


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_equals_ar_on_the_real_target(target, prompts, name):
    path = shipped_drafter(MODEL, name)
    assert path is not None, f"no {name} drafter shipped for {MODEL}"
    drafter = load_drafter(path, target)
    ids, eos = prompts
    ar = generate(target, ids, 24, eos_token_id=eos)
    for gamma in (3, 7):
        spec = speculative_generate(target, drafter, ids, 24, gamma, eos_token_id=eos)
        assert spec.tokens == ar.tokens, (name, gamma)
        assert spec.tau >= 1.0


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_with_a_draft_vocabulary_equals_ar(target, prompts, name):
    drafter = load_drafter(shipped_drafter(MODEL, name), target, draft_vocab=8192)
    assert drafter.draft_vocab.size == 8192
    ids, eos = prompts
    ar = generate(target, ids, 24, eos_token_id=eos)
    spec = speculative_generate(target, drafter, ids, 24, 7, eos_token_id=eos)
    assert spec.tokens == ar.tokens
    assert sum(spec.accept_hist[1:]) > 0


def test_sampled_speculative_decoding_emits_tokens_of_the_vocabulary(target, prompts):
    drafter = load_drafter(shipped_drafter(MODEL, "dspark"), target)
    ids, eos = prompts
    out = speculative_generate(target, drafter, ids, 16, 7, temperature=1.0, seeds=[1, 2], eos_token_id=eos)
    assert all(0 <= t < target.config.vocab_size for seq in out.tokens for t in seq)
    assert all(1 <= len(seq) <= 16 for seq in out.tokens)


def test_demo_runs_on_the_real_target_by_default(tmp_path, smollm2_gguf):
    out = tmp_path / "demo.json"
    demo.main(["--prompt", MESSAGES[1], "--max-new-tokens", "12", "--repeats", "1", "--draft-length", "fixed",
               "--batch-invariant", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["settings"]["draft_vocab"] == 8192  # the registry's default for the shipped drafters
    assert data["model"] == MODEL and set(data["drafters"]) == set(DRAFTERS)
    assert data["device"]["commit"] is None or len(data["device"]["commit"]) == 40
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ar", *DRAFTERS}
    for r in runs.values():
        assert {"method", "tokens_per_s", "tau", "new_tokens", "domain"} <= set(r) and r["domain"] == "all"
    for name in DRAFTERS:
        assert runs[name]["identical_to_ar"] is True
