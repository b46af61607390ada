"""Train a chain drafter (EAGLE-style, ``--name eagle``) or MTP-1 (``--name mtp1``) on target rollouts.

Teacher forcing over whole rollouts (the target's outputs come from :func:`.drafter_data.rollout_outputs`: recorded
with the rollouts, or one target forward per batch): step 1 at position
``t`` sees ``(f_t, x_{t+1})`` and predicts ``x_{t+2}``; EAGLE also unrolls ``--steps-unroll - 1`` more steps whose
feature input is the drafter's own previous output hidden (training-time test, see
:meth:`~dspark_kernels.drafters.chain_drafter.ChainDrafter.forward_train`). Step ``k`` at position ``t`` belongs to the
chain anchored at ``A = t - k + 2``; it is supervised when ``A`` is a response token and ``x_{A+k}`` exists (same
anchor rule as the block drafter), against the rollout token (CE) and the target's temperature-1 distribution at
``t + 1`` (L1 = twice the TV distance), weighted by ``w_k = exp(-(k - 1) / 4)`` and normalised over valid slots:
``L = a_ce * CE + a_tv * L1`` (default 0.1 / 0.9 as for DSpark); ``--draft-vocab K`` trains over a draft vocabulary
(:mod:`.draft_vocab_loss`). MTP-1 trains step 1 only. ``--positions`` bounds
memory: the LM head and loss run at that many random supervised positions per sequence (the layer runs everywhere).

AdamW (weight decay 0), linear warmup over 4% of the steps then cosine decay to 0, gradient clipping 1.0; resumable
from ``work_dir/checkpoint.pt``, or started from a saved drafter's weights with ``--init DIR`` (fine-tuning, e.g. on new
rollouts); losses to ``work_dir/log.jsonl``.

CLI::

    python -m dspark_kernels.train.chain_drafter --name eagle --out dspark_kernels/assets/drafters/eagle
    python -m dspark_kernels.train.chain_drafter --name mtp1 --out dspark_kernels/assets/drafters/mtp1
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from ..cli_args import non_negative_float, non_negative_int
from ..drafters.chain_drafter import ChainDrafter, ChainDrafterConfig
from ..models import CausalLM, load_model
from .draft_vocab_loss import (
    add_draft_vocab_arguments,
    attach_draft_vocab,
    ce_and_l1,
    check_draft_vocab_arguments,
    save_ranking,
)
from .drafter_data import TargetOutputs, rollout_outputs, target_distribution
from .loop import add_optimiser_arguments, add_training_arguments, check_batch_size, run_training, training_main
from .rollouts import Rollouts, load_rollout_dirs

DEFAULT_STEPS = {"eagle": 4, "mtp1": 1}


def make_chain_batch(target: CausalLM, rollouts: Rollouts, indices: list[int], feature_layer: int) -> TargetOutputs:
    return rollout_outputs(target, rollouts, indices, (feature_layer,))


@dataclass
class LossParts:
    total: torch.Tensor
    ce: float
    l1: float
    per_step_l1: list[float]


def chain_loss(drafter: ChainDrafter, batch: TargetOutputs, steps: int, weights: tuple[float, float] = (0.1, 0.9),
               decay: float = 4.0, positions: int = 0, generator: torch.Generator | None = None) -> LossParts:
    """The position-weighted CE + L1 loss of ``steps`` unrolled chain steps (see module docstring).

    ``positions > 0`` evaluates the LM head and the loss at that many random supervised positions per sequence only
    (memory: ``[B, K, positions, V]`` instead of ``[B, K, L, V]`` logits); 0 = every position.
    """
    a_ce, a_tv = weights
    _, hidden = drafter.forward_train(batch.features, batch.tokens, steps, logits=False)  # [B, K, L, h]
    b, k_steps, seq_len, _ = hidden.shape
    t = torch.arange(seq_len).expand(b, seq_len)  # [B, P] positions evaluated
    if 0 < positions < seq_len:
        ok = (t + 1 >= batch.prompt_lens[:, None]) & (t + 2 < batch.lens[:, None])  # step-1 supervised
        score = torch.rand(b, seq_len, generator=generator) + ok.float()
        t = score.topk(positions, dim=1).indices.sort(dim=1).values
        hidden = hidden.gather(2, t[:, None, :, None].expand(b, k_steps, -1, hidden.shape[-1]))
    logits = drafter.draft_logits(hidden)  # [B, K, P, V], or [..., K] over a draft vocabulary
    k = torch.arange(1, k_steps + 1)
    anchor = t[:, None, :] - k[None, :, None] + 2  # [B, K, P]
    valid = (anchor >= batch.prompt_lens[:, None, None]) & (t[:, None, :] + 2 < batch.lens[:, None, None])
    labels = batch.tokens.gather(1, (t + 2).clamp(max=seq_len - 1))  # [B, P]
    tgt_rows = (t + 1).clamp(max=seq_len - 1)
    rows = batch.last_hidden.gather(1, tgt_rows[..., None].expand(-1, -1, batch.last_hidden.shape[-1]))
    lse = None if batch.logsumexp is None else batch.logsumexp.gather(1, tgt_rows)
    tgt, lse = target_distribution(drafter.target, rows, drafter.draft_vocab, lse)  # [B, P, V] or [B, P, K], [B, P]
    w = torch.exp(-(k.float() - 1) / decay)[None, :, None] * valid
    denom = w.sum().clamp_min(1e-8)
    ce, l1 = ce_and_l1(logits, tgt[:, None], labels[:, None], drafter.draft_vocab,
                       None if lse is None else lse[:, None])
    total = a_ce * (w * ce).sum() / denom + a_tv * (w * l1).sum() / denom
    with torch.no_grad():
        n_valid = valid.sum(dim=(0, 2)).clamp_min(1)
        per_step = ((l1 * valid).sum(dim=(0, 2)) / n_valid).tolist()
        return LossParts(total, float((w * ce).sum() / denom), float((w * l1).sum() / denom), per_step)


def train(args: argparse.Namespace) -> dict:
    check_draft_vocab_arguments(args)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_model(args.target)
    rollouts = load_rollout_dirs(args.rollouts, "train", features=True)
    check_batch_size(args.batch_size, len(rollouts), args.rollouts)
    if args.ce_weight + args.tv_weight == 0:
        raise SystemExit("error: --ce-weight and --tv-weight are both 0: the loss would be 0 and nothing trained")
    unroll = args.steps_unroll or DEFAULT_STEPS.get(args.name, 4)
    cfg = ChainDrafterConfig(feature_layer=args.feature_layer, vocab_size=target.config.vocab_size,
                             hidden_size=target.config.hidden_size, max_steps=unroll, name=args.name,
                             input_norm=args.input_norm)
    drafter = ChainDrafter(cfg, target)
    ranking = attach_draft_vocab(drafter, args, cfg.vocab_size)
    order = list(range(len(rollouts)))

    def loss_fn():
        batch = make_chain_batch(target, rollouts, rng.sample(order, args.batch_size),
                                 drafter.config.feature_layer)
        parts = chain_loss(drafter, batch, unroll, (args.ce_weight, args.tv_weight), positions=args.positions)
        return parts.total, {"ce": parts.ce, "l1": parts.l1, "l1_by_step": parts.per_step_l1}

    summary = run_training(drafter, args, rng, loss_fn)
    save_ranking(ranking, args.out)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", choices=("eagle", "mtp1"), default="eagle",
                   help="eagle (chain, unrolled) or mtp1 (one step)")
    p.add_argument("--steps-unroll", type=non_negative_int, default=0,
                   help="chain steps trained (default: eagle 4, mtp1 1)")
    p.add_argument("--feature-layer", type=int, default=-1, help="target layer (-1 = last non-final layer)")
    p.add_argument("--input-norm", action="store_true",
                   help="RMS-normalise the feature and the token embedding apiece before the drafter's fc")
    p.add_argument("--ce-weight", type=non_negative_float, default=0.1,
                   help="weight of the cross-entropy against the rollout token")
    p.add_argument("--tv-weight", type=non_negative_float, default=0.9,
                   help="weight of the L1 distance to the target's distribution")
    add_training_arguments(p)
    p.add_argument("--positions", type=non_negative_int, default=128,
                   help="supervised positions sampled per sequence and step (0 = all; bounds the logits' memory)")
    add_draft_vocab_arguments(p)
    add_optimiser_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    training_main(build_parser(), train, argv)


if __name__ == "__main__":
    main()
