"""Confidence calibration: recorder metrics, Platt scaling, Sequential Temperature Scaling, the calibration file and
the CLI.

* ECE / AUROC / Brier on hand-made inputs (calibrated -> ECE 0, a hand-counted AUROC with ties, brute force);
* STS on a synthetic head whose logits are 3x the true conditional log-odds: every position's ECE drops and the
  fitted temperatures are near 3; the grid holds exactly 1 and ties go to it;
* Platt scaling recovers a head's scale and offset, fixes an offset that STS cannot, stays finite on separable and
  empty positions and keeps its scale in range;
* calibration.json round trip (both formats) and malformed files; the CLI end to end on a tiny random target and
  drafter.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_kernels.ops.survival import prefix_survival
from dspark_kernels.train import calibration as cal
from dspark_kernels.train.calibration import (
    DrafterCalibration,
    auroc,
    brier_score,
    calibration_metrics,
    cumulative_survival,
    ece_noise_floor,
    expected_calibration_error,
    fit_platt,
    fit_sts,
    load_biases,
    load_calibration,
    load_mean_survival,
    load_temperatures,
    save_calibration,
    sts_grid,
)


# ------------------------------------------------------------------------------------------------------ metrics
def test_ece_hand_made():
    # bins hold (0.25: 1 of 4 positive) and (0.75: 3 of 4 positive): perfectly calibrated
    pred = [0.25] * 4 + [0.75] * 4
    label = [1, 0, 0, 0, 1, 1, 1, 0]
    assert expected_calibration_error(pred, label) == pytest.approx(0.0, abs=1e-12)
    # one bin, gap 0.4
    assert expected_calibration_error([0.9] * 4, [1, 0, 1, 0]) == pytest.approx(0.4)
    # count weighting: bin A (2 rows, gap 0.95), bin B (6 rows, gap 0) -> 0.95 * 2 / 8
    assert expected_calibration_error([0.05, 0.05] + [0.5] * 6, [1, 1, 1, 0, 1, 0, 1, 0]) == pytest.approx(0.2375)
    # clamping: 0 and 1 go to the first and last bin with value 1e-8 / 1 - 1e-8
    assert expected_calibration_error([0.0, 1.0], [0, 1]) == pytest.approx(1e-8)
    assert math.isnan(expected_calibration_error([], []))


def test_ece_of_sampled_calibrated_predictions_is_small():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=200_000)
    y = rng.uniform(size=p.size) < p
    assert expected_calibration_error(p, y) < 0.005
    assert expected_calibration_error(np.clip(p * 1.3, 0, 1), y) > 0.05


def _auroc_brute(p, y):
    pos, neg = p[y == 1], p[y == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size


def test_auroc_with_ties():
    # pairs (pos, neg): (0.4, 0.1) 1, (0.4, 0.4) 1/2, (0.8, 0.1) 1, (0.8, 0.4) 1 -> 3.5 / 4
    assert auroc([0.1, 0.4, 0.4, 0.8], [0, 0, 1, 1]) == pytest.approx(0.875)
    assert auroc([0.3, 0.3, 0.3], [0, 1, 1]) == pytest.approx(0.5)
    assert auroc([0.9, 0.1], [0, 1]) == pytest.approx(0.0)
    rng = np.random.default_rng(1)
    p = rng.integers(0, 7, size=300).astype(float)  # heavy ties
    y = (rng.uniform(size=300) < 0.2 + 0.1 * p).astype(int)
    assert auroc(p, y) == pytest.approx(_auroc_brute(p, y), abs=1e-12)
    assert auroc(torch.tensor(p), torch.tensor(y)) == pytest.approx(_auroc_brute(p, y), abs=1e-12)


def test_auroc_one_class_is_nan():
    assert math.isnan(auroc([0.2, 0.7], [1, 1]))
    assert math.isnan(auroc([0.2, 0.7], [0, 0]))
    assert math.isnan(auroc([], []))


def test_brier():
    assert brier_score([0.5, 1.0], [1, 1]) == pytest.approx(0.125)
    assert brier_score([0.0, 1.0], [0, 1]) == 0.0
    assert math.isnan(brier_score([], []))


def test_per_position_metrics_cumulative_and_conditional():
    z = np.array([[2.0, 0.0, -1.0], [1.0, 1.0, 1.0], [0.5, -2.0, 0.0], [3.0, 2.0, 1.0]])
    acc = np.array([0, 3, 1, 2])
    m = calibration_metrics(z, acc)
    a = cumulative_survival(z)
    c = 1 / (1 + np.exp(-z))
    assert np.allclose(a, np.cumprod(c, axis=1))
    assert [x.n for x in m.cumulative] == [4, 4, 4]
    assert [x.positives for x in m.cumulative] == [3, 2, 1]
    # conditional position j scores the rounds with accepted >= j - 1: 4, 3, 2 rounds
    assert [x.n for x in m.conditional] == [4, 3, 2]
    assert m.conditional[2].positives == 1 and m.conditional[2].mean_pred == pytest.approx(c[[1, 3], 2].mean())
    assert m.cumulative[1].brier == pytest.approx(np.mean((a[:, 1] - [0, 1, 0, 1]) ** 2))
    assert m.cumulative[0].auroc == pytest.approx(_auroc_brute(a[:, 0], np.array([0, 1, 1, 1])))
    # a position whose labels are one class: AUROC nan, the rest finite
    m1 = calibration_metrics(z, np.array([1, 1, 1, 1]))
    assert math.isnan(m1.cumulative[0].auroc) and math.isfinite(m1.cumulative[0].ece)
    assert m1.conditional[2].n == 0 and math.isnan(m1.conditional[2].ece)
    with pytest.raises(ValueError, match="accepted"):
        calibration_metrics(z, np.array([0, 4, 1, 2]))
    with pytest.raises(ValueError, match="finite"):
        calibration_metrics(np.full((2, 2), np.inf), np.array([0, 1]))


def test_cumulative_survival_matches_the_op():
    rng = np.random.default_rng(2)
    z = rng.normal(0, 3, size=(5, 6)).astype(np.float32)
    temps = sts_grid()[[30, 40, 20, 35, 25, 50]].astype(np.float32)
    biases = rng.normal(0, 1, size=6).astype(np.float32)
    flat = torch.tensor(z.reshape(-1))
    cu = torch.arange(0, 31, 6, dtype=torch.int32)
    for b in (None, biases):
        ours = cumulative_survival(z, temps, b)
        op = prefix_survival(flat, cu, torch.tensor(temps), None if b is None else torch.tensor(b), impl="torch")
        assert np.allclose(ours, op.view(5, 6).numpy(), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------- STS
def _synthetic_traces(n, gamma, scale, seed):
    """Rounds whose true conditional acceptance probs are p [n, gamma]; logits = scale * logit(p)."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.35, 0.97, size=(n, gamma))
    ok = rng.uniform(size=(n, gamma)) < p
    accepted = np.cumprod(ok, axis=1).sum(axis=1)
    return scale * np.log(p / (1 - p)), accepted


def test_sts_fixes_an_over_confident_head():
    z, acc = _synthetic_traces(30_000, 6, 3.0, seed=3)
    temps = fit_sts(z, acc)
    assert temps.shape == (6,) and temps.dtype == torch.float32
    assert np.all(np.abs(np.log2(temps.numpy() / 3.0)) <= 0.25), temps  # grid neighbours of 3: 2.83, 3.03, 3.25
    z_ev, acc_ev = _synthetic_traces(30_000, 6, 3.0, seed=4)  # held-out rounds
    before, after = calibration_metrics(z_ev, acc_ev), calibration_metrics(z_ev, acc_ev, temps)
    for b, a in zip(before.cumulative, after.cumulative):
        assert a.ece < b.ece and a.ece < 0.02, (b, a)
        assert a.brier < b.brier
    for b, a in zip(before.conditional, after.conditional):  # per-position scaling keeps the conditional ranking
        assert a.auroc == pytest.approx(b.auroc, abs=1e-12)
    assert after.mean_ece() < 0.3 * before.mean_ece()


def test_ece_noise_floor_matches_a_calibrated_predictor_and_shrinks_with_n():
    rng = np.random.default_rng(5)
    floors = []
    for n in (1_000, 16_000):
        p = rng.uniform(0.2, 0.8, size=n)
        floor = ece_noise_floor(p)
        measured = [expected_calibration_error(p, rng.uniform(size=n) < p) for _ in range(20)]
        assert abs(np.mean(measured) - floor) < 0.25 * floor, (n, floor, np.mean(measured))
        floors.append(floor)
    assert floors[1] < 0.35 * floors[0]  # 1/sqrt(n): 16x the rounds -> a quarter of the floor
    assert expected_calibration_error(p, rng.uniform(size=p.size) < p + 0.1) > 5 * floors[1]  # real bias shows
    assert math.isnan(ece_noise_floor(np.zeros(0)))


def test_sts_is_sequential_earlier_temperatures_fixed():
    # position 2's fit must use T_1 as fitted: refitting position 2 alone with T_1 = 1 would pick differently
    z, acc = _synthetic_traces(20_000, 2, 3.0, seed=5)
    temps = fit_sts(z, acc).numpy()
    grid = sts_grid()
    a1 = cumulative_survival(z[:, :1], temps[:1])[:, 0]
    y2 = acc >= 2
    eces = [expected_calibration_error(a1 / (1 + np.exp(-z[:, 1] / t)), y2) for t in grid]
    assert temps[1] == pytest.approx(grid[int(np.argmin(eces))])


def test_grid_and_ties_go_to_one():
    grid = sts_grid()
    assert grid.size == 61 and grid[30] == 1.0 and grid[0] == 0.125 and grid[-1] == 8.0
    assert np.all(np.diff(grid) > 0)
    # zero logits: every temperature gives sigmoid = 0.5, so all ECEs tie -> T = 1 everywhere
    z = np.zeros((50, 3))
    acc = np.random.default_rng(6).integers(0, 4, size=50)
    assert fit_sts(z, acc).tolist() == [1.0, 1.0, 1.0]
    # a tie not involving 1: the smaller |log T| wins, then the smaller T
    eces = np.full(61, 0.1)
    eces[30] = 0.2
    assert cal._pick_temperature(eces, grid) == 29
    eces[[10, 50]] = 0.05
    assert cal._pick_temperature(eces, grid) == 10
    eces[30] = 0.05
    assert cal._pick_temperature(eces, grid) == 30
    # no rounds: identity temperatures
    assert fit_sts(np.zeros((0, 4)), np.zeros(0, dtype=int)).tolist() == [1.0] * 4


# ------------------------------------------------------------------------------------------------ Platt scaling
def test_platt_recovers_scale_and_offset():
    # logits = 3 * logit(p) + 1.5, so the true conditional is sigmoid(z / 3 - 0.5): T = 3, b = -0.5 at every position
    z, acc = _synthetic_traces(40_000, 4, 3.0, seed=8)
    temps, biases = fit_platt(z + 1.5, acc)
    assert temps.dtype == biases.dtype == torch.float32 and temps.shape == biases.shape == (4,)
    assert np.allclose(temps.numpy(), 3.0, rtol=0.08), temps
    assert np.allclose(biases.numpy(), -0.5, atol=0.08), biases


def test_platt_fixes_an_offset_that_sts_cannot():
    # a head that ranks right but sits 1 logit above the truth: a temperature scales around 0 and cannot remove it
    z, acc = _synthetic_traces(30_000, 5, 1.0, seed=9)
    z_ev, acc_ev = _synthetic_traces(30_000, 5, 1.0, seed=10)
    sts = calibration_metrics(z_ev + 1.0, acc_ev, fit_sts(z + 1.0, acc))
    temps, biases = fit_platt(z + 1.0, acc)
    platt = calibration_metrics(z_ev + 1.0, acc_ev, temps, biases=biases)
    for s_, p_ in zip(sts.cumulative, platt.cumulative):
        assert p_.ece < 0.01 and p_.ece < 0.5 * s_.ece, (s_, p_)
    for s_, p_ in zip(sts.conditional, platt.conditional):  # a positive scale keeps the conditional ranking
        assert p_.auroc == pytest.approx(s_.auroc, abs=1e-12)


def test_platt_prior_keeps_degenerate_positions_finite():
    rng = np.random.default_rng(11)
    z = rng.normal(0, 2, size=(400, 3))
    # position 1 separable (MLE scale -> inf); position 2 on trial but never accepted (MLE bias -> -inf); position 3
    # never on trial
    acc = (z[:, 0] > 0).astype(int)
    temps, biases = fit_platt(z, acc)
    assert np.isfinite(temps.numpy()).all() and np.isfinite(biases.numpy()).all()
    assert float(temps[0]) < 0.5 and float(biases[1]) < -2
    assert float(temps[2]) == 1.0 and float(biases[2]) == 0.0
    # the prior's weight: a weaker prior lets position 2's fit move further from the identity on the same rounds
    strong, weak = fit_platt(z, acc, l2=100.0), fit_platt(z, acc, l2=0.01)
    assert abs(float(weak[1][1])) > abs(float(strong[1][1]))
    with pytest.raises(ValueError, match="l2"):
        fit_platt(z, acc, l2=0.0)
    # no rounds at all: the identity everywhere
    temps, biases = fit_platt(np.zeros((0, 2)), np.zeros(0, dtype=int))
    assert temps.tolist() == [1.0, 1.0] and biases.tolist() == [0.0, 0.0]


def test_platt_clamps_an_anti_correlated_head():
    # the head says the opposite of the truth: the best scale is negative, clamped to 1/8 with the bias refitted
    z, acc = _synthetic_traces(20_000, 1, -1.0, seed=12)
    temps, biases = fit_platt(z, acc)
    assert float(temps[0]) == 8.0
    on_trial_rate = float((acc >= 1).mean())
    predicted = float(cumulative_survival(z, temps, biases)[:, 0].mean())
    assert predicted == pytest.approx(on_trial_rate, abs=0.01)  # the refitted bias still matches the rate


# -------------------------------------------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path):
    z, acc = _synthetic_traces(500, 4, 3.0, seed=7)
    temps = fit_sts(z, acc)
    before = calibration_metrics(z, np.full(500, 4))  # all-positive labels: AUROC nan -> JSON null
    after = calibration_metrics(z, acc, temps)
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    out = save_calibration(drafter_dir, temps, method="sts", metrics_before=before, metrics_after=after,
                           meta={"gamma": 4, "note": "test"})
    assert out == drafter_dir / "calibration.json"
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert doc["metrics_before"]["cumulative"][0]["auroc"] is None and doc["meta"]["note"] == "test"
    assert doc["format"] == "dspark-calibration-v2" and doc["method"] == "sts"
    assert len(doc["metrics_after"]["conditional"]) == 4
    assert torch.equal(load_temperatures(drafter_dir), temps)
    assert torch.equal(load_temperatures(out, gamma=4), temps)
    assert load_biases(drafter_dir).tolist() == [0.0] * 4  # STS fits no bias
    temps, biases = fit_platt(z, acc)
    save_calibration(tmp_path / "t.json", temps, biases)
    assert torch.equal(load_temperatures(tmp_path / "t.json"), temps)
    assert torch.equal(load_biases(tmp_path / "t.json"), biases)
    assert torch.equal(load_biases(tmp_path / "t.json", gamma=2), biases[:2])
    assert json.loads((tmp_path / "t.json").read_text())["method"] == "platt"


def test_temperature_only_files_still_load(tmp_path):
    doc = {"format": "dspark-sts-v1", "gamma": 2, "temperatures": [1.5, 0.5]}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    assert load_temperatures(path).tolist() == [1.5, 0.5]
    assert load_biases(path) is None and load_biases(tmp_path, gamma=1) is None


def _write(tmp_path, doc) -> object:
    path = tmp_path / "calibration.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.mark.parametrize("doc,match", [
    ("{not json", "not valid JSON"),
    ([1.0, 2.0], "not a calibration file"),
    ({"format": "other", "gamma": 1, "temperatures": [1.0]}, "not a calibration file"),
    ({"format": "dspark-sts-v1", "gamma": 2, "temperatures": [1.0]}, "1 temperatures but gamma = 2"),
    ({"format": "dspark-sts-v1", "gamma": 0, "temperatures": []}, "gamma must be an int >= 1"),
    ({"format": "dspark-sts-v1", "gamma": "2", "temperatures": [1.0, 1.0]}, "gamma must be an int"),
    ({"format": "dspark-sts-v1", "gamma": 2, "temperatures": [1.0, -0.5]}, r"temperatures\[1\] = -0.5"),
    ({"format": "dspark-sts-v1", "gamma": 2, "temperatures": [0.0, 1.0]}, r"temperatures\[0\] = 0.0"),
    ({"format": "dspark-sts-v1", "gamma": 1, "temperatures": ["2"]}, "not a positive finite number"),
    ({"format": "dspark-sts-v1", "gamma": 1, "temperatures": [True]}, "not a positive finite number"),
    ({"format": "dspark-sts-v1", "gamma": 1, "temperatures": 2.0}, "must be a non-empty list"),
    ({"format": "dspark-sts-v1", "gamma": 1}, "must be a non-empty list"),
    ('{"format": "dspark-sts-v1", "gamma": 2, "temperatures": [1.0, NaN]}', "not a positive finite number"),
    ('{"format": "dspark-sts-v1", "gamma": 1, "temperatures": [Infinity]}', "not a positive finite number"),
])
def test_malformed_files(tmp_path, doc, match):
    with pytest.raises(ValueError, match=match):
        load_temperatures(_write(tmp_path, doc))


V2 = {"format": "dspark-calibration-v2", "method": "platt", "gamma": 2, "temperatures": [1.0, 1.0]}


@pytest.mark.parametrize("doc,match", [
    ({**V2, "biases": [0.5]}, "1 biases but gamma = 2"),
    ({**V2, "biases": [0.5, True]}, r"biases\[1\] = True is not a finite number"),
    ({**V2, "biases": "0.5"}, "biases must be a non-empty list"),
    ({**V2}, "biases must be a non-empty list"),
    ('{"format": "dspark-calibration-v2", "gamma": 1, "temperatures": [1.0], "biases": [NaN]}', "not a finite"),
])
def test_malformed_biases(tmp_path, doc, match):
    with pytest.raises(ValueError, match=match):
        load_biases(_write(tmp_path, doc))


def test_mean_survival_prior_of_the_shipped_drafter_and_bad_tables(tmp_path):
    shipped = load_mean_survival(Path(__file__).resolve().parents[1] / "dspark_kernels/assets/drafters/dspark", 7)
    assert len(shipped) == 7 and all(0 < b < a < 1 for a, b in zip(shipped, shipped[1:]))  # a prefix survival
    rows = [{"position": j + 1, "mean_pred": 0.5 ** (j + 1)} for j in range(3)]
    doc = {"format": "dspark-sts-v1", "gamma": 3, "temperatures": [1.0] * 3, "metrics_after": {"cumulative": rows}}
    assert load_mean_survival(_write(tmp_path, doc), 2) == [0.5, 0.25]
    with pytest.raises(ValueError, match="at least 4 positions"):
        load_mean_survival(_write(tmp_path, doc), 4)
    rows[1]["mean_pred"] = 1.5
    with pytest.raises(ValueError, match="position 2 mean_pred = 1.5 is not in"):
        load_mean_survival(_write(tmp_path, doc), 3)
    with pytest.raises(ValueError, match="metrics_after.cumulative"):
        load_mean_survival(_write(tmp_path, {**doc, "metrics_after": None}), 1)


def test_load_calibration_reads_what_the_three_loaders_read(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "dspark_kernels/assets/drafters/smollm2-135m-instruct/dspark"
    cal = load_calibration(shipped, 5)
    assert torch.equal(cal.temperatures, load_temperatures(shipped, 5))
    assert torch.equal(cal.biases, load_biases(shipped, 5))
    assert cal.prior_survival == load_mean_survival(shipped, 5)
    assert cal.policy_args() == (cal.temperatures, cal.prior_survival, cal.biases)
    rows = [{"position": j + 1, "mean_pred": 0.5 ** (j + 1)} for j in range(2)]
    v1 = _write(tmp_path, {"format": "dspark-sts-v1", "gamma": 2, "temperatures": [1.5, 0.5],
                           "metrics_after": {"cumulative": rows}})
    cal = load_calibration(v1, 2)
    assert cal.temperatures.tolist() == [1.5, 0.5] and cal.biases is None and cal.prior_survival == [0.5, 0.25]
    assert DrafterCalibration().policy_args() == (None, None, None)
    with pytest.raises(ValueError, match="calibrated for gamma <= 2, requested gamma = 3"):
        load_calibration(v1, 3)
    with pytest.raises(ValueError, match="at least 2 positions"):
        load_calibration(_write(tmp_path, {**json.loads(v1.read_text()), "metrics_after": None}), 2)
    with pytest.raises(FileNotFoundError, match="calibration file missing"):
        load_calibration(tmp_path / "elsewhere", 2)


def test_missing_file_wrong_gamma_and_bad_save(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibration file missing"):
        load_temperatures(tmp_path)
    save_calibration(tmp_path, [1.0, 2.0, 3.0], [0.0, -1.0, 0.5])
    with pytest.raises(ValueError, match="calibrated for gamma <= 3, requested gamma = 7"):
        load_temperatures(tmp_path, gamma=7)
    with pytest.raises(ValueError, match="calibrated for gamma <= 3, requested gamma = 7"):
        load_biases(tmp_path, gamma=7)
    assert load_temperatures(tmp_path, gamma=2).tolist() == [1.0, 2.0]  # a prefix serves a shorter block
    assert load_biases(tmp_path, gamma=2).tolist() == [0.0, -1.0]
    for bad in ([], [1.0, float("nan")], [1.0, 0.0], torch.tensor([1.0, -2.0])):
        with pytest.raises(ValueError, match="temperatures"):
            save_calibration(tmp_path / "bad.json", bad)
    for bad, match in (([0.0], "1 biases for 2 temperatures"), ([0.0, float("inf")], r"biases\[1\]")):
        with pytest.raises(ValueError, match=match):
            save_calibration(tmp_path / "bad.json", [1.0, 1.0], bad)
    with pytest.raises(ValueError, match="method must be one of"):
        save_calibration(tmp_path / "bad.json", [1.0], method="isotonic")
    assert not (tmp_path / "bad.json").exists()


# ---------------------------------------------------------------------------------------------------------- CLI
def test_split_by_request_is_disjoint_and_by_request():
    req = np.repeat(np.arange(10), 3)
    fit, ev = cal.split_by_request(torch.tensor(req), 10, seed=0)
    assert not np.any(fit & ev) and np.all(fit | ev)
    assert len(set(req[fit])) == 5 and not set(req[fit]) & set(req[ev])


def test_cli_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from dspark_kernels.drafters.block_drafter import BlockDrafter, DrafterConfig
    from dspark_kernels.models import load_model
    from dspark_kernels.train.rollouts import Rollouts, save_rollouts
    from tests.tiny_models import save_tiny_qwen3

    save_tiny_qwen3(tmp_path / "target", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=2, num_kv_heads=1, peak=30.0)  # peaky target: varied acceptance
    target = load_model(tmp_path / "target")
    dcfg = DrafterConfig(feature_layers=(0, 1), mask_token_id=3, vocab_size=64, hidden_size=32, num_layers=1,
                         gamma=7, head_kind="vanilla", markov_rank=4)
    drafter = BlockDrafter(dcfg, target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drafter.save(tmp_path / "drafter")
    prompts = [[1, 5 + i, 9 + 2 * i] for i in range(6)]
    save_rollouts(Rollouts(prompts, [[4]] * 6, [1.0] * 6, [0] * 6), tmp_path / "rollouts", "heldout")

    cal.main(["--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--rollouts",
              str(tmp_path / "rollouts"), "--gamma", "4", "--num-prompts", "6", "--max-new-tokens", "12",
              "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "ECE before" in printed and "pos  4" in printed and "biases:" in printed
    temps = load_temperatures(tmp_path / "drafter", gamma=4)
    assert temps.shape == (4,) and bool((temps > 0).all())
    assert load_biases(tmp_path / "drafter", gamma=4).shape == (4,)
    doc = json.loads((tmp_path / "drafter" / "calibration.json").read_text())
    meta = doc["meta"]
    assert doc["method"] == meta["method"] == "platt" and meta["l2"] == 1.0 and meta["grid"] is None
    assert meta["num_prompts"] == 6 and meta["fit_rounds"] > 0 and meta["eval_rounds"] > 0
    assert len(doc["metrics_before"]["cumulative"]) == 4
    assert sum(m["n"] for m in doc["metrics_before"]["cumulative"][:1]) == meta["eval_rounds"]
    assert meta["draft_vocab"] is None  # a drafter that is not the one shipped for --model: the whole vocabulary

    from dspark_kernels.drafters.draft_vocab import save_token_ranking

    argv = ["--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--rollouts",
            str(tmp_path / "rollouts"), "--gamma", "4", "--num-prompts", "6", "--max-new-tokens", "12", "--device",
            "cpu", "--draft-vocab", "16"]
    with pytest.raises(SystemExit):  # no token ranking to take the 16 tokens from
        cal.main(argv)
    assert "has no token ranking" in capsys.readouterr().err
    save_token_ranking(torch.randperm(64), tmp_path / "drafter")
    cal.main(argv)  # calibrated as it drafts with a draft vocabulary
    assert json.loads((tmp_path / "drafter" / "calibration.json").read_text())["meta"]["draft_vocab"] == 16
    cal.main(argv + ["--method", "sts"])
    doc = json.loads((tmp_path / "drafter" / "calibration.json").read_text())
    assert doc["method"] == "sts" and doc["biases"] == [0.0] * 4 and doc["meta"]["grid"].startswith("2^")


@pytest.mark.parametrize("argv", [["--method", "isotonic"], ["--l2", "0"], ["--l2", "nan"], ["--l2", "-1"]])
def test_cli_rejects_bad_method_and_l2_before_loading(argv, capsys):
    with pytest.raises(SystemExit):
        cal.main(["--rollouts", "/nonexistent/rollouts", *argv])
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and "nonexistent" not in err
