"""Tiny random Qwen3 targets in Hugging Face format, for the drafter, engine and calibration tests."""

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def save_tiny_qwen3(path, *, vocab_size: int = 96, hidden_size: int = 64, intermediate_size: int = 128,
                    num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                    peak: float = 40.0) -> Path:
    """Write a randomly initialised, untied Qwen3 to ``path`` and return the path.

    The LM head is scaled by ``peak`` so next-token distributions are peaky (strong statistical tests, varied
    acceptance); ``peak=1`` leaves it as initialised. Nothing is seeded here: callers seed torch first.
    """
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                                      intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                      head_dim=head_dim, tie_word_embeddings=False))
    if peak != 1:
        with torch.no_grad():
            hf.lm_head.weight.mul_(peak)
    hf.save_pretrained(path)
    return Path(path)
