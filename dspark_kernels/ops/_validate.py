"""Input checks shared by the public ops. Every failure names the argument and what was expected."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..reference._paged_attention import PlannedCall

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def is_int(value: object) -> bool:
    """A Python int that is not a bool: ``True`` is not the count or size 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype and device; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on device {device} like the other inputs, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Check ``t.shape`` against ``expected``; ``None`` entries match any size."""
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected))
    if not ok:
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {shown}, got {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Reject NaN/Inf values (one reduction; costs a host sync, so public ops allow skipping it)."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf values")


def check_range(name: str, t: torch.Tensor, ok: torch.Tensor, expected: str) -> None:
    """Reject a tensor where the boolean mask ``ok`` (same shape) has a False entry; show a few offending values."""
    if not bool(ok.all()):
        bad = t[~ok][:4].tolist()
        raise ValueError(f"{name} must be {expected}, got values such as {bad}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> torch.Tensor:
    """Check an offsets tensor ``[R + 1]``: starts at 0, non-decreasing, ends at ``total``."""
    check_tensor(name, cu, ndim=1, dtypes=INDEX_DTYPES)
    if cu.numel() < 1:
        raise ValueError(f"{name} must have R + 1 >= 1 entries, got 0")
    c = cu.detach().to("cpu", torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(c[0])}")
    if c.numel() > 1 and bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (lengths >= 0), got {c.tolist()}")
    if int(c[-1]) != total:
        raise ValueError(f"{name}[-1] must equal the number of flattened rows ({total}), got {int(c[-1])}")
    return c


def check_draft_offsets(draft_token_ids: object, cu_num_draft_tokens: object, max_spec_len: object,
                        device: torch.device) -> torch.Tensor:
    """Flattened drafts ``[N]`` of R requests with offsets ``[R + 1]`` (integer tensors on ``device``), each request's
    draft at most ``max_spec_len`` (an int >= 0) long. Returns the host int64 draft lengths ``[R]``."""
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if not is_int(max_spec_len) or max_spec_len < 0:
        raise ValueError(f"max_spec_len must be an int >= 0, got {max_spec_len!r}")
    cu = check_cu_seqlens("cu_num_draft_tokens", cu_num_draft_tokens, draft_token_ids.shape[0])
    lens = cu[1:] - cu[:-1]
    if lens.numel() and int(lens.max()) > max_spec_len:
        raise ValueError(
            f"cu_num_draft_tokens: draft lengths must be <= max_spec_len={max_spec_len}, got {lens.tolist()}"
        )
    return lens


def check_sampling_params(
    temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, r: int, device: torch.device
) -> None:
    """Per-request sampling parameters ``[R]``: temperature float32 >= 0 (0 = greedy), top_k int >= 0 (0 = off),
    top_p float32 in (0, 1] (1 = off); top_k/top_p may be None."""
    check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=device)
    check_shape("temperature", temperature, (r,))
    check_finite("temperature", temperature)
    check_range("temperature", temperature, temperature >= 0, ">= 0")
    if top_k is not None:
        check_tensor("top_k", top_k, ndim=1, dtypes=INDEX_DTYPES, device=device)
        check_shape("top_k", top_k, (r,))
        check_range("top_k", top_k, top_k >= 0, ">= 0 (0 = off)")
    if top_p is not None:
        check_tensor("top_p", top_p, ndim=1, dtypes=(torch.float32,), device=device)
        check_shape("top_p", top_p, (r,))
        check_range("top_p", top_p, (top_p > 0) & (top_p <= 1), "in (0, 1] (1 = off)")


def check_paged_requests(
    lens_name: str, lens: object, page_table: object, cu_seqlens_q: object, total_q: int | None, page_size: object,
    num_pages: int | None, device: torch.device | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The request layout of the paged attention ops: ``lens [R]`` cached tokens each request reads (named
    ``lens_name``), ``cu_seqlens_q [R + 1]`` offsets of ``total_q`` query rows (``None``: whatever ``cu`` ends at, for
    a plan, which sees no queries), ``page_table [R, max_pages]`` whose first ``ceil(lens[r] / page_size)`` entries
    of row ``r`` must be page ids in ``[0, num_pages)`` (later entries are never read, so padding such as -1 is
    allowed; ``num_pages`` ``None``: not checked, for a plan, which sees no cache). Returns host int64 copies of
    ``cu_seqlens_q`` and ``lens``."""
    check_tensor(lens_name, lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    r = lens.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=lens.device)
    if cu_seqlens_q.shape[0] != r + 1:
        raise ValueError(f"cu_seqlens_q must have R + 1 = {r + 1} offsets for the R = {r} requests of {lens_name}, got "
                         f"{cu_seqlens_q.shape[0]} (one of the two has the wrong length)")
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX_DTYPES, device=lens.device)
    check_shape("page_table", page_table, (r, None))
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size (the cache's dim 1) must be an int >= 1, got {page_size!r}")
    cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q if total_q is not None else int(cu_seqlens_q[-1]))
    n = lens.detach().to("cpu", torch.int64)
    check_range(lens_name, n, n >= 0, ">= 0")
    max_pages = page_table.shape[1]
    if r and int(n.max()) > max_pages * page_size:
        raise ValueError(f"{lens_name} (max {int(n.max())}) exceeds page_table capacity {max_pages} pages x "
                         f"{page_size}")
    if num_pages is not None and r and max_pages:
        pt = page_table.detach().to("cpu", torch.int64)
        pages = (n + page_size - 1) // page_size
        bad = (torch.arange(max_pages)[None, :] < pages[:, None]) & ((pt < 0) | (pt >= num_pages))
        if bool(bad.any()):
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"page_table[{i}, {j}] must be a page id in [0, {num_pages}) (request {i} reads "
                             f"{int(n[i])} cached tokens: its first {int(pages[i])} pages), got {int(pt[i, j])}")
    return cu, n


def check_paged_attention(q: object, k_cache: object, v_cache: object, page_table: object, cu_seqlens_q: object,
                          lens: object, lens_name: str, sm_scale: object, max_seqlen_q: object,
                          plan: object) -> tuple[torch.Tensor, torch.Tensor]:
    """What both paged attention ops check (each adds its own): ``q [total_q, Hq, D]`` float, the paged
    ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]`` in its dtype and on its device, the head dims, the request
    layout (:func:`check_paged_requests`, ``lens`` named ``lens_name``), ``sm_scale`` and ``max_seqlen_q``
    (:func:`check_attention_call`), and that a reference plan was made for these lengths and page table. Returns host
    int64 ``q_lens [R]`` and ``lens [R]``."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=dev)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=dev)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_head_dims(q, k_cache)
    cu, n = check_paged_requests(lens_name, lens, page_table, cu_seqlens_q, q.shape[0], k_cache.shape[1],
                                 k_cache.shape[0], dev)
    q_lens = cu[1:] - cu[:-1]
    check_attention_call(sm_scale, max_seqlen_q, q_lens)
    if isinstance(plan, PlannedCall):
        plan.check_made_for(q_lens.tolist(), n.tolist(), page_table)
    return q_lens, n


def check_attention_call(sm_scale: object, max_seqlen_q: object, q_lens: torch.Tensor) -> None:
    """``sm_scale`` ``None`` or a finite float > 0; ``max_seqlen_q`` ``None`` or an int >= the longest of
    ``q_lens [R]`` (it sizes the Triton grid: a smaller one would leave query rows unwritten)."""
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
                or sm_scale <= 0:
            raise ValueError(f"sm_scale must be a finite number > 0 (or None for head_dim ** -0.5), got {sm_scale!r}")
    if max_seqlen_q is not None:
        longest = int(q_lens.max()) if q_lens.numel() else 0
        if not is_int(max_seqlen_q) or max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q must be an int >= the longest query ({longest} rows), got {max_seqlen_q!r}")


def check_head_dims(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """``q [*, Hq, D]`` against ``k_cache [*, *, Hkv, D]``: same ``D >= 1``, ``Hq`` a multiple of ``Hkv >= 1``."""
    hq, d = q.shape[1:]
    hkv, dk = k_cache.shape[2:]
    if d < 1:
        raise ValueError(f"q head_dim must be >= 1, got shape {tuple(q.shape)}")
    if dk != d:
        raise ValueError(f"k_cache head_dim must equal q head_dim {d}, got {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache kv heads ({hkv}) for GQA")


def check_plan_args(page_table: object, cu_seqlens_q: object, lens: object, lens_name: str, page_size: object,
                    num_q_heads: object) -> None:
    """The arguments of the attention ops' ``plan_*`` functions (the op's request layout, without queries or cache)."""
    device = page_table.device if isinstance(page_table, torch.Tensor) else None
    check_paged_requests(lens_name, lens, page_table, cu_seqlens_q, None, page_size, None, device)
    if not is_int(num_q_heads) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")


def check_scaled_logits_finite(name: str, logits: torch.Tensor, row_temperature: torch.Tensor) -> None:
    """Each row ``logits[i]`` (finite) sampled at a temperature ``row_temperature[i] > 0`` must stay finite divided by
    it, the sampling ops' first step: a tiny temperature overflows float32 and the softmax would be NaN."""
    if not logits.numel():
        return
    peak = logits.detach().abs().amax(dim=1).float()
    t = row_temperature
    bad = (t > 0) & ~torch.isfinite(peak / torch.where(t > 0, t, torch.ones_like(t)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"temperature {float(t[i]):.3g} is too small for {name} row {i} (largest |logit| "
                         f"{float(peak[i]):.3g}): logits / temperature overflows float32; use a larger temperature, "
                         f"or 0 for greedy")
