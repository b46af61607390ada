"""What a decode call is asked to do, checked the same way by generate, speculative_generate and the engine: prompts,
stop tokens, sampling parameters, positions, gamma, and logits that are not finite."""

import dataclasses
import re

import numpy as np
import pytest
import torch

from dspark_kernels.drafters.block_drafter import BlockDrafter
from dspark_kernels.engine.engine import Engine, run_closed_loop
from dspark_kernels.engine.policies import make_policy
from dspark_kernels.engine.rounds import finish_reason
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.request_checks import check_prompts, check_step_logits, stop_tokens
from tests.test_drafter_engine import VOCAB, make_drafter
from tests.test_engine import flat_profile
from tests.tiny_models import save_tiny_qwen3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=VOCAB))


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def test_check_prompts_copies_and_rejects():
    prompts = [[1, 2], (np.int64(3),)]
    out = check_prompts(prompts, 10, 4, 8)
    assert out == [[1, 2], [3]] and out[0] is not prompts[0] and all(type(t) is int for t in out[1])
    for bad, err, match in [
        ([[1, 2.0]], TypeError, r"prompt 0 token 1 must be an int"),
        ([[1, True]], TypeError, r"prompt 0 token 1 must be an int"),
        (["123"], TypeError, r"prompt 0 must be a sequence"),
        ([[1], []], ValueError, r"prompt 1 is empty"),
        ([[1, 10]], ValueError, r"prompt 0 token 1 must be a token id in \[0, 10\)"),
        ([[-1]], ValueError, r"must be a token id in \[0, 10\)"),
        ([[1] * 5], ValueError, r"prompt 0 \(5 tokens\) \+ max_new_tokens \(4\) exceeds .* \(8\)"),
        ("12", TypeError, "prompts must be a list"),
    ]:
        with pytest.raises(err, match=match):
            check_prompts(bad, 10, 4, 8)
    assert check_prompts([[1] * 50], 10, 4, None) == [[1] * 50]
    # no max_position_embeddings: bounded before the KV cache is allocated up front
    with pytest.raises(ValueError, match="sets no max_position_embeddings"):
        check_prompts([[1, 2]], 10, 10**7, None)


def test_stop_tokens():
    assert stop_tokens(None, 10) == frozenset()
    assert stop_tokens(3, 10) == {3} and stop_tokens(np.int32(3), 10) == {3}
    assert stop_tokens((3, 4), 10) == {3, 4} and stop_tokens([5], 10) == {5}
    for bad, err in [(10, ValueError), (-1, ValueError), ("4", TypeError), (True, TypeError), ([3, 2.0], TypeError),
                     (3.0, TypeError)]:
        with pytest.raises(err, match="eos_token_id"):
            stop_tokens(bad, 10)


def test_check_step_logits_names_the_request():
    ok = torch.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    check_step_logits(ok, ["a", "b"])  # -inf beside a finite maximum is a masked token
    for bad in (float("nan"), float("inf")):
        logits = ok.clone()
        logits[1, 0] = bad
        with pytest.raises(FloatingPointError, match="request b"):
            check_step_logits(logits, ["a", "b"])
    with pytest.raises(FloatingPointError, match="request 7"):
        check_step_logits(torch.tensor([[0.0], [1.0], [float("-inf")]]), [3, 7], [2, 1])
    check_step_logits(ok.bfloat16(), ["a", "b"])  # other dtypes take torch's reduction
    with pytest.raises(FloatingPointError, match="request a"):
        check_step_logits(torch.tensor([[float("nan"), 0.0], [1.0, 2.0]], dtype=torch.bfloat16), ["a", "b"])


def test_a_list_of_stop_tokens_ends_every_loop(target, drafter):
    """``eos_token_id`` may be several ids (a config's ``eos_token_ids``): each loop stops at the first of them."""
    ar = generate(target, [[5, 6, 7]], 12).tokens[0]
    stop = ar[3]
    first = ar.index(stop)
    eos = (VOCAB - 1 if stop != VOCAB - 1 else VOCAB - 2, stop)
    want = ar[: first + 1]
    res = generate(target, [[5, 6, 7]], 12, eos_token_id=list(eos))
    assert res.tokens[0] == want and res.finish_reasons == ["eos"]
    spec = speculative_generate(target, drafter, [[5, 6, 7]], 12, 4, eos_token_id=eos)
    assert spec.tokens[0] == want and spec.finish_reasons == ["eos"]
    engine = Engine(target, drafter, make_policy("fixed4"), flat_profile(64, 100.0), gamma=7, max_seq_len=64)
    stats = run_closed_loop(engine, [[5, 6, 7]], 1, 12, eos=eos)
    assert engine.requests[stats["rids"][0]].tokens == want


def test_decode_arguments_are_checked_alike(target, drafter):
    cases = [
        (dict(prompts=[[1, 2.5]]), TypeError, "prompt 0 token 1 must be an int"),
        (dict(prompts=[[1, VOCAB]]), ValueError, rf"must be a token id in \[0, {VOCAB}\)"),
        (dict(eos_token_id="4"), TypeError, "eos_token_id"),
        (dict(eos_token_id=[VOCAB]), ValueError, "eos_token_id entry"),
        (dict(top_k=2.7), TypeError, "top_k must be an int"),
        (dict(top_k=2**40), ValueError, "top_k must be in"),
        (dict(temperature=float("inf")), ValueError, "finite temperature"),
        (dict(temperature=True), TypeError, "temperature must be a real number"),
        (dict(seeds=[1.9]), TypeError, "seeds must be an int"),
        (dict(seeds=[2**64]), ValueError, "seeds must be in"),
        (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an int"),
        (dict(page_size=0), ValueError, "page_size must be an int >= 1"),
        (dict(max_new_tokens=10**12), ValueError, "max_position_embeddings"),
    ]
    for change, err, match in cases:
        kw = {"prompts": [[1, 2]], "max_new_tokens": 4, **change}
        with pytest.raises(err, match=match):
            generate(target, **kw)
        with pytest.raises(err, match=match):
            speculative_generate(target, drafter, gamma=3, **kw)
    numpy_scalar = generate(target, [[1, 2]], 2, temperature=np.float32(0.0))
    assert numpy_scalar.tokens == generate(target, [[1, 2]], 2).tokens


def test_engine_requests_are_checked(target, drafter):
    engine = Engine(target, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=7, max_seq_len=64)
    for args, kw, err, match in [
        (("123", 4), {}, TypeError, "prompt 0 must be a sequence"),
        (([1, 2], 4), dict(eos=[1, 2.0]), TypeError, "eos_token_id entry"),
        (([1, 2], 4), dict(top_k=1.5), TypeError, "top_k must be an int"),
        (([1, 2], 4), dict(seed=0.5), TypeError, "seed must be an int"),
        (([1, 2], True), {}, ValueError, "max_new_tokens must be an int >= 1"),
    ]:
        with pytest.raises(err, match=match):
            engine.add_request(*args, **kw)
    assert not engine.requests
    with pytest.raises(ValueError, match="seeds: one per prompt"):
        run_closed_loop(engine, [[1], [2], [3]], 1, 4, seeds=[0])
    with pytest.raises(TypeError, match="sps_profile must be an SPSProfile"):
        Engine(target, drafter, make_policy("fixed3"), None, gamma=7)
    limit = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_seq_len .* exceeds the target's max_position_embeddings"):
        Engine(target, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=7, max_seq_len=limit + 9)
    for name in ("page_size", "max_batch", "max_seq_len"):  # True is not the int 1
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got True"):
            Engine(target, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=7, **{name: True})
    with pytest.raises(ValueError, match="concurrency must be an int"):
        run_closed_loop(engine, [[1], [2]], True, 4)


def test_finish_reason_takes_numpy_stop_ids():
    tokens = [5, 6, 2, 7]
    assert finish_reason(tokens, 10, np.int64(2)) == "eos" and tokens == [5, 6, 2]


def test_gamma_beyond_the_drafter_is_refused_before_decoding(target, drafter):
    """An adaptive length reaches ``gamma`` only after some rounds: the drafter's limit is checked up front."""
    for gamma in (drafter.max_gamma + 1, 0, 2.0):
        with pytest.raises(ValueError, match="gamma must be"):
            speculative_generate(target, drafter, [[1, 2]], 4, gamma)
        with pytest.raises(ValueError, match="gamma must be"):
            Engine(target, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=gamma)


def test_confidence_policies_refuse_a_drafter_without_confidence(target):
    """A drafter trained without a confidence head (DFlash) reports no confidences, so a policy that schedules on
    them fails clearly instead of scheduling on constant zeros."""
    base = make_drafter(target, kind="none", rank=0)
    dflash = BlockDrafter(dataclasses.replace(base.config, confidence=False), target).eval()
    engine = Engine(target, dflash, make_policy("dspark"), flat_profile(64, 100.0), gamma=7, max_seq_len=64)
    engine.add_request([1, 2], 8)
    with pytest.raises(ValueError, match="needs a drafter with a confidence head"):
        for _ in range(3):
            engine.step()


def test_broken_model_is_a_clear_error_in_every_loop(tmp_path, drafter):
    """NaN weights make NaN logits: each loop raises naming the request instead of emitting tokens from them."""
    torch.manual_seed(0)
    broken = load_model(save_tiny_qwen3(tmp_path / "t", vocab_size=VOCAB))
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    for temperature in (0.0, 1.0):
        with pytest.raises(FloatingPointError, match="logits of request 0 are not finite"):
            generate(broken, [[1, 2]], 4, temperature=temperature, seeds=[0])
    d = make_drafter(broken)
    with pytest.raises(FloatingPointError, match="logits of request 0 are not finite"):
        speculative_generate(broken, d, [[1, 2]], 4, 3)


def test_a_drafter_loaded_for_another_target_is_refused(tmp_path, target, drafter):
    torch.manual_seed(1)
    other = load_model(save_tiny_qwen3(tmp_path / "t", vocab_size=VOCAB, num_layers=2))
    with pytest.raises(ValueError, match="loaded for another target"):
        speculative_generate(other, drafter, [[1, 2]], 4, 3)
    with pytest.raises(ValueError, match="loaded for another target"):
        Engine(other, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=7, max_seq_len=64)
    same_shape = load_model(save_tiny_qwen3(tmp_path / "s", vocab_size=VOCAB))  # another model of the same shape
    assert len(speculative_generate(same_shape, drafter, [[1, 2]], 4, 3).tokens[0]) == 4


def test_a_temperature_too_small_for_the_logits_is_an_error_in_every_decode_loop(target, drafter):
    """1e-42 divides the logits past float32's range: generate, speculative_generate and the engine raise naming the
    temperature (they used to emit token -1 or fail with an IndexError); one that rounds to 0 in float32 would decode
    greedily and is refused up front; T = 1e-3 still samples."""
    prompt = [1, 5, 9, 3]
    with pytest.raises(ValueError, match=r"temperature 1e-42 of request 0 is too small for its logits"):
        generate(target, [prompt], 1, temperature=1e-42, seeds=[0])
    with pytest.raises(ValueError, match=r"temperature 1e-42 of request 0 is too small for its logits"):
        speculative_generate(target, drafter, [prompt], 4, 3, temperature=1e-42, seeds=[0])
    engine = Engine(target, drafter, make_policy("fixed3"), flat_profile(16, 10.0), 3, max_batch=2, max_seq_len=32)
    rid = engine.add_request(prompt, 4, temperature=1e-42, seed=0)
    while engine.has_work:  # the forward's check fails the request, naming the temperature
        engine.step()
    assert engine.requests[rid].reason == "error"
    assert re.search(r"temperature 1e-42 of request \d+ is too small", engine.requests[rid].error)
    with pytest.raises(ValueError, match="rounds to 0 in float32"):
        generate(target, [prompt], 1, temperature=1e-46, seeds=[0])
    assert len(generate(target, [prompt], 3, temperature=1e-3, seeds=[0]).tokens[0]) == 3
    logits = torch.tensor([[1e30, 0.0], [1.0, 2.0]])
    check_step_logits(logits, ["a", "b"], temperature=torch.tensor([0.0, 1e-30]))  # greedy row: no division
    with pytest.raises(ValueError, match="request a is too small"):
        check_step_logits(logits, ["a", "b"], temperature=torch.tensor([1e-10, 1.0]))


def test_wrong_types_name_the_argument(target, drafter, tmp_path, monkeypatch):
    """Wrong types fail up front naming the argument; tensors are read as values; bools are not counts; a seed is
    refused alike by generate and the engine; a corrupt drafter config names its file."""
    from dspark_kernels.adapters.sglang import schedule_verify_lens_topk
    from dspark_kernels.drafters import load_drafter
    from dspark_kernels.models import PagedKVCache

    with pytest.raises(TypeError, match="model must be a loaded model"):
        generate("path/to/model", [[1, 2]], 2)
    with pytest.raises(TypeError, match="drafter must be a drafter"):
        speculative_generate(target, None, [[1, 2]], 2, 3)
    with pytest.raises(TypeError, match="target must be a loaded model"):
        speculative_generate("x", drafter, [[1, 2]], 2, 3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got np.int64"):
        generate(target, [[1, 2]], np.int64(3))
    a = generate(target, [[1, 2]], 3, temperature=torch.tensor(0.7), seeds=[1]).tokens
    assert a == generate(target, [[1, 2]], 3, temperature=0.7, seeds=[1]).tokens
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        PagedKVCache(True, 4, 4, 1, 8)
    conf = torch.rand(2, 4)
    with pytest.raises(ValueError, match="min_verify_len"):
        schedule_verify_lens_topk(conf, 2, min_verify_len=True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is available"):
        load_model(tmp_path, device="cuda")
    engine = Engine(target, drafter, make_policy("fixed3"), flat_profile(64, 100.0), gamma=7, max_seq_len=64)
    with pytest.raises(ValueError, match=r"seed must be in \[0, "):
        engine.add_request([1, 2], 4, seed=-1)
    for content, message in [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")]:
        bad = tmp_path / "drafter"
        bad.mkdir(exist_ok=True)
        (bad / "drafter_config.json").write_text(content)
        (bad / "model.safetensors").write_bytes(b"")
        with pytest.raises(ValueError, match=message) as exc:
            load_drafter(bad, target)
        assert "drafter_config.json" in str(exc.value)


def test_the_vllm_adapter_names_a_leading_zero_in_its_offsets():
    from dspark_kernels.adapters.vllm import rejection_sample_vllm

    v = 16
    with pytest.raises(ValueError, match="cu_num_draft_tokens must hold one inclusive count per request"):
        rejection_sample_vllm(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3], dtype=torch.int32), 2, None,
                              torch.randn(5, v), None, None, None, torch.tensor([1, 2]), torch.tensor([0, 0]))
