"""Public ops. Each validates its inputs and dispatches to a Triton kernel (CUDA) or its PyTorch reference (CPU)."""

from .draft_block_attention import draft_block_attention
from .rejection_sample import rejection_sample
from .verify_attention import verify_attention

__all__ = ["draft_block_attention", "rejection_sample", "verify_attention"]
