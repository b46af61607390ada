"""The real target, SmolLM2-135M-Instruct from its GGUF, against ``transformers`` loading the same file through its
own GGUF integration (an independent dequantizer, name map and Q/K un-permutation): fp32 logits within 1e-4 relative
for a full prefill, token-by-token decode through the paged cache (page sizes 16 and 4), verify chunks with rollback
and a ragged batch of three chat prompts; and the converted Hugging Face directory loaded by both runtimes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dspark_kernels.models import load_model  # noqa: E402
from dspark_kernels.models.convert import OUTPUT_FILES  # noqa: E402
from dspark_kernels.models.convert import main as convert_main  # noqa: E402
from tests.test_models import assert_rel, hf_logits, run  # noqa: E402

CHATS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "What is 17 * 23?"}, {"role": "assistant", "content": "17 * 23 = 391."},
     {"role": "user", "content": "And 391 / 17?"}],
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(gguf_path):
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    out = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in CHATS]
    return [list(map(int, ids)) for ids in out]


@pytest.fixture(scope="module")
def model(gguf_path):
    return load_model(gguf_path)


def test_config_from_gguf_metadata(model):
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert cfg.rope_theta == 1e5 and cfg.max_position_embeddings == 8192


def test_prefill(model, hf_model, prompts):
    seq = prompts[0]
    cache = model.new_cache(num_pages=8, page_size=16)
    cache.add_request(0)
    assert_rel(run(model, cache, {0: seq})[0][0], hf_logits(hf_model, seq), "prefill")


@pytest.mark.parametrize("page_size", (16, 4))
def test_token_by_token_decode(model, hf_model, prompts, page_size):
    seq = prompts[1][:12] + prompts[2][:24]
    ref = hf_logits(hf_model, seq)
    cache = model.new_cache(num_pages=64 // page_size + 2, page_size=page_size)
    cache.add_request("r")
    assert_rel(run(model, cache, {"r": seq[:4]})[0]["r"], ref[:4], "first chunk")
    for t in range(4, len(seq)):
        assert_rel(run(model, cache, {"r": [seq[t]]})[0]["r"], ref[t:t + 1], f"decode step {t}")


def test_verify_chunks_with_rollback(model, hf_model, prompts):
    seq = prompts[2][:40]
    ref = hf_logits(hf_model, seq)
    cache = model.new_cache(num_pages=8, page_size=8)
    cache.add_request("a")
    pos = 0
    for n in (11, 8, 1, 7, 5, 8):
        chunk = seq[pos:pos + n]
        run(model, cache, {"a": [(t + 7) % 49152 for t in chunk]})  # a rejected draft...
        cache.rollback("a", n)  # ...rolled back before the real tokens are verified
        assert cache.length("a") == pos
        assert_rel(run(model, cache, {"a": chunk})[0]["a"], ref[pos:pos + n], f"verify chunk at {pos}")
        pos += n


def test_ragged_batch_of_chat_prompts(model, hf_model, prompts):
    refs = [hf_logits(hf_model, p) for p in prompts]
    cache = model.new_cache(num_pages=24, page_size=16)
    for i in range(3):
        cache.add_request(i)
    got = run(model, cache, dict(enumerate(prompts)))[0]
    for i in range(3):
        assert_rel(got[i], refs[i], f"chat prompt {i} in a ragged batch")


def test_converted_directory_loads_in_both_runtimes(model, gguf_path, prompts, tmp_path, capsys):
    """``python -m dspark_kernels.models.convert`` writes a directory both runtimes load to the same logits; it does
    not overwrite one without ``--force``."""
    out = tmp_path / "hf"
    assert convert_main([str(gguf_path), str(out)]) == 0
    assert {p.name for p in out.iterdir()} == set(OUTPUT_FILES)
    assert convert_main([str(gguf_path), str(out)]) == 1
    assert "already holds config.json" in capsys.readouterr().err
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out)
    seq = prompts[1]
    cache = ours.new_cache(num_pages=8, page_size=16)
    cache.add_request(0)
    got = run(ours, cache, {0: seq})[0][0]
    assert_rel(got, hf_logits(hf, seq), "converted directory, ours vs transformers")
    cache = model.new_cache(num_pages=8, page_size=16)
    cache.add_request(0)
    assert torch.equal(got, run(model, cache, {0: seq})[0][0]), "the converted weights differ from the GGUF's"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=True, return_dict=False) == seq


def test_convert_refuses_what_it_cannot_convert(tmp_path, capsys):
    """A directory, a missing path and a non-GGUF file are errors naming the source, before anything is written."""
    from dspark_kernels.bench import ASSETS

    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a model")
    for src, message in ((str(ASSETS / "target"), "already a Hugging Face directory"),
                         (str(tmp_path / "missing.gguf"), "is not a registry name or an existing path"),
                         (str(bad), "is not a GGUF file")):
        assert convert_main([src, str(tmp_path / "out")]) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
