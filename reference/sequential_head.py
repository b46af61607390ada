"""Reference for the sequential (Markov) draft head: slot-by-slot bias, filtered sampling and confidence logits.

Vectorised over requests; the only Python loop is over the slot index k (at most gamma iterations). The semantics
are documented in :mod:`dspark_kernels.ops.sequential_head`; the sampling filters and the draw are the shared ones of
:mod:`dspark_kernels.reference._sampling`, so a draft row is filtered exactly like a target row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ._sampling import argmax_rows, inverse_cdf_ref, target_probs_ref, top_k_filters, top_p_filters
from ._tensor_key import tensor_key

KINDS = ("none", "vanilla", "gated", "rnn")
HOST_SLOTS = 256  # all-greedy batches of at most this many slots draft on the host (greedy_host)


class SequentialHeadWeights(NamedTuple):
    """Weights of the sequential head in the op's layout (any float dtype; the op computes in float32).

    ``kind``: one of ``KINDS``; ``"none"`` (rank 0) adds no bias and has no Markov embedding.
    ``w1`` ``[V, r]`` (or ``[V_prev, r]`` with more rows, for anchors outside the drafted vocabulary): Markov embedding
    ``e = w1[x_prev]``.  ``w2`` ``[r, V]``: bias-free output, ``bias = lat @ w2``.
    ``gate_w`` ``[d + r, r]``, ``gate_b`` ``[r]`` (gated): ``g = sigmoid([h; e] @ gate_w + gate_b)``.
    ``rnn_w`` ``[2r + d, 3r]``, ``rnn_b`` ``[3r]`` (rnn): ``(a, c, o) = split([s; e; h] @ rnn_w + rnn_b, r)``.
    ``conf_w`` ``[d + r]`` (``[d]`` for kind ``"none"``) and ``conf_b`` ``[]``: confidence logit
    ``[h; e] . conf_w + conf_b``; ``None`` means no confidence head (the op returns zero logits).
    ``bias_rows`` (kind "vanilla" only, optional): a :class:`MarkovBiasRows` of these ``w1`` and ``w2``; the CPU path
    then reads each slot's bias as its previous token's row instead of multiplying ``[B, r] x [r, V]``.
    Unused fields are ``None``.
    """

    kind: str
    w1: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    gate_w: torch.Tensor | None = None
    gate_b: torch.Tensor | None = None
    rnn_w: torch.Tensor | None = None
    rnn_b: torch.Tensor | None = None
    conf_w: torch.Tensor | None = None
    conf_b: torch.Tensor | None = None
    bias_rows: MarkovBiasRows | None = None


class MarkovBiasRows:
    """The vanilla head's bias rows by previous token, ``w1[x] @ w2`` ``[V]`` float32, each computed once and kept.

    A vanilla head's bias depends on the previous token only, and a decode keeps meeting the same tokens (the demo's six
    prompts, decoded three times each at fixed gamma 7, need 88 rows). A kept row is read back instead of multiplying
    ``[1, r] x [r, V]`` again (about 20 us a slot at ``r`` 64, ``V`` 8192 here, most of the head's cost). Every row is
    computed alone, by the same one-row product, so its bits do not depend on which requests were drafted with it or
    when: a request's drafts do not depend on its batch. (They can differ in the last bit from the in-place
    ``base + lat @ w2`` of the uncached path, which rounds the sum once.)

    Rows are kept up to ``max_bytes`` (at least one row); when a slot needs more, the table starts over. ``w1 [V, r]``
    and ``w2 [r, V]``: the weights the rows belong to (float32 copies are made if needed); :meth:`belongs_to` tells
    whether tensors are those weights, unchanged (same storage, layout and version counter).
    """

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, max_bytes: int = 64 << 20) -> None:
        self.source = (tensor_key(w1), tensor_key(w2))
        self.w1, v = w1.float(), w2.shape[1]
        self._bias = _MarkovBias(w2.float())
        self.capacity = max(1, max_bytes // (4 * v))
        with torch.inference_mode(False):  # kept tensors stay writable inside and outside inference mode
            self._row_of = torch.full((w1.shape[0],), -1, dtype=torch.int64, device=w1.device)
            self._table = torch.empty(0, v, dtype=torch.float32, device=w1.device)  # grown on demand
            self._zero = torch.zeros(1, v, dtype=torch.float32, device=w1.device)
        self._host_at: dict[int, int] = {}  # the places of _row_of on the host, for host_row
        self.used = 0

    def belongs_to(self, w1: torch.Tensor | None, w2: torch.Tensor | None) -> bool:
        return w1 is not None and w2 is not None and self.source == (tensor_key(w1), tensor_key(w2))

    def host_row(self, token: int) -> np.ndarray:
        """The bias row ``[V]`` float32 of one previous token as a numpy view of the kept table (computed and kept
        first if needed); valid until the next call that keeps rows (the table may grow or start over)."""
        at = self._host_at.get(token)
        if at is None:
            with torch.inference_mode(False), torch.no_grad():
                self._keep(torch.tensor([token]), torch.tensor([-1]))
            at = self._host_at[token]
        return self._table.numpy()[at]

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B]`` int64 -> their bias rows ``[B, V]`` float32 (computing the rows not kept yet)."""
        at = self._row_of[tokens]
        if bool((at < 0).any()):
            with torch.inference_mode(False), torch.no_grad():  # the kept tensors stay normal tensors
                if not self._keep(tokens, at):  # more distinct tokens than the table holds: computed, not kept
                    return torch.cat([self._row(t) for t in tokens.tolist()])
            at = self._row_of[tokens]
        return self._table.index_select(0, at)

    def _keep(self, tokens: torch.Tensor, at: torch.Tensor) -> bool:
        """Compute and keep the rows of ``tokens`` not kept yet (``at``: their places, -1 where not kept), starting
        the table over when they do not fit; ``False`` when the tokens alone do not fit."""
        new = tokens[at < 0].unique().tolist()
        if len(new) > self.capacity - self.used:
            self._row_of.fill_(-1)
            self._host_at.clear()
            self.used = 0
            new = tokens.unique().tolist()
            if len(new) > self.capacity:
                return False
        if self.used + len(new) > self._table.shape[0]:
            size = min(self.capacity, max(2 * self._table.shape[0], self.used + len(new), 64))
            grown = self._table.new_empty(size, self._table.shape[1])
            grown[: self.used] = self._table[: self.used]
            self._table = grown
        for t in new:
            self._table[self.used] = self._row(t)[0]
            self._row_of[t] = self._host_at[t] = self.used
            self.used += 1
        return True

    def _row(self, token: int) -> torch.Tensor:
        return self._bias.add(self._zero, self.w1[token: token + 1])


class SequentialHeadResult(NamedTuple):
    """``tokens [N]`` int64 drafts; ``draft_probs [N, V]`` float32 filtered draft distributions (one-hot for greedy
    requests), or ``None`` when the op ran without uniforms (every request greedy: verification compares tokens and
    needs no distributions, so no ``[N, V]`` buffer is written); ``confidence_logits [N]`` float32
    (``c_k = sigmoid(logit)``)."""

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    confidence_logits: torch.Tensor


def _latent_step(
    weights: SequentialHeadWeights, e: torch.Tensor, h: torch.Tensor | None, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One slot of the head before ``w2``: ``(lat [B, r], new state [B, r] | None)`` from the Markov embedding
    ``e [B, r]``, the hidden state ``h [B, d]`` (``None`` for kind "vanilla", which ignores it) and (rnn) the
    previous state ``[B, r]``; float32 weights."""
    if weights.kind == "vanilla":
        return e, state
    if weights.kind == "gated":
        g = torch.sigmoid(torch.cat([h, e], dim=1) @ weights.gate_w + weights.gate_b)
        return g * e, state
    z = torch.cat([state, e, h], dim=1) @ weights.rnn_w + weights.rnn_b
    a, c, o = z.chunk(3, dim=1)
    gate = torch.sigmoid(a)
    return torch.tanh(o), gate * state + (1 - gate) * torch.tanh(c)


class _MarkovBias:
    """``logits [B, V] + lat [B, r] @ w2 [r, V]`` in float32 (``w2`` may be a strided view), set up once per op call
    and applied at every slot; :meth:`add` returns a new tensor.

    On the CPU, with more than one intra-op thread and ``V`` divisible by their number, the columns are split into one
    chunk per thread and multiplied as one batched GEMM: torch runs a few-row GEMM on a single thread, a batched one
    on all of them (19 vs 28 us per slot at r = 64, V = 8192 on 2 cores). Same products, same sums per column. The
    chunked view of ``w2`` is made here, not per slot.
    """

    def __init__(self, w2: torch.Tensor) -> None:
        self.w2, (rank, self.v) = w2, w2.shape
        self.chunks = torch.get_num_threads()
        self.blocks = None
        if w2.device.type == "cpu" and self.chunks > 1 and self.v % self.chunks == 0:
            width = self.v // self.chunks
            s_r, s_v = w2.stride()
            self.blocks = w2.as_strided((self.chunks, rank, width), (width * s_v, s_r, s_v))

    def add(self, logits: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return torch.addmm(logits, lat, self.w2)
        b = logits.shape[0]
        chunked = logits.view(b, self.chunks, -1).transpose(0, 1)
        return torch.baddbmm(chunked, lat.expand(self.chunks, -1, -1), self.blocks).transpose(0, 1).reshape(b, self.v)


def _confidence(weights: SequentialHeadWeights, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
    """Confidence logits ``[B]`` float32 from ``h [B, d]`` and the Markov embedding ``e [B, r]`` of the previous
    token (``None`` for kind ``"none"``); zeros without a confidence head; float32 weights."""
    if weights.conf_w is None:
        return torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    features = h if e is None else torch.cat([h, e], dim=1)
    return features @ weights.conf_w + weights.conf_b


def sequential_head_ref(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    weights: SequentialHeadWeights,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> SequentialHeadResult:
    """Draft every request's slots left to right; shapes as in :func:`dspark_kernels.ops.sequential_head`.

    Inputs are assumed valid. At slot k only the requests with more than k slots take part. The confidence logits
    (which depend on the previous token, not on the state) are computed for all slots at once after the loop.
    Without uniforms every slot takes the lowest-index argmax and ``draft_probs`` is ``None``; such a batch of CPU
    tensors with at most ``HOST_SLOTS`` slots, whose bias needs no product (kind "none", or vanilla with kept rows),
    takes :func:`greedy_host` (the same tokens; a slot costs about eight small tensor ops here).
    """
    n, v = base_logits.shape
    dev = base_logits.device
    weights = _as_float32(weights)
    cu = cu_num_draft_tokens.long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    if (uniforms is None and dev.type == "cpu" and n <= HOST_SLOTS
            and (weights.kind == "none" or weights.bias_rows is not None)):
        tokens = greedy_host(base_logits, anchor_tokens, cu_num_draft_tokens, weights.bias_rows)
        return SequentialHeadResult(tokens, None, _confidence(weights, hidden.float(), _previous_embedding(
            weights, tokens, anchor_tokens, starts, lens)))
    r = lens.numel()
    rank = weights.w1.shape[1] if weights.kind != "none" else 0
    needs_h = weights.kind in ("gated", "rnn")
    tokens = torch.zeros(n, dtype=torch.int64, device=dev)
    probs = None if uniforms is None else torch.zeros(n, v, dtype=torch.float32, device=dev)
    prev = anchor_tokens.long().clone()
    state = torch.zeros(r, rank, dtype=torch.float32, device=dev) if weights.kind == "rnn" else None
    every = torch.arange(r, device=dev)
    bias = _MarkovBias(weights.w2) if weights.kind != "none" else None
    min_len, max_len = (int(lens.min()), int(lens.max())) if r else (0, 0)
    if probs is not None:  # decided once per call, not per slot: a filter no request asks for, and greedy rows
        top_k = top_k if top_k is not None and bool(top_k_filters(top_k, v).any()) else None
        top_p = top_p if top_p is not None and bool(top_p_filters(top_p).any()) else None
        any_greedy = bool((temperature == 0).any())
    for k in range(max_len):
        everyone = k < min_len  # every request takes part: whole-tensor reads instead of gathers
        req = every if everyone else (lens > k).nonzero().squeeze(1)
        rows = starts + k if everyone else starts[req] + k
        logits = base_logits[rows].float()
        if weights.bias_rows is not None:  # vanilla: the kept row of each previous token
            logits = logits + weights.bias_rows.rows(prev if everyone else prev[req])
        elif weights.kind != "none":
            e = weights.w1[prev if everyone else prev[req]]
            h = hidden[rows].float() if needs_h else None
            lat, new_state = _latent_step(weights, e, h, None if state is None else state[req])
            if new_state is not None:
                state[req] = new_state
            logits = bias.add(logits, lat)
        if probs is None:  # all greedy: the lowest-index argmax
            token = argmax_rows(logits)
        else:
            token, probs[rows] = _draw(logits, req, temperature, top_k, top_p, uniforms[rows], any_greedy)
        tokens[rows] = token
        if everyone:
            prev = token
        else:
            prev[req] = token
    return SequentialHeadResult(tokens, probs, _confidence(weights, hidden.float(), _previous_embedding(
        weights, tokens, anchor_tokens, starts, lens)))


def greedy_host(base_logits: torch.Tensor, anchor_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                bias_rows: MarkovBiasRows | None) -> torch.Tensor:
    """All-greedy drafting (shapes as in :func:`sequential_head_ref`) as a scan over host arrays: each slot's logits
    are its base row plus the kept bias row of the previous token (``bias_rows``; ``None``: no bias), and the token is
    their lowest-index argmax. Returns ``tokens [N]`` int64. The sums are the tensor path's float32 adds element for
    element, so the tokens equal its tokens (tested bit for bit); for a decode round's few slots it is several times
    cheaper."""
    if bias_rows is None:
        return argmax_rows(base_logits.float())
    base = base_logits.detach().float().numpy()
    bounds = cu_num_draft_tokens.tolist()
    tokens = [0] * base.shape[0]
    scratch = np.empty(base.shape[1], dtype=np.float32)
    for prev, start, end in zip(anchor_tokens.tolist(), bounds, bounds[1:]):
        for row in range(start, end):
            prev = tokens[row] = int(np.add(base[row], bias_rows.host_row(prev), out=scratch).argmax())
    return torch.tensor(tokens, dtype=torch.int64)


def _previous_embedding(weights: SequentialHeadWeights, tokens: torch.Tensor, anchor_tokens: torch.Tensor,
                        starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
    """Markov embedding ``[N, r]`` of each slot's previous token (the anchor for a request's first slot, else the
    draft before it); ``None`` for kind ``"none"``."""
    if weights.kind == "none":
        return None
    prev = torch.roll(tokens, 1)
    has_slots = lens > 0
    prev[starts[has_slots]] = anchor_tokens.long()[has_slots]
    return weights.w1[prev]


def _as_float32(weights: SequentialHeadWeights) -> SequentialHeadWeights:
    """The weights with every tensor converted to float32 once (a no-op for float32 weights)."""
    return weights._replace(**{f: t.float() for f, t in zip(weights._fields[1:], weights[1:])
                               if isinstance(t, torch.Tensor)})


def _draw(
    logits: torch.Tensor,
    req: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    u: torch.Tensor,
    any_greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B]`` and draft probabilities ``[B, V]`` of float32 ``logits [B, V]`` of requests ``req [B]``:
    greedy rows take the lowest-index argmax and a one-hot row, the others the filtered row and its inverse-CDF draw
    (the argmax and one-hot rows are only made when some request of the call is greedy: ``any_greedy``; ``top_k`` /
    ``top_p`` are ``None`` when no request of the call filters)."""
    t = temperature[req]
    probs = target_probs_ref(
        logits, t, top_k[req] if top_k is not None else None, top_p[req] if top_p is not None else None
    )
    token = inverse_cdf_ref(probs, u)
    if not any_greedy:
        return token, probs
    greedy = t == 0
    argmax = logits.argmax(dim=1)
    one_hot = torch.nn.functional.one_hot(argmax, logits.shape[1]).float()
    return torch.where(greedy, argmax, token), torch.where(greedy[:, None], one_hot, probs)
