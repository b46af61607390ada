"""A GGUF model file as the runtime's config and state dict (llama and qwen3 architectures).

:func:`gguf_config_dict` turns the GGUF metadata into a Hugging Face ``config.json`` dict, which
:class:`~.config.ModelConfig` then checks like any other config. :func:`load_gguf_state_dict` dequantizes every tensor
(any type the ``gguf`` package can dequantize: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...), renames llama.cpp's
tensors to the Hugging Face names of :func:`~.checkpoint.expected_shapes`, and undoes the row permutation that
llama.cpp's converter applies to the query and key projections of llama models (it stores them for its interleaved
RoPE; qwen3 is stored unpermuted). Errors name the file and the key or tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .checkpoint import expected_shapes
from .config import ModelConfig
from .gguf_reader import GGUFError, GGUFFile, open_gguf

__all__ = ["GGUF_ARCHITECTURES", "gguf_config_dict", "load_gguf_state_dict", "unpermute_qk"]

# general.architecture -> (HF model_type, HF architecture class)
GGUF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _architecture(f: GGUFFile) -> str:
    arch = f.get("general.architecture", "str")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"GGUF file {f.path}: unsupported architecture {arch!r} (general.architecture); "
                        f"supported: {sorted(GGUF_ARCHITECTURES)}")
    return arch


def gguf_config_dict(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` contents that describe the model in ``f`` (checked by ``ModelConfig``)."""
    arch = _architecture(f)
    model_type, hf_class = GGUF_ARCHITECTURES[arch]
    heads = f.get(f"{arch}.attention.head_count", "int")
    hidden = f.get(f"{arch}.embedding_length", "int")
    if heads < 1 or hidden % heads:
        raise GGUFError(f"GGUF file {f.path}: {arch}.embedding_length {hidden} is not a multiple of "
                        f"{arch}.attention.head_count {heads}")
    head_dim = f.get(f"{arch}.attention.key_length", "int", hidden // heads)
    rope_dim = f.get(f"{arch}.rope.dimension_count", "int", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"GGUF file {f.path}: {arch}.rope.dimension_count {rope_dim} differs from the head size "
                        f"{head_dim}; partial rotary embeddings are not supported")
    scaling = f.get(f"{arch}.rope.scaling.type", "str", "none")
    if scaling != "none" or "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"GGUF file {f.path}: RoPE scaling ({arch}.rope.scaling.type = {scaling!r}"
                        f"{', rope_freqs.weight' if 'rope_freqs.weight' in f.tensors else ''}) is not supported")
    tokens = f.get("tokenizer.ggml.tokens", "str_list", None)
    vocab = f.get(f"{arch}.vocab_size", "int", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise GGUFError(f"GGUF file {f.path} states no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": f.get(f"{arch}.feed_forward_length", "int"),
        "num_hidden_layers": f.get(f"{arch}.block_count", "int"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{arch}.attention.head_count_kv", "int", heads),
        "head_dim": head_dim,
        "rms_norm_eps": f.get(f"{arch}.attention.layer_norm_rms_epsilon", "float"),
        "rope_theta": float(f.get(f"{arch}.rope.freq_base", "float", 10000.0)),
        "max_position_embeddings": f.get(f"{arch}.context_length", "int"),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
    }
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in f.tensors
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = f.get(name, "int", None)
        if value is not None:
            cfg[key] = value
    return cfg


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's query/key row order: within each head, its converter interleaves the two RoPE halves
    (row ``2 i + j`` of a head holds HF row ``j * d / 2 + i``); ``w`` is ``[n_heads * d, ...]`` (weight or bias)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def load_gguf_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> tuple[ModelConfig,
                                                                                    dict[str, torch.Tensor]]:
    """Config and dequantized weights (HF names, PyTorch layouts) of the GGUF model at ``path``.

    ``dtype``: cast the float32 dequantized tensors (``None`` keeps float32). Returns ``(cfg, state_dict)`` with
    exactly the names of :func:`expected_shapes`; with tied embeddings ``state_dict["lm_head.weight"]`` is the
    embedding tensor itself. The file is opened through :func:`.gguf_reader.open_gguf` (parsed once while unchanged).
    """
    f = open_gguf(path)
    cfg = ModelConfig.from_dict(gguf_config_dict(f), source=f"{f.path} (GGUF metadata)")
    shapes = expected_shapes(cfg)
    by_hf = {}
    for name in f.tensors:
        hf = _hf_name(name)
        if hf is not None:
            by_hf[hf] = name
    missing = [n for n in shapes if n not in by_hf and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        gguf_names = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
        first = missing[0]
        m = re.match(r"model\.layers\.(\d+)\.(.+)", first)
        theirs = (f"blk.{m.group(1)}." + {v: k for k, v in _LAYER_NAMES.items()}[m.group(2)]) if m \
            else gguf_names.get(first, first)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(f"GGUF file {f.path} has no tensor {theirs!r} (runtime name {first!r}){more}")
    extra = sorted({int(m.group(1)) for n in f.tensors if (m := _BLOCK.fullmatch(n))}
                   - set(range(cfg.num_hidden_layers)))
    if extra:
        raise GGUFError(f"GGUF file {f.path} holds blocks {extra[:5]} beyond {_architecture(f)}.block_count = "
                        f"{cfg.num_hidden_layers}")
    permute = cfg.model_type == "llama"
    sd: dict[str, torch.Tensor] = {}
    for hf, name in by_hf.items():
        if hf not in shapes:
            continue
        t = f.tensor(name)
        if permute and (".q_proj." in hf or ".k_proj." in hf):
            t = unpermute_qk(t, cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads)
        if tuple(t.shape) != shapes[hf]:
            raise GGUFError(f"GGUF file {f.path}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                            f"{shapes[hf]} from the metadata")
        sd[hf] = t if dtype is None else t.to(dtype)
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return cfg, sd
