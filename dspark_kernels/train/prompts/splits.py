"""The domains and splits, the held-out rule for families of sources, and the seeding, record, de-duplication and
sampling helpers that every domain shares."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence

DOMAINS = ("code", "math", "chat")
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1


def seeded_rng(seed: int, *parts: str) -> random.Random:
    digest = hashlib.sha256(":".join((str(seed),) + parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def heldout_sources(names: Iterable[str], family: str, fraction: float = HELDOUT_FRACTION) -> frozenset[str]:
    """The held-out members of one family of sources: the ``ceil(fraction * n)`` (at least one) names whose
    ``sha256("<family>:<name>")`` hex digest sorts lowest. Independent of order, machine and hash seed."""
    unique = sorted(set(names))
    if not unique:
        return frozenset()
    count = max(1, math.ceil(fraction * len(unique)))
    ranked = sorted(unique, key=lambda name: hashlib.sha256(f"{family}:{name}".encode()).hexdigest())
    return frozenset(ranked[:count])


def make_record(kind: str, source: str, prompt: str, answer: str | None = None) -> dict:
    record = {"kind": kind, "source": source, "prompt": prompt}
    if answer is not None:
        record["answer"] = answer
    return record


def dedupe(records: Iterable[dict]) -> list[dict]:
    seen: set[str] = set()
    out = []
    for record in records:
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            out.append(record)
    return out


def _interleave(queues: Sequence[Sequence[dict]]) -> list[dict]:
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def sample_split(candidates: list[dict], count: int, rng: random.Random, domain: str, split: str) -> list[dict]:
    """``count`` candidates, round-robin over kinds and, within a kind, over sources; then shuffled."""
    if len(candidates) < count:
        raise ValueError(f"domain {domain!r} can make only {len(candidates)} distinct {split} prompts, "
                         f"{count} requested")
    grouped: dict[str, dict[str, list[dict]]] = {}
    for record in candidates:
        grouped.setdefault(record["kind"], {}).setdefault(record["source"], []).append(record)
    kind_queues = []
    for kind in sorted(grouped):
        sources = sorted(grouped[kind])
        rng.shuffle(sources)
        per_source = []
        for source in sources:
            items = list(grouped[kind][source])
            rng.shuffle(items)
            per_source.append(items)
        kind_queues.append(_interleave(per_source))
    chosen = _interleave(kind_queues)[:count]
    rng.shuffle(chosen)
    return chosen


def pick(rng: random.Random, phrasings: Sequence[str], **fields: str) -> str:
    return rng.choice(phrasings).format(**fields)
