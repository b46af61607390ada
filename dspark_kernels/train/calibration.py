"""Confidence calibration: recorder metrics, per-position Platt scaling and Sequential Temperature Scaling (DSpark
§3.2.1, brief §4 and §6).

Data (from ``speculative_generate(..., record_traces=True)``, n rounds, verify length gamma):
    conf_logits   [n, gamma] float   raw confidence logits z_k, k = 1..gamma; c_k = sigmoid(z_k / T_k + b_k) is the
                                     probability that draft k is accepted given drafts 1..k-1 were accepted
    accepted      [n] int in [0, gamma]   drafts accepted that round
    temperatures  [gamma] float > 0  temperature per position, dividing the logit (1 = uncalibrated)
    biases        [gamma] float      bias per position, added after the temperature (0 = uncalibrated; STS fits none)

Derived, per round and position j = 1..gamma:
    survival a_j = prod_{i <= j} c_i      (the scheduler's prefix-survival prediction, as ``ops.prefix_survival``)
    label    y_j = [accepted >= j]        (the realised prefix-acceptance event)

Metrics (DeepSpec's recorder, ``eval/dspark/confidence_head.py``, with an exact AUROC):
* ECE: 20 equal-width bins over [0, 1], predictions clamped to [1e-8, 1 - 1e-8], bin gaps |mean p - mean y|
  weighted by bin counts; a prediction of exactly 1 goes to the last bin.
* AUROC: exact Mann-Whitney statistic with average ranks for tied predictions (a tie between a positive and a
  negative counts 1/2). It is ``nan`` when the labels are all one class (no pair to rank).
* Brier: mean (p - y)^2 of the unclamped prediction.
* ECE floor: the mean ECE of labels drawn as Bernoulli(p) from the same predictions, i.e. what a perfectly
  calibrated head scores on this many rounds; about 0.4 * sqrt(occupied bins / n) for predictions near 1/2.
``cumulative`` metrics score a_j against y_j over all rounds; ``conditional`` metrics score c_j against y_j on the
rounds with ``accepted >= j - 1`` (where draft j was actually on trial). Empty sets give ``nan`` everywhere.
Unlike DeepSpec's recorder, positions after an accepted EOS are not dropped: ``accepted`` is the verifier's count,
which does not look at EOS (a small effect at the end of each request).

Platt scaling (the default): for each position k on its own, ``(1 / T_k, b_k)`` is the maximum-likelihood logistic
regression of the label ``[accepted >= k]`` on ``z_k`` over the rounds where draft k was on trial (``accepted >= k -
1``: the event c_k predicts), with a Gaussian prior ``l2 / 2 * ((1 / T_k - 1)^2 + b_k^2)`` on the log-likelihood
(the identity map is the prior's centre; it keeps a position with few or one-class rounds finite and leaves an empty
one at T = 1, b = 0), by damped Newton steps; ``1 / T_k`` is kept in [1/8, 8] as the STS grid is. A temperature alone
rescales the logit around 0, so it cannot move a head whose mean prediction sits above its acceptance rate while its
ranking is right; the bias does.

STS: for k = 1..gamma in order, T_k is the grid temperature minimising the ECE of a_k against y_k with T_1..T_{k-1}
already fixed. Grid: 2^(i/10), i = -30..30 (61 values, 0.125..8, including 1). Ties (ECE within ``1e-12``) go to
T = 1, then to the smaller |log T|, then to the smaller T. Temperature scaling of one position keeps the ranking of
the conditional c_k; the ranking of the cumulative a_k can change (it mixes positions with different T).

File: ``calibration.json`` inside the drafter directory::

    {"format": "dspark-calibration-v2", "method": "platt" | "sts", "gamma": G,
     "temperatures": [G positive finite floats], "biases": [G finite floats],
     "metrics_before": {...}, "metrics_after": {...}, "meta": {...}}

The loaders also read the temperature-only ``"dspark-sts-v1"`` file (no ``method``, no ``biases``).

CLI: ``python -m dspark_kernels.train.calibration --drafter dspark_kernels/assets/drafters/dspark --gamma 15``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..cli_args import (
    DRAFT_VOCAB_HELP,
    draft_vocab_choice,
    missing_inputs_are_usage_errors,
    model_source,
    non_negative_float,
    positive_float,
    positive_int,
)
from ..models.registry import is_shipped_drafter

__all__ = [
    "CALIBRATION_FILE",
    "CalibrationMetrics",
    "DrafterCalibration",
    "PositionMetrics",
    "auroc",
    "brier_score",
    "calibration_metrics",
    "cumulative_survival",
    "ece_noise_floor",
    "expected_calibration_error",
    "fit_platt",
    "fit_sts",
    "format_table",
    "load_biases",
    "load_calibration",
    "load_mean_survival",
    "load_temperatures",
    "save_calibration",
    "split_by_request",
    "sts_grid",
]

CALIBRATION_FILE = "calibration.json"
FORMAT = "dspark-calibration-v2"
FORMAT_V1 = "dspark-sts-v1"  # temperatures only; still read
METHODS = ("platt", "sts")
PLATT_L2 = 1.0
SCALE_RANGE = (0.125, 8.0)  # 1 / T of a Platt fit, as the STS grid's range
ECE_BINS = 20
CLAMP_EPS = 1e-8
TIE_TOL = 1e-12


# ------------------------------------------------------------------------------------------------- scalar metrics
def _as_1d(name: str, x) -> np.ndarray:
    """Any array-like / tensor -> float64 ``[n]``."""
    arr = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def expected_calibration_error(pred, label, bins: int = ECE_BINS) -> float:
    """ECE of predictions ``pred [n]`` in [0, 1] against 0/1 ``label [n]``: equal-width bins, count-weighted.

    Predictions are clamped to [1e-8, 1 - 1e-8]; bin b holds p in [b/bins, (b+1)/bins). ``nan`` when n = 0.
    """
    p = np.clip(_as_1d("pred", pred), CLAMP_EPS, 1.0 - CLAMP_EPS)
    y = _as_1d("label", label)
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, weights=p, minlength=bins) - np.bincount(idx, weights=y, minlength=bins))
    # sum_b (n_b / n) * |mean_b(p) - mean_b(y)| = sum_b |sum_b(p) - sum_b(y)| / n
    return float(gap.sum() / count.sum())


def ece_noise_floor(pred, bins: int = ECE_BINS, draws: int = 64, seed: int = 0) -> float:
    """Expected ECE of a *perfectly calibrated* predictor that makes the predictions ``pred [n]``: the mean ECE over
    ``draws`` label sets drawn as ``y ~ Bernoulli(pred)`` (seeded). A measured ECE near this value is sampling
    noise, not miscalibration; it shrinks as 1/sqrt(n). ``nan`` when n = 0."""
    p = np.clip(_as_1d("pred", pred), 0.0, 1.0)
    if p.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([expected_calibration_error(p, rng.random(p.size) < p, bins) for _ in range(draws)]))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x [n]``, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]  # group g spans sorted slots [starts[g], ends[g])
    group_rank = (starts + 1 + ends) / 2.0  # mean of the 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(group_rank, ends - starts)
    return ranks


def auroc(pred, label) -> float:
    """Exact AUROC of scores ``pred [n]`` for 0/1 ``label [n]`` (Mann-Whitney U / (n_pos n_neg), ties = 1/2).

    ``nan`` when the labels are all one class (or n = 0): no positive/negative pair exists.
    """
    p, y = _as_1d("pred", pred), _as_1d("label", label) > 0.5
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum = _average_ranks(p)[y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier_score(pred, label) -> float:
    """Mean squared error of ``pred [n]`` against 0/1 ``label [n]``; ``nan`` when n = 0."""
    p, y = _as_1d("pred", pred), _as_1d("label", label)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


# ------------------------------------------------------------------------------------------ per-position metrics
@dataclass
class PositionMetrics:
    """Metrics of one position j (1-based) over ``n`` scored rounds, ``positives`` of them with label 1."""

    position: int
    n: int
    positives: int
    mean_pred: float
    mean_label: float
    ece: float
    ece_floor: float
    auroc: float
    brier: float

    @classmethod
    def of(cls, position: int, pred: np.ndarray, label: np.ndarray, bins: int = ECE_BINS) -> PositionMetrics:
        """Score ``pred [m]`` against ``label [m]`` (m may be 0: everything but the counts is ``nan``)."""
        n = int(pred.size)
        return cls(
            position=position, n=n, positives=int(label.sum()),
            mean_pred=float(pred.mean()) if n else float("nan"),
            mean_label=float(label.mean()) if n else float("nan"),
            ece=expected_calibration_error(pred, label, bins), ece_floor=ece_noise_floor(pred, bins),
            auroc=auroc(pred, label),
            brier=brier_score(pred, label),
        )


@dataclass
class CalibrationMetrics:
    """``cumulative[j-1]``: a_j vs y_j over all rounds; ``conditional[j-1]``: c_j vs y_j where accepted >= j-1."""

    cumulative: list[PositionMetrics]
    conditional: list[PositionMetrics]

    def to_dict(self) -> dict:
        """JSON-ready dict; ``nan`` becomes ``None``."""
        return {kind: [{k: _json_float(v) for k, v in asdict(m).items()} for m in getattr(self, kind)]
                for kind in ("cumulative", "conditional")}

    def mean_ece(self) -> float:
        """Mean cumulative ECE over the positions that have data."""
        vals = [m.ece for m in self.cumulative if not math.isnan(m.ece)]
        return float(np.mean(vals)) if vals else float("nan")


def _json_float(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _check_logits(conf_logits) -> np.ndarray:
    """Validate and convert ``conf_logits [n, gamma]`` (gamma >= 1, finite) to float64."""
    z = np.asarray(conf_logits.detach().cpu() if isinstance(conf_logits, torch.Tensor) else conf_logits,
                   dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 1:
        raise ValueError(f"conf_logits must be [rounds, gamma] with gamma >= 1, got shape {z.shape}")
    if not np.isfinite(z).all():
        raise ValueError("conf_logits must be finite")
    return z


def _check_traces(conf_logits, accepted) -> tuple[np.ndarray, np.ndarray]:
    """Validate and convert: ``conf_logits [n, gamma]`` float64 finite, ``accepted [n]`` int64 in [0, gamma]."""
    z = _check_logits(conf_logits)
    acc = np.asarray(accepted.detach().cpu() if isinstance(accepted, torch.Tensor) else accepted)
    if acc.shape != (z.shape[0],):
        raise ValueError(f"accepted must be [rounds] = [{z.shape[0]}], got shape {acc.shape}")
    if acc.size and (not np.array_equal(acc, np.round(acc)) or acc.min() < 0 or acc.max() > z.shape[1]):
        raise ValueError(f"accepted must hold integers in [0, gamma = {z.shape[1]}]")
    return z, acc.astype(np.int64)


def _check_per_position(values, gamma: int, name: str, default: float, positive: bool) -> np.ndarray:
    """``None`` -> ``[gamma]`` filled with ``default``; otherwise ``[gamma]`` finite float64, positive where
    ``positive``; ``ValueError`` naming ``name`` otherwise."""
    if values is None:
        return np.full(gamma, default)
    v = _as_1d(name, values)
    if v.size != gamma or not np.isfinite(v).all() or (positive and (v <= 0).any()):
        kind = "positive finite" if positive else "finite"
        raise ValueError(f"{name} must be {gamma} {kind} values, got {v.tolist()}")
    return v


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic in float64."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _confidences(z: np.ndarray, temperatures, biases) -> np.ndarray:
    """Calibrated conditional confidences ``c [n, gamma] = sigmoid(z / T + b)`` float64."""
    gamma = z.shape[1]
    return _sigmoid(z / _check_per_position(temperatures, gamma, "temperatures", 1.0, positive=True)
                    + _check_per_position(biases, gamma, "biases", 0.0, positive=False))


def cumulative_survival(conf_logits, temperatures=None, biases=None) -> np.ndarray:
    """Prefix survival ``a [n, gamma]`` float64: a[:, j-1] = prod_{i <= j} sigmoid(z_i / T_i + b_i)."""
    return np.cumprod(_confidences(_check_logits(conf_logits), temperatures, biases), axis=1)


def calibration_metrics(conf_logits, accepted, temperatures=None, bins: int = ECE_BINS,
                        biases=None) -> CalibrationMetrics:
    """Per-position cumulative and conditional metrics of traces ``conf_logits [n, gamma]``, ``accepted [n]``
    under ``temperatures [gamma]`` and ``biases [gamma]`` (None = raw head)."""
    z, acc = _check_traces(conf_logits, accepted)
    c = _confidences(z, temperatures, biases)
    a = np.cumprod(c, axis=1)
    cum, cond = [], []
    for j in range(1, z.shape[1] + 1):
        y = (acc >= j).astype(np.float64)
        on_trial = acc >= j - 1
        cum.append(PositionMetrics.of(j, a[:, j - 1], y, bins))
        cond.append(PositionMetrics.of(j, c[on_trial, j - 1], y[on_trial], bins))
    return CalibrationMetrics(cum, cond)


# ----------------------------------------------------------------------------------------------------------- STS
def sts_grid() -> np.ndarray:
    """The 61 grid temperatures ``2^(i/10)``, i = -30..30, ascending ``[61]`` float64 (index 30 is exactly 1)."""
    return np.exp2(np.arange(-30, 31) / 10.0)


def _pick_temperature(eces: np.ndarray, grid: np.ndarray) -> int:
    """Index of the best grid entry: minimal ECE (within ``TIE_TOL``), then T = 1, smaller |log T|, smaller T."""
    best = np.flatnonzero(eces <= np.nanmin(eces) + TIE_TOL)
    # |log2 T| rounded so that T and 1/T of the grid tie exactly despite floating point
    return int(min(best, key=lambda i: (grid[i] != 1.0, round(abs(math.log2(grid[i])), 9), grid[i])))


def fit_sts(conf_logits, accepted, grid=None, bins: int = ECE_BINS) -> torch.Tensor:
    """Sequential Temperature Scaling: temperatures ``[gamma]`` float32 for traces ``conf_logits [n, gamma]``,
    ``accepted [n]``.

    For k = 1..gamma, T_k = argmin over ``grid`` of ECE(a_k, y_k) with a_k = a_{k-1} * sigmoid(z_k / T_k) and
    T_1..T_{k-1} fixed (ties: see the module docstring). A position with no rounds keeps T = 1.
    """
    z, acc = _check_traces(conf_logits, accepted)
    grid = sts_grid() if grid is None else _check_per_position(grid, np.size(grid), "grid", 1.0, positive=True)
    a_prev = np.ones(z.shape[0])
    temps = np.ones(z.shape[1])
    for k in range(z.shape[1]):
        if z.shape[0] == 0:
            break
        y = (acc >= k + 1).astype(np.float64)
        eces = np.array([expected_calibration_error(a_prev * _sigmoid(z[:, k] / t), y, bins) for t in grid])
        temps[k] = grid[_pick_temperature(eces, grid)]
        a_prev = a_prev * _sigmoid(z[:, k] / temps[k])
    return torch.tensor(temps, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ Platt scaling
def _platt_objective(w: np.ndarray, x: np.ndarray, y: np.ndarray, l2: float) -> float:
    """Negative log-likelihood of ``y`` under ``sigmoid(w[0] x + w[1])`` plus the prior ``l2/2 |w - (1, 0)|^2``."""
    u = w[0] * x + w[1]
    nll = np.logaddexp(0.0, u).sum() - (y * u).sum()  # sum of log(1 + e^u) - y u, overflow-free
    return float(nll + 0.5 * l2 * ((w[0] - 1.0) ** 2 + w[1] ** 2))


def _fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, scale: float | None = None, iters: int = 100
                  ) -> np.ndarray:
    """``(scale, bias)`` minimising :func:`_platt_objective` (strictly convex for ``l2 > 0``), or only the bias at a
    fixed ``scale``: Newton steps halved until the objective does not rise, from the identity ``(1, 0)``."""
    free = [0, 1] if scale is None else [1]
    w = np.array([1.0 if scale is None else float(scale), 0.0])
    f = _platt_objective(w, x, y, l2)
    for _ in range(iters):
        p = _sigmoid(w[0] * x + w[1])
        q = p * (1.0 - p)
        grad = np.array([((p - y) * x).sum() + l2 * (w[0] - 1.0), (p - y).sum() + l2 * w[1]])[free]
        hess = np.array([[(q * x * x).sum() + l2, (q * x).sum()], [(q * x).sum(), q.sum() + l2]])[np.ix_(free, free)]
        step = np.zeros(2)
        step[free] = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6:
            cand = w - t * step
            f_cand = _platt_objective(cand, x, y, l2)
            if f_cand <= f:
                break
            t *= 0.5
        else:
            break  # no descent along the Newton direction: at the optimum up to rounding
        w, f = cand, f_cand
        if np.abs(t * step).max() < 1e-10:
            break
    return w


def fit_platt(conf_logits, accepted, l2: float = PLATT_L2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position Platt scaling: ``(temperatures [gamma], biases [gamma])`` float32 for traces ``conf_logits [n,
    gamma]``, ``accepted [n]`` (see the module docstring). ``l2 > 0`` is the prior's weight, in rounds' worth of
    log-likelihood."""
    z, acc = _check_traces(conf_logits, accepted)
    if not (isinstance(l2, (int, float)) and math.isfinite(l2) and l2 > 0):
        raise ValueError(f"l2 must be a positive finite number, got {l2!r}")
    temps, biases = np.ones(z.shape[1]), np.zeros(z.shape[1])
    for k in range(z.shape[1]):
        on_trial = acc >= k
        x, y = z[on_trial, k], (acc[on_trial] >= k + 1).astype(np.float64)
        w = _fit_logistic(x, y, float(l2))
        scale = float(np.clip(w[0], *SCALE_RANGE))
        if scale != w[0]:  # out of range: the best bias at the nearest allowed scale
            w = _fit_logistic(x, y, float(l2), scale=scale)
        temps[k], biases[k] = 1.0 / scale, w[1]
    return torch.tensor(temps, dtype=torch.float32), torch.tensor(biases, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------------- file I/O
def _resolve(path) -> Path:
    """A drafter directory means its ``calibration.json``; anything else is the file itself."""
    p = Path(path)
    return p / CALIBRATION_FILE if p.is_dir() else p


def _validated_values(values, where: str, name: str, positive: bool) -> list[float]:
    """A non-empty list of finite floats (not bools), positive ones where ``positive``; ``ValueError`` naming
    ``where`` and ``name`` otherwise."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{where}: {name} must be a non-empty list, got {values!r}")
    kind = "positive finite" if positive else "finite"
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise ValueError(f"{where}: {name}[{i}] = {v!r} is not a {kind} number")
    return [float(v) for v in values]


def _metrics_dict(m) -> dict | None:
    return m.to_dict() if isinstance(m, CalibrationMetrics) else m


def save_calibration(path, temps, biases=None, *, method: str = "platt", metrics_before=None, metrics_after=None,
                     meta: dict | None = None) -> Path:
    """Write ``temps [gamma]`` and ``biases [gamma]`` (None = zeros, as STS fits) with the fitting ``method``, the
    metric tables and the settings as strict JSON; ``path`` is a drafter directory or a file. Returns the file
    written."""
    out = _resolve(path)
    t = _validated_values(temps, str(out), "temperatures", positive=True)
    b = [0.0] * len(t) if biases is None else _validated_values(biases, str(out), "biases", positive=False)
    if len(b) != len(t):
        raise ValueError(f"{out}: {len(b)} biases for {len(t)} temperatures")
    if method not in METHODS:
        raise ValueError(f"{out}: method must be one of {METHODS}, got {method!r}")
    doc = {"format": FORMAT, "method": method, "gamma": len(t), "temperatures": t, "biases": b,
           "metrics_before": _metrics_dict(metrics_before), "metrics_after": _metrics_dict(metrics_after),
           "meta": meta or {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return out


def _read_calibration(path) -> tuple[Path, dict]:
    """The calibration file of ``path`` (a drafter directory or the file) and its JSON object, format-checked."""
    src = _resolve(path)
    if not src.is_file():
        raise FileNotFoundError(f"calibration file missing: {src} (run python -m dspark_kernels.train.calibration)")
    try:
        doc = json.loads(src.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{src}: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") not in (FORMAT, FORMAT_V1):
        raise ValueError(f"{src}: not a calibration file (expected a JSON object with format {FORMAT!r} or "
                         f"{FORMAT_V1!r})")
    return src, doc


def _per_position(src: Path, doc: dict, gamma: int | None, name: str, positive: bool) -> torch.Tensor:
    """The first ``gamma`` (default all) entries of the ``name`` list of ``doc`` (the file ``src``, as
    :func:`_read_calibration` returns them) as ``[gamma]`` float32, checked against the stored gamma."""
    stored = doc.get("gamma")
    if isinstance(stored, bool) or not isinstance(stored, int) or stored < 1:
        raise ValueError(f"{src}: gamma must be an int >= 1, got {stored!r}")
    values = _validated_values(doc.get(name), str(src), name, positive)
    if len(values) != stored:
        raise ValueError(f"{src}: {len(values)} {name} but gamma = {stored}")
    if gamma is not None and not 1 <= gamma <= stored:
        raise ValueError(f"{src}: calibrated for gamma <= {stored}, requested gamma = {gamma}")
    return torch.tensor(values[:gamma], dtype=torch.float32)


def load_temperatures(path, gamma: int | None = None) -> torch.Tensor:
    """Read the calibration temperatures ``[gamma]`` float32 (the ``position_temperatures`` of
    ``ops.prefix_survival``).

    ``path``: a drafter directory or the file. ``gamma`` (optional) asks for the first ``gamma`` temperatures: Platt
    scaling fits each position on its own and STS fits positions left to right with earlier ones fixed, so a prefix
    is exactly what a fit at that block size gives. Raises ``FileNotFoundError`` when missing and ``ValueError`` on
    malformed JSON, a wrong format tag, a length that disagrees with the stored ``gamma``, a requested ``gamma`` above
    the stored one, or a temperature that is not a positive finite number.
    """
    return _per_position(*_read_calibration(path), gamma, "temperatures", positive=True)


def _biases(src: Path, doc: dict, gamma: int | None) -> torch.Tensor | None:
    return None if doc.get("format") == FORMAT_V1 else _per_position(src, doc, gamma, "biases", positive=False)


def load_biases(path, gamma: int | None = None) -> torch.Tensor | None:
    """Read the calibration biases ``[gamma]`` float32 (the ``position_biases`` of ``ops.prefix_survival``), or
    ``None`` for a temperature-only ``dspark-sts-v1`` file. Raises like :func:`load_temperatures`, for a bias that is
    not a finite number."""
    return _biases(*_read_calibration(path), gamma)


def _mean_survival(src: Path, doc: dict, gamma: int) -> list[float]:
    after = doc.get("metrics_after")
    rows = after.get("cumulative") if isinstance(after, dict) else None
    if not isinstance(rows, list) or len(rows) < gamma:
        raise ValueError(f"{src}: metrics_after.cumulative must list at least {gamma} positions")
    means = [row.get("mean_pred") if isinstance(row, dict) else None for row in rows[:gamma]]
    for j, m in enumerate(means, 1):
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise ValueError(f"{src}: metrics_after.cumulative position {j} mean_pred = {m!r} is not in [0, 1]")
    return [float(m) for m in means]


def load_mean_survival(path, gamma: int) -> list[float]:
    """The held-out mean calibrated prefix survival ``[gamma]`` (``metrics_after``'s cumulative ``mean_pred`` at
    positions 1..gamma): what the draft gate of the scheduled policies starts from before it has drafted
    (``make_policy(..., prior_survival=)``). Raises like :func:`load_temperatures`, and ``ValueError`` when the file
    has no such table for ``gamma`` positions or a value outside [0, 1]."""
    return _mean_survival(*_read_calibration(path), gamma)


@dataclass(frozen=True)
class DrafterCalibration:
    """Everything a scheduler reads from a drafter's calibration for blocks of ``gamma`` drafts:
    ``temperatures [gamma]`` and ``biases [gamma]`` float32 (``biases`` is ``None`` for a temperature-only file) and
    ``prior_survival [gamma]``, the held-out mean calibrated prefix survival (the draft gate's prior). An
    uncalibrated drafter is ``DrafterCalibration()``: all ``None``."""

    temperatures: torch.Tensor | None = None
    biases: torch.Tensor | None = None
    prior_survival: list[float] | None = None

    def policy_args(self) -> tuple:
        """``(temperatures, prior_survival, biases)``, the calibration arguments of ``engine.make_policy``."""
        return self.temperatures, self.prior_survival, self.biases


def load_calibration(path, gamma: int) -> DrafterCalibration:
    """:func:`load_temperatures`, :func:`load_biases` and :func:`load_mean_survival` of ``path`` for ``gamma``
    drafts, from one read of the file; raises as they do."""
    src, doc = _read_calibration(path)
    return DrafterCalibration(_per_position(src, doc, gamma, "temperatures", positive=True), _biases(src, doc, gamma),
                              _mean_survival(src, doc, gamma))


# ------------------------------------------------------------------------------------------------------------ CLI
def split_by_request(trace_request, num_requests: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks ``[rounds]`` (fit, eval): a seeded half of the requests fits, the other half evaluates."""
    req = np.asarray(trace_request.cpu() if isinstance(trace_request, torch.Tensor) else trace_request)
    perm = np.random.default_rng(seed).permutation(num_requests)
    fit_req = np.zeros(num_requests, dtype=bool)
    fit_req[perm[: num_requests // 2]] = True
    fit = fit_req[req]
    return fit, ~fit


def format_table(before: CalibrationMetrics, after: CalibrationMetrics, kind: str = "cumulative") -> str:
    """Text table, one row per position: n, label rate, ECE / AUROC / Brier before -> after, and the ECE noise
    floor of the calibrated predictions (what a perfectly calibrated head would score on this many rounds)."""
    rows = [f"{kind:11s}     n  rate  ECE before  ECE after  ECE floor  AUROC bef  AUROC aft  Brier bef  Brier aft"]
    for b, a in zip(getattr(before, kind), getattr(after, kind)):
        rows.append(f"  pos {b.position:2d}  {b.n:7d} {b.mean_label:5.3f}  {b.ece:10.4f} {a.ece:10.4f} "
                    f"{a.ece_floor:10.4f} {b.auroc:10.4f} {a.auroc:10.4f} {b.brier:10.4f} {a.brier:10.4f}")
    return "\n".join(rows)


def _collect_traces(args: argparse.Namespace):
    """Run speculative decoding on the held-out prompts; returns (SpecResult, number of prompts)."""
    from ..drafters import load_drafter
    from ..engine.speculative import speculative_generate
    from ..models import load_model
    from ..models.target_tokenizer import stop_token_ids
    from .rollouts import load_rollouts

    target = load_model(args.model, device=args.device)
    drafter = load_drafter(args.drafter, target, draft_vocab=args.draft_vocab)
    prompts = load_rollouts(args.rollouts, "heldout").prompts[: args.num_prompts]
    res = speculative_generate(target, drafter, prompts, args.max_new_tokens, args.gamma,
                               temperature=args.temperature, seeds=list(range(len(prompts))),
                               eos_token_id=list(stop_token_ids(args.model)),
                               record_traces=True)
    if "confidence_logits" not in res.extra:
        has_head = getattr(getattr(drafter, "config", None), "confidence", False)
        raise SystemExit(f"{args.drafter}: no drafting round was recorded (every request ended at its first token)"
                         if has_head else f"{args.drafter}: this drafter has no confidence head (no traces recorded)")
    return res, len(prompts)


def run(args: argparse.Namespace) -> dict:
    """Collect traces, fit the calibration (``args.method``) on the fit half, score the eval half before/after;
    write ``calibration.json``."""
    res, n_prompts = _collect_traces(args)
    z, acc = res.extra["confidence_logits"].numpy(), res.extra["accepted"].numpy()
    fit, ev = split_by_request(res.extra["trace_request"], n_prompts, args.seed)
    if args.method == "platt":
        temps, biases = fit_platt(z[fit], acc[fit], args.l2)
    else:
        temps, biases = fit_sts(z[fit], acc[fit], bins=args.bins), None
    before = calibration_metrics(z[ev], acc[ev], None, args.bins)
    after = calibration_metrics(z[ev], acc[ev], temps, args.bins, biases)
    meta = {"model": str(args.model), "drafter": str(args.drafter), "rollouts": str(args.rollouts),
            "split": "heldout", "gamma": args.gamma, "temperature": args.temperature, "num_prompts": n_prompts,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "bins": args.bins,
            "method": args.method, "l2": args.l2 if args.method == "platt" else None,
            "grid": "2^(i/10), i=-30..30" if args.method == "sts" else None,
            "fit_rounds": int(fit.sum()), "eval_rounds": int(ev.sum()),
            "tau": res.tau, "device": str(args.device), "draft_vocab": args.draft_vocab}
    out = save_calibration(args.drafter, temps, biases, method=args.method, metrics_before=before,
                           metrics_after=after, meta=meta)
    print(f"rounds: fit {int(fit.sum())}, eval {int(ev.sum())}; tau = {res.tau:.3f}")
    print("temperatures:", " ".join(f"{t:.3f}" for t in temps.tolist()))
    if biases is not None:
        print("biases:", " ".join(f"{b:.3f}" for b in biases.tolist()))
    print(format_table(before, after, "cumulative"))
    print(format_table(before, after, "conditional"))
    print(f"mean cumulative ECE (eval): {before.mean_ece():.4f} -> {after.mean_ece():.4f}; wrote {out}")
    return {"temperatures": temps.tolist(), "biases": None if biases is None else biases.tolist(), "before": before,
            "after": after, "meta": meta}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--drafter", type=Path, default=Path("dspark_kernels/assets/drafters/dspark"),
                   help="DSpark drafter directory (calibration.json is written into it)")
    p.add_argument("--rollouts", type=Path, default=Path("data/rollouts"),
                   help="rollout directory whose held-out prompts are decoded")
    p.add_argument("--gamma", type=positive_int, default=15,
                   help="block size of the decoded rounds")
    p.add_argument("--temperature", type=non_negative_float, default=1.0,
                   help="sampling temperature of the decoded rounds")
    p.add_argument("--num-prompts", type=positive_int, default=2048,
                   help="held-out prompts to decode (all of them when fewer); the ECE floor shrinks as 1/sqrt(rounds)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="new tokens per prompt")
    p.add_argument("--method", choices=METHODS, default="platt",
                   help="platt: a temperature and a bias per position, by maximum likelihood (default); sts: "
                        "Sequential Temperature Scaling, a temperature per position minimising the ECE")
    p.add_argument("--l2", type=positive_float, default=PLATT_L2,
                   help="platt: weight of the prior that pulls each position's fit to the identity")
    p.add_argument("--bins", type=positive_int, default=ECE_BINS,
                   help="bins of the expected calibration error")
    p.add_argument("--seed", type=int, default=0, help="seed of the 50/50 request split")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to decode on")
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    args = p.parse_args(argv)
    try:
        args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.model,
                                              is_shipped_drafter(args.model, args.drafter), [args.drafter])
    except ValueError as e:
        p.error(str(e))
    with missing_inputs_are_usage_errors(p):
        run(args)


if __name__ == "__main__":
    main()
