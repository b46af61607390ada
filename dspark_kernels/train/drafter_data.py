"""Drafter training batches from target rollouts: target features, target distributions, anchors and labels.

For a batch of rollouts (prompt + response), the frozen target's per-position outputs come either from the features
recorded while the rollouts were generated (:mod:`.rollout_generation`, ``--feature-layers`` of the rollouts CLI: no
target compute at all) or from one ragged forward of the target over the sequences. Either way a batch holds, per
position, the concatenated raw hidden states of the drafter's ``feature_layers`` and the raw output of the target's
last decoder layer; the target's logits (its final norm and LM head over that output, :func:`target_logits`) are
computed only at the positions a loss reads, not over the whole ``[B, L, V]``. A drafter trained over a draft vocabulary
of K tokens needs only their K logits and the whole vocabulary's log-sum-exp, which generation recorded
(:func:`target_distribution`): its batches read V / K times fewer LM-head rows.

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

from ..drafters.draft_vocab import DraftVocab, draft_logits
from ..models import CausalLM, forward_sequences
from ..train.rollouts import Rollouts


@dataclass
class DrafterBatch:
    """Padded to ``L`` positions; ``A`` anchors per sequence; block size ``gamma``.

    features [B, L, m * hidden]; tokens [B, L]; anchors [B, A] (-1 = padding);
    labels [B, A, gamma]; valid [B, A, gamma] bool; the target's distribution at every slot
    (:func:`target_distribution`): target_logits [B, A, gamma, V] fp32 and target_lse None, or over a draft vocabulary
    target_logits [B, A, gamma, K] and target_lse [B, A, gamma], the whole vocabulary's log-sum-exp.
    """

    features: torch.Tensor
    tokens: torch.Tensor
    anchors: torch.Tensor
    labels: torch.Tensor
    target_logits: torch.Tensor
    valid: torch.Tensor
    target_lse: torch.Tensor | None = None


@dataclass
class TargetOutputs:
    """Padded to ``L`` (the longest sequence): features [B, L, m * hidden] and last_hidden [B, L, hidden] float32
    (zeros past each sequence's recorded positions); tokens [B, L] int64; lens [B]; prompt_lens [B]; logsumexp [B, L]
    float32, the log-sum-exp of the target's logits at each position as recorded while generating (NaN where none
    was: the prompt before its last token, padding), or None when the outputs come from a forward."""

    features: torch.Tensor
    last_hidden: torch.Tensor
    tokens: torch.Tensor
    lens: torch.Tensor
    prompt_lens: torch.Tensor
    logsumexp: torch.Tensor | None = None


@torch.no_grad()
def target_logits(target: CausalLM, last_hidden: torch.Tensor) -> torch.Tensor:
    """The target's fp32 logits ``[..., V]`` from raw outputs of its last decoder layer ``[..., hidden]``."""
    return target.lm_head(target.model.norm(last_hidden.to(target.dtype))).float()


def target_distribution(target: CausalLM, last_hidden: torch.Tensor, vocab: DraftVocab | None,
                        logsumexp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's distribution at raw last-layer outputs ``last_hidden [..., hidden]`` as the drafter losses read it
    (:func:`~dspark_kernels.train.draft_vocab_loss.ce_and_l1`).

    Without ``vocab``: ``(logits [..., V] fp32, None)``. With a draft vocabulary of K tokens: ``(logits [..., K]``
    over its tokens in rank order, ``lse [...]`` the log-sum-exp over the whole vocabulary ``)``. Given the recorded
    ``logsumexp [...]`` only the K rows of the LM head are evaluated, and the rows without a recorded value (NaN: the
    prompt, padding; no loss reads them) take the K logits' own log-sum-exp so that every value stays finite; without
    it the whole logits are computed and reduced.
    """
    if vocab is None:
        return target_logits(target, last_hidden), None
    if logsumexp is None:
        full = target_logits(target, last_hidden)
        return full[..., vocab.ids], full.logsumexp(-1)
    part = draft_logits(vocab, target.lm_head, target.model.norm(last_hidden.to(target.dtype)))
    return part, torch.where(logsumexp.isnan(), part.logsumexp(-1), logsumexp)


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
    lse = torch.full((len(indices), seq_len), float("nan"))
    for row, i in enumerate(indices):
        recorded = rollouts.features[i].logsumexp
        lse[row, : recorded.shape[0]] = recorded
    return TargetOutputs(_padded(feats, seq_len), _padded(last, seq_len), tokens, lens, torch.tensor(prompt_lens),
                         lse)


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, rng: random.Random) -> list[int]:
    """Anchor positions ``p`` with ``p`` and ``p + 1`` both response tokens, sampled without replacement, sorted."""
    candidates = list(range(prompt_len, seq_len - 1))
    picked = sorted(rng.sample(candidates, min(num_anchors, len(candidates))))
    return picked + [-1] * (num_anchors - len(picked))


def make_batch(target: CausalLM, rollouts: Rollouts, indices: list[int], feature_layers: tuple[int, ...],
               gamma: int, num_anchors: int, rng: random.Random, vocab: DraftVocab | None = None) -> DrafterBatch:
    """The batch of rollouts ``indices`` with ``num_anchors`` blocks of ``gamma`` slots each (module docstring); the
    target's distributions over ``vocab``'s tokens when the drafter trains over a draft vocabulary."""
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
    rows = (safe - 1).clamp(min=0).view(b, -1)
    lse = None if out.logsumexp is None else out.logsumexp.gather(1, rows)
    tgt, lse = target_distribution(target, out.last_hidden.gather(1, rows[..., None].expand(
        -1, -1, out.last_hidden.shape[-1])), vocab, lse)
    return DrafterBatch(out.features, out.tokens, anchors, labels, tgt.view(b, num_anchors, gamma, -1), valid,
                        None if lse is None else lse.view(b, num_anchors, gamma))
