"""Engine-layout adapters (vLLM sampler layout, SGLang scheduler layout) and ``examples/engine_step.py``.

* the vLLM adapter is our rejection sampler under vLLM's offsets and output conventions, bit for bit;
* the SGLang-style scheduler adapter equals the ragged survival ops on dense blocks, within its verify window;
* the example engine step gives exactly the tokens of the library's own loop (T = 0 and seeded T = 1), and with a
  verify budget it still reproduces the target's greedy output.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from dspark_kernels.adapters import (
    offsets_from_vllm_cu,
    pack_verified_drafts,
    rejection_sample_vllm,
    schedule_verify_lens_alg1,
    schedule_verify_lens_topk,
)
from dspark_kernels.ops import (
    prefix_survival,
    rejection_sample,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
)
from dspark_kernels.ops.rejection_sample import rejection_noise

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("lens", [[3, 0, 5, 1], [0, 0], [4]])
def test_vllm_adapter_equals_op(impl, lens, monkeypatch):
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    v, s = 67, max(max(lens), 1)
    b, n = len(lens), sum(lens)
    cu_vllm = torch.tensor(lens).cumsum(0).to(torch.int32)
    drafts = torch.randint(0, v, (n,), dtype=torch.int32)
    probs = torch.softmax(torch.randn(n, v), -1)
    logits = torch.randn(n + b, v)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3][:b])
    seeds, offs = torch.arange(b, dtype=torch.int64) + 5, torch.full((b,), 3, dtype=torch.int64)
    out, acc = rejection_sample_vllm(drafts, cu_vllm, s, probs, logits, temp, None, None, seeds, offs, impl=impl)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), cu_vllm])
    au, su = rejection_noise(seeds, offs, cu, n, max_spec_len=s)
    ref = rejection_sample(drafts, cu, probs, logits, temp, None, None, au, su, max_spec_len=s, impl="torch")
    assert out.dtype == torch.int32 and out.shape == (b, s + 1)
    assert torch.equal(out, ref.output_token_ids.to(torch.int32)) and torch.equal(acc, ref.num_accepted)
    for row, a in zip(out.tolist(), acc.tolist()):  # accepted drafts + one token, then vLLM's -1 placeholders
        assert all(t >= 0 for t in row[: a + 1]) and all(t == -1 for t in row[a + 1:])


def test_vllm_offsets():
    assert offsets_from_vllm_cu(torch.tensor([2, 2, 7])).tolist() == [0, 2, 2, 7]
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        offsets_from_vllm_cu(torch.zeros(2, 2))


def test_sglang_schedule_topk_equals_ragged_ops():
    bs, gamma = 5, 6
    conf = torch.randn(bs, gamma) * 2
    conf[1, 2] = conf[3, 2] = 0.5  # a tie across requests
    temps = torch.linspace(0.8, 1.4, gamma)
    cu = torch.arange(bs + 1, dtype=torch.int32) * gamma
    a = prefix_survival(conf.reshape(-1), cu, temps)
    for budget in (0, 3, 11, 30, 100):
        got = schedule_verify_lens_topk(conf, budget, position_temperatures=temps)
        assert torch.equal(got, select_verify_lengths_topk(a, cu, budget))
        assert int(got.sum()) == min(budget, bs * gamma)
    # a window: every request verifies its first draft; the budget buys slots 2..4 (positions 1..3), never more
    window = a.view(bs, gamma)[:, 1:4].reshape(-1)
    window_cu = torch.arange(bs + 1, dtype=torch.int32) * 3
    for budget in (0, 3, 7, 50):
        got = schedule_verify_lens_topk(conf, budget, min_verify_len=1, max_len=4, position_temperatures=temps)
        assert torch.equal(got, select_verify_lengths_topk(window, window_cu, budget) + 1)
        assert int(got.sum()) == bs + min(budget, bs * 3) and int(got.min()) >= 1 and int(got.max()) <= 4
    with pytest.raises(ValueError, match="min_verify_len"):
        schedule_verify_lens_topk(conf, 3, min_verify_len=5, max_len=4)
    with pytest.raises(TypeError, match="budget"):
        schedule_verify_lens_topk(conf, 2.5)
    with pytest.raises(ValueError, match="confidence_logits"):
        schedule_verify_lens_topk(conf.reshape(-1), 3)


def test_sglang_schedule_alg1_equals_ragged_ops():
    bs, gamma = 4, 5
    conf = torch.randn(bs, gamma)
    sps = torch.cat([torch.ones(1), 100.0 / (1 + 0.05 * torch.arange(1, 64).float())])
    cu = torch.arange(bs + 1, dtype=torch.int32) * gamma
    want = select_verify_lengths_alg1(prefix_survival(conf.reshape(-1), cu), cu, sps)
    assert torch.equal(schedule_verify_lens_alg1(conf, sps), want)
    stairs = sps / (1 + 0.3 * (torch.arange(64) // 8))  # 8-token tiles: the step-aware stop
    want = select_verify_lengths_alg1(prefix_survival(conf.reshape(-1), cu), cu, stairs, lookahead=bs * gamma)
    assert torch.equal(schedule_verify_lens_alg1(conf, stairs, lookahead=bs * gamma), want)


def test_pack_verified_drafts():
    drafts = torch.arange(12).view(3, 4)
    probs = torch.rand(3, 4, 5)
    ids, cu, p = pack_verified_drafts(drafts, torch.tensor([2, 0, 4], dtype=torch.int32), probs)
    assert ids.tolist() == [0, 1, 8, 9, 10, 11] and cu.tolist() == [0, 2, 2, 6]
    assert torch.equal(p, torch.cat([probs[0, :2], probs[2]]))
    for lens, err, match in [(torch.tensor([1, 2]), ValueError, "verify_lens must have shape"),
                             (torch.tensor([2, -1, 4]), ValueError, r"verify_lens must be in 0..gamma = 4"),
                             (torch.tensor([2, 0, 6]), ValueError, r"verify_lens must be in 0..gamma = 4"),
                             (torch.tensor([2.0, 0.0, 1.0]), TypeError, "verify_lens must have dtype")]:
        with pytest.raises(err, match=match):
            pack_verified_drafts(drafts, lens)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        pack_verified_drafts(drafts, torch.tensor([2, 0, 4]), probs[:, :3])


def test_vllm_adapter_greedy_marker_and_bad_offsets():
    """vLLM marks greedy requests with temperature -1 (or passes none for an all-greedy batch): both decode greedily,
    like 0 here; bad offsets and noise inputs are clear errors before any noise is made."""
    v, lens = 11, [2, 3]
    cu_vllm = torch.tensor(lens).cumsum(0).to(torch.int32)
    logits = torch.randn(sum(lens) + len(lens), v)
    drafts = logits[[0, 1, 3, 4, 5]].argmax(-1).to(torch.int32)  # the greedy tokens: all accepted
    seeds, offs = torch.tensor([1, 2]), torch.tensor([0, 0])
    outs = [rejection_sample_vllm(drafts, cu_vllm, 3, None, logits, t, None, None, seeds, offs)[0]
            for t in (torch.zeros(2), torch.full((2,), -1.0), None)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for change, err, match in [
        (dict(cu_num_draft_tokens=torch.tensor([2, 4], dtype=torch.int32)), ValueError, r"cu_num_draft_tokens\[-1\]"),
        (dict(cu_num_draft_tokens=torch.tensor([3, 2], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(cu_num_draft_tokens=torch.tensor([2.0, 5.0])), TypeError, "cu_num_draft_tokens must have dtype"),
        (dict(max_spec_len=2), ValueError, "max_spec_len=2"),
        (dict(seeds=torch.tensor([1, 2, 3])), ValueError, "seeds must have shape"),
        (dict(offsets=torch.tensor([0.0, 0.0])), TypeError, "offsets must have dtype"),
    ]:
        kw = dict(draft_token_ids=drafts, cu_num_draft_tokens=cu_vllm, max_spec_len=3, draft_probs=None,
                  logits=logits, temperature=torch.ones(2), top_k=None, top_p=None, seeds=seeds, offsets=offs)
        kw.update(change)
        with pytest.raises(err, match=match):
            rejection_sample_vllm(**kw)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("engine_step_example", ROOT / "examples" / "engine_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shipped():
    from dspark_kernels.drafters import load_drafter
    from dspark_kernels.models import load_model
    from dspark_kernels.train.tokenizer import BOS_ID, load_tokenizer

    assets = ROOT / "dspark_kernels" / "assets"
    target = load_model(assets / "target")
    tok = load_tokenizer(assets / "target")
    drafter = load_drafter(assets / "drafters" / "dspark", target)
    prompts = [[BOS_ID] + tok.encode(t).ids for t in ("def area(r):\n", "The function returns", "#include <")]
    return target, drafter, prompts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_example_equals_engine_loop(example, shipped, temperature):
    from dspark_kernels.engine.speculative import speculative_generate

    target, drafter, prompts = shipped
    seeds = [11, 12, 13]
    ours = speculative_generate(target, drafter, prompts, 24, 5, temperature=temperature, seeds=seeds,
                                eos_token_id=2).tokens
    assert example.run(target, drafter, prompts, 24, 5, temperature, seeds=seeds, eos_token_id=2) == ours


def test_example_with_budget_is_greedy_exact(example, shipped):
    from dspark_kernels.models import generate

    target, drafter, prompts = shipped
    ar = generate(target, prompts, 24, eos_token_id=2).tokens
    assert example.run(target, drafter, prompts, 24, 7, 0.0, budget=4, eos_token_id=2) == ar
