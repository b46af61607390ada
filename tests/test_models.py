"""Target runtime vs Hugging Face transformers: logits/hidden-state parity through the paged cache, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dspark_kernels.models import (  # noqa: E402
    CausalLM,
    CheckpointError,
    ModelConfig,
    OutOfPagesError,
    load_model,
)
from dspark_kernels.models.transformer import RMSNorm  # noqa: E402
from dspark_kernels.models.weight_layout import is_column_major  # noqa: E402

V = 300
RTOL = 1e-4
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.1, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
KINDS = ("qwen3", "qwen3_tied", "qwen3_sharded", "llama", "llama3")


def _hf_model(kind: str):
    torch.manual_seed(1234)
    if kind.startswith("qwen3"):
        cfg = Qwen3Config(**SMALL, tie_word_embeddings=kind == "qwen3_tied", rope_theta=1000.0)
        model = Qwen3ForCausalLM(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, rope_theta=500.0)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**SMALL, rope_parameters=dict(LLAMA3_ROPE))
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # make norms / biases non-trivial so q_norm, k_norm and biases are really exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.float().eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (hf_model, checkpoint_dir)."""
    out = {}
    for kind in KINDS:
        model = _hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        if kind == "qwen3_sharded":
            model.save_pretrained(path, max_shard_size="40KB")
            assert (path / "model.safetensors.index.json").is_file()
        else:
            model.save_pretrained(path)
        out[kind] = (model, path)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {kind: load_model(path) for kind, (_, path) in checkpoints.items()}


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def assert_rel(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> float:
    err = float((ours - ref).abs().max())
    scale = float(ref.abs().max())
    assert err <= RTOL * scale, f"{what}: max|a-b| = {err:.3e} > {RTOL} * {scale:.3e}"
    return err / scale


def run(model: CausalLM, cache, chunks: dict, **kw):
    """One batched forward: chunks = {rid: [tokens]} (in order). Returns per-request logits."""
    rids = list(chunks)
    ids = torch.tensor([t for r in rids for t in chunks[r]])
    lens = [len(chunks[r]) for r in rids]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = model(ids, cu, rids, cache, **kw)
    return {r: out.logits[cu[i]:cu[i + 1]] for i, r in enumerate(rids)}, out


@pytest.mark.parametrize("kind", KINDS)
def test_config_parsed(checkpoints, loaded, kind):
    cfg = loaded[kind].config
    assert cfg.model_type == ("qwen3" if kind.startswith("qwen3") else "llama")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.qk_norm == kind.startswith("qwen3")
    assert cfg.rope_type == ("llama3" if kind == "llama3" else "default")
    if kind == "qwen3_tied":
        # tied: the same values; on the CPU the LM head holds a column-major copy (models/weight_layout.py)
        model = loaded[kind]
        assert cfg.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
        assert is_column_major(model.lm_head.weight) and model.model.embed_tokens.weight.is_contiguous()
    hf_inv = checkpoints[kind][0].model.rotary_emb.inv_freq
    torch.testing.assert_close(cfg.inv_freq(), hf_inv, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_hidden_states(checkpoints, loaded, kind):
    hf, model = checkpoints[kind][0], loaded[kind]
    seq = torch.randint(0, V, (23,)).tolist()
    cache = model.new_cache(num_pages=8, page_size=4)
    cache.add_request("r")
    logits, out = run(model, cache, {"r": seq}, hidden_layers=(-1, 0, 1))
    assert logits["r"].dtype == torch.float32 and logits["r"].shape == (23, V)
    assert_rel(logits["r"], hf_logits(hf, seq), f"{kind} prefill")
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    assert_rel(out.hidden_states[-1], hs[0][0], "embedding output")
    assert_rel(out.hidden_states[0], hs[1][0], "layer 0 output")
    # HF's last entry is taken after the final norm; ours is the raw output of the last decoder layer.
    assert_rel(model.model.norm(out.hidden_states[1]), hs[2][0], "layer 1 output")
    assert cache.length("r") == 23


@pytest.mark.parametrize("kind", ("qwen3", "llama3"))
def test_incremental_decode(checkpoints, loaded, kind):
    hf, model = checkpoints[kind][0], loaded[kind]
    seq = torch.randint(0, V, (30,)).tolist()  # llama3: positions beyond original_max_position_embeddings
    ref = hf_logits(hf, seq)
    cache = model.new_cache(num_pages=10, page_size=4)
    cache.add_request(7)
    logits, _ = run(model, cache, {7: seq[:3]})
    assert_rel(logits[7], ref[:3])
    for t in range(3, 30):
        logits, _ = run(model, cache, {7: [seq[t]]}, logits_indices=torch.tensor([0]))
        assert_rel(logits[7], ref[t : t + 1], f"decode step {t}")
    assert cache.length(7) == 30


def test_verify_chunks_and_rollback(checkpoints, loaded):
    hf, model = checkpoints["qwen3"][0], loaded["qwen3"]
    seq = torch.randint(0, V, (26,)).tolist()
    ref = hf_logits(hf, seq)
    cache = model.new_cache(num_pages=12, page_size=4)
    cache.add_request("a")
    pos = 0
    for n in (5, 4, 1, 7, 3, 6):
        chunk = seq[pos : pos + n]
        # first feed a wrong draft continuation, reject it, then feed the real tokens
        wrong = [(t + 1) % V for t in chunk]
        run(model, cache, {"a": wrong})
        free_before = cache.num_free_pages
        cache.rollback("a", n)
        assert cache.num_free_pages >= free_before and cache.length("a") == pos
        logits, _ = run(model, cache, {"a": chunk})
        assert_rel(logits["a"], ref[pos : pos + n], f"verify chunk at {pos}")
        pos += n


@pytest.mark.parametrize("kind", ("qwen3", "llama"))
def test_ragged_batch_mixes_prefill_decode_verify(checkpoints, loaded, kind):
    hf, model = checkpoints[kind][0], loaded[kind]
    seqs = {r: torch.randint(0, V, (n,)).tolist() for r, n in (("a", 19), ("b", 14), ("c", 11), ("d", 9))}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    cache = model.new_cache(num_pages=20, page_size=4)
    done = {r: 0 for r in seqs}

    def step(plan):
        chunks = {}
        for r, n in plan.items():
            if r not in cache:
                cache.add_request(r)
            chunks[r] = seqs[r][done[r] : done[r] + n]
        logits, _ = run(model, cache, chunks)
        for r, n in plan.items():
            assert_rel(logits[r], refs[r][done[r] : done[r] + n], f"{kind} request {r} at {done[r]}")
            done[r] += n

    step({"a": 5, "b": 9, "c": 2})  # ragged prefill of three prompts
    step({"b": 1, "a": 6, "d": 7, "c": 3})  # decode, verify, a new prefill and verify in one batch
    step({"c": 5, "a": 1})
    cache.rollback("a", 3)  # reject the last 3 tokens of a, re-feed them together with more
    done["a"] -= 3
    step({"a": 7, "d": 2, "b": 4, "c": 1})
    assert {r: cache.length(r) for r in seqs} == done
    for r in seqs:
        cache.free(r)
    assert cache.num_free_pages == 20


def test_dtype_and_logits_indices(checkpoints):
    hf, path = checkpoints["qwen3"]
    model = load_model(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    seq = torch.randint(0, V, (9,)).tolist()
    cache = model.new_cache(4, 4)
    assert cache.dtype == torch.bfloat16
    cache.add_request(0)
    _, out = run(model, cache, {0: seq}, logits_indices=torch.tensor([8, 2]))
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, V)
    ref = hf_logits(hf, seq)[[8, 2]]
    assert float((out.logits - ref).abs().max()) < 0.05 * float(ref.abs().max())


# ---------------------------------------------------------------------------------------------------- bad input
def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_and_rope(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen3"][1], tmp_path)
    _edit_config(path, model_type="mistral")
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        load_model(path)
    _edit_config(path, model_type="qwen3", architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen3MoeForCausalLM'"):
        load_model(path)
    _edit_config(path, architectures=["Qwen3ForCausalLM"], rope_parameters={"rope_type": "yarn", "rope_theta": 1.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        load_model(path)


def test_legacy_rope_fields():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    cfg = ModelConfig.from_dict({**base, "rope_theta": 123.0})
    assert (cfg.rope_theta, cfg.rope_type, cfg.head_dim, cfg.num_key_value_heads) == (123.0, "default", 4, 2)
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    cfg = ModelConfig.from_dict({**base, "rope_theta": 7.0, "rope_scaling": scaling})
    assert cfg.rope_type == "llama3" and cfg.rope_theta == 7.0 and cfg.rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="missing required field 'vocab_size'"):
        ModelConfig.from_dict({**base, "vocab_size": None})


@pytest.mark.parametrize("key,value,match", [
    ("vocab_size", "64", "vocab_size must be an integer"),
    ("num_hidden_layers", 0, "num_hidden_layers must be >= 1"),
    ("hidden_size", 64.0, "hidden_size must be an integer"),
    ("rms_norm_eps", -1, r"rms_norm_eps must be a number in \(0, 1\)"),
    ("max_position_embeddings", -5, "max_position_embeddings must be >= 1"),
    ("eos_token_id", V, rf"eos_token_id must be token ids in \[0, vocab_size = {V}\)"),
    ("eos_token_id", [2, True], "eos_token_id must be token ids"),
    ("bos_token_id", [1], "bos_token_id must be a token id"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be a JSON boolean"),
    ("attention_bias", "false", "attention_bias must be a JSON boolean"),
    ("mlp_bias", 0, "mlp_bias must be a JSON boolean"),
    ("num_key_value_heads", 0, "num_key_value_heads must be >= 1"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number > 0"),
    ("rope_theta", 0, "rope_theta must be a finite number > 0"),
    ("rope_theta", -1e4, "rope_theta must be a finite number > 0"),
    ("rope_theta", True, "rope_theta must be a finite number > 0"),
    ("rope_theta", "1e4", "rope_theta must be a finite number > 0"),
])
def test_config_values_are_checked(checkpoints, key, value, match):
    raw = json.loads((checkpoints["qwen3"][1] / "config.json").read_text())
    raw.pop("rope_parameters", None)  # rope_theta given at the top level, the legacy form
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**raw, key: value})


@pytest.mark.parametrize("key,value,match", [
    ("factor", float("inf"), r"rope_scaling.factor must be a finite number > 0"),
    ("low_freq_factor", "1", r"rope_scaling.low_freq_factor must be a finite number > 0"),
    ("original_max_position_embeddings", 0, r"rope_scaling.original_max_position_embeddings must be a finite"),
    ("high_freq_factor", 0.5, "high_freq_factor must exceed low_freq_factor"),
    ("rope_theta", None, "rope_theta must be a finite number > 0"),
])
def test_llama3_rope_fields_are_checked(key, value, match):
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**base, "rope_parameters": {**LLAMA3_ROPE, key: value}})


def test_config_with_fewer_layers_than_the_weights_is_refused(checkpoints, tmp_path):
    """A config that names fewer layers than the checkpoint holds would silently drop the rest."""
    path = _copy(checkpoints["qwen3"][1], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": raw["num_hidden_layers"] - 1}))
    with pytest.raises(CheckpointError, match=r"holds decoder layers \[\d+\] beyond the config's num_hidden_layers"):
        load_model(path)


def test_load_arguments_are_checked(checkpoints):
    path = checkpoints["qwen3"][1]
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_model(path, dtype="bfloat16")
    with pytest.raises(ValueError, match="device must name a torch device"):
        load_model(path, device="tpu0")
    from dspark_kernels.drafters import load_drafter

    with pytest.raises(TypeError, match="target must be the CausalLM"):
        load_drafter(path, None)


def test_missing_dir_config_weights(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nope' is not a registry name or an existing path; registry names"):
        load_model(tmp_path / "nope")
    path = _copy(checkpoints["qwen3"][1], tmp_path)
    (path / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_model(path)


def test_missing_and_misshaped_tensors(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(checkpoints["qwen3"][1], tmp_path)
    tensors = load_file(path / "model.safetensors")
    full = dict(tensors)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        load_model(path)
    tensors = dict(full)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight'.*shape \(95, 64\).*\(96, 64\)"):
        load_model(path)
    tensors = dict(full)
    del tensors["lm_head.weight"]  # untied config: the head is required
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(path)


def test_truncated_safetensors(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen3"][1], tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        load_model(path)
    sharded = _copy(checkpoints["qwen3_sharded"][1], tmp_path / "s")
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard file .*{shard.name}"):
        load_model(sharded)


def test_forward_bad_input(loaded):
    model = loaded["qwen3"]
    cache = model.new_cache(2, 4)
    cache.add_request(0)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="token id 300 outside the vocabulary"):
        model(torch.tensor([1, 300, 2]), cu, [0], cache)
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([1, -1, 2]), cu, [0], cache)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]"):
        model(torch.tensor([1, 2]), cu, [0], cache)
    with pytest.raises(ValueError, match="len\\(request_ids\\) \\+ 1"):
        model(torch.tensor([1, 2, 3]), cu, [0, 1], cache)
    with pytest.raises(ValueError, match="hidden_layers"):
        model(torch.tensor([1, 2, 3]), cu, [0], cache, hidden_layers=(2,))
    with pytest.raises(OutOfPagesError):
        model(torch.arange(9), torch.tensor([0, 9]), [0], cache)
    assert cache.length(0) == 0 and cache.num_free_pages == 2  # failed calls leave the cache untouched


# ---------------------------------------------------------------------------------------------------- generate
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ("qwen3", "llama"))
def test_generate_greedy_matches_hf_and_batching(checkpoints, loaded, kind):
    from dspark_kernels.models import generate

    hf, model = checkpoints[kind][0], loaded[kind]
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (7, 3, 12)]
    batched = generate(model, prompts, max_new_tokens=10, page_size=4)
    assert batched.steps == 10 and batched.finish_reasons == ["length"] * 3
    for p, toks in zip(prompts, batched.tokens):
        assert toks == _hf_greedy(hf, p, 10)
        assert generate(model, [p], max_new_tokens=10, page_size=4).tokens == [toks]


def test_generate_eos_stops_request(loaded):
    from dspark_kernels.models import generate

    model = loaded["qwen3"]
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (5, 9)]
    full = generate(model, prompts, max_new_tokens=8).tokens
    eos = full[0][2]  # request 0 stops at its third token (request 1 stops wherever eos first appears, if at all)
    res = generate(model, prompts, max_new_tokens=8, eos_token_id=eos)
    assert res.tokens[0] == full[0][:3] and res.finish_reasons[0] == "eos"
    cut = full[1].index(eos) + 1 if eos in full[1] else 8
    assert res.tokens[1] == full[1][:cut]
    assert generate(model, prompts, max_new_tokens=0).tokens == [[], []]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=2)


def test_triton_attention_path_matches_hf(checkpoints, loaded, device):
    """The same ragged prefill + verify batch through the Triton attention kernel (interpreter on CPU)."""
    hf, model = checkpoints["qwen3"][0], loaded["qwen3"]
    if device.type == "cuda":
        model = load_model(checkpoints["qwen3"][1], device=device)
    seqs = {r: torch.randint(0, V, (n,)).tolist() for r, n in (("a", 9), ("b", 6))}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    cache = model.new_cache(num_pages=8, page_size=4)
    for r in seqs:
        cache.add_request(r)
    logits, _ = run(model, cache, {"a": seqs["a"][:6], "b": seqs["b"][:2]}, impl="triton")
    assert_rel(logits["a"].cpu(), refs["a"][:6], "triton prefill a")
    assert_rel(logits["b"].cpu(), refs["b"][:2], "triton prefill b")
    logits, _ = run(model, cache, {"b": seqs["b"][2:], "a": seqs["a"][6:]}, impl="triton")
    assert_rel(logits["a"].cpu(), refs["a"][6:], "triton verify a")
    assert_rel(logits["b"].cpu(), refs["b"][2:], "triton verify b")


def test_generate_sampling_seeded_and_batch_invariant(loaded):
    from dspark_kernels.models import generate

    model = loaded["qwen3"]
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (4, 8, 6)]
    kw = dict(max_new_tokens=6, temperature=[1.0, 0.7, 0.0], top_k=[0, 20, 0], top_p=[0.9, 1.0, 1.0],
              seeds=[11, 22, 33])
    a = generate(model, prompts, **kw)
    b = generate(model, prompts, **kw)
    assert a.tokens == b.tokens and all(len(t) == 6 for t in a.tokens)
    for i in range(3):  # a request's draws depend only on its own seed and step, not on the batch
        one = generate(model, [prompts[i]], max_new_tokens=6, temperature=kw["temperature"][i],
                       top_k=kw["top_k"][i], top_p=kw["top_p"][i], seeds=[kw["seeds"][i]])
        assert one.tokens[0] == a.tokens[i]
    assert a.tokens[2] == generate(model, [prompts[2]], max_new_tokens=6).tokens[0]  # T=0 row is greedy
    c = generate(model, prompts, **{**kw, "seeds": [12, 23, 34]})
    assert c.tokens[:2] != a.tokens[:2]
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompts, max_new_tokens=2, temperature=[1.0, 1.0])


def test_generate_top_k_1_is_greedy(loaded):
    from dspark_kernels.models import generate

    model = loaded["llama"]
    prompts = [torch.randint(0, V, (5,)).tolist()]
    greedy = generate(model, prompts, max_new_tokens=6).tokens
    assert generate(model, prompts, max_new_tokens=6, temperature=1.5, top_k=1, seeds=[3]).tokens == greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_normalize_is_the_five_op_formula_bit_for_bit(dtype):
    """``RMSNorm.normalize`` (one ``F.rms_norm`` call) computes exactly ``x.float() * rsqrt(mean(x^2) + eps)`` cast
    back, row by row and for head-shaped inputs, so swapping it in changed no logits."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    for shape in [(1, 64), (13, 64), (5, 6, 64)]:
        x = (torch.randn(shape) * 3).to(dtype)
        xf = x.float()
        expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(norm.normalize(x), expected)


def test_rope_tables_give_hf_rotate_half_bit_for_bit(loaded):
    """``apply_rope`` with :meth:`CausalLM._rope`'s tables (a roll and a sine with its first half negated) equals
    HF's ``x * cos + rotate_half(x) * sin`` exactly."""
    from dspark_kernels.models.transformer import apply_rope

    model = loaded["qwen3"] if "qwen3" in loaded else next(iter(loaded.values()))
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = model._rope(positions, torch.float32)
    d = cos.shape[-1]
    freqs = positions.float()[:, None] * model.config.inv_freq(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    x = torch.randn(5, 3, d)
    rotate_half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    expected = x * emb.cos()[:, None, :] + rotate_half * emb.sin()[:, None, :]
    assert torch.equal(apply_rope(x, cos, sin), expected)
