"""Drafter training batches from target rollouts: target features, target distributions, anchors and labels.

For a batch of rollouts (prompt + response), the frozen target's per-position outputs come either from the features
recorded while the rollouts were generated (:mod:`.rollout_generation`, ``--feature-layers`` of the rollouts CLI: no
target compute at all) or from one ragged forward of the target over the sequences. Either way a batch holds, per
position, the concatenated raw hidden states of the drafter's ``feature_layers`` and the raw output of the target's
last decoder layer; the target's logits (its final norm and LM head over that output, :func:`target_logits`) are
computed only at the positions a loss reads, not over the whole ``[B, L, V]``.

Anchors are sampled uniformly without replacement among positions ``p`` with ``loss_mask[p] = loss_mask[p + 1] = 1``
(response tokens), sorted; shortfalls are padding (``-1``). Block slot k (0-based) of anchor p is labelled with token
``p + k + 1`` and supervised by the target's distribution at position ``p + k``; a slot is valid only if it and every
earlier slot lie inside the response (contiguous-prefix mask, paper §5).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models import CausalLM, forward_sequences
from ..train.rollouts import Rollouts


@dataclass
class DrafterBatch:
    """Padded to ``L`` positions; ``A`` anchors per sequence; block size ``gamma``.

    features [B, L, m * hidden]; tokens [B, L]; anchors [B, A] (-1 = padding);
    labels [B, A, gamma]; target_logits [B, A, gamma, V] fp32; valid [B, A, gamma] bool.
    """

    features: torch.Tensor
    tokens: torch.Tensor
    anchors: torch.Tensor
    labels: torch.Tensor
    target_logits: torch.Tensor
    valid: torch.Tensor


@dataclass
class TargetOutputs:
    """Padded to ``L`` (the longest sequence): features [B, L, m * hidden] and last_hidden [B, L, hidden] float32
    (zeros past each sequence's recorded positions); tokens [B, L] int64; lens [B]; prompt_lens [B]."""

    features: torch.Tensor
    last_hidden: torch.Tensor
    tokens: torch.Tensor
    lens: torch.Tensor
    prompt_lens: torch.Tensor


@torch.no_grad()
def target_logits(target: CausalLM, last_hidden: torch.Tensor) -> torch.Tensor:
    """The target's fp32 logits ``[..., V]`` from raw outputs of its last decoder layer ``[..., hidden]``."""
    return target.lm_head(target.model.norm(last_hidden.to(target.dtype))).float()


def _padded(rows: Sequence[torch.Tensor], seq_len: int) -> torch.Tensor:
    out = rows[0].new_zeros(len(rows), seq_len, rows[0].shape[-1], dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _token_batch(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, L] int64 zero-padded, lens [B])`` of token sequences."""
    tokens = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.int64)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = torch.tensor(seq)
    return tokens, torch.tensor([len(s) for s in seqs])


def forward_outputs(target: CausalLM, seqs: Sequence[Sequence[int]], feature_layers: tuple[int, ...],
                    prompt_lens: Sequence[int] | None = None) -> TargetOutputs:
    """One ragged target forward over whole token sequences (``prompt_lens``: recorded as given, default 0)."""
    tokens, lens = _token_batch(seqs)
    last_layer = target.config.num_hidden_layers - 1
    with torch.no_grad():
        out, cu = forward_sequences(target, seqs, hidden_layers=(*feature_layers, last_layer),
                                    logits_indices=torch.zeros(0, dtype=torch.int64), check_inputs=False)
    flat_feat = torch.cat([out.hidden_states[layer] for layer in feature_layers], dim=-1)
    bounds = cu.tolist()
    feats = [flat_feat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    last = [out.hidden_states[last_layer][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    # the padded copies are new tensors outside inference mode, so autograd may use them
    seq_len = tokens.shape[1]
    return TargetOutputs(_padded(feats, seq_len), _padded(last, seq_len), tokens, lens,
                         torch.tensor(list(prompt_lens) if prompt_lens is not None else [0] * len(seqs)))


def rollout_outputs(target: CausalLM, rollouts: Rollouts, indices: Sequence[int],
                    feature_layers: tuple[int, ...]) -> TargetOutputs:
    """The target's outputs over rollouts ``indices``: from the recorded features when ``rollouts`` has them for every
    layer of ``feature_layers`` (:attr:`Rollouts.feature_layers`), else from :func:`forward_outputs`."""
    seqs = [rollouts.prompts[i] + rollouts.responses[i] for i in indices]
    prompt_lens = [len(rollouts.prompts[i]) for i in indices]
    stored = rollouts.feature_layers or ()
    if rollouts.features is None or not set(feature_layers) <= set(stored):
        return forward_outputs(target, seqs, feature_layers, prompt_lens)
    tokens, lens = _token_batch(seqs)
    seq_len = tokens.shape[1]
    h = rollouts.features[indices[0]].last_hidden.shape[-1]
    cols = torch.cat([torch.arange(stored.index(layer) * h, (stored.index(layer) + 1) * h) for layer in feature_layers])
    feats = [rollouts.features[i].features[:, cols] for i in indices]
    last = [rollouts.features[i].last_hidden for i in indices]
    return TargetOutputs(_padded(feats, seq_len), _padded(last, seq_len), tokens, lens, torch.tensor(prompt_lens))


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, rng: random.Random) -> list[int]:
    """Anchor positions ``p`` with ``p`` and ``p + 1`` both response tokens, sampled without replacement, sorted."""
    candidates = list(range(prompt_len, seq_len - 1))
    picked = sorted(rng.sample(candidates, min(num_anchors, len(candidates))))
    return picked + [-1] * (num_anchors - len(picked))


def make_batch(target: CausalLM, rollouts: Rollouts, indices: list[int], feature_layers: tuple[int, ...],
               gamma: int, num_anchors: int, rng: random.Random) -> DrafterBatch:
    out = rollout_outputs(target, rollouts, indices, feature_layers)
    b, seq_len = out.tokens.shape
    anchors = torch.tensor(
        [sample_anchors(int(p), int(n), num_anchors, rng) for p, n in zip(out.prompt_lens, out.lens)],
        dtype=torch.int64,
    )
    k = torch.arange(gamma)
    label_pos = anchors[:, :, None] + 1 + k  # [B, A, gamma]
    inside = (anchors[:, :, None] >= 0) & (label_pos < out.lens[:, None, None])
    valid = inside.long().cumprod(dim=2).bool()
    safe = label_pos.clamp(0, seq_len - 1)
    labels = out.tokens.gather(1, safe.view(b, -1)).view(b, num_anchors, gamma)
    rows = (safe - 1).clamp(min=0).view(b, -1, 1).expand(-1, -1, out.last_hidden.shape[-1])
    tgt = target_logits(target, out.last_hidden.gather(1, rows))
    return DrafterBatch(out.features, out.tokens, anchors, labels, tgt.view(b, num_anchors, gamma, -1), valid)
