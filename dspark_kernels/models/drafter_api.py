"""The interface between drafters and the decode loop (block drafters, EAGLE-style chains, MTP)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["DraftOutput", "Drafter", "load_drafter"]


@dataclass
class DraftOutput:
    """``tokens [R * gamma]`` int64, ``draft_probs [R * gamma, V]`` fp32 (the exact distributions the tokens were drawn
    from, filtered like the target's), ``confidence_logits [R * gamma]`` fp32 or None (no confidence head)."""

    tokens: torch.Tensor
    draft_probs: torch.Tensor
    confidence_logits: torch.Tensor | None


class Drafter(Protocol):
    """What the decode loop needs from a drafter.

    ``state`` is the drafter's per-batch cache (created by ``new_state``); ``extend`` appends committed tokens (ids and
    the target's features ``[T, m * hidden]`` of ``feature_layers``, requests flattened by ``cu [R + 1]``);
    ``draft`` proposes ``gamma`` tokens after each request's anchor (the last emitted token, not yet in the context)
    with per-request sampling parameters ``[R]`` and one uniform per drafted token (None when all greedy).
    """

    feature_layers: tuple[int, ...]

    def new_state(self, num_pages: int, page_size: int): ...

    def add_request(self, state, rid) -> None: ...

    def free(self, state, rid) -> None: ...

    def extend(self, state, rids: Sequence, token_ids: torch.Tensor, features: torch.Tensor,
               cu: torch.Tensor) -> None: ...

    def draft(self, state, rids: Sequence, anchors: torch.Tensor, gamma: int, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor | None,
              impl: str | None = None) -> DraftOutput: ...


def load_drafter(path, target, dtype: torch.dtype = torch.float32) -> Drafter:
    """Load any shipped drafter directory (``drafter_config.json`` names its ``drafter_type``) for ``target``."""
    import json
    from pathlib import Path

    cfg_file = Path(path) / "drafter_config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"drafter checkpoint file missing: {cfg_file}")
    kind = json.loads(cfg_file.read_text()).get("drafter_type")
    if kind == "block":
        from .drafter import load_block_drafter

        return load_block_drafter(path, target, dtype)
    if kind == "chain":
        from .chain_drafter import load_chain_drafter

        return load_chain_drafter(path, target, dtype)
    raise ValueError(f"{cfg_file}: unknown drafter_type {kind!r} (expected 'block' or 'chain')")
