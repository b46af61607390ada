"""Bytes and FLOPs of the model passes the perf suites time, one model of each shared by the benches that need it.

Conventions: every matmul weight is read once per pass (the LM head too when it is tied to the embedding: it is read
as a GEMM operand); norm weights are read (bytes) but are not matmul FLOPs; embedding rows are gathered (only the
rows of the pass's tokens); K/V and activations are in the model's activation dtype; logits are written in fp32.
FLOPs: ``2 * params`` per token through a linear layer, ``4 * Hq * D`` per (query, key) pair an attention layer scores
(QK^T and PV). Names of the tied and fused projections follow :mod:`dspark_kernels.models.transformer`.
"""

from __future__ import annotations

from torch import nn

__all__ = ["decode_flops", "draft_block_cost", "target_forward_cost"]


def _weights(module: nn.Module, keep) -> tuple[int, int, int]:
    """``(matmul params, matmul bytes, norm bytes)`` over ``module``'s parameters whose names ``keep`` accepts (tied
    weights counted under each name)."""
    params = list(module.named_parameters(remove_duplicate=False))
    matmul = [p for n, p in params if keep(n) and (n.endswith("proj.weight") or n == "lm_head.weight")]
    norms = [p for n, p in params if keep(n) and "norm" in n]
    return (sum(p.numel() for p in matmul), sum(p.numel() * p.element_size() for p in matmul),
            sum(p.numel() * p.element_size() for p in norms))


def _lm_head(model: nn.Module) -> tuple[int, int]:
    """``(body matmul params, LM head params)`` of a :class:`~dspark_kernels.models.CausalLM`."""
    body, _, _ = _weights(model, lambda n: n.startswith("model.layers."))
    return body, model.lm_head.weight.numel()


def target_forward_cost(model: nn.Module, context: int, n_new: int) -> tuple[float, float]:
    """One forward of ``n_new`` new tokens of one request with ``context`` tokens already cached: the weights, the
    embedding rows, the request's K/V read per layer (``context + n_new`` keys) and the new K/V written, the logits of
    every new token written; causal attention scores ``sum(context + i + 1 for i < n_new)`` pairs per layer."""
    c = model.config
    elem = model.model.embed_tokens.weight.element_size()
    matmul_params, matmul_bytes, norm_bytes = _weights(model, lambda n: True)
    kv_row = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
    bytes_moved = (matmul_bytes + norm_bytes + elem * (n_new * c.hidden_size + kv_row * (context + 2 * n_new))
                   + 4 * n_new * c.vocab_size)
    pairs = sum(context + i + 1 for i in range(n_new))
    flops = 2.0 * matmul_params * n_new + 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs
    return float(bytes_moved), flops


def draft_block_cost(drafter: nn.Module, context: int, gamma: int) -> tuple[float, float]:
    """One backbone pass of a block drafter over a ``gamma``-token block of one request with ``context`` projected
    context tokens cached and no new context (so ``fc`` and ``hidden_norm`` do not run): the drafter's layer weights
    and final norm, the target's LM head over the block, the block's embedding rows, the context K/V read per draft
    layer (the block's own K/V are not cached), the base logits written; the block attends to every context key and
    to itself (non-causal): ``gamma * (context + gamma)`` pairs per layer."""
    target, cfg = drafter.target, drafter.layer_config
    elem = drafter.dtype.itemsize
    own_params, own_bytes, norm_bytes = _weights(drafter, lambda n: n.startswith(("layers.", "norm.")))
    head = target.lm_head.weight
    kv_read = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * context * elem
    bytes_moved = (own_bytes + norm_bytes + head.numel() * head.element_size() + elem * gamma * cfg.hidden_size
                   + kv_read + 4 * gamma * cfg.vocab_size)
    attention = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * gamma * (context + gamma)
    return float(bytes_moved), 2.0 * gamma * (own_params + head.numel()) + attention


def decode_flops(model: nn.Module, through_layers: int, lm_head_rows: int) -> float:
    """Matmul FLOPs of a decode in which ``through_layers`` tokens pass the decoder layers and ``lm_head_rows`` of
    them the LM head (a prefill computes the logits of its last token only)."""
    body, lm_head = _lm_head(model)
    return 2.0 * (body * through_layers + lm_head * lm_head_rows)
