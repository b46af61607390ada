"""Reference for prefix survival and the verify-length selection (DSpark §3.2, Algorithm 1; production top-K).

Vectorised torch, no Python loop over requests and no host sync (Algorithm 1 also has a host scan, which the CPU path
takes for a few slots: :func:`alg1_host`). The semantics are documented in
:mod:`dspark_kernels.ops.survival`. The candidate ordering (:func:`candidate_order`) and the Theta path
(:func:`theta_path`) are shared with the Triton launcher, so both implementations scan the same sequence.
"""

from __future__ import annotations

import torch

_KEY_TOP = 0x7FFFFFFF  # largest float32 bit pattern of a non-negative number; inverts the order of a


def slot_maps(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``req [N]`` and 0-based position ``pos [N]`` of every flattened slot (int64, no host sync)."""
    r = cu.numel() - 1
    cu64 = cu.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(r, device=cu.device), cu64[1:] - cu64[:-1], output_size=n)
    return req, torch.arange(n, device=cu.device) - cu64[req]


def prefix_survival_ref(
    conf_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, position_temperatures: torch.Tensor | None,
    position_biases: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a[r, j] = prod_{i <= j} sigmoid(logit[r, i] / T[i] + b[i])`` over each request's slots; ``[N]`` float32
    (``T`` = 1 and ``b`` = 0 where None).

    On the CPU, when every request has the same number of slots (a serving round's drafts), the slots already form
    the dense ``[R, width]`` matrix :func:`prefix_survival_ragged` builds, so the same three ops run on a view of them
    (bit for bit the same result, without its index maps: about 10 instead of 60 us a round)."""
    n = conf_logits.numel()
    r = cu_num_draft_tokens.numel() - 1
    if conf_logits.device.type == "cpu" and cu_num_draft_tokens.device.type == "cpu" and r and n and n % r == 0:
        width = n // r
        if cu_num_draft_tokens.tolist() == list(range(0, n + 1, width)):
            logits = conf_logits.float().view(r, width)
            if position_temperatures is not None:
                logits = logits / position_temperatures.float()[:width]
            if position_biases is not None:
                logits = logits + position_biases.float()[:width]
            return torch.sigmoid(logits).cumprod(dim=1).view(n)
    return prefix_survival_ragged(conf_logits, cu_num_draft_tokens, position_temperatures, position_biases)


def prefix_survival_ragged(
    conf_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, position_temperatures: torch.Tensor | None,
    position_biases: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`prefix_survival_ref` for any offsets, as tensor ops (no host sync): the slots scattered into a dense
    ``[R, width]`` matrix padded with ones, its cumulative product along the slots, gathered back."""
    n = conf_logits.numel()
    r = cu_num_draft_tokens.numel() - 1
    req, pos = slot_maps(cu_num_draft_tokens, n)
    logits = conf_logits.float()
    if position_temperatures is not None:
        logits = logits / position_temperatures.float()[pos]
    if position_biases is not None:
        logits = logits + position_biases.float()[pos]
    width = int(pos.max()) + 1 if n else 0
    dense = torch.ones(r, width, dtype=torch.float32, device=conf_logits.device)
    dense[req, pos] = torch.sigmoid(logits)
    return dense.cumprod(dim=1)[req, pos]


def candidate_order(survival: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort every slot by survival, highest first; ties by lower position j, then lower request r.

    The tie-break uses only (j, r), never the values, and puts a request's slot j before its slot j + 1, so with a
    non-increasing survival per request every prefix of the order is prefix-closed. One int64 sort on the key
    ``(0x7FFFFFFF - bits(a)) << 32 | (j * R + r)`` (unique keys, so stability does not matter). Slots with a = 0
    sort last. Returns ``a_sorted [N]`` float32, ``req_sorted [N]`` and ``pos_sorted [N]`` (0-based j) int64.
    """
    n = survival.numel()
    r = cu.numel() - 1
    req, pos = slot_maps(cu, n)
    a = survival.float() + 0.0  # -0.0 -> +0.0, so the bit pattern is a non-negative int32
    bits = a.view(torch.int32).to(torch.int64)
    key = ((_KEY_TOP - bits) << 32) | (pos * r + req)
    order = torch.sort(key).indices
    return a[order], req[order], pos[order]


def tau_path(a_sorted: torch.Tensor, num_requests: int) -> torch.Tensor:
    """Expected tokens after admitting the first k sorted candidates, k = 0..N: ``R + sum_{i<k} a_sorted[i]``
    (cumulative sum in float64); ``[N + 1]`` float64."""
    zero = torch.zeros(1, dtype=torch.float64, device=a_sorted.device)
    return num_requests + torch.cat([zero, a_sorted.double().cumsum(0)])


def theta_path(a_sorted: torch.Tensor, num_requests: int, sps_table: torch.Tensor) -> torch.Tensor:
    """Theta after admitting the first k sorted candidates, k = 0..N; ``[N + 1]`` float64.

    ``theta[k] = tau[k] * SPS(R + k)`` (:func:`tau_path`). Entries where the candidate has a = 0 or ``R + k`` lies
    past the table's last entry are ``-inf`` (never an improvement).
    """
    n = a_sorted.numel()
    bmax = sps_table.numel() - 1
    k = torch.arange(n + 1, device=a_sorted.device)
    batch = num_requests + k
    tau = tau_path(a_sorted, num_requests)
    positive = torch.cat([torch.ones(1, dtype=torch.bool, device=a_sorted.device), a_sorted > 0])
    sps = sps_table.double()[batch.clamp(max=bmax)]
    return torch.where(positive & (batch <= bmax), tau * sps, float("-inf"))


def sps_runs(sps_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's runs of equal steps/s, numbered from 0 along B: ``run_index [Bmax + 1]`` int32 (B's run) and
    ``runs [Bmax + 1, 2]`` float64, row i = (run i's last B, run i's SPS), so one 16-byte load reads both; rows past
    the last run are unused. No host synchronisation.

    An outlook term ``(tau + m a) SPS(B + m)`` with ``a > 0`` never falls along a run (float64 rounding is
    monotone), so its maximum over a window of B is taken at the end of a run, or at the window's last B, which
    shares its run's SPS: the first-drop kernel visits the runs of each window alone. A fitted, non-increasing
    profile pools its measurement noise into flat runs, and a GEMM's tiles make steps."""
    n = sps_table.numel()
    table = sps_table.double()
    starts = torch.ones(n, dtype=torch.int64, device=sps_table.device)
    starts[1:] = (table[1:] != table[:-1]).to(torch.int64)
    run_index = starts.cumsum(0) - 1
    runs = torch.zeros(n, 2, dtype=torch.float64, device=sps_table.device)
    runs[:, 0].scatter_reduce_(0, run_index, torch.arange(n, dtype=torch.float64, device=sps_table.device),
                               reduce="amax")
    runs[:, 1].scatter_(0, run_index, table)
    return run_index.to(torch.int32), runs


OUTLOOK_TILE = 64  # outlook terms per candidate in one tile of projected_theta


def projected_theta(a_sorted: torch.Tensor, num_requests: int, sps_table: torch.Tensor, lookahead: int
                    ) -> torch.Tensor:
    """The step-aware stop's outlook at every candidate, ``[N + 1]`` float64 (entry 0 unused, ``-inf``).

    ``proj[k] = max_{0 <= m < M_k} (tau[k] + m * a_k) * SPS(R + k + m)`` for the k-th candidate ``a_k`` (1-based):
    Theta once it is admitted and, optimistically, the next ``m`` candidates too as if each had its survival (an
    upper bound: they have at most that much). ``M_k = min(lookahead, N - k + 1)``, and terms with ``R + k + m``
    past the table's last entry are left out; ``-inf`` where ``a_k = 0`` or no term is left. ``m = 0`` is
    ``theta[k]`` bit for bit. Works on ``[N, OUTLOOK_TILE]`` float64 tiles of the terms."""
    n = a_sorted.numel()
    bmax = sps_table.numel() - 1
    dev = a_sorted.device
    tau = tau_path(a_sorted, num_requests)[1:, None]
    a = a_sorted.double()[:, None]
    k = torch.arange(1, n + 1, device=dev)[:, None]
    table = sps_table.double()
    proj = torch.full((n + 1,), float("-inf"), dtype=torch.float64, device=dev)
    for start in range(0, min(lookahead, n), OUTLOOK_TILE):
        m = torch.arange(start, min(start + OUTLOOK_TILE, lookahead, n), device=dev)[None, :]
        batch = num_requests + k + m
        valid = (a > 0) & (batch <= bmax) & (k + m <= n)
        terms = (tau + m.double() * a) * table[batch.clamp(max=bmax)]
        proj[1:] = torch.maximum(proj[1:], torch.where(valid, terms, float("-inf")).amax(dim=1))
    return proj


def lengths_from_count(
    count: torch.Tensor, a_sorted: torch.Tensor, req_sorted: torch.Tensor, pos_sorted: torch.Tensor, num_requests: int
) -> torch.Tensor:
    """Admit the first ``count`` sorted candidates with a > 0; ``l_r`` = the largest admitted j; ``[R]`` int32."""
    n = a_sorted.numel()
    admitted = (torch.arange(n, device=a_sorted.device) < count) & (a_sorted > 0)
    lens = torch.zeros(num_requests, dtype=torch.int64, device=a_sorted.device)
    lens.scatter_reduce_(0, req_sorted, torch.where(admitted, pos_sorted + 1, 0), reduce="amax")
    return lens.to(torch.int32)


HOST_SLOTS = 256  # on the CPU, Algorithm 1, capacity and top-K over at most this many slots run as Python scans


def select_verify_lengths_alg1_ref(
    survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sps_table: torch.Tensor, lookahead: int = 1
) -> torch.Tensor:
    """Algorithm 1: admit along the sorted order while Theta improves; stop at the first candidate that does not.
    With ``lookahead > 1``, the step-aware stop (:mod:`dspark_kernels.ops.survival`, semantics 3).

    CPU tensors with at most ``HOST_SLOTS`` slots take :func:`alg1_host` (the same result; a serving round's few dozen
    slots cost less as a Python scan than as the ~40 small tensor ops of :func:`alg1_vectorised`)."""
    if _on_host(survival):
        return alg1_host(survival, cu_num_draft_tokens, sps_table, lookahead)
    return alg1_vectorised(survival, cu_num_draft_tokens, sps_table, lookahead)


def alg1_vectorised(survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sps_table: torch.Tensor,
                    lookahead: int = 1) -> torch.Tensor:
    """Algorithm 1 as tensor ops (no host sync): :func:`candidate_order`, :func:`theta_path`, the best Theta so far
    (a running max), each candidate's outlook (:func:`projected_theta`; Theta itself when ``lookahead`` is 1) and
    the leading run of candidates whose outlook beats the best before them."""
    r = cu_num_draft_tokens.numel() - 1
    a_sorted, req_sorted, pos_sorted = candidate_order(survival, cu_num_draft_tokens)
    theta = theta_path(a_sorted, r, sps_table)
    outlook = theta if lookahead == 1 else projected_theta(a_sorted, r, sps_table, lookahead)
    improves = outlook[1:] > torch.cummax(theta, 0).values[:-1]
    count = improves.to(torch.int64).cumprod(0).sum()  # length of the leading run of improvements
    return lengths_from_count(count, a_sorted, req_sorted, pos_sorted, r)


def _host_order(survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor) -> tuple[int, list[tuple[float, int, int]]]:
    """:func:`candidate_order` on the host: ``(R, [(-a, j, r)] sorted)`` (float32 values compare as their bit
    patterns do; ties by lower j, then lower r)."""
    a = (survival.float() + 0.0).tolist()
    cu = cu_num_draft_tokens.tolist()
    r = len(cu) - 1
    return r, sorted((-a[i], i - cu[q], q) for q in range(r) for i in range(cu[q], cu[q + 1]))


def _host_table(sps_table: torch.Tensor, r: int, n: int) -> list[float]:
    """The SPS table up to ``B = min(Bmax, R + N)`` as float64 host values (a scan of N candidates reads no further;
    ``len - 1`` is the last B it may admit)."""
    return sps_table[: min(sps_table.numel() - 1, r + n) + 1].double().tolist()


def _host_path(order: list[tuple[float, int, int]], r: int, table: list[float]):
    """:func:`tau_path` and :func:`theta_path` on the host, lazily: ``(tau_k, theta_k)`` for k = 0..N (theta ``-inf``
    for a zero survival or past ``table``, from :func:`_host_table`), the running sum in float64 in the sorted order
    as ``cumsum`` adds it."""
    last = len(table) - 1
    yield float(r), r * table[r] if r <= last else float("-inf")
    total = 0.0
    for k, (neg_a, _, _) in enumerate(order, 1):
        total += -neg_a
        tau = r + total
        yield tau, tau * table[r + k] if neg_a < 0 and r + k <= last else float("-inf")


def _host_lengths(order: list[tuple[float, int, int]], count: int, r: int) -> torch.Tensor:
    """:func:`lengths_from_count` on the host: ``[R]`` int32 on the CPU."""
    lens = [0] * r
    for neg_a, pos, q in order[:count]:
        if neg_a < 0:
            lens[q] = max(lens[q], pos + 1)
    return torch.tensor(lens, dtype=torch.int32)


def alg1_host(survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sps_table: torch.Tensor,
              lookahead: int = 1) -> torch.Tensor:
    """Algorithm 1 as a Python scan over host values, bit for bit :func:`alg1_vectorised` (CPU tensors only).

    Same order (survival high first, then lower j, then lower r; float32 values compare as their bit patterns do),
    same float64 Theta (``R + running sum``, summed in the sorted order as ``cumsum`` does), same stop: a candidate
    is admitted while its outlook (Theta, and with ``lookahead > 1`` the terms of :func:`projected_theta`, tried only
    when Theta alone does not beat the best so far) beats the best Theta before it; ``[R]`` int32 on the CPU."""
    r, order = _host_order(survival, cu_num_draft_tokens)
    n, table = len(order), _host_table(sps_table, r, len(order))
    path = _host_path(order, r, table)
    best, count = next(path)[1], 0
    for k, (tau, theta) in enumerate(path, 1):
        if not theta > best:
            a, span = -order[k - 1][0], min(lookahead, n - k + 1, len(table) - r - k)
            if a <= 0 or not any((tau + m * a) * table[r + k + m] > best for m in range(1, span)):
                break
        best, count = max(best, theta), count + 1
    return _host_lengths(order, count, r)


def topk_host(survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """:func:`select_verify_lengths_topk_ref`'s tensor path as a host scan, bit for bit (CPU tensors only)."""
    r, order = _host_order(survival, cu_num_draft_tokens)
    return _host_lengths(order, max(int(budget.reshape(())), 0), r)


def capacity_host(survival_stale: torch.Tensor, cu_stale: torch.Tensor, sps_table: torch.Tensor) -> torch.Tensor:
    """:func:`capacity_unconstrained_ref`'s tensor path as a host scan, bit for bit: the first k maximising Theta
    over the whole sorted path; ``[1]`` int64 on the CPU."""
    r, order = _host_order(survival_stale, cu_stale)
    thetas = [theta for _, theta in _host_path(order, r, _host_table(sps_table, r, len(order)))]
    return torch.tensor([thetas.index(max(thetas))], dtype=torch.int64)


def _on_host(survival: torch.Tensor) -> bool:
    """A CPU call small enough for the host scans (a serving round's few dozen slots cost less as a Python scan than
    as the ~20-40 small tensor ops of the vectorised paths)."""
    return survival.device.type == "cpu" and survival.numel() <= HOST_SLOTS


def select_verify_lengths_topk_ref(
    survival: torch.Tensor, cu_num_draft_tokens: torch.Tensor, budget: torch.Tensor
) -> torch.Tensor:
    """Admit the ``budget`` highest-survival slots (a > 0 only) in the candidate order (a small CPU call: the host
    scan :func:`topk_host`)."""
    if _on_host(survival):
        return topk_host(survival, cu_num_draft_tokens, budget)
    r = cu_num_draft_tokens.numel() - 1
    a_sorted, req_sorted, pos_sorted = candidate_order(survival, cu_num_draft_tokens)
    return lengths_from_count(budget.reshape(()), a_sorted, req_sorted, pos_sorted, r)


def capacity_unconstrained_ref(
    survival_stale: torch.Tensor, cu_stale: torch.Tensor, sps_table: torch.Tensor
) -> torch.Tensor:
    """The k maximising Theta over the whole sorted path (no early stop; first maximum on ties); ``[1]`` int64 (a
    small CPU call: the host scan :func:`capacity_host`)."""
    if _on_host(survival_stale):
        return capacity_host(survival_stale, cu_stale, sps_table)
    r = cu_stale.numel() - 1
    a_sorted, _, _ = candidate_order(survival_stale, cu_stale)
    return theta_path(a_sorted, r, sps_table).argmax().reshape(1)
