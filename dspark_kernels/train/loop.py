"""The optimisation loop shared by the drafter trainers: AdamW, warmup + cosine, clipping, resume, logs, saving."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch

from ..cli_args import missing_inputs_are_usage_errors, model_source, non_negative_float, positive_int


def lr_at(step: int, max_steps: int, lr: float) -> float:
    """Linear warmup over the first 4% of the steps, then cosine decay to 0."""
    warmup = max(1, int(0.04 * max_steps))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, max_steps - warmup))))


def run_training(drafter: torch.nn.Module, args: argparse.Namespace, rng: random.Random,
                 loss_fn: Callable[[], tuple[torch.Tensor, dict]], init_added: Collection[str] = ()) -> dict:
    """Minimise ``loss_fn()`` (a fresh batch each call; returns the loss and the values to log) for ``args.steps``.

    Uses ``args``: ``lr``, ``steps``, ``work_dir`` (``checkpoint.pt``, ``log.jsonl``), ``resume``, ``ckpt_every``,
    ``init`` (a saved drafter directory whose weights start a run that has no checkpoint to resume: fine-tuning),
    ``init_added`` (tensors the drafter adds to the ``init`` architecture, see :func:`load_initial_weights`),
    ``name`` and ``out`` (the drafter is saved there in bfloat16 with ``train_summary.json``). AdamW with weight decay
    0 and betas (0.9, 0.95) (the reference code keeps torch's (0.9, 0.999); the shipped drafters were trained with
    these), gradient clipping at 1.0; the checkpoint holds the model, the optimiser, the step and ``rng``'s state.
    """
    from tqdm import tqdm

    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path, step, start = work / "checkpoint.pt", 0, time.time()
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        try:
            drafter.load_state_dict(ckpt["model"])
        except RuntimeError as e:  # torch lists every mismatched tensor; the first line says what kind
            raise SystemExit(f"error: --resume: {ckpt_path} was saved for another architecture (is --rank / --layers "
                             f"/ --head the saved run's?): {str(e).splitlines()[0]}") from None
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        rng.setstate(ckpt["rng"])
    else:
        if args.resume:
            print(f"--resume: no checkpoint at {ckpt_path}; starting from step 0", file=sys.stderr)
        if args.init is not None:
            load_initial_weights(drafter, args.init, init_added)
    with open(work / "log.jsonl", "a") as log, tqdm(total=args.steps, initial=step, desc=args.name,
                                                    dynamic_ncols=True) as bar:
        while step < args.steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            loss, values = loss_fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            log.write(json.dumps({"step": step, "loss": loss.item(), **values}) + "\n")
            log.flush()
            if step % args.ckpt_every == 0 or step == args.steps:
                torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step,
                            "rng": rng.getstate()}, ckpt_path)
    drafter.to(torch.bfloat16).save(args.out)
    summary = {"name": args.name, "steps": step, "minutes": (time.time() - start) / 60,
               "params": sum(p.numel() for p in drafter.parameters()), "args": vars(args)}
    (Path(args.out) / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def check_batch_size(batch_size: int, num_rollouts: int, rollouts_dirs: Sequence[Path]) -> None:
    """Each step samples ``batch_size`` distinct rollouts: refuse a batch larger than the training rollouts."""
    if batch_size > num_rollouts:
        raise SystemExit(f"error: --batch-size {batch_size} exceeds the {num_rollouts} training rollouts under "
                         f"{', '.join(map(str, rollouts_dirs))}")


def load_initial_weights(drafter: torch.nn.Module, init_dir: Path, added: Collection[str] = ()) -> None:
    """Fill ``drafter`` (in training mode, its own dtype) from ``init_dir/model.safetensors``, a directory that a
    trainer saved for the same architecture; clear errors for missing, extra or mis-shaped tensors. ``added`` names
    tensors this drafter adds to the saved architecture: they may be missing and keep their initialisation."""
    from safetensors.torch import load_file

    weights = Path(init_dir) / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"--init: no drafter weights at {weights}")
    state = load_file(str(weights))
    own = drafter.state_dict()
    missing, unexpected = set(own) - set(state) - set(added), set(state) - set(own)
    if missing or unexpected:
        raise ValueError(f"--init {init_dir}: tensors differ from this drafter's: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    for name, tensor in state.items():
        if tensor.shape != own[name].shape:
            raise ValueError(f"--init {init_dir}: {name} has shape {tuple(tensor.shape)}, this drafter's "
                             f"{tuple(own[name].shape)} (is the architecture, e.g. --rank / --layers, the saved one?)")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options every drafter trainer shares (the ones :func:`run_training` and the data loaders read)."""
    p.add_argument("--target", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--rollouts", type=Path, nargs="+", default=[Path("data/rollouts")],
                   help="rollout directories; the train rollouts of all of them are pooled")
    p.add_argument("--work-dir", type=Path, default=None, help="default: data/drafter_runs/<name>")
    p.add_argument("--out", type=Path, required=True,
                   help="directory the trained drafter is saved to (bf16, with train_summary.json)")
    p.add_argument("--steps", type=positive_int, default=600,
                   help="optimiser steps (the cosine schedule spans them)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="rollouts per step")


def add_optimiser_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr", type=non_negative_float, default=1e-3,
                   help="peak learning rate (AdamW, linear warmup over 4%% of the steps, cosine decay to 0)")
    p.add_argument("--ckpt-every", type=positive_int, default=50,
                   help="steps between checkpoints in the work directory")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation and the batch sampler")
    p.add_argument("--resume", action="store_true",
                   help="continue from work_dir/checkpoint.pt (starts from step 0, with a notice, if there is none)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from a saved drafter directory's weights (fine-tuning; ignored when resuming)")


def training_main(parser: argparse.ArgumentParser, train: Callable[[argparse.Namespace], dict],
                  argv: list[str] | None) -> None:
    """Parse, default the work directory to ``data/drafter_runs/<name>``, train, print the summary."""
    args = parser.parse_args(argv)
    if args.work_dir is None:
        args.work_dir = Path("data/drafter_runs") / args.name
    with missing_inputs_are_usage_errors(parser):
        summary = train(args)
    print(json.dumps(summary, indent=1, default=str))
