"""Public ops. Each validates its inputs and dispatches to a Triton kernel (CUDA) or its PyTorch reference (CPU)."""

from .verify_attention import verify_attention

__all__ = ["verify_attention"]
