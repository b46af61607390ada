"""Rank the target's tokens by how often its own answers use them, for drafting over a draft vocabulary.

Counts every response token of the train rollouts (the prompts are the user's, not the target's), then writes the
ranking (every target id once, most frequent first, ties by id) into each drafter directory as
``token_ranking.safetensors`` (:mod:`dspark_kernels.drafters.draft_vocab`), and prints how much of the held-out
responses the top ``K`` cover for a few ``K``.

CLI::

    python -m dspark_kernels.train.token_ranking --rollouts data/rollouts_smollm2 \\
        --out dspark_kernels/assets/drafters/smollm2-135m-instruct/dspark
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ..drafters.api import read_drafter_config
from ..drafters.draft_vocab import save_token_ranking
from .rollouts import load_rollout_dirs

__all__ = ["coverage", "token_ranking"]


def _counts(responses: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    ids = [t for r in responses for t in r]
    return torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]


def token_ranking(responses: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """``ranking [V]`` int64: every id in ``[0, vocab_size)`` once, by count in ``responses`` (descending), ties by
    id (ascending)."""
    counts = _counts(responses, vocab_size)
    return torch.argsort(-counts, stable=True)


def coverage(ranking: torch.Tensor, responses: Iterable[list[int]], sizes: Iterable[int]) -> dict[int, float]:
    """The fraction of the tokens of ``responses`` inside the top ``K`` of ``ranking``, for each ``K`` of ``sizes``."""
    counts = _counts(responses, ranking.numel())
    total = max(int(counts.sum()), 1)
    ranked = counts[ranking].cumsum(0)
    return {k: float(ranked[min(k, ranking.numel()) - 1]) / total for k in sizes}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=Path, nargs="+", required=True,
                   help="rollout directories; the train responses of all of them are counted")
    p.add_argument("--out", type=Path, nargs="+", required=True,
                   help="drafter directories the ranking is written into (of one target: their vocab_size)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                   help="draft vocabulary sizes whose held-out coverage is printed")
    args = p.parse_args(argv)
    sizes = set()
    for out in args.out:
        try:
            sizes.add(read_drafter_config(out)["vocab_size"])
        except (FileNotFoundError, ValueError, KeyError) as e:
            p.error(f"--out {out} is not a drafter directory: {e}")
    if len(sizes) != 1:
        p.error(f"--out: the drafters are for targets of different vocabulary sizes {sorted(sizes)}")
    vocab_size = sizes.pop()
    ranking = token_ranking(load_rollout_dirs(args.rollouts, "train").responses, vocab_size)
    for out in args.out:
        print(f"wrote {save_token_ranking(ranking, out)}")
    heldout = load_rollout_dirs(args.rollouts, "heldout").responses
    print(json.dumps({"heldout_coverage": coverage(ranking, heldout, args.sizes)}))


if __name__ == "__main__":
    main()
