"""The drafters' CE and L1 terms over the whole vocabulary or over a draft vocabulary, and the trainers' options for it.

With ``--draft-vocab K`` a trainer trains the drafter as it drafts with a draft vocabulary
(:mod:`dspark_kernels.drafters.draft_vocab`): its logits cover the first ``K`` tokens of ``--token-ranking``'s ranking
only, so its softmax is over them (probability 0 elsewhere). The target keeps its whole vocabulary: its probabilities of
the ``K`` tokens are normalised by the full log-sum-exp, and ``L1 = sum_K |p_d - p_t| + (1 - sum_K p_t)`` is still
twice the TV distance between the drafted distribution and the target's, so ``1 - L1 / 2`` is still the acceptance. A
label outside the ``K`` tokens cannot be drafted and adds no CE. The LM head's share of a step falls by ``V / K`` (6x
at K = 8192 of SmolLM2's 49,152).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cli_args import non_negative_int
from ..drafters.draft_vocab import DraftVocab, load_token_ranking, save_token_ranking


def ce_and_l1(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, vocab: DraftVocab | None,
              target_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot CE and L1 of draft logits against the target.

    Args:
        logits: ``[..., V]`` draft logits, or ``[..., K]`` over ``vocab``'s tokens in its rank order (differentiable).
        target_logits: the target's logits, broadcastable to ``logits``' leading dimensions: ``[..., V]``, or with
            ``vocab`` ``[..., K]`` over its tokens in rank order
            (:func:`~dspark_kernels.train.drafter_data.target_distribution`).
        labels: ``[...]`` int64 target ids (the leading dimensions of ``logits``, or broadcastable to them).
        vocab: the draft vocabulary of ``logits``, or None.
        target_lse: with ``vocab`` (required then): ``[...]`` the log-sum-exp of the target's logits over the whole
            vocabulary, broadcastable like ``target_logits``' leading dimensions.
    Returns:
        ``(ce [...], l1 [...])``: the CE of each label (0 for a label outside the draft vocabulary), and
        ``||p_d - p_t||_1`` over the whole vocabulary.
    """
    log_pd = F.log_softmax(logits, dim=-1)
    if vocab is None:
        p_t = F.softmax(target_logits, dim=-1)
        local, outside = labels, None
    else:
        if target_lse is None:
            raise ValueError("ce_and_l1 over a draft vocabulary needs target_lse, the target's log-sum-exp over the "
                             "whole vocabulary")
        p_t = (target_logits - target_lse[..., None]).exp()
        local = vocab.local_of[labels]
        outside = (1 - p_t.sum(-1)).clamp_min(0)  # the target's mass the drafter cannot cover
    labelled = local < logits.shape[-1]
    local = local.clamp(max=logits.shape[-1] - 1).expand(log_pd.shape[:-1])
    ce = -log_pd.gather(-1, local[..., None]).squeeze(-1) * labelled
    l1 = (log_pd.exp() - p_t).abs().sum(-1)
    return ce, l1 if outside is None else l1 + outside


def add_draft_vocab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-vocab", type=non_negative_int, default=0,
                   help="train over the first K tokens of --token-ranking's ranking, as the drafter drafts with "
                        "load_drafter(..., draft_vocab=K) (0 = the whole vocabulary)")
    p.add_argument("--token-ranking", type=Path, default=None,
                   help="drafter directory whose token_ranking.safetensors gives the draft vocabulary (with "
                        "--draft-vocab; copied to --out)")


def check_draft_vocab_arguments(args: argparse.Namespace) -> None:
    """Run before any model loads."""
    if args.draft_vocab and args.token_ranking is None:
        raise SystemExit("error: --draft-vocab needs --token-ranking (a drafter directory with "
                         "token_ranking.safetensors)")


def attach_draft_vocab(drafter: torch.nn.Module, args: argparse.Namespace, vocab_size: int) -> torch.Tensor | None:
    """Give ``drafter`` the draft vocabulary of ``args`` (``--draft-vocab``, ``--token-ranking``); returns the ranking
    (to save with the trained drafter, :func:`save_ranking`), or None without a draft vocabulary."""
    if not args.draft_vocab:
        return None
    ranking = load_token_ranking(args.token_ranking, vocab_size)
    drafter.draft_vocab = DraftVocab.from_ranking(ranking, args.draft_vocab)
    return ranking


def save_ranking(ranking: torch.Tensor | None, out: Path) -> None:
    """The drafter directory ``out`` drafts over the vocabulary it was trained on."""
    if ranking is not None:
        save_token_ranking(ranking, out)
