"""Where a target's weights come from: a registry name, a Hugging Face directory or a GGUF file.

:func:`load_weights` resolves the source (:func:`.registry.resolve_model` fetches a named model on first use) and
reads it with the matching loader, so every entry point (``load_model``, each CLI's ``--model``) takes all three.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import load_state_dict
from .config import ModelConfig
from .gguf_weights import load_gguf_state_dict
from .registry import resolve_model

__all__ = ["load_weights"]


def load_weights(source: str | Path, dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(cfg, state_dict)`` of the model at ``source`` (HF names; see :func:`.checkpoint.load_state_dict`)."""
    path = resolve_model(source)
    if path.is_file():
        return load_gguf_state_dict(path, dtype=dtype)
    return load_state_dict(path, dtype=dtype)
