"""Drafter training batches from target rollouts: target features, target distributions, anchors and labels.

For a batch of rollouts (prompt + response) the frozen target runs once (ragged, through our runtime) to give, per
position, the concatenated raw hidden states of the drafter's ``feature_layers`` and the target's next-token logits.
Anchors are sampled uniformly without replacement among positions ``p`` with ``loss_mask[p] = loss_mask[p + 1] = 1``
(response tokens), sorted; shortfalls are padding (``-1``). Block slot k (0-based) of anchor p is labelled with token
``p + k + 1`` and supervised by the target's distribution at position ``p + k``; a slot is valid only if it and every
earlier slot lie inside the response (contiguous-prefix mask, paper §5).
"""

from __future__ import annotations

import random
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


@torch.no_grad()
def target_outputs(target: CausalLM, seqs: list[list[int]], feature_layers: tuple[int, ...]):
    """Run the target over whole sequences: (features [B, L, m * h], logits [B, L, V], tokens [B, L]), padded."""
    n = len(seqs)
    seq_len = max(len(s) for s in seqs)
    out, cu = forward_sequences(target, seqs, hidden_layers=feature_layers, check_inputs=False)
    flat_feat = torch.cat([out.hidden_states[layer] for layer in feature_layers], dim=-1)
    features = flat_feat.new_zeros(n, seq_len, flat_feat.shape[-1])
    logits = out.logits.new_zeros(n, seq_len, out.logits.shape[-1])
    tokens = torch.zeros(n, seq_len, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        a, b = int(cu[i]), int(cu[i + 1])
        features[i, : b - a] = flat_feat[a:b]
        logits[i, : b - a] = out.logits[a:b]
        tokens[i, : b - a] = torch.tensor(seq)
    return features.clone(), logits.clone(), tokens  # clone: leave inference mode so autograd may use them


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, rng: random.Random) -> list[int]:
    """Anchor positions ``p`` with ``p`` and ``p + 1`` both response tokens, sampled without replacement, sorted."""
    candidates = list(range(prompt_len, seq_len - 1))
    picked = sorted(rng.sample(candidates, min(num_anchors, len(candidates))))
    return picked + [-1] * (num_anchors - len(picked))


def make_batch(target: CausalLM, rollouts: Rollouts, indices: list[int], feature_layers: tuple[int, ...],
               gamma: int, num_anchors: int, rng: random.Random) -> DrafterBatch:
    seqs = [rollouts.prompts[i] + rollouts.responses[i] for i in indices]
    features, logits, tokens = target_outputs(target, seqs, feature_layers)
    b, seq_len = tokens.shape
    anchors = torch.tensor(
        [sample_anchors(len(rollouts.prompts[i]), len(s), num_anchors, rng) for i, s in zip(indices, seqs)],
        dtype=torch.int64,
    )
    lens = torch.tensor([len(s) for s in seqs])
    k = torch.arange(gamma)
    label_pos = anchors[:, :, None] + 1 + k  # [B, A, gamma]
    inside = (anchors[:, :, None] >= 0) & (label_pos < lens[:, None, None])
    valid = inside.long().cumprod(dim=2).bool()
    safe = label_pos.clamp(0, seq_len - 1)
    labels = tokens.gather(1, safe.view(b, -1)).view(b, num_anchors, gamma)
    tgt = logits.gather(1, (safe - 1).clamp(min=0).view(b, -1, 1).expand(-1, -1, logits.shape[-1]))
    return DrafterBatch(features, tokens, anchors, labels, tgt.view(b, num_anchors, gamma, -1), valid)
