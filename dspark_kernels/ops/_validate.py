"""Input checks shared by the public ops. Every failure names the argument and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


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
