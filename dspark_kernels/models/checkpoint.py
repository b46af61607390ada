"""Checkpoint I/O: read a Hugging Face model directory (``config.json`` + safetensors) into a checked state dict.

Accepted layouts:
    <dir>/config.json + <dir>/model.safetensors
    <dir>/config.json + <dir>/model.safetensors.index.json (``weight_map``: tensor name -> shard file)

Every tensor the runtime needs is checked for presence and shape against :func:`expected_shapes`; errors name the file
and tensor. With ``tie_word_embeddings`` and no ``lm_head.weight``, the LM head reuses the embedding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig

__all__ = ["CheckpointError", "expected_shapes", "load_config", "load_state_dict"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing pieces, unreadable, or does not match its config."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every weight the runtime reads (HF naming). ``lm_head.weight`` is always listed."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (i,)
            shapes[p + "mlp.up_proj.bias"] = (i,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path is not a directory: {path}")
    return path


def load_config(path: str | Path) -> ModelConfig:
    """Parse ``<path>/config.json``."""
    path = _check_dir(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"missing config.json in checkpoint directory {path}")
    return ModelConfig.from_json_file(cfg_file)


def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it (single file: every name the file lists)."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            wm = data["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot parse shard index {index}: {e}") from e
        out = {}
        for name, fname in wm.items():
            shard = path / fname
            if not shard.is_file():
                raise FileNotFoundError(f"shard file {shard} (listed for tensor {name!r} in {index}) not found")
            out[name] = shard
        return out
    if single.is_file():
        return {name: single for name in _keys(single)}
    raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}")


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for bad headers / truncation
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def load_state_dict(
    path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load and check every weight of the model in ``path``.

    Args:
        path: checkpoint directory.
        cfg: parsed config (read from ``path`` when ``None``).
        dtype: cast floating tensors to this dtype (``None`` keeps the stored dtype).
    Returns:
        ``(cfg, state_dict)`` with exactly the names of :func:`expected_shapes`; with tied embeddings
        ``state_dict["lm_head.weight"]`` is the embedding tensor itself.
    """
    path = _check_dir(path)
    if cfg is None:
        cfg = load_config(path)
    shapes = expected_shapes(cfg)
    wmap = _weight_map(path)
    tied = "lm_head.weight" not in wmap
    if tied and not cfg.tie_word_embeddings:
        raise CheckpointError(f"missing tensor 'lm_head.weight' in {path} and tie_word_embeddings is false")
    missing = [n for n in shapes if n not in wmap and not (n == "lm_head.weight" and tied)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in checkpoint {path}")
    extra_layers = sorted({int(m.group(1)) for n in wmap if (m := _LAYER.match(n))} - set(range(cfg.num_hidden_layers)))
    if extra_layers:
        raise CheckpointError(f"checkpoint {path} holds decoder layers {extra_layers[:5]} beyond the config's "
                              f"num_hidden_layers = {cfg.num_hidden_layers}: config and weights disagree")

    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name in wmap:
            by_file.setdefault(wmap[name], []).append(name)
    sd: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"tensor {name!r} is listed in the index but absent from {file}")
                    sd[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e
    for name, t in sd.items():
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"tensor {name!r} in {wmap[name]} has shape {tuple(t.shape)}, expected {shapes[name]} from config"
            )
        if dtype is not None and t.is_floating_point():
            sd[name] = t.to(dtype)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return cfg, sd
