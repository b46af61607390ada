"""Public ops. Each validates its inputs and dispatches to a Triton kernel (CUDA) or its PyTorch reference (CPU)."""

from .draft_block_attention import draft_block_attention, plan_draft_block_attention
from .rejection_sample import rejection_sample
from .sequential_head import sequential_head
from .survival import (
    capacity_unconstrained,
    prefix_survival,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
)
from .verify_attention import plan_verify_attention, verify_attention

__all__ = [
    "capacity_unconstrained",
    "draft_block_attention",
    "plan_draft_block_attention",
    "plan_verify_attention",
    "prefix_survival",
    "rejection_sample",
    "select_verify_lengths_alg1",
    "select_verify_lengths_topk",
    "sequential_head",
    "verify_attention",
]
