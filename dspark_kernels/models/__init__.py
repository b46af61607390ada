"""Target-model runtime: config parsing, checkpoint I/O, paged KV cache, the Qwen3/Llama forward and generation."""

from .checkpoint import CheckpointError, expected_shapes, load_config, load_state_dict
from .config import ModelConfig
from .generate import GenerateResult, forward_sequences, generate
from .kv_cache import OutOfPagesError, PagedKVCache
from .transformer import CausalLM, ForwardOutput, load_model

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ForwardOutput",
    "GenerateResult",
    "ModelConfig",
    "OutOfPagesError",
    "PagedKVCache",
    "expected_shapes",
    "forward_sequences",
    "generate",
    "load_config",
    "load_model",
    "load_state_dict",
]
