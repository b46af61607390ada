"""A draft vocabulary: the drafter proposes only from the ``K`` most frequent tokens of the target's own answers.

The draft LM head over a 49k vocabulary is a large part of a small drafter's cost (EAGLE-3 and FR-Spec draft over a
frequency-ranked subset instead). With a :class:`DraftVocab`, a drafter computes its logits for the ``K`` tokens of
the subset only (``[N, K]``), its sequential head draws among them, and the draft distribution it reports is the
drawn one, widened to the target's vocabulary with probability 0 outside the subset. Verification reads the target's
full distribution and these draft probabilities, so the output stays the target's exactly (T = 0) or in distribution
(T > 0): a token outside the subset is never proposed, and a residual draw can still emit it.

Layouts: ``ids [K]`` int64, the subset's target ids in rank order; the drafted tokens are local ids ``0..K-1`` (row
``i`` of the subset's logits is token ``ids[i]``). The sequential head's Markov embedding ``w1`` is reordered to
``order [V]`` (the subset first, then every other id ascending), so that a drafted token's local id and an anchor's
(any target token) index the same table: ``w1_local[local_of[x]] == w1[x]``. ``w2`` keeps the subset's columns.

The ranking a drafter directory ships (``token_ranking.safetensors``, tensor ``ranking [V]``: every target id once,
the most frequent in the train rollouts' responses first, ties by id) is written by
:mod:`dspark_kernels.train.token_ranking`; :func:`~dspark_kernels.drafters.loader.load_drafter` with ``draft_vocab=K``
drafts over its first ``K`` entries.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..models.gemm_dtype import CastGemmLinear
from ..models.weight_layout import is_column_major
from ..ops._validate import is_int
from ..ops.sequential_head import MarkovBiasRows, SequentialHeadResult, SequentialHeadWeights, sequential_head
from ..reference._tensor_key import tensor_key

__all__ = ["RANKING_FILE", "DraftVocab", "draft_logits", "draw", "load_token_ranking", "save_token_ranking"]

RANKING_FILE = "token_ranking.safetensors"


def _check_permutation(ranking: torch.Tensor, vocab_size: int, where: str) -> None:
    if ranking.dim() != 1 or ranking.numel() != vocab_size or ranking.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: the ranking must be a 1-D int tensor of the target's {vocab_size} token ids, got "
                         f"{ranking.dtype} of shape {tuple(ranking.shape)}")
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    inside = (ranking >= 0) & (ranking < vocab_size)
    seen[ranking[inside].long()] = True
    if not bool(inside.all()) or not bool(seen.all()):
        raise ValueError(f"{where}: the ranking must hold every token id in [0, {vocab_size}) exactly once")


def save_token_ranking(ranking: torch.Tensor, out_dir: str | Path) -> Path:
    """Write ``ranking [V]`` (a permutation of the target's ids, most frequent first) as ``out_dir/RANKING_FILE``
    (int32)."""
    from safetensors.torch import save_file

    _check_permutation(ranking, ranking.numel(), "save_token_ranking")
    path = Path(out_dir) / RANKING_FILE
    save_file({"ranking": ranking.to(torch.int32).contiguous()}, str(path))
    return path


def load_token_ranking(drafter_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """``ranking [V]`` int64 of a drafter directory; a clear error if it has none or it does not fit the target."""
    from safetensors.torch import load_file

    path = Path(drafter_dir) / RANKING_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: a draft vocabulary needs the drafter's token ranking (build it "
                                "with python -m dspark_kernels.train.token_ranking)")
    try:
        ranking = load_file(str(path))["ranking"]
    except Exception as e:  # safetensors raises several types for corrupt files; a missing key is a KeyError
        raise ValueError(f"cannot read the token ranking {path}: {e}") from e
    _check_permutation(ranking, vocab_size, str(path))
    return ranking.long()


class DraftVocab:
    """The subset ``ids [K]`` (distinct target ids in ``[0, vocab_size)``) a drafter drafts over; see the module
    docstring. Derived weights (the LM head's rows, the head's reordered ``w1`` and sliced ``w2``) are made on first
    use and again when the weights they come from change."""

    def __init__(self, ids: torch.Tensor, vocab_size: int) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be a 1-D int tensor of token ids, got {ids!r:.80}")
        if not is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not 1 <= ids.numel() <= vocab_size:
            raise ValueError(f"ids must hold 1..{vocab_size} tokens, got {ids.numel()}")
        if bool(((ids < 0) | (ids >= vocab_size)).any()) or ids.unique().numel() != ids.numel():
            raise ValueError(f"ids must be distinct token ids in [0, {vocab_size})")
        self.ids = ids.long()
        self.vocab_size = vocab_size
        dev = self.ids.device
        inside = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        inside[self.ids] = True
        self.order = torch.cat([self.ids, torch.arange(vocab_size, device=dev)[~inside]])  # local -> target id
        self.local_of = torch.empty_like(self.order)
        self.local_of[self.order] = torch.arange(vocab_size, device=dev)  # target id -> local
        self._head_key: tuple | None = None
        self._head: SequentialHeadWeights | None = None
        self._lm_key: tuple | None = None
        self._lm: nn.Module | None = None

    @classmethod
    def from_ranking(cls, ranking: torch.Tensor, size: int) -> "DraftVocab":
        """The ``size`` first tokens of ``ranking [V]``."""
        if not is_int(size) or not 1 <= size <= ranking.numel():
            raise ValueError(f"draft_vocab must be an int in [1, {ranking.numel()}] (the target's vocabulary), "
                             f"got {size!r}")
        return cls(ranking[:size], ranking.numel())

    @property
    def size(self) -> int:
        return self.ids.numel()

    def to(self, device: torch.device | str) -> "DraftVocab":
        return self if self.ids.device == torch.device(device) else DraftVocab(self.ids.to(device), self.vocab_size)

    def logits(self, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The subset's logits ``[..., K]`` fp32 of normalised hidden states ``x [..., hidden]`` (in the LM head's
        input dtype) through ``lm_head``'s rows of the subset: the same linear layer kind, weight dtype and memory
        layout as ``lm_head``, so each logit is computed as the full head computes it."""
        key = tensor_key(lm_head.weight)
        if key != self._lm_key:
            self._lm, self._lm_key = _row_subset(lm_head, self.ids), key
        return self._lm(x).float()

    def head_weights(self, weights: SequentialHeadWeights) -> SequentialHeadWeights:
        """The sequential head's weights over the subset: ``w1`` reordered to :attr:`order`, ``w2``'s subset columns
        (with their kept bias rows when ``weights`` has them); a head without ``w1`` is unchanged."""
        if weights.kind == "none":
            return weights
        key = (tensor_key(weights.w1), tensor_key(weights.w2), weights.bias_rows is not None)
        if key != self._head_key:
            w1 = weights.w1[self.order.to(weights.w1.device)]
            w2 = weights.w2[:, self.ids.to(weights.w2.device)].contiguous()
            rows = MarkovBiasRows(w1, w2) if weights.bias_rows is not None else None
            self._head, self._head_key = weights._replace(w1=w1, w2=w2, bias_rows=rows), key
        return self._head._replace(gate_w=weights.gate_w, gate_b=weights.gate_b, rnn_w=weights.rnn_w,
                                   rnn_b=weights.rnn_b, conf_w=weights.conf_w, conf_b=weights.conf_b)

    def sequential_head(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                        cu_num_draft_tokens: torch.Tensor, weights: SequentialHeadWeights, temperature: torch.Tensor,
                        top_k: torch.Tensor | None, top_p: torch.Tensor | None, uniforms: torch.Tensor | None, *,
                        impl: str | None = None, check_inputs: bool = True) -> SequentialHeadResult:
        """:func:`~dspark_kernels.ops.sequential_head` over the subset: ``base_logits [N, K]``, target-id anchors
        ``[R]``; returns target ids ``[N]`` and draft probabilities ``[N, V]`` (0 outside the subset)."""
        head = self.head_weights(weights)
        local = self.local_of[anchor_tokens.long()] if head.kind != "none" else torch.zeros_like(anchor_tokens)
        res = sequential_head(base_logits, hidden, local, cu_num_draft_tokens, head, temperature, top_k, top_p,
                              uniforms, impl=impl, check_inputs=check_inputs)
        return SequentialHeadResult(self.ids[res.tokens], self.widen(res.draft_probs), res.confidence_logits)

    def widen(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """Draft probabilities ``[N, K]`` over the subset -> ``[N, V]`` over the target's vocabulary."""
        if probs is None:
            return None
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.ids, probs)


def _row_subset(lm_head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A bias-free linear layer of ``lm_head``'s kind whose weight is rows ``ids`` of its weight, stored in its
    layout (column-major stays column-major)."""
    weight = lm_head.weight.detach()
    rows = weight[ids.to(weight.device)]
    rows = rows.t().contiguous().t() if is_column_major(weight) else rows.contiguous()
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    linear.weight = nn.Parameter(rows, requires_grad=False)
    if isinstance(lm_head, CastGemmLinear):
        cast = CastGemmLinear(linear, rows.dtype)
        cast.min_rows = lm_head.min_rows
        return cast
    return linear


def draft_logits(vocab: DraftVocab | None, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A drafter's base logits of normalised hidden states ``x [..., hidden]``: ``[..., V]`` through the full
    ``lm_head`` (``vocab`` None), else ``[..., K]`` over the draft vocabulary; fp32."""
    return lm_head(x).float() if vocab is None else vocab.logits(lm_head, x)


def draw(vocab: DraftVocab | None, *args, **kwargs) -> SequentialHeadResult:
    """:func:`~dspark_kernels.ops.sequential_head` (``vocab`` None) or :meth:`DraftVocab.sequential_head` (same
    arguments): target ids and ``[N, V]`` draft probabilities either way."""
    return (sequential_head if vocab is None else vocab.sequential_head)(*args, **kwargs)
