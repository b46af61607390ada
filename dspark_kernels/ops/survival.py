"""Prefix survival and the hardware-aware verify-length selection (DSpark §3.2.2, Algorithm 1, §5.2 production).

Layout (ragged, R requests, N draft slots in all, gamma_max = the longest draft block):
    conf_logits            [N] float32               confidence-head logits, request r owns ``cu[r]:cu[r+1]``
    cu_num_draft_tokens    [R + 1] int32/int64       offsets ``cu``; slot i of request r is position j = i + 1
    position_temperatures  [gamma_max] float32 > 0   calibration temperature per position (None = 1 everywhere)
    position_biases        [gamma_max] float32       calibration bias per position, added after the temperature
                                                     (None = 0 everywhere; ``train.calibration``'s Platt scaling)
    survival               [N] float32 in [0, 1]     a[r, j] = prod_{i <= j} c[r, i], non-increasing in j
    sps_table              [Bmax + 1] float32 > 0    SPS(B), target steps/s at a verify batch of B tokens, index B;
                                                     entry 0 is unused; must reach B = R (Bmax >= R)
    verify_lens            [R] int32                 draft tokens to verify per request (the verify batch holds
                                                     ``B = sum_r (1 + l_r)`` tokens)

Semantics:
1. ``c[r, i] = sigmoid(logit[r, i] / T[i] + b[i])`` with T and b indexed by the slot's position inside its request.
2. Candidates are the slots with a > 0, sorted by a descending; ties go to the lower position j, then the lower
   request r. The tie-break never looks at values, and a request's slot j always precedes its slot j + 1, so any
   leading part of the order admits a prefix of every request.
3. Algorithm 1: start at ``l = 0, B = R, tau = R, Theta_best = R * SPS(R)``; admit candidates in order
   (``l_r = j, B += 1, tau += a``); keep the point while ``tau * SPS(B) > Theta_best`` and stop at the first
   candidate that does not strictly improve. A B past the table's last entry counts as not improving (the
   scheduler never extrapolates beyond the profiled range). tau and Theta are accumulated in float64.
   With ``lookahead = L > 1`` (the step-aware stop), a candidate ``a_k`` that does not raise Theta above the best
   point so far is still admitted when its outlook does: ``(tau_k + m a_k) SPS(B_k + m) > Theta_best`` for some
   ``1 <= m < L`` within the remaining candidates and the table, i.e. the next m candidates would pay if each were as
   good as it (an upper bound: they rank after it). The scan stays where it stopped (no return to the best point).
   On a profile whose step time ``1 / SPS(B)`` is convex in B (affine included) no outlook beats Theta where Theta
   does not, and the result is Algorithm 1's; on a staircase (a bf16 GEMM's 16-row tiles) it crosses a step that
   the candidates can pay for, where Algorithm 1 stops at the step's first row.
4. Top-K: admit the first ``min(K, #candidates)`` candidates of the same order.
5. Capacity (production): K = the number of candidates at the global argmax of Theta over the whole sorted path
   (no early stop; the first maximum on ties), computed from stale confidences.

On CUDA the ordering is one ``torch.sort`` on a unique int64 key; the Theta scan (float64 cumulative sum), the
first-non-improvement reduction and the scatter of lengths are Triton kernels, with no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autotune.store import launch_config
from ..reference.survival import (
    candidate_order,
    capacity_unconstrained_ref,
    prefix_survival_ref,
    select_verify_lengths_alg1_ref,
    select_verify_lengths_topk_ref,
    slot_maps,
    sps_runs,
)
from ._dispatch import resolve_impl
from ._layout import unit_inner_stride
from ._validate import INDEX_DTYPES, check_cu_seqlens, check_finite, check_shape, check_tensor, is_int

__all__ = [
    "capacity_unconstrained",
    "prefix_survival",
    "prefix_survival_triton",
    "select_verify_lengths_alg1",
    "select_verify_lengths_alg1_triton",
    "select_verify_lengths_topk",
    "select_verify_lengths_topk_triton",
]

# launch parameters by bucket, over which the autotune store's "survival" entries go: the per-request survival
# product is a scalar loop (one warp is enough); BLOCK = candidates per step of the Theta scan and per program of the
# first-drop and scatter kernels
_DEFAULTS = {"prefix": {"num_warps": 1}, "scan": {"BLOCK": 1024, "num_warps": 4}}


# --------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _prefix_survival_kernel(LOGITS, CU, TEMPS, BIASES, OUT, HAS_TEMPS: tl.constexpr, HAS_BIASES: tl.constexpr):
    """One program = one request: the running product of sigmoid(logit / T[pos] + b[pos]) over its slots, one slot
    at a time from the left (a request has at most a few dozen). Each ``a[j]`` is ``a[j - 1] * c[j]`` rounded once with
    ``c[j] <= 1``, so the survival never rises along a request; a parallel scan (``tl.cumprod`` on a GPU) multiplies
    in another order per lane and can round a later product 1 ulp above an earlier one, which breaks the
    prefix-closed candidate order Algorithm 1 relies on. The reference's sequential cumprod does the same products."""
    r = tl.program_id(0)
    start = tl.load(CU + r).to(tl.int64)
    length = tl.load(CU + r + 1).to(tl.int64) - start
    a = tl.full((), 1.0, tl.float32)
    for j in range(0, length):
        x = tl.load(LOGITS + start + j).to(tl.float32)
        if HAS_TEMPS:
            x = x / tl.load(TEMPS + j)
        if HAS_BIASES:
            x = x + tl.load(BIASES + j)
        e = tl.exp(-tl.abs(x))  # overflow-free sigmoid: exactly 0 for very negative logits
        c = tl.minimum(tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), 1.0)
        a = a * c
        tl.store(OUT + start + j, a)


@triton.jit
def _theta_scan_kernel(A_SORTED, SPS, THETA, TAU, N, R, BMAX, BLOCK: tl.constexpr):
    """Single program: ``TAU[k] = R + cumsum(a)[k-1]`` and ``THETA[k] = TAU[k] * SPS[R + k]`` for k = 0..N in
    float64, ``THETA[k] = -inf`` where the k-th candidate has a = 0 or ``R + k > BMAX``."""
    carry = tl.full((), 0.0, tl.float64)
    for off in range(0, N + 1, BLOCK):
        k = off + tl.arange(0, BLOCK)
        has_a = (k >= 1) & (k <= N)
        x = tl.load(A_SORTED + k - 1, mask=has_a, other=0.0).to(tl.float64)
        tau = R + carry + tl.cumsum(x, 0)
        batch = R + k
        in_table = batch <= BMAX
        sps = tl.load(SPS + batch, mask=in_table & (k <= N), other=1.0).to(tl.float64)
        valid = in_table & ((k == 0) | (x > 0.0))
        theta = tl.where(valid, tau * sps, float("-inf"))
        tl.store(THETA + k, theta, mask=k <= N)
        tl.store(TAU + k, tau, mask=k <= N)
        carry = carry + tl.sum(x, 0)


@triton.jit
def _first_drop_kernel(A_SORTED, TAU, BEST, SPS, RUN_INDEX, RUNS, COUNT, N, R, BMAX, LOOKAHEAD,
                       STEP_AWARE: tl.constexpr, BLOCK: tl.constexpr):
    """``COUNT = min k - 1`` over the candidates k in 1..N whose outlook ``max_{m < LOOKAHEAD} (TAU[k] + m a_k)
    SPS[R + k + m]`` (``m <= N - k``, ``R + k + m <= BMAX``, ``a_k > 0``) does not beat ``BEST[k - 1]``, the best
    Theta before them (atomic min; COUNT starts at N). ``m = 0`` is Theta itself; LOOKAHEAD 1 is Algorithm 1.

    A term never falls along a run of equal SPS, so with STEP_AWARE (LOOKAHEAD > 1) each lane visits one term per
    run of its window ``[R + k, last]`` (:func:`sps_runs`: the run's end, or ``last`` inside the last run): the loop
    runs as many times as the block's widest window has runs, not LOOKAHEAD times, with one 16-byte load a lane
    (run i's end and SPS) that does not depend on the loop's earlier loads. Without STEP_AWARE the window is
    ``R + k`` alone and the run tables are not read."""
    k = 1 + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = k <= N
    a = tl.load(A_SORTED + k - 1, mask=ok, other=0.0).to(tl.float64)
    tau = tl.load(TAU + k, mask=ok, other=0.0)
    best = tl.load(BEST + k - 1, mask=ok, other=0.0)
    first_b = R + k
    busy = ok & (a > 0.0) & (first_b <= BMAX)
    if STEP_AWARE:
        last_b = tl.minimum(tl.minimum(first_b + LOOKAHEAD - 1, R + N), BMAX)
        first_run = tl.load(RUN_INDEX + first_b, mask=busy, other=0)
        last_run = tl.load(RUN_INDEX + last_b, mask=busy, other=0)
        beats = tl.zeros((BLOCK,), dtype=tl.int1)
        for i in range(0, tl.max(tl.where(busy, last_run - first_run + 1, 0), 0)):
            run = first_run + i
            live = busy & (run <= last_run)
            pair = tl.load(RUNS + run[:, None] * 2 + tl.arange(0, 2)[None, :], mask=live[:, None], other=0.0)
            run_end, sps = tl.split(pair)
            end = tl.minimum(run_end.to(tl.int32), last_b)
            beats = beats | (live & ((tau + (end - first_b) * a) * sps > best))
    else:
        beats = busy & (tau * tl.load(SPS + first_b, mask=busy, other=1.0) > best)
    drop = ok & ~beats
    first = tl.min(tl.where(drop, k - 1, N), 0).to(tl.int32)
    tl.atomic_min(COUNT, first)


@triton.jit
def _scatter_lengths_kernel(A_SORTED, REQ_SORTED, POS_SORTED, COUNT, LENS, N, BLOCK: tl.constexpr):
    """``LENS[req] = max(j)`` over the first COUNT sorted candidates with a > 0 (atomic max; LENS starts at 0)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    count = tl.load(COUNT)
    ok = i < N
    a = tl.load(A_SORTED + i, mask=ok, other=0.0)
    admit = ok & (i < count) & (a > 0.0)
    req = tl.load(REQ_SORTED + i, mask=admit, other=0)
    j = tl.load(POS_SORTED + i, mask=admit, other=0).to(tl.int32) + 1
    tl.atomic_max(LENS + req, j, mask=admit)


# -------------------------------------------------------------------------------------------------------- launchers
def prefix_survival_triton(
    conf_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, position_temperatures: torch.Tensor | None,
    position_biases: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the per-request survival scan; same contract as :func:`prefix_survival_ref`."""
    r = cu_num_draft_tokens.numel() - 1
    out = torch.empty(conf_logits.shape, dtype=torch.float32, device=conf_logits.device)
    if conf_logits.numel() == 0 or r == 0:
        return out
    temps = position_temperatures if position_temperatures is not None else out
    biases = position_biases if position_biases is not None else out
    cfg = launch_config("survival", _DEFAULTS["prefix"], conf_logits.device, "prefix")
    _prefix_survival_kernel[(r,)](
        conf_logits.contiguous(), unit_inner_stride(cu_num_draft_tokens), unit_inner_stride(temps),
        unit_inner_stride(biases), out, HAS_TEMPS=position_temperatures is not None,
        HAS_BIASES=position_biases is not None, num_warps=cfg["num_warps"],
    )
    return out


def _theta_path_triton(a_sorted: torch.Tensor, num_requests: int, sps_table: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`theta_path` and :func:`tau_path`: the float64 Theta and tau along the sorted order,
    ``[N + 1]`` each."""
    n = a_sorted.numel()
    theta = torch.empty(n + 1, dtype=torch.float64, device=a_sorted.device)
    tau = torch.empty_like(theta)
    cfg = _scan_config(a_sorted.device)
    _theta_scan_kernel[(1,)](
        a_sorted, sps_table.double().contiguous(), theta, tau, n, num_requests, sps_table.numel() - 1,
        BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
    )
    return theta, tau


def _scan_config(device: torch.device) -> dict[str, int]:
    return launch_config("survival", _DEFAULTS["scan"], device, "scan")


def _scatter_lengths_triton(count: torch.Tensor, ordered: tuple[torch.Tensor, ...], num_requests: int) -> torch.Tensor:
    """Lengths ``[R]`` int32 from the first ``count`` (a ``[1]`` int32 device tensor) sorted candidates."""
    a_sorted, req_sorted, pos_sorted = ordered
    n = a_sorted.numel()
    lens = torch.zeros(num_requests, dtype=torch.int32, device=a_sorted.device)
    if n:
        cfg = _scan_config(a_sorted.device)
        _scatter_lengths_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](a_sorted, req_sorted, pos_sorted, count, lens, n,
                                                                  BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return lens


def select_verify_lengths_alg1_triton(
    survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sps_table: torch.Tensor, lookahead: int = 1
) -> torch.Tensor:
    """Sort (torch), Theta scan, its running max (torch), first drop and scatter (Triton); same contract as the
    reference. The first-drop kernel visits, per candidate, one term per run of equal SPS inside its outlook window
    of ``min(lookahead, N)`` B."""
    r = cu_num_draft_tokens.numel() - 1
    ordered = candidate_order(survival, cu_num_draft_tokens)
    n = survival.numel()
    count = torch.full((1,), n, dtype=torch.int32, device=survival.device)
    if n and r:
        table = sps_table.double().contiguous()
        theta, tau = _theta_path_triton(ordered[0], r, table)
        best = torch.cummax(theta, 0).values
        cfg = _scan_config(survival.device)
        step_aware = lookahead > 1
        runs = sps_runs(table) if step_aware else (count, table)  # unread by Algorithm 1's variant
        # no FMA contraction: an outlook term rounds tau + m a and then the product, as the reference's does
        _first_drop_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](ordered[0], tau, best, table, *runs, count, n, r,
                                                             table.numel() - 1, min(lookahead, n), step_aware,
                                                             BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
                                                             enable_fp_fusion=False)
    return _scatter_lengths_triton(count, ordered, r)


def select_verify_lengths_topk_triton(
    survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, budget: torch.Tensor
) -> torch.Tensor:
    """Sort (torch) and scatter of the first ``budget`` candidates (Triton)."""
    r = cu_num_draft_tokens.numel() - 1
    ordered = candidate_order(survival, cu_num_draft_tokens)
    count = budget.reshape(1).to(torch.int64).clamp(max=survival.numel()).to(torch.int32)
    return _scatter_lengths_triton(count, ordered, r)


# ----------------------------------------------------------------------------------------------------- validation
def _check_cu(cu: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    check_tensor("cu_num_draft_tokens", cu, ndim=1, dtypes=INDEX_DTYPES, device=device)
    return check_cu_seqlens("cu_num_draft_tokens", cu, n)


def _validate_survival_inputs(conf_logits, cu, temps, biases) -> None:
    check_tensor("conf_logits", conf_logits, ndim=1, dtypes=(torch.float32,))
    dev = conf_logits.device
    c = _check_cu(cu, conf_logits.numel(), dev)
    check_finite("conf_logits", conf_logits)
    longest = int((c[1:] - c[:-1]).max()) if c.numel() > 1 else 0
    for name, values in (("position_temperatures", temps), ("position_biases", biases)):
        if values is None:
            continue
        check_tensor(name, values, ndim=1, dtypes=(torch.float32,), device=dev)
        check_finite(name, values)
        if longest > values.numel():
            raise ValueError(f"{name} has {values.numel()} entries but a request has {longest} draft slots")
    if temps is not None and bool((temps <= 0).any()):
        raise ValueError(f"position_temperatures must be > 0, got {temps.tolist()}")


def _validate_survival(name: str, survival: torch.Tensor, cu: torch.Tensor) -> None:
    check_tensor(name, survival, ndim=1, dtypes=(torch.float32,))
    c = _check_cu(cu, survival.numel(), survival.device)
    check_finite(name, survival)
    if bool(((survival < 0) | (survival > 1)).any()):
        raise ValueError(f"{name} must lie in [0, 1]")
    req, _ = slot_maps(c.to(survival.device), survival.numel())
    same_req = req[1:] == req[:-1]
    if bool((same_req & (survival[1:] > survival[:-1])).any()):
        raise ValueError(f"{name} must be non-increasing within each request (a prefix survival)")


def _validate_sps_table(sps_table: torch.Tensor, num_requests: int, device: torch.device) -> None:
    check_tensor("sps_table", sps_table, ndim=1, dtypes=(torch.float32, torch.float64), device=device)
    if sps_table.numel() < num_requests + 1:
        raise ValueError(
            f"sps_table must cover B = R = {num_requests} (at least {num_requests + 1} entries, index = B), "
            f"got {sps_table.numel()}"
        )
    measured = sps_table[1:]
    check_finite("sps_table", measured)
    if bool((measured <= 0).any()):
        raise ValueError("sps_table entries 1..Bmax must be > 0 (steps per second)")


def _budget_tensor(budget: int | torch.Tensor, device: torch.device, check: bool) -> torch.Tensor:
    if isinstance(budget, torch.Tensor):
        if check:
            check_tensor("budget", budget, dtypes=INDEX_DTYPES, device=device)
            check_shape("budget", budget.reshape(-1), (1,))
        k = budget.reshape(1)
    elif is_int(budget):
        k = torch.tensor([budget], dtype=torch.int64, device=device)
    else:
        raise TypeError(f"budget must be an int or a [1] integer tensor, got {type(budget).__name__}")
    if check and int(k.item()) < 0:
        raise ValueError(f"budget must be >= 0, got {int(k.item())}")
    return k


# ------------------------------------------------------------------------------------------------------ public ops
def prefix_survival(
    conf_logits: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    position_temperatures: torch.Tensor | None = None,
    position_biases: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Calibrated prefix survival ``a [N]`` float32 of every draft slot; see the module docstring.

    Logits must be finite (use a very negative logit for a zero confidence: sigmoid underflows to exactly 0).
    ``check_inputs=False`` skips validation (host syncs) for hot loops and CUDA-graph capture.
    """
    if check_inputs:
        _validate_survival_inputs(conf_logits, cu_num_draft_tokens, position_temperatures, position_biases)
    if resolve_impl(impl, conf_logits.device) == "triton":
        return prefix_survival_triton(conf_logits, cu_num_draft_tokens, position_temperatures, position_biases)
    return prefix_survival_ref(conf_logits, cu_num_draft_tokens, position_temperatures, position_biases)


def select_verify_lengths_alg1(
    survival: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    sps_table: torch.Tensor,
    *,
    lookahead: int = 1,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """DSpark Algorithm 1 (greedy with early stop): verify lengths ``[R]`` int32; see the module docstring.

    The early stop is what keeps decoding lossless (App. A): whether slot (r, j) is admitted depends only on
    candidates ranked before it, never on a[r, j+1] (which depends on the sampled token x[r, j]).
    ``lookahead`` (int >= 1; 1 is the paper's Algorithm 1) turns on the step-aware stop (semantics 3): slot (r, j)'s
    outlook reads its own survival, the candidates before it and the number of slots N, so it stays a stopping rule
    and decoding stays lossless. The tensor path evaluates ``min(lookahead, N)`` terms per candidate; the first-drop
    kernel one per run of equal SPS inside each window, so its serial depth is the number of runs in the widest
    window: small on a fitted (measured) or tile-stepped profile, up to ``min(lookahead, N)`` on a strictly falling
    one (where, if step time is convex in B, lookahead 1 gives the same lengths). The host scan only looks ahead at
    a candidate that does not raise Theta.
    """
    if not is_int(lookahead) or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    if check_inputs:
        _validate_survival("survival", survival, cu_num_draft_tokens)
        _validate_sps_table(sps_table, cu_num_draft_tokens.numel() - 1, survival.device)
    r = cu_num_draft_tokens.numel() - 1
    if r == 0:
        return torch.zeros(0, dtype=torch.int32, device=survival.device)
    if resolve_impl(impl, survival.device) == "triton":
        return select_verify_lengths_alg1_triton(survival, cu_num_draft_tokens, sps_table, lookahead)
    return select_verify_lengths_alg1_ref(survival, cu_num_draft_tokens, sps_table, lookahead)


def select_verify_lengths_topk(
    survival: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Admit the top-``budget`` slots by survival (same order and tie-break as Algorithm 1); lengths ``[R]`` int32.

    ``budget`` is an int or a ``[1]`` integer tensor on the survival's device (no host sync when
    ``check_inputs=False``). Slots with a = 0 are never admitted; a budget beyond the candidates admits them all.
    """
    if check_inputs:
        _validate_survival("survival", survival, cu_num_draft_tokens)
    k = _budget_tensor(budget, survival.device, check_inputs)
    if resolve_impl(impl, survival.device) == "triton":
        return select_verify_lengths_topk_triton(survival, cu_num_draft_tokens, k)
    return select_verify_lengths_topk_ref(survival, cu_num_draft_tokens, k)


def capacity_unconstrained(
    survival_stale: torch.Tensor,
    cu_stale: torch.Tensor,
    sps_table: torch.Tensor,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Production capacity K ``[1]`` int64: the number of draft slots at the global argmax of ``tau * SPS(B)``.

    The whole sorted path is searched (no early stop; first maximum on ties), which handles a jagged SPS
    staircase that Algorithm 1 would stop on. The live step then calls :func:`select_verify_lengths_topk` with K.

    Why this stays lossless: ``survival_stale`` comes from the confidence head two rounds back, so K is a function
    of tokens that were already verified and of the SPS table, both fixed before the live drafts are sampled;
    given them, K is a constant for the live round. In the live top-K, slot (r, j) is admitted iff fewer than K
    candidates rank before it; those are other requests' slots (independent of request r's draft) and r's own
    slots i < j (a[r, i] depends on x[r, <i] only), because r's slots j' > j always rank after j. So the decision
    to verify x[r, j] is a function of x[r, <j] and independent data, never of x[r, j] itself or anything after
    it: the verify length is a stopping rule, and standard speculative sampling with it emits the target
    distribution. A global search on the live confidences would let x[r, j] (through a[r, j+1]) decide whether
    x[r, j] is verified, which biases the output (App. A).
    """
    if check_inputs:
        _validate_survival("survival_stale", survival_stale, cu_stale)
        _validate_sps_table(sps_table, cu_stale.numel() - 1, survival_stale.device)
    r = cu_stale.numel() - 1
    if r == 0:
        return torch.zeros(1, dtype=torch.int64, device=survival_stale.device)
    if resolve_impl(impl, survival_stale.device) == "triton":
        a_sorted, _, _ = candidate_order(survival_stale, cu_stale)
        return _theta_path_triton(a_sorted, r, sps_table)[0].argmax().reshape(1)
    return capacity_unconstrained_ref(survival_stale, cu_stale, sps_table)
