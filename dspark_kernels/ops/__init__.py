"""Public ops. Each validates its inputs and dispatches to a Triton kernel (CUDA) or its PyTorch reference (CPU)."""

from .rejection_sample import rejection_sample
from .verify_attention import verify_attention

__all__ = ["rejection_sample", "verify_attention"]
