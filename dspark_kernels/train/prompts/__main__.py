"""Command line: ``python -m dspark_kernels.train.prompts --out DIR`` builds the prompt sets and writes them."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ...cli_args import positive_int
from .build import build_prompts
from .splits import DOMAINS
from .store import write_prompts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dspark_kernels.train.prompts",
                                     description="Build deterministic offline prompt sets (code, math, chat) with "
                                                 "disjoint train and held-out sources.")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory: <out>/<domain>/<split>.jsonl and <out>/manifest.json")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives identical files")
    parser.add_argument("--train-per-domain", type=positive_int, default=3000,
                        help="train prompts per domain (>= 1, default 3000)")
    parser.add_argument("--heldout-per-domain", type=positive_int, default=300,
                        help="held-out prompts per domain (>= 1, default 300)")
    parser.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS),
                        help="domains to build (default: all)")
    return parser


def _preview(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        prompts = build_prompts(args.seed, args.train_per_domain, args.heldout_per_domain, args.domains)
    except ValueError as e:
        parser.error(str(e))
    manifest = write_prompts(prompts, args.out, seed=args.seed)
    for domain, splits in prompts.items():
        print(f"{domain}: train {len(splits['train'])}, heldout {len(splits['heldout'])}")
        print(f"  sample: {_preview(splits['train'][0]['prompt'])}")
    print(f"wrote {manifest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
