"""Shared pieces of the attention references: a *plan* of the index work of one call (which cache slots to gather,
which rows are padding, which keys each query may see), and one batched, masked GQA attention that runs it.

The references run many requests at once (one padded batch instead of a Python loop over requests), in groups whose
score tensor stays under ``SCORE_BUDGET`` elements, so a long prefill does not allocate scores for every request
padded to the longest one.

Planning and running are split (FlashInfer's plan/run): the plan depends only on the page table and the lengths,
which every layer of one model forward shares, so a forward plans once and each layer only gathers its own K/V and
runs the attention. Without a plan each call makes its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

SCORE_BUDGET = 1 << 24  # fp32 scores per request group: 64 MiB


def request_groups(q_lens: list[int], kv_lens: list[int], heads: int,
                   budget: int | None = None) -> Iterator[slice]:
    """Consecutive slices of the requests whose padded scores ``[n, heads, max q, max kv]`` fit ``budget`` elements
    (``None``: ``SCORE_BUDGET``; a single request always forms a group, however large)."""
    budget = SCORE_BUDGET if budget is None else budget
    start, n = 0, len(q_lens)
    while start < n:
        end, max_q, max_kv = start, 0, 0
        while end < n:
            q, kv = max(max_q, q_lens[end]), max(max_kv, kv_lens[end])
            if end > start and (end - start + 1) * heads * q * kv > budget:
                break
            end, max_q, max_kv = end + 1, q, kv
        yield slice(start, end)
        start = end


@dataclass(frozen=True)
class PagedRead:
    """Where ``n`` requests' first ``length`` cached positions live: ``slots [n * length]`` flat cache rows (a
    position at or past its request's length reads slot 0) and ``outside [m]``, the flat indices of those positions,
    which :meth:`gather` zeroes: neither the page table's unused entries nor the stale slots of a live cache are read
    (they may hold anything, and a masked NaN still poisons attention).

    ``start``: when the read is one run of consecutive flat slots (a single request whose pages are consecutive, as
    a request decoding alone gets them from the pool), its first slot, and ``slots``/``outside`` are ``None``: the
    read is then a slice of the cache, not a gather."""

    n: int
    length: int
    slots: torch.Tensor | None
    outside: torch.Tensor | None
    start: int | None = None

    @classmethod
    def of(cls, page_table: torch.Tensor, lens: torch.Tensor, length: int, page_size: int) -> PagedRead:
        """``page_table [n, max_pages]``, ``lens [n]``: read positions ``0 .. length - 1`` of every request."""
        start = _single_run(page_table, lens, length, page_size)
        if start is not None:
            return cls(1, length, None, None, start)
        pos = torch.arange(length, device=page_table.device)
        beyond = pos >= lens[:, None]
        pages = (pos // page_size).clamp(max=max(page_table.shape[1] - 1, 0))  # past the table: masked below
        slots = (page_table.long()[:, pages] * page_size + pos % page_size).masked_fill(beyond, 0)
        return cls(page_table.shape[0], length, slots.reshape(-1), beyond.reshape(-1).nonzero().squeeze(1))

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache [num_pages, page_size, Hkv, D]`` -> ``[n, length, Hkv, D]`` (one flat gather: the fast path; a view
        of ``cache`` for a single run, so callers only read it)."""
        return self._read(cache.reshape(-1, *cache.shape[2:]), 0).view(self.n, self.length, *cache.shape[2:])

    def gather_heads_first(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache [num_pages, page_size, H, D]`` -> contiguous ``[H, n, length, D]`` (one gather, head-major)."""
        heads = cache.shape[2]
        by_head = cache.reshape(-1, heads, cache.shape[3]).transpose(0, 1)
        return self._read(by_head, 1).contiguous().view(heads, self.n, self.length, cache.shape[3])

    def _read(self, flat: torch.Tensor, dim: int) -> torch.Tensor:
        """The read's ``n * length`` rows along ``dim`` of the flat cache view ``flat`` (``dim`` indexes the cache
        slots): a slice for a single run, else a gather with the positions outside the requests zeroed."""
        if self.start is not None:
            return flat.narrow(dim, self.start, self.length)
        rows = flat.index_select(dim, self.slots)
        if self.outside.numel():
            rows.index_fill_(dim, self.outside, 0)
        return rows


def _single_run(page_table: torch.Tensor, lens: torch.Tensor, length: int, page_size: int) -> int | None:
    """The first flat slot of positions ``0 .. length - 1`` when they are one run of consecutive slots: a single
    request (``page_table [1, max_pages]``) holding all ``length`` positions (``lens [1]``) on consecutive pages;
    else ``None``. Reads a few page ids on the host."""
    if page_table.shape[0] != 1 or length == 0:
        return None
    need = -(-length // page_size)
    if need > page_table.shape[1] or int(lens[0]) < length:
        return None
    pages = page_table[0, :need].tolist()
    return pages[0] * page_size if pages == list(range(pages[0], pages[0] + need)) else None


@dataclass(frozen=True)
class RaggedRows:
    """``n`` requests' ragged rows of a flattened ``[total, ...]`` tensor as a padded ``[n, width, ...]`` one: request
    i owns rows ``starts[i] .. starts[i] + lens[i] - 1``. ``dense``: every request has ``width`` rows, so padding is a
    view of ``rows[first : first + n * width]``; otherwise ``index [n * width]`` (padding clamped into range),
    ``valid [n * width]`` bool and ``pad [m]`` / ``keep [k]`` (flat indices of the padding / the real rows) and
    ``out_rows [k]`` (their rows in the flat tensor)."""

    n: int
    width: int
    dense: bool
    first: int
    index: torch.Tensor | None
    valid: torch.Tensor
    pad: torch.Tensor | None
    keep: torch.Tensor | None
    out_rows: torch.Tensor | None

    @classmethod
    def of(cls, starts: torch.Tensor, lens: torch.Tensor, lens_host: list[int], width: int, total: int) -> RaggedRows:
        idx = torch.arange(width, device=starts.device)
        valid = idx < lens[:, None]
        first = int(starts[0]) if len(lens_host) else 0
        if all(n == width for n in lens_host):
            return cls(len(lens_host), width, True, first, None, valid, None, None, None)
        rows = (starts[:, None] + idx).clamp(max=max(total - 1, 0)).reshape(-1)
        flat = valid.reshape(-1)
        keep = flat.nonzero().squeeze(1)
        return cls(len(lens_host), width, False, first, rows, valid, (~flat).nonzero().squeeze(1), keep, rows[keep])

    def padded(self, x: torch.Tensor, zero_padding: bool = False) -> torch.Tensor:
        """``x [total, ...]`` -> ``[n, width, ...]``; padding rows hold other rows' values, or zeros if asked."""
        if self.dense:
            return x[self.first: self.first + self.n * self.width].view(self.n, self.width, *x.shape[1:])
        out = x.index_select(0, self.index)
        if zero_padding and self.pad.numel():
            out.view(out.shape[0], -1).index_fill_(0, self.pad, 0)
        return out.view(self.n, self.width, *x.shape[1:])

    def scatter(self, out: torch.Tensor, padded: torch.Tensor) -> None:
        """Write the real rows of ``padded [n, width, ...]`` into ``out [total, ...]`` (cast to its dtype)."""
        flat = padded.reshape(self.n * self.width, *padded.shape[2:])
        if self.dense:
            out[self.first: self.first + flat.shape[0]] = flat
        else:
            out.index_copy_(0, self.out_rows, flat.index_select(0, self.keep).to(out.dtype))


@dataclass(frozen=True)
class GroupPlan:
    """One request group: its query rows (the drafter's block keys/values use the same rows), its cached K/V read and
    the attention mask ``allowed [n, 1, Q, K]`` (True = may attend; ``None`` when every query sees every key)."""

    queries: RaggedRows
    cached: PagedRead
    allowed: torch.Tensor | None


@dataclass(frozen=True)
class PlannedCall:
    """What every attention plan is made for: ``total_q`` query rows, a cache with ``page_size`` slots per page, the
    per-request query and cached (KV or context) lengths, and a CPU copy of the page table it was planned from."""

    total_q: int
    page_size: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_table: torch.Tensor

    @staticmethod
    def inputs(q_lens: list[int], kv_lens: list[int], page_table: torch.Tensor) -> dict:
        """The ``q_lens``, ``kv_lens`` and ``page_table`` fields of a plan made from these inputs."""
        return {"q_lens": tuple(q_lens), "kv_lens": tuple(kv_lens),
                "page_table": page_table.detach().to("cpu", torch.int64, copy=True)}

    def check(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        if q.shape[0] != self.total_q or k_cache.shape[1] != self.page_size:
            raise ValueError(f"plan was made for {self.total_q} query rows and page size {self.page_size}, got "
                             f"{q.shape[0]} rows and page size {k_cache.shape[1]}")

    def check_made_for(self, q_lens: list[int], kv_lens: list[int], page_table: torch.Tensor) -> None:
        """Raise unless the plan was made for these lengths and an equal page table (the ops' input validation)."""
        if (tuple(q_lens), tuple(kv_lens)) != (self.q_lens, self.kv_lens):
            raise ValueError(f"plan was made for query lengths {list(self.q_lens)} and cached lengths "
                             f"{list(self.kv_lens)}, got {list(q_lens)} and {list(kv_lens)}: make a new plan")
        if not torch.equal(page_table.detach().to("cpu", torch.int64), self.page_table):
            raise ValueError("plan was made for another page_table: make a new plan")


@dataclass(frozen=True)
class AttentionPlan(PlannedCall):
    """The index work of one attention call; reusable by every call with the same page table, offsets and lengths
    (every layer of a forward)."""

    groups: tuple[GroupPlan, ...]


def mask_or_none(allowed: torch.Tensor) -> torch.Tensor | None:
    """``allowed [n, Q, K]`` -> ``[n, 1, Q, K]``, or ``None`` when nothing is masked (the unmasked fused path)."""
    return None if bool(allowed.all()) else allowed[:, None]


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                         sm_scale: float) -> torch.Tensor:
    """``softmax(q k^T * sm_scale, where not allowed -> -inf) v`` in float32 for padded requests.

    ``q [n, Q, Hq, D]``, ``k``/``v [n, K, Hkv, D]`` (query head h reads KV head ``h // (Hq / Hkv)``), ``allowed
    [n, 1, Q, K]`` True where a query may see a key (``None``: everywhere). Returns ``[n, Q, Hq, D]`` float32 (a
    view); a row that sees no key holds no meaningful value. Keys and values must be finite even where masked (a
    masked NaN score, or a zero probability times a NaN value, is still NaN). torch's fused CPU attention does the
    math (1.5x faster than two einsums here).
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=allowed,
        scale=sm_scale, enable_gqa=True)
    return out.transpose(1, 2)
