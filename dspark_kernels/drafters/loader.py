"""Load any drafter directory: the loader sits above the drafter kinds (:mod:`.block_drafter`,
:mod:`.chain_drafter`), which import only :mod:`.api`, so no module imports one that imports it back."""

from __future__ import annotations

import torch

from ..models.transformer import CausalLM
from .api import Drafter, read_drafter_config
from .block_drafter import load_block_drafter
from .chain_drafter import load_chain_drafter
from .draft_vocab import DraftVocab, load_token_ranking

__all__ = ["load_drafter"]


def load_drafter(path, target, dtype: torch.dtype = torch.float32, gemm_dtype: torch.dtype | str | None = None,
                 draft_vocab: int | None = None) -> Drafter:
    """Load any shipped drafter directory (``drafter_config.json`` names its ``drafter_type``) for ``target``;
    ``gemm_dtype`` as in :func:`dspark_kernels.models.load_model`, for the drafter's own linear layers (its embedding
    and LM head are the target's, in the target's setting). It need not match the target's: the drafter's numerics
    decide only which tokens are proposed, never what verification emits (T = 0) or its distribution (T > 0). On a CPU
    whose small bf16 GEMMs have a high fixed cost, fp32 drafter layers are the faster at a draft block's few rows.

    ``draft_vocab = K``: draft over the ``K`` first tokens of the directory's token ranking
    (:mod:`.draft_vocab`; lossless, verification still reads the target's whole vocabulary); None drafts over all."""
    if not isinstance(target, CausalLM):
        raise TypeError(f"target must be the CausalLM the drafter runs with (load_model), got {type(target).__name__}")
    kind = read_drafter_config(path)["drafter_type"]
    if kind not in ("block", "chain"):
        raise ValueError(f"{path}/drafter_config.json: unknown drafter_type {kind!r} (expected 'block' or 'chain')")
    vocab = None
    if draft_vocab is not None:  # checked before the weights load
        vocab = DraftVocab.from_ranking(load_token_ranking(path, target.config.vocab_size), draft_vocab)
    drafter = (load_block_drafter if kind == "block" else load_chain_drafter)(path, target, dtype, gemm_dtype)
    if vocab is not None:
        drafter.draft_vocab = vocab.to(drafter.device)
    return drafter
