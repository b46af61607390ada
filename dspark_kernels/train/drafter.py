"""Train a block drafter (DSpark with a vanilla/gated/rnn head, or DFlash with rank 0) on target rollouts.

Loss (paper §5): ``L = a_ce * CE + a_tv * L1 + a_conf * BCE``, every term weighted per slot by
``w_k = exp(-(k - 1) / decay)`` (``--slot-decay``, 4 by default as in the paper's configs; a smaller decay puts more
of the loss on the first slots) and normalised by the sum of weights over valid slots:
* CE: cross-entropy of the Markov-corrected draft logits against the rollout token;
* L1: ``||p_d - p_t||_1`` between the draft and target softmaxes at temperature 1 (twice the TV distance);
* BCE: confidence logits against the detached analytic acceptance ``clamp(1 - L1 / 2, 0, 1)``.
DSpark uses (0.1, 0.9, 1.0); DFlash (1, 0, 0) with no Markov head and no confidence head.

``--anchor-feature`` adds the anchor predecessor's context feature to the block input (:mod:`..drafters.block_drafter`).

``--draft-vocab K`` trains over a draft vocabulary, as the drafter then drafts (:mod:`.draft_vocab_loss`).

Each step draws a block size from ``--gammas`` (default 7 and 15, so one checkpoint serves both benchmark settings).
AdamW (weight decay 0), linear warmup over 4% of the steps then cosine decay to 0, gradient clipping 1.0; resumable
from ``work_dir/checkpoint.pt``, or started from a saved drafter's weights with ``--init DIR`` (fine-tuning, e.g. on new
rollouts); losses to ``work_dir/log.jsonl``.

CLI::

    python -m dspark_kernels.train.drafter --name dspark --head vanilla --rank 64 \
        --out dspark_kernels/assets/drafters/dspark
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cli_args import non_negative_int, positive_float, positive_int
from ..drafters.block_drafter import BlockDrafter, DrafterConfig
from ..models import load_model
from .draft_vocab_loss import (
    add_draft_vocab_arguments,
    attach_draft_vocab,
    ce_and_l1,
    check_draft_vocab_arguments,
    save_ranking,
)
from .drafter_data import DrafterBatch, make_batch
from .loop import add_optimiser_arguments, add_training_arguments, check_batch_size, run_training, training_main
from .rollouts import load_rollout_dirs
from .tokenizer import MASK_ID

LOSS_WEIGHTS = {"dspark": (0.1, 0.9, 1.0), "dflash": (1.0, 0.0, 0.0)}


@dataclass
class LossParts:
    total: torch.Tensor
    ce: float
    l1: float
    conf: float


def drafter_loss(drafter: BlockDrafter, batch: DrafterBatch, gamma: int, weights: tuple[float, float, float],
                 decay: float = 4.0) -> LossParts:
    """The weighted DSpark/DFlash loss of one batch (see module docstring)."""
    a_ce, a_tv, a_conf = weights
    vocab = drafter.draft_vocab
    base, hidden = drafter.forward_train(batch.features, batch.tokens, batch.anchors, gamma)
    anchor_tok = batch.tokens.gather(1, batch.anchors.clamp(min=0))
    prev = torch.cat([anchor_tok[:, :, None], batch.labels[:, :, :-1]], dim=2)
    b, a, g, v = base.shape
    logits, conf = drafter.head.teacher_forced(base.view(b * a, g, v), hidden.view(b * a, g, -1), prev.view(b * a, g),
                                               None if vocab is None else vocab.ids)
    logits, conf = logits.view(b, a, g, v), conf.view(b, a, g)
    w = torch.exp(-torch.arange(g, dtype=torch.float32) / decay)[None, None, :] * batch.valid
    denom = w.sum().clamp_min(1e-8)
    ce, l1 = ce_and_l1(logits, batch.target_logits, batch.labels, vocab, batch.target_lse)
    total = a_ce * (w * ce).sum() / denom + a_tv * (w * l1).sum() / denom
    conf_loss = torch.zeros(())
    if a_conf > 0:
        target_acc = (1 - 0.5 * l1.detach()).clamp(0, 1)
        conf_loss = (w * F.binary_cross_entropy_with_logits(conf, target_acc, reduction="none")).sum() / denom
        total = total + a_conf * conf_loss
    with torch.no_grad():
        return LossParts(total, float((w * ce).sum() / denom), float((w * l1).sum() / denom), float(conf_loss))


def train(args: argparse.Namespace) -> dict:
    check_draft_vocab_arguments(args)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_model(args.target)
    rollouts = load_rollout_dirs(args.rollouts, "train", features=True)
    check_batch_size(args.batch_size, len(rollouts), args.rollouts)
    cfg = DrafterConfig(
        feature_layers=tuple(args.feature_layers), mask_token_id=args.mask_token_id,
        vocab_size=target.config.vocab_size, hidden_size=target.config.hidden_size, num_layers=args.layers,
        gamma=max(args.gammas), head_kind=args.head if args.rank > 0 else "none", markov_rank=args.rank,
        confidence=LOSS_WEIGHTS[args.loss][2] > 0, name=args.name, anchor_feature=args.anchor_feature,
    )
    drafter = BlockDrafter(cfg, target)
    ranking = attach_draft_vocab(drafter, args, cfg.vocab_size)

    def loss_fn():
        gamma = rng.choice(args.gammas)
        batch = make_batch(target, rollouts, rng.sample(range(len(rollouts)), args.batch_size), cfg.feature_layers,
                           gamma, args.anchors, rng, drafter.draft_vocab)
        parts = drafter_loss(drafter, batch, gamma, LOSS_WEIGHTS[args.loss], args.slot_decay)
        return parts.total, {"gamma": gamma, "ce": parts.ce, "l1": parts.l1, "conf": parts.conf}

    added = ("anchor_proj.weight",) if cfg.anchor_feature else ()
    summary = run_training(drafter, args, rng, loss_fn, init_added=added)
    save_ranking(ranking, args.out)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", default="dspark",
                   help="drafter name (the work directory defaults to data/drafter_runs/<name>)")
    p.add_argument("--loss", choices=sorted(LOSS_WEIGHTS), default="dspark",
                   help="dspark: 0.1 CE + 0.9 L1 + confidence BCE; dflash: CE only, no confidence head")
    p.add_argument("--head", choices=("vanilla", "gated", "rnn"), default="vanilla",
                   help="sequential head kind: vanilla (low-rank Markov bias), gated, or rnn")
    p.add_argument("--rank", type=non_negative_int, default=64, help="Markov rank (0 = pure DFlash)")
    p.add_argument("--layers", type=positive_int, default=2,
                   help="draft decoder layers")
    p.add_argument("--feature-layers", type=int, nargs="+", default=[0, 2, 4],
                   help="target decoder layers whose hidden states condition the drafter")
    p.add_argument("--mask-token-id", type=int, default=MASK_ID,
                   help="token id whose embedding fills the block's masked slots")
    p.add_argument("--gammas", type=positive_int, nargs="+", default=[7, 15],
                   help="block sizes, one drawn per step (one checkpoint serves them all)")
    p.add_argument("--slot-decay", type=positive_float, default=4.0,
                   help="decay of the per-slot loss weights exp(-(k - 1) / decay) along the block")
    p.add_argument("--anchor-feature", action="store_true",
                   help="add the anchor predecessor's context feature to the block input (zero-initialised, so "
                        "--init may name a drafter without it)")
    add_training_arguments(p)
    p.add_argument("--anchors", type=positive_int, default=32,
                   help="blocks (anchor positions) per rollout per step")
    add_draft_vocab_arguments(p)
    add_optimiser_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    training_main(build_parser(), train, argv)


if __name__ == "__main__":
    main()
