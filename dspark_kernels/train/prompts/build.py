"""Building the prompt sets: each domain's candidates, de-duplicated across splits and sampled to the requested
counts."""

from __future__ import annotations

from collections.abc import Sequence

from .chat_prompts import chat_splits
from .code_prompts import code_splits
from .math_prompts import math_splits
from .splits import DOMAINS, dedupe, sample_split, seeded_rng


def build_prompts(seed: int = 0, train_per_domain: int = 3000, heldout_per_domain: int = 300,
                  domains: Sequence[str] = DOMAINS) -> dict[str, dict[str, list[dict]]]:
    """``{domain: {"train": [...], "heldout": [...]}}`` with exactly the requested number of distinct prompts per
    split. Raises ValueError for an unknown domain, a count below 1, or a domain that cannot make enough prompts."""
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}; choose from {list(DOMAINS)}")
    if train_per_domain < 1 or heldout_per_domain < 1:
        raise ValueError(f"prompt counts must be >= 1, got train={train_per_domain}, heldout={heldout_per_domain}")
    counts = {"train": train_per_domain, "heldout": heldout_per_domain}
    out: dict[str, dict[str, list[dict]]] = {}
    for domain in DOMAINS:
        if domain not in domains:
            continue
        if domain == "code":
            candidates = code_splits(seed)
        elif domain == "math":
            candidates = math_splits(seed, counts)
        else:
            candidates = chat_splits(seed)
        heldout = dedupe(candidates["heldout"])
        heldout_texts = {r["prompt"] for r in heldout}
        train = [r for r in dedupe(candidates["train"]) if r["prompt"] not in heldout_texts]
        out[domain] = {}
        for split, pool in (("train", train), ("heldout", heldout)):
            chosen = sample_split(pool, counts[split], seeded_rng(seed, domain, split, "sample"), domain, split)
            out[domain][split] = [{"id": f"{domain}-{split}-{i}", "domain": domain, **r} for i, r in enumerate(chosen)]
    return out
