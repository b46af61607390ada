"""GGUF loading on synthetic files written with ``gguf.GGUFWriter``: every tensor type against
``gguf.quants.dequantize``, tiny llama / qwen3 models (llama.cpp names, permuted Q/K) against ``transformers``, and the
errors for truncated files, unknown architectures, missing tensors, wrong metadata types and undequantizable types."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from dspark_kernels.models import load_model  # noqa: E402
from dspark_kernels.models.gguf_reader import GGUFError, GGUFFile  # noqa: E402
from dspark_kernels.models.gguf_weights import load_gguf_state_dict, unpermute_qk  # noqa: E402

V, H = 300, 64
SMALL = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp converter's row order for llama Q/K: each head's two RoPE halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(arch: str, tied: bool = True):
    torch.manual_seed(7)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_theta=500.0,
                                                                         tie_word_embeddings=tied))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, rope_theta=800.0,
                                                                         tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.float().eval()


def write_model_gguf(path, model, arch: str, *, skip: str | None = None, metadata: dict | None = None,
                     qtype: Q = Q.F32):
    """``model`` as llama.cpp writes it: metadata, llama.cpp tensor names, Q/K permuted for llama; 2-D weights in
    ``qtype`` (norms stay F32). ``skip`` leaves out one tensor; ``metadata`` overrides or adds keys (a value of type
    str is written as a string whatever the key)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    keys = {f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": cfg.max_position_embeddings,
            f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.feed_forward_length": cfg.intermediate_size,
            f"{arch}.attention.head_count": cfg.num_attention_heads,
            f"{arch}.attention.head_count_kv": cfg.num_key_value_heads, f"{arch}.vocab_size": cfg.vocab_size,
            f"{arch}.rope.dimension_count": cfg.head_dim, f"{arch}.attention.key_length": cfg.head_dim}
    floats = {f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
              f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps}
    extra = dict(metadata or {})
    for key, value in {**keys, **floats, **extra}.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if gname == skip:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and ("attn_q." in gname or "attn_k." in gname):
            data = permute_qk(data, cfg.num_attention_heads if "attn_q." in gname else cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model, seq):
    if isinstance(model, torch.nn.Module) and hasattr(model, "generate"):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0].float()
    cache = model.new_cache(num_pages=8, page_size=4)
    cache.add_request(0)
    cu = torch.tensor([0, len(seq)], dtype=torch.int32)
    return model(torch.tensor(seq), cu, [0], cache).logits


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen3", True)])
def test_tiny_model_matches_transformers(tmp_path, arch, tied):
    """Names, Q/K un-permutation (llama only), config from metadata and tied / untied heads, end to end."""
    hf = hf_model(arch, tied)
    path = write_model_gguf(tmp_path / f"{arch}.gguf", hf, arch)
    ours = load_model(path)
    assert ours.config.model_type == arch and ours.config.tie_word_embeddings == tied
    assert ours.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    seq = torch.randint(0, V, (19,)).tolist()
    ref = logits(hf, seq)
    err = float((logits(ours, seq) - ref).abs().max())
    assert err <= 1e-4 * float(ref.abs().max())


def test_quantized_weights_load_as_dequantized(tmp_path):
    """A Q8_0 file loads with exactly ``gguf.quants.dequantize``'s values, Q/K rows back in Hugging Face order, and
    logits close to the fp32 model's (Q8_0 rounding only)."""
    hf = hf_model("llama")
    path = write_model_gguf(tmp_path / "q8.gguf", hf, "llama", qtype=Q.Q8_0)
    _, sd = load_gguf_state_dict(path)
    f = GGUFFile(path)
    for name, hf_name, heads in (("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", 2),
                                 ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None)):
        raw = f.tensors[name]
        shape = tuple(reversed(raw.shape.tolist()))
        want = torch.from_numpy(gguf.quants.dequantize(raw.data, Q.Q8_0).reshape(shape).copy())
        assert torch.equal(sd[hf_name], unpermute_qk(want, heads) if heads else want)
        assert float((sd[hf_name] - hf.state_dict()[hf_name]).abs().max()) < 0.01
    seq = torch.randint(0, V, (11,)).tolist()
    ref = logits(hf, seq)
    assert float((logits(load_model(path), seq) - ref).abs().max()) < 0.05 * float(ref.abs().max())


RAW_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
             Q.Q6_K, Q.IQ4_NL]


@pytest.mark.parametrize("qtype", RAW_TYPES, ids=lambda q: q.name)
def test_every_tensor_type_matches_gguf_dequantize(tmp_path, qtype):
    """Random bytes of each type (finite scales) read back as ``gguf.quants.dequantize`` gives them, in PyTorch's
    dimension order."""
    rows, cols = 3, 512
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        raw.view(np.uint8)[:] &= 0x3B  # keeps every f16 scale's exponent small: finite values, no NaN
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("x", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "t.gguf")
    got = f.tensor("x")
    want = gguf.quants.dequantize(f.tensors["x"].data, qtype).astype(np.float32).reshape(rows, cols)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    np.testing.assert_array_equal(got.numpy(), want)


# ---------------------------------------------------------------------------------------------------- errors
@pytest.fixture
def llama_file(tmp_path):
    return write_model_gguf(tmp_path / "ok.gguf", hf_model("llama"), "llama")


def test_truncated_file(llama_file, tmp_path):
    data = llama_file.read_bytes()
    for keep in (len(data) - 100, 40):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(GGUFError, match=r"truncated"):
            load_model(cut)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        load_model(bad)


def test_unknown_architecture(tmp_path):
    hf = hf_model("llama")
    path = write_model_gguf(tmp_path / "m.gguf", hf, "mamba")
    with pytest.raises(GGUFError, match=r"unsupported architecture 'mamba' \(general.architecture\)"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    path = write_model_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama", skip="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"has no tensor 'blk.1.ffn_up.weight' \(runtime name "
                                        r"'model.layers.1.mlp.up_proj.weight'\)"):
        load_model(path)


@pytest.mark.parametrize("key,value,match", [
    ("llama.block_count", "2", "'llama.block_count' must be an integer"),
    ("llama.rope.freq_base", "1e4", "'llama.rope.freq_base' must be a number"),
    ("llama.attention.head_count", 0, "head_count 0"),
    ("llama.rope.dimension_count", 8, "partial rotary"),
    ("llama.rope.scaling.type", "yarn", "RoPE scaling"),
])
def test_wrong_metadata_is_named(tmp_path, key, value, match):
    path = write_model_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama", metadata={key: value})
    with pytest.raises(GGUFError, match=match):
        load_model(path)


def test_missing_metadata_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="has no metadata key 'llama.attention.head_count'"):
        load_model(path)


def test_undequantizable_type_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    block, size = GGML_QUANT_SIZES[Q.Q8_K]
    w.add_tensor("x", np.zeros((2, 256 // block * size), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="tensor 'x' has quantization type Q8_K, which the gguf package cannot"):
        GGUFFile(tmp_path / "t.gguf").tensor("x")
