"""Target-model configuration parsed from a Hugging Face ``config.json`` (Qwen3 and Llama families).

Only the fields the runtime needs are kept. Anything the runtime cannot reproduce exactly (another architecture, an
unsupported RoPE scaling, a non-SiLU activation, sliding-window attention) is rejected with a ``ValueError`` that names
the offending value, rather than silently producing different logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES"]

# model_type -> accepted ``architectures`` entries
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "qwen3": ("Qwen3ForCausalLM",),
    "llama": ("LlamaForCausalLM",),
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _int_field(source: str, key: str, value: Any, low: int = 1) -> int:
    """A config integer: a JSON int (not a bool, string or float) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{source}: {key} must be >= {low}, got {value}")
    return value


def _bool_field(source: str, key: str, value: Any) -> bool:
    """A config flag: a JSON boolean (a string such as ``"false"`` would read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be a JSON boolean (true or false), got {value!r}")
    return value


def _positive_number(source: str, key: str, value: Any) -> float:
    """A finite number > 0 (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    return float(value)


def _bos_id(source: str, value: Any, vocab_size: int) -> int | None:
    """``None`` or one token id in ``[0, vocab_size)``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
        raise ValueError(f"{source}: bos_token_id must be a token id in [0, vocab_size = {vocab_size}), got {value!r}")
    return value


def _token_ids(source: str, key: str, value: Any, vocab_size: int) -> tuple[int, ...]:
    """``None``, one token id or a list of them, each in ``[0, vocab_size)``."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{source}: {key} must be token ids in [0, vocab_size = {vocab_size}), got {value!r}")
    return tuple(ids)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters.

    ``rope_scaling`` holds the llama3 parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) when ``rope_type == "llama3"``, else it is empty.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, float] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int | None = None

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        """Build from the parsed contents of a Hugging Face ``config.json``; ``source`` names it in errors."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        archs = d.get("architectures") or []
        allowed = SUPPORTED_MODEL_TYPES[model_type]
        bad = [a for a in archs if a not in allowed]
        if bad:
            raise ValueError(f"{source}: unsupported architecture {bad[0]!r} for model_type {model_type!r}; "
                             f"supported: {list(allowed)}")

        def req(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ValueError(f"{source}: missing required field {key!r}")
            return d[key]

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        if d.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention (use_sliding_window=true) is not supported")

        hidden = _int_field(source, "hidden_size", req("hidden_size"))
        heads = _int_field(source, "num_attention_heads", req("num_attention_heads"))
        kv_value = d.get("num_key_value_heads")
        kv_heads = heads if kv_value is None else _int_field(source, "num_key_value_heads", kv_value)
        vocab = _int_field(source, "vocab_size", req("vocab_size"))
        head_dim = d.get("head_dim")
        if head_dim is not None:
            _int_field(source, "head_dim", head_dim)
        else:
            if hidden % heads:
                raise ValueError(f"{source}: hidden_size {hidden} not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                             f"{kv_heads}")

        eps = d.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"{source}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
        positions = d.get("max_position_embeddings")
        if positions is not None:
            _int_field(source, "max_position_embeddings", positions)
        theta, rope_type, scaling = cls._parse_rope(d, source)
        cfg = cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int_field(source, "intermediate_size", req("intermediate_size")),
            num_hidden_layers=_int_field(source, "num_hidden_layers", req("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(eps),
            rope_theta=theta,
            rope_type=rope_type,
            rope_scaling=scaling,
            tie_word_embeddings=_bool_field(source, "tie_word_embeddings", d.get("tie_word_embeddings", False)),
            attention_bias=_bool_field(source, "attention_bias", d.get("attention_bias", False)),
            mlp_bias=_bool_field(source, "mlp_bias", d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=_bos_id(source, d.get("bos_token_id"), vocab),
            eos_token_ids=_token_ids(source, "eos_token_id", d.get("eos_token_id"), vocab),
            max_position_embeddings=positions,
        )
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        return cfg

    @staticmethod
    def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, str, dict[str, float]]:
        """Accept transformers-5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` pair."""
        params = d.get("rope_parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{source}: rope_parameters must be an object, got {type(params).__name__}")
        if params and "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]  # per-layer-type form
        params = dict(params or {})
        legacy = d.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise ValueError(f"{source}: rope_scaling must be an object, got {type(legacy).__name__}")
        merged = {**legacy, **params}
        theta = _positive_number(source, "rope_theta", merged.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{source}: unsupported rope_type {rope_type!r}; supported: {list(_SUPPORTED_ROPE_TYPES)}")
        if float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
        scaling: dict[str, float] = {}
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if k not in merged]
            if missing:
                raise ValueError(f"{source}: llama3 rope scaling is missing {missing}")
            scaling = {k: _positive_number(source, f"rope_scaling.{k}", merged[k]) for k in _LLAMA3_KEYS}
            if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ValueError(f"{source}: rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                                 f"{scaling['high_freq_factor']} <= {scaling['low_freq_factor']}")
        return float(theta), str(rope_type), scaling

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        """Read and parse ``config.json``; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot parse config file {path}: {e}") from e
        return cls.from_dict(data, source=str(path))

    # ------------------------------------------------------------------ derived
    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """RoPE inverse frequencies ``[head_dim // 2]`` float32, with llama3 wavelength-dependent scaling if set."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "llama3":
            s = self.rope_scaling
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_ctx = s["original_max_position_embeddings"]
            low_wl, high_wl = old_ctx / lo, old_ctx / hi
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            blended = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            inv = torch.where(medium, blended, scaled)
        return inv.to(device)
