"""Target rollouts: generation with the batched path, compact storage round-trip, prompt sampling."""

import json
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_kernels.models import load_model
from dspark_kernels.models.target_tokenizer import load_target_tokenizer
from dspark_kernels.train.corpus import build_corpus
from dspark_kernels.train.rollouts import (
    Rollouts,
    generate_rollouts,
    load_rollout_dirs,
    load_rollouts,
    sample_prompts,
    save_rollouts,
)
from tests.test_corpus_tokenizer import ASSETS, _small_sources


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return load_model(path)


def test_rollouts_round_trip_and_temperature_mix(tiny_target, tmp_path):
    prompts = [([1, 5, 6, 7], 0), ([1, 9, 10], 1), ([1, 11], 0)]
    ro = generate_rollouts(tiny_target, prompts, max_new_tokens=5, temperatures=[0.7, 1.0], batch_size=2, seed=3)
    assert ro.temperature == [0.7, 1.0, 0.7]
    assert all(len(r) == 5 or (len(r) < 5 and r[-1] == 2) for r in ro.responses)  # EOS (id 2) may stop early
    save_rollouts(ro, tmp_path, "train", shard_size=2)
    assert len(list(tmp_path.glob("train-*.safetensors"))) == 2
    back = load_rollouts(tmp_path, "train")
    assert back.prompts == ro.prompts and back.responses == ro.responses
    assert back.domain == ro.domain and back.temperature == pytest.approx(ro.temperature)
    again = generate_rollouts(tiny_target, prompts, max_new_tokens=5, temperatures=[0.7, 1.0], batch_size=2, seed=3)
    assert again.responses == ro.responses  # seeded


def test_rollout_store_holds_any_vocabulary_size(tmp_path):
    """Ids of a 49,152-token vocabulary (and beyond 2**16) round-trip; a store of small ids stays int16."""
    from safetensors.torch import load_file

    big = Rollouts([[1, 49151], [70000]], [[32767, 32768], [2**31 - 1]], [1.0, 0.0], [0, 1])
    small = Rollouts([[1, 5]], [[32767]], [1.0], [0])
    save_rollouts(big, tmp_path / "big", "train")
    save_rollouts(small, tmp_path / "small", "train")
    back = load_rollouts(tmp_path / "big", "train")
    assert back.prompts == big.prompts and back.responses == big.responses
    assert load_file(str(tmp_path / "big" / "train-000.safetensors"))["tokens"].dtype == torch.int32
    assert load_file(str(tmp_path / "small" / "train-000.safetensors"))["tokens"].dtype == torch.int16
    with pytest.raises(ValueError, match="token ids must lie in"):
        save_rollouts(Rollouts([[1]], [[-1]], [1.0], [0]), tmp_path / "bad", "train")


def test_missing_rollouts_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no heldout rollouts"):
        load_rollouts(tmp_path, "heldout")


def test_rollout_dirs_are_pooled_in_the_order_given(tmp_path):
    """Sampled and greedy rollouts written by two runs into two directories train as one pool, in the order named; a
    directory without rollouts of the split is an error naming it."""
    sampled = Rollouts([[1, 5], [1, 6]], [[7, 8], [9]], [0.7, 1.0], [0, 1])
    greedy = Rollouts([[1, 10]], [[11, 12, 13]], [0.0], [1])
    save_rollouts(sampled, tmp_path / "sampled", "train")
    save_rollouts(greedy, tmp_path / "greedy", "train")
    pooled = load_rollout_dirs([tmp_path / "sampled", tmp_path / "greedy"], "train")
    assert pooled.prompts == sampled.prompts + greedy.prompts
    assert pooled.responses == sampled.responses + greedy.responses
    assert pooled.temperature == pytest.approx([0.7, 1.0, 0.0]) and pooled.domain == [0, 1, 1]
    assert load_rollout_dirs([tmp_path / "greedy", tmp_path / "sampled"], "train").prompts[0] == [1, 10]
    with pytest.raises(FileNotFoundError, match=f"no train rollouts under {tmp_path / 'empty'}"):
        load_rollout_dirs([tmp_path / "sampled", tmp_path / "empty"], "train")


def test_prompts_come_from_the_requested_split(tmp_path):
    corpus = tmp_path / "corpus"
    build_corpus(corpus, _small_sources(tmp_path))
    tok = load_target_tokenizer(ASSETS)
    prompts = sample_prompts(tok, corpus, "train", 6, max_prompt=32, seed=0)
    assert len(prompts) == 6 and {d for _, d in prompts} == {0, 1}
    assert all(p[0] == 1 and 17 <= len(p) <= 33 for p, _ in prompts)
    assert prompts == sample_prompts(tok, corpus, "train", 6, max_prompt=32, seed=0)


@pytest.mark.parametrize("argv,message", [(["--max-prompt", "5"], "--max-prompt must be >= 16"),
                                          (["--num-prompts", "0"], "--num-prompts: must be an int >= 1"),
                                          (["--batch-size", "-1"], "--batch-size: must be an int >= 1")])
def test_rollouts_cli_bad_options(tmp_path, argv, message, capsys):
    from dspark_kernels.train import rollouts

    with pytest.raises(SystemExit):
        rollouts.main(["--out", str(tmp_path / "ro"), *argv])
    assert message in capsys.readouterr().err and not (tmp_path / "ro").exists()


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny Qwen3 with the shipped tokenizer, a ChatML template and EOS 2, and a three-domain chat prompt set."""
    import shutil

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("chat_target")
    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    shutil.copy(ASSETS / "tokenizer.json", path / "tokenizer.json")
    template = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    prompts = tmp_path_factory.mktemp("prompts")
    for domain in ("code", "math", "chat"):
        (prompts / domain).mkdir()
        for split in ("train", "heldout"):
            lines = [json.dumps({"prompt": f"{domain} {split} question {i}"}) for i in range(4)]
            (prompts / domain / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return path, prompts


def test_chat_rollouts_go_through_the_template_and_resume_exactly(chat_target, tmp_path):
    """``--prompts``: user messages rendered with the chat template, domains in equal shares; a run stopped after its
    first shards and resumed with ``--resume`` writes the same shards as one uninterrupted run."""
    from safetensors.torch import load_file

    from dspark_kernels.train import rollouts

    model, prompts = chat_target
    common = ["--model", str(model), "--prompts", str(prompts), "--num-prompts", "7", "--max-new-tokens", "3",
              "--batch-size", "2", "--shard-size", "3", "--temperatures", "1.0", "0"]
    rollouts.main([*common, "--out", str(tmp_path / "whole")])
    ro = load_rollouts(tmp_path / "whole", "train")
    # domains interleaved, so a run stopped early is balanced
    assert len(ro) == 7 and ro.domain == [0, 1, 2, 0, 1, 2, 0] and ro.temperature == [1.0, 0.0] * 3 + [1.0]
    tok = load_target_tokenizer(model)
    assert ro.prompts[1] == tok.encode_chat([{"role": "user", "content": "math train question 0"}])
    rollouts.main([*common, "--out", str(tmp_path / "resumed")])
    (tmp_path / "resumed" / "train-002.safetensors").unlink()  # as if stopped after two shards
    rollouts.main([*common, "--out", str(tmp_path / "resumed"), "--resume"])
    for k in range(3):
        whole = load_file(str(tmp_path / "whole" / f"train-{k:03d}.safetensors"))
        again = load_file(str(tmp_path / "resumed" / f"train-{k:03d}.safetensors"))
        assert all(torch.equal(whole[n], again[n]) for n in whole)
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())["train"]
    assert manifest["complete"] and manifest["rollouts"] == 7 and manifest["domains"] == ["code", "math", "chat"]
    assert manifest["response_tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        rollouts.main([*common[:5], "--num-prompts", "13", "--out", str(tmp_path / "x")])


def test_recorded_features_equal_a_forward_over_the_finished_rollouts(chat_target, tmp_path):
    """``--feature-layers``: the features, last-layer outputs and log-sum-exps recorded while generating (continuous
    batching, prefill rows mixed with decode rows) equal one target forward over each finished rollout."""
    from dspark_kernels.drafters.draft_vocab import DraftVocab
    from dspark_kernels.models import load_model
    from dspark_kernels.train import rollouts
    from dspark_kernels.train.drafter_data import forward_outputs, make_batch, rollout_outputs, target_logits

    model_dir, prompts = chat_target
    rollouts.main(["--model", str(model_dir), "--prompts", str(prompts), "--num-prompts", "5", "--max-new-tokens",
                   "6", "--batch-size", "2", "--shard-size", "3", "--temperatures", "1.0", "0",
                   "--feature-layers", "0", "--out", str(tmp_path)])
    ro = load_rollout_dirs([tmp_path], "train", features=True)
    assert ro.feature_layers == (0,) and len(ro.features) == len(ro) == 5
    assert load_rollout_dirs([tmp_path], "train").features is None  # only when asked for
    target = load_model(model_dir)
    for i in range(len(ro)):
        seq = ro.prompts[i] + ro.responses[i]
        rec = ro.features[i]
        assert rec.features.dtype == torch.bfloat16 and rec.features.shape[0] == len(seq) - 1
        ref = forward_outputs(target, [seq], (0,))
        torch.testing.assert_close(rec.features.float(), ref.features[0, :-1], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(rec.last_hidden, ref.last_hidden[0, :-1], rtol=1e-4, atol=1e-4)
        lse = torch.logsumexp(target_logits(target, ref.last_hidden[0, :-1]), dim=-1)
        p = len(ro.prompts[i])
        torch.testing.assert_close(rec.logsumexp[p - 1:], lse[p - 1:], rtol=1e-4, atol=1e-4)
        assert bool(rec.logsumexp[: p - 1].isnan().all())
    out = rollout_outputs(target, ro, [0, 3], (0,))  # the batch a trainer builds reads the recorded rows
    assert torch.equal(out.features[0, : ro.features[0].features.shape[0]], ro.features[0].features.float())
    # over a draft vocabulary the batch's target distribution takes the recorded log-sum-exp and K logits only: the
    # same as reducing the whole logits of a forward
    vocab = DraftVocab(torch.randperm(8192, generator=torch.Generator().manual_seed(0))[:300], 8192)
    recorded = make_batch(target, ro, [0, 3, 4], (0,), 3, 2, random.Random(1), vocab)
    forward = make_batch(target, load_rollout_dirs([tmp_path], "train"), [0, 3, 4], (0,), 3, 2, random.Random(1), vocab)
    assert torch.equal(recorded.anchors, forward.anchors) and bool(recorded.valid.any())
    assert recorded.target_logits.shape[-1] == 300 and bool(recorded.target_lse.isfinite().all())
    valid = recorded.valid
    torch.testing.assert_close(recorded.target_logits[valid], forward.target_logits[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(recorded.target_lse[valid], forward.target_lse[valid], rtol=1e-4, atol=1e-4)
    with pytest.raises(SystemExit):  # a layer the target does not have
        rollouts.main(["--model", str(model_dir), "--prompts", str(prompts), "--num-prompts", "3",
                       "--feature-layers", "99", "--out", str(tmp_path / "bad")])
