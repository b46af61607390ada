"""Paged KV cache of the target model: fixed-size pages from one shared pool, a page list per request.

Storage (per layer ``l``):
    k[l], v[l]    [num_pages, page_size, Hkv, D]

Token ``t`` of request ``r`` lives at ``(pages[r][t // page_size], t % page_size)``, i.e. flat slot
``pages[r][t // page_size] * page_size + t % page_size`` of the ``[num_pages * page_size, Hkv, D]`` view.

Bookkeeping (host side): a free-page pool, each request's page list and its length (tokens in the cache). ``reserve``
appends room for new tokens (the length grows), ``rollback`` drops trailing tokens (rejected drafts) and returns pages
that are no longer needed to the pool, ``free`` releases a finished request. Page contents are never cleared: a token
is valid iff its position is below the request's length.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["PagedKVCache", "OutOfPagesError"]


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold the requested tokens."""


class PagedKVCache:
    """Per-layer paged K/V storage plus page accounting.

    Args:
        num_layers: decoder layers (one k and one v tensor each).
        num_pages: pages in the shared pool.
        page_size: tokens per page.
        num_kv_heads, head_dim: ``Hkv`` and ``D``.
        dtype, device: storage dtype/device (should match the model's activations).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                          ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._pages)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._pages

    def _get(self, rid: Hashable) -> list[int]:
        try:
            return self._pages[rid]
        except KeyError:
            raise KeyError(f"unknown request id {rid!r} (call add_request first)") from None

    def length(self, rid: Hashable) -> int:
        """Tokens currently held for ``rid``."""
        self._get(rid)
        return self._lens[rid]

    def pages(self, rid: Hashable) -> list[int]:
        """A copy of ``rid``'s page list, in token order."""
        return list(self._get(rid))

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def add_request(self, rid: Hashable) -> None:
        """Register an empty request."""
        if rid in self._pages:
            raise ValueError(f"request id {rid!r} is already in the cache")
        self._pages[rid] = []
        self._lens[rid] = 0

    def reserve(self, rid: Hashable, n: int) -> int:
        """Append room for ``n`` more tokens of ``rid``; return the position of the first one.

        All-or-nothing: raises :class:`OutOfPagesError` (leaving the cache unchanged) when the pool is too small.
        """
        pages = self._get(rid)
        if n < 0:
            raise ValueError(f"reserve: n must be >= 0, got {n}")
        start = self._lens[rid]
        need = self._pages_for(start + n) - len(pages)
        if need > len(self._free):
            raise OutOfPagesError(
                f"out of KV-cache pages: request {rid!r} needs {need} more page(s) for {n} token(s), "
                f"{len(self._free)} of {self.num_pages} free (page_size {self.page_size})"
            )
        for _ in range(need):
            pages.append(self._free.pop())
        self._lens[rid] = start + n
        return start

    def reserve_many(self, rids: Sequence[Hashable], counts: Sequence[int]) -> list[int]:
        """``reserve`` for several requests at once, all-or-nothing across the batch; returns start positions."""
        if len(rids) != len(counts):
            raise ValueError(f"reserve_many: {len(rids)} request ids but {len(counts)} counts")
        if len(set(rids)) != len(rids):
            raise ValueError(f"reserve_many: duplicate request ids in {list(rids)}")
        need = 0
        for rid, n in zip(rids, counts):
            pages = self._get(rid)
            if n < 0:
                raise ValueError(f"reserve: n must be >= 0, got {n} for request {rid!r}")
            need += max(0, self._pages_for(self._lens[rid] + n) - len(pages))
        if need > len(self._free):
            raise OutOfPagesError(
                f"out of KV-cache pages: batch of {len(rids)} request(s) needs {need} more page(s), "
                f"{len(self._free)} of {self.num_pages} free (page_size {self.page_size})"
            )
        return [self.reserve(rid, n) for rid, n in zip(rids, counts)]

    def rollback(self, rid: Hashable, n: int) -> None:
        """Drop the last ``n`` tokens of ``rid`` (e.g. rejected drafts); pages no longer needed go back to the pool."""
        pages = self._get(rid)
        if n < 0 or n > self._lens[rid]:
            raise ValueError(f"rollback: n must be in [0, {self._lens[rid]}] for request {rid!r}, got {n}")
        self._lens[rid] -= n
        keep = self._pages_for(self._lens[rid])
        while len(pages) > keep:
            self._free.append(pages.pop())

    def free(self, rid: Hashable) -> None:
        """Release every page of ``rid`` and forget it."""
        pages = self._get(rid)
        self._free.extend(reversed(pages))
        del self._pages[rid]
        del self._lens[rid]

    # ------------------------------------------------------------------ batch tensors
    def batch_tensors(
        self, rids: Sequence[Hashable], device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [R, max_pages] int32, seq_lens [R] int32)`` for ``rids`` (unused entries are 0)."""
        device = self.device if device is None else torch.device(device)
        page_lists = [self._get(rid) for rid in rids]
        width = max([len(p) for p in page_lists] + [1])
        table = torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.int32, device=device)
        lens = torch.tensor([self._lens[rid] for rid in rids], dtype=torch.int32, device=device)
        return table.view(len(rids), width), lens

    def token_slots(self, rids: Sequence[Hashable], counts: Sequence[int],
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slots and absolute positions, both ``[sum(counts)]`` int64, of the last ``counts[r]`` tokens of each
        request of ``rids`` (typically the ones just reserved), request by request in order.

        Read from the host page lists: no device work and no host sync, just two small host-to-device copies
        (a vectorised version on the page-table tensor took about ten tensor ops)."""
        device = self.device if device is None else torch.device(device)
        ps, slots, positions = self.page_size, [], []
        for rid, n in zip(rids, counts):
            pages, end = self._get(rid), self._lens[rid]
            if not 0 <= n <= end:
                raise ValueError(f"token_slots: count must be in [0, {end}] for request {rid!r}, got {n}")
            span = range(end - n, end)
            positions.extend(span)
            slots.extend(pages[p // ps] * ps + p % ps for p in span)
        return (torch.tensor(slots, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new keys/values ``[total_q, Hkv, D]`` of ``layer`` into ``slots`` (see :meth:`token_slots`)."""
        flat_shape = (self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat_shape).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(flat_shape).index_copy_(0, slots, v.to(self.dtype))
