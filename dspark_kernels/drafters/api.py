"""The interface between drafters and the decode loop (block drafters, EAGLE-style chains, MTP)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..models.transformer import CausalLM
from ..ops._validate import is_int

__all__ = ["DraftContext", "DraftOutput", "Drafter", "NullDrafter", "check_drafter_target", "check_gamma",
           "read_drafter_config", "load_drafter_weights", "save_drafter"]


DraftContext = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Committed tokens waiting for a drafter: ``(token_ids [T] int64, features [T, m * hidden], cu [R + 1] int32)``, the
target's features of ``feature_layers`` for each token, requests flattened by ``cu`` (a request may have none)."""


@dataclass
class DraftOutput:
    """``tokens [R * gamma]`` int64, ``draft_probs [R * gamma, V]`` fp32 (the exact distributions the tokens were drawn
    from, filtered like the target's; None: the tokens are deterministic proposals, verified as one-hot
    distributions, e.g. greedy drafts made without uniforms), ``confidence_logits [R * gamma]`` fp32 or None (no
    confidence head)."""

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None


class Drafter(Protocol):
    """What the decode loop needs from a drafter.

    ``state`` is the drafter's per-batch cache (created by ``new_state``); ``extend`` appends committed tokens (ids and
    the target's features ``[T, m * hidden]`` of ``feature_layers``, requests flattened by ``cu [R + 1]``);
    ``draft`` proposes ``gamma`` tokens after each request's anchor (the last emitted token, not yet in the context)
    with per-request sampling parameters ``[R]`` and one uniform per drafted token (None when all greedy). Its
    ``context`` (a :data:`DraftContext` aligned with ``rids``) holds committed tokens not yet given to ``extend``:
    drafting with it is the same as ``extend(state, rids, *context)`` first, and a drafter may do both in one pass
    (the block drafter does; the decode loops hand every round's kept tokens over this way). A drafter whose
    blocks have a largest size says so with an optional ``max_gamma`` attribute (see :func:`check_gamma`).
    """

    feature_layers: tuple[int, ...]

    def new_state(self, num_pages: int, page_size: int): ...

    def add_request(self, state, rid) -> None: ...

    def free(self, state, rid) -> None: ...

    def extend(self, state, rids: Sequence, token_ids: torch.Tensor, features: torch.Tensor,
               cu: torch.Tensor) -> None: ...

    def draft(self, state, rids: Sequence, anchors: torch.Tensor, gamma: int, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor | None,
              impl: str | None = None, context: DraftContext | None = None) -> DraftOutput: ...


def check_gamma(drafter: object, gamma: object) -> None:
    """``gamma`` (the most drafts a round asks for) an int >= 1 and within the drafter's ``max_gamma`` when it has
    one, checked before decoding starts (an adaptive length may reach ``gamma`` only after some rounds)."""
    if not is_int(gamma) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    most = getattr(drafter, "max_gamma", None)
    if most is not None and gamma > most:
        raise ValueError(f"gamma must be <= {most} for this drafter ({type(drafter).__name__} drafts at most {most} "
                         f"tokens per round), got {gamma}")


def check_drafter_target(drafter: object, target: CausalLM) -> None:
    """A drafter bound to a target (its ``target`` attribute: the model whose embedding, LM head and RoPE it borrows
    and whose layers' features it reads) must run with a target of the same shape; another instance of the same
    model (e.g. one loaded with other GEMM dtypes) is fine, since the drafter only proposes tokens."""
    bound = getattr(drafter, "target", None)
    if bound is None or bound is target:
        return
    shape = (bound.config.vocab_size, bound.config.hidden_size, bound.config.num_hidden_layers)
    here = (target.config.vocab_size, target.config.hidden_size, target.config.num_hidden_layers)
    if shape != here:
        raise ValueError(f"the drafter was loaded for another target (vocab, hidden size, layers = {shape}) than the "
                         f"one it is run with ({here}): load it with load_drafter(path, target)")


class NullDrafter:
    """A drafter that keeps no state and costs nothing: the no-speculation baseline of the engine (with a policy that
    verifies 0 drafts, every step is a plain decode step). ``draft`` returns ``gamma`` placeholder tokens (id 0) per
    request with no distribution; if a policy does verify them they are checked as deterministic proposals, so the
    output stays exact/lossless, they are just rejected."""

    feature_layers = (-1,)  # the embedding output: every forward has it, nothing extra is kept

    def new_state(self, num_pages: int, page_size: int) -> None:
        return None

    def add_request(self, state, rid) -> None:
        pass

    def free(self, state, rid) -> None:
        pass

    def extend(self, state, rids: Sequence, token_ids: torch.Tensor, features: torch.Tensor,
               cu: torch.Tensor) -> None:
        pass

    def draft(self, state, rids: Sequence, anchors: torch.Tensor, gamma: int, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor | None,
              impl: str | None = None, context: DraftContext | None = None) -> DraftOutput:
        return DraftOutput(torch.zeros(len(rids) * gamma, dtype=torch.int64, device=anchors.device), None, None)


def save_drafter(module: torch.nn.Module, config: dict, drafter_type: str, out_dir: str | Path) -> None:
    """Write ``drafter_config.json`` (``{"drafter_type": ..., **config}``) and ``model.safetensors`` (the module's own
    weights: the frozen target embedding and LM head are not part of it)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_config.json").write_text(json.dumps({"drafter_type": drafter_type, **config}, indent=1) + "\n")
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, str(out / "model.safetensors"))


def read_drafter_config(path: str | Path, drafter_type: str | None = None) -> dict:
    """The config dict of a drafter directory (``drafter_type`` removed); checks both files exist and the type."""
    cfg_file, weights = Path(path) / "drafter_config.json", Path(path) / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise FileNotFoundError(f"drafter checkpoint file missing: {f}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object of drafter settings, got {type(raw).__name__}")
    kind = raw.pop("drafter_type", None)
    if drafter_type is not None and kind != drafter_type:
        raise ValueError(f"{cfg_file}: drafter_type must be {drafter_type!r}, got {kind!r}")
    raw["drafter_type"] = kind
    return raw


def load_drafter_weights(module: torch.nn.Module, path: str | Path, target, dtype: torch.dtype) -> torch.nn.Module:
    """Fill ``module`` from ``path/model.safetensors`` (clear errors for unreadable files and missing tensors) and
    return it in eval mode on the target's device."""
    from safetensors.torch import load_file

    weights = Path(path) / "model.safetensors"
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise ValueError(f"cannot read drafter weights {weights}: {e}") from e
    missing = set(module.state_dict()) - set(state)
    if missing:
        raise ValueError(f"drafter weights {weights} miss tensors: {sorted(missing)[:5]}")
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return module.to(dtype=dtype, device=target.device).eval().requires_grad_(False)
