"""The sequential (Markov) draft head and its confidence head as an ``nn.Module``.

Training runs :meth:`SequentialHead.teacher_forced` (parallel over the block's slots, differentiable; the rnn kind is
unrolled over them); inference runs :meth:`SequentialHead.sample`, which hands :meth:`SequentialHead.weights` to the
:func:`~dspark_kernels.ops.sequential_head` op. Both compute the logits in float32 with the same formulas, so a
block sampled by the op and replayed with its own tokens as ``prev_tokens`` gives the same logits and confidences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.sequential_head import MarkovBiasRows, SequentialHeadResult, SequentialHeadWeights, sequential_head
from ..reference._tensor_key import tensor_key

__all__ = ["SequentialHead"]

_HEAD_KINDS = ("vanilla", "gated", "rnn")


class SequentialHead(nn.Module):
    """Low-rank bias ``W2 lat(W1[x_{k-1}], h_k)`` added to the backbone logits of every draft slot, plus the
    confidence head ``c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b)``.

    Parameters (torch layouts; :meth:`weights` gives the op's): ``w1`` Embedding ``(V, r)``; ``w2`` Linear
    ``r -> V`` without bias (zero-initialised, so the bias starts at exactly 0); ``gate`` Linear ``d + r -> r``
    (gated); ``rnn`` Linear ``2r + d -> 3r`` (rnn, input order ``[s; e; h]``); ``confidence`` Linear
    ``d + r -> 1`` (``d -> 1`` when ``rank == 0``). ``rank == 0`` is kind ``"none"``: pure DFlash, no bias.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str = "vanilla", confidence: bool = True):
        super().__init__()
        if kind not in _HEAD_KINDS:
            raise ValueError(f"kind must be one of {_HEAD_KINDS}, got {kind!r}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0 (0 = no sequential head), got {rank}")
        self.vocab_size, self.hidden_size, self.rank = vocab_size, hidden_size, rank
        self.kind = kind if rank > 0 else "none"
        if rank > 0:
            self.w1 = nn.Embedding(vocab_size, rank)
            nn.init.normal_(self.w1.weight, std=0.02)
            self.w2 = nn.Linear(rank, vocab_size, bias=False)
            nn.init.zeros_(self.w2.weight)
        if self.kind == "gated":
            self.gate = nn.Linear(hidden_size + rank, rank)
        if self.kind == "rnn":
            self.rnn = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.confidence = nn.Linear(hidden_size + rank, 1) if confidence else None

    def _latent(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """``(lat [..., r], new state)`` of one slot (vanilla/gated work on any leading shape; rnn on ``[B, r]``)."""
        if self.kind == "vanilla":
            return e, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate(torch.cat([h, e], dim=-1))) * e, state
        a, c, o = self.rnn(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(a)
        return torch.tanh(o), gate * state + (1 - gate) * torch.tanh(c)

    def teacher_forced(
        self, base_logits: torch.Tensor, hidden: torch.Tensor, prev_tokens: torch.Tensor,
        columns: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward over blocks with known previous tokens (differentiable).

        Args:
            base_logits: ``[B, G, V]`` backbone logits of the G slots of each block, or ``[B, G, K]`` over the
                vocabulary ids ``columns``.
            hidden: ``[B, G, d]`` backbone hidden states.
            prev_tokens: ``[B, G]`` int target ids, ``[anchor, x_1 .. x_{G-1}]`` of each block.
            columns: ``[K]`` int64, the target ids of ``base_logits``' last dimension (a draft vocabulary); None =
                the whole vocabulary in id order.
        Returns:
            ``(logits [B, G, V or K] float32, confidence_logits [B, G] float32)``; the confidence logits are zeros
            when the head has no confidence layer.
        """
        h = hidden.float()
        logits = base_logits.float()
        e = self.w1(prev_tokens).float() if self.rank > 0 else None
        w2 = None if self.rank == 0 else self.w2.weight if columns is None else self.w2.weight[columns]
        if self.kind in ("vanilla", "gated"):
            logits = logits + F.linear(self._latent(e, h, None)[0], w2)
        elif self.kind == "rnn":
            state = h.new_zeros(h.shape[0], self.rank)
            lats = []
            for k in range(h.shape[1]):
                lat, state = self._latent(e[:, k], h[:, k], state)
                lats.append(lat)
            logits = logits + F.linear(torch.stack(lats, dim=1), w2)
        if self.confidence is None:
            return logits, h.new_zeros(h.shape[:2])
        features = h if e is None else torch.cat([h, e], dim=-1)
        return logits, self.confidence(features).squeeze(-1)

    def weights(self) -> SequentialHeadWeights:
        """Detached parameters in the op's layout. ``gate_w [d + r, r]`` and ``rnn_w [2r + d, 3r]`` are transposed
        views, read by the kernel through their strides. ``w2 [r, V]`` is a contiguous copy, kept until the weight
        changes: a row-major ``w2`` makes the bias GEMV of every slot read whole rows, which halves its cost on the
        CPU and coalesces the kernel's loads. A vanilla head outside autograd also hands over its
        :class:`~dspark_kernels.ops.sequential_head.MarkovBiasRows` (bias rows by previous token, kept across calls
        until ``w1`` or ``w2`` changes), which the CPU path reads instead of recomputing each slot's bias. A change is
        seen through the weights' version counters (assignment, ``load_state_dict``, optimiser steps, in-place ops
        under ``no_grad``); a write through ``.data`` bypasses them: write under ``no_grad``, or replace it."""
        fields: dict = {}
        if self.rank > 0:
            fields.update(w1=self.w1.weight.detach(), w2=self._w2_rows())
        if self.kind == "vanilla" and not torch.is_grad_enabled():
            fields.update(bias_rows=self._bias_rows(fields["w1"], fields["w2"]))
        if self.kind == "gated":
            fields.update(gate_w=self.gate.weight.detach().t(), gate_b=self.gate.bias.detach())
        if self.kind == "rnn":
            fields.update(rnn_w=self.rnn.weight.detach().t(), rnn_b=self.rnn.bias.detach())
        if self.confidence is not None:
            fields.update(conf_w=self.confidence.weight.detach()[0], conf_b=self.confidence.bias.detach()[0])
        return SequentialHeadWeights(self.kind, **fields)

    def _w2_rows(self) -> torch.Tensor:
        """``w2`` as a contiguous ``[r, V]`` tensor, recopied only when the parameter was replaced or updated (an
        inference tensor keeps no version counter, so a module created under ``torch.inference_mode`` copies it
        every call)."""
        weight = self.w2.weight
        if weight.is_inference():
            return weight.detach().t().contiguous()
        key = tensor_key(weight)
        if getattr(self, "_w2_rows_key", None) != key:
            with torch.no_grad():
                self._w2_rows_cache = weight.detach().t().contiguous()
            self._w2_rows_key = key
        return self._w2_rows_cache

    def _bias_rows(self, w1: torch.Tensor, w2: torch.Tensor) -> MarkovBiasRows:
        """The kept :class:`MarkovBiasRows` of ``w1``/``w2``, made anew when they changed."""
        rows = getattr(self, "_bias_rows_cache", None)
        if w1.is_inference():  # no version counter to tell an update: a table for this call only
            return MarkovBiasRows(w1, w2)
        if rows is None or not rows.belongs_to(w1, w2):
            rows = self._bias_rows_cache = MarkovBiasRows(w1, w2)
        return rows

    @torch.no_grad()
    def sample(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_tokens: torch.Tensor,
        cu_num_draft_tokens: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        *,
        impl: str | None = None,
        check_inputs: bool = True,
    ) -> SequentialHeadResult:
        """Draft ragged blocks with the op (shapes as in :func:`~dspark_kernels.ops.sequential_head`)."""
        return sequential_head(
            base_logits, hidden, anchor_tokens, cu_num_draft_tokens, self.weights(), temperature, top_k, top_p,
            uniforms, impl=impl, check_inputs=check_inputs,
        )
