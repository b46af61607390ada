"""Storage: one JSON Lines file per domain and split, and a manifest with the seed, Python version, counts and
sha256 of every file."""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Iterable
from pathlib import Path

from .splits import DOMAINS, SPLITS

BUILD_COMMAND = "python -m dspark_kernels.train.prompts --out {out}"


def _jsonl(records: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_prompts(prompts: dict[str, dict[str, list[dict]]], out_dir: Path, *, seed: int | None = None) -> Path:
    """Write ``<out_dir>/<domain>/<split>.jsonl`` for every domain and split in ``prompts`` and ``manifest.json``
    (``seed``, the Python version, counts, sha256 of each file). Returns the manifest's path."""
    out_dir = Path(out_dir)
    files, counts = {}, {}
    for domain in sorted(prompts):
        counts[domain] = {}
        for split in sorted(prompts[domain]):
            data = _jsonl(prompts[domain][split])
            path = out_dir / domain / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            counts[domain][split] = len(prompts[domain][split])
            files[f"{domain}/{split}.jsonl"] = {"records": counts[domain][split], "bytes": len(data),
                                                "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"seed": seed, "python": platform.python_version(), "counts": counts, "files": files}
    path = out_dir / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_prompts(out_dir: Path, domain: str, split: str) -> list[dict]:
    """The records of ``<out_dir>/<domain>/<split>.jsonl``. Raises FileNotFoundError naming the file and the command
    that builds it, ValueError for an unknown domain or split."""
    if domain not in DOMAINS or split not in SPLITS:
        raise ValueError(f"unknown domain/split {domain!r}/{split!r}; domains {list(DOMAINS)}, splits {list(SPLITS)}")
    path = Path(out_dir) / domain / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found: build it with "
                                f"`{BUILD_COMMAND.format(out=out_dir)}`")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
