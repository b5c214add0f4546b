"""The latency tail in replays and its fit (experiments/replay.py, calibrate.py ``fit_tail``) and
validate's seeds and generalisation tables (validate.py), on a tiny in-memory experiment.

The "measurement" is a kvsched replay with known tail parameters, so a grid that contains them
must pick them (same seeds, same client jitter: zero residual there).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.specs import CostParams, get_model
from kvsched.experiments.groundtruth import QUANTILE_KEYS, Experiment, StageMeasurement, _workload
from kvsched.experiments.replay import POOLED_SCHEDULE_DELAY_MS, replay, send_delays_s

MODEL = "meta-llama/Llama-2-7b-hf"
TRUE_TAIL = dict(step_time_sigma=0.1, front_end_hiccup_probability=0.05, front_end_hiccup_mean_s=0.02)


def _experiment(exp_id: str = "99-llama-2-7b-tp1-general", stages=None, schedule_delay=None) -> Experiment:
    sp = {"num_unique_system_prompts": 2, "num_users_per_system_prompt": 3, "system_prompt_len": 64,
          "question_len": 200, "output_len": 24, "enable_multi_turn_chat": False}
    st = [{"rate": 8, "duration": 8}]
    stages = stages or (StageMeasurement(0, {}, 24.0, schedule_delay_ms=schedule_delay),)
    return Experiment(exp_id, "training_default_args", MODEL, get_model(MODEL).name, "H100", 1, 2048, 128, 4096,
                      None, None, False, _workload(sp, st, MODEL, 4096), stages)


def _measured(cost: CostParams, seeds=(0,)) -> Experiment:
    """An experiment whose stage-0 TTFT quantiles are kvsched's mean over ``seeds`` with ``cost``."""
    e = _experiment()
    res = [replay(e, cost, seed=s, client_jitter=True) for s in seeds]
    q = {k: float(np.mean([r.ttft_quantiles_ms[0][k] for r in res])) for k in ("p95", "p99", "p99.9")}
    vals = {m: v for m, v in res[0].stages_ms[0].items()}
    return dataclasses.replace(e, stages=(StageMeasurement(0, vals, 24.0, ttft_quantiles_ms=q),))


def test_replay_without_tail_or_jitter_ignores_the_seed():
    e = _experiment()
    a, b = replay(e, CostParams(), seed=0), replay(e, CostParams(), seed=0)
    assert a == b
    # the seed reaches the workload generator only (group permutation): no noise is drawn
    c = replay(e, CostParams(), seed=3)
    assert set(c.stages_ms) == {0} and c.n_requests == a.n_requests


def test_replay_with_the_tail_is_byte_exact_per_seed_and_differs_across_seeds():
    e = _experiment()
    cost = CostParams(**TRUE_TAIL)
    a = replay(e, cost, seed=1, client_jitter=True)
    assert a == replay(e, cost, seed=1, client_jitter=True)
    assert a.ttft_quantiles_ms != replay(e, cost, seed=2, client_jitter=True).ttft_quantiles_ms


def test_send_delays_follow_the_measured_quantiles_and_fall_back_to_the_pooled_ones():
    q = {k: v for k, v in zip(QUANTILE_KEYS, np.linspace(0.0, 12.0, len(QUANTILE_KEYS)))}
    own = send_delays_s(_experiment(schedule_delay=q), np.zeros(20_000, dtype=np.int64), seed=0)
    assert own.min() >= 0.0 and own.max() <= 12e-3
    assert abs(np.median(own) - q["median"] * 1e-3) < 2e-4
    pooled = send_delays_s(_experiment(), np.full(20_000, -1, dtype=np.int64), seed=0)  # warm-up, no quantiles
    assert abs(np.percentile(pooled, 99) - POOLED_SCHEDULE_DELAY_MS["p99"] * 1e-3) < 1e-4


def test_tail_fit_recovers_the_parameters_that_made_the_measurement():
    from kvsched.experiments.calibrate import fit_tail

    truth = _measured(CostParams(**TRUE_TAIL))
    grid = {"step_time_sigma": (0.0, 0.1), "front_end_hiccup_probability": (0.01, 0.05),
            "front_end_hiccup_mean_s": (0.005, 0.02)}
    tf = fit_tail([truth], CostParams(), seeds=1, stage_cap_s=None, jobs=1, grid=grid,
                  stages=((truth.exp_id, 0),))
    assert {f: getattr(tf.cost, f) for f in TRUE_TAIL} == TRUE_TAIL
    assert tf.rms == 0.0 < tf.before_rms and len(tf.grid) == 8


def test_tail_fit_rejects_a_field_outside_the_tail_and_a_stage_without_quantiles():
    from kvsched.experiments.calibrate import fit_tail

    e = _experiment()
    with pytest.raises(ConfigError, match="mbu"):
        fit_tail([e], CostParams(), grid={"mbu": (0.5,)}, stages=((e.exp_id, 0),), jobs=1)
    with pytest.raises(ConfigError, match="no TTFT quantiles"):
        fit_tail([e], CostParams(), seeds=1, stage_cap_s=None, jobs=1, stages=((e.exp_id, 0),),
                 grid={"step_time_sigma": (0.0,)})


def test_validate_seeds_report_mean_and_spread_and_tables_per_family_tp_gpu():
    from kvsched.experiments.validate import breakdown_table, csv_coverage, score, summary_table

    truth = _measured(CostParams(**TRUE_TAIL), seeds=(0, 1))
    other = dataclasses.replace(truth, exp_id="98-llama-2-7b-tp1-codegen", source="sim_to_real")
    rep = score([truth, other], CostParams(**TRUE_TAIL), train=[truth.exp_id], jobs=1, seeds=2,
                client_jitter=True)
    assert rep.seeds == 2 and len(rep.per_seed) == 2 * len(rep.rows)
    p99 = rep.rows[(rep.rows["metric"] == "ttft_p99") & (rep.rows["exp_id"] == truth.exp_id)].iloc[0]
    assert p99["kvsched_ms_sd"] > 0 and np.isfinite(p99["kvsched_ape_seed_sd"])
    summ = summary_table(rep).set_index("metric")
    assert np.isfinite(summ.loc["ttft_p99", "held_out_mape_seed_sd"])
    fam = breakdown_table(rep, "model_family")
    assert list(fam["model_family"]) == ["Llama-2", "Llama-2"] and set(fam["split"]) == {"train", "held-out"}
    assert set(breakdown_table(rep, "tp")["tp"]) == {1} and set(breakdown_table(rep, "gpu")["gpu"]) == {"H100"}
    assert set(rep.runs["vllm_version"]) == {"unknown"}
    cov = csv_coverage(rep)
    assert list(cov["exp_id"]) == [other.exp_id] and cov["stages_scored"].tolist() == [1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_validate_refuses_a_seed_count_below_one(bad):
    from kvsched.experiments.validate import score

    with pytest.raises(ConfigError, match="seeds"):
        score([_experiment()], CostParams(), seeds=bad, jobs=1)


def test_validate_only_names_an_unknown_experiment():
    from kvsched.experiments.validate import score

    with pytest.raises(ConfigError, match="nope"):
        score([_experiment()], CostParams(), only=["nope"], jobs=1)


def test_validate_only_with_part_of_an_id_lists_the_ids_containing_it():
    """`--only mixtral` is refused (ids are exact) but names the ids to pass, case-insensitively."""
    from kvsched.experiments.validate import score

    exp = _experiment()
    part = exp.exp_id[1:-1].upper()
    with pytest.raises(ConfigError, match="ids containing it") as e:
        score([exp], CostParams(), only=[part], jobs=1)
    assert exp.exp_id in str(e.value) and "\n" not in str(e.value)


def test_calibrate_tail_only_without_a_calibration_file_is_a_one_line_error(tmp_path, capsys):
    from kvsched.experiments.cli import main
    from kvsched.experiments.groundtruth import GroundTruthMissing, find_groundtruth

    try:
        gt = find_groundtruth()
    except GroundTruthMissing as e:
        pytest.skip(f"shared/groundtruth not available ({e})")
    rc = main(["calibrate", "--tail-only", "--groundtruth", str(gt), "--out", str(tmp_path / "none.json")])
    err = capsys.readouterr().err
    assert rc != 0 and "--tail-only" in err and "none.json" in err and len(err.strip().splitlines()) == 1


def test_calibration_file_keeps_the_tail_apart_from_the_default_cost(tmp_path):
    from kvsched.envs.sim.calibration import CalibrationFile, load_calibration, save_calibration

    tail = {"front_end_hiccup_probability": 0.01, "front_end_hiccup_mean_s": 0.007}
    cal = CalibrationFile("H100-SXM", 1, CostParams(), tail_params=tail)
    assert not cal.cost.step_noise_on and not cal.cost.front_end_noise_on  # the default stays deterministic
    assert cal.cost_with_tail().front_end_noise_on
    save_calibration(cal, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json").tail_params == tail
    assert "tail_params" not in CalibrationFile("H100-SXM", 1, CostParams()).to_dict()  # old files unchanged


@pytest.mark.parametrize("tail,match", [({"mbu": 0.5}, "mbu"), ({"front_end_hiccup_probability": 1.5},
                                                                  "front_end_hiccup_probability")])
def test_calibration_file_refuses_a_tail_field_or_value_out_of_range(tail, match):
    from kvsched.envs.sim.calibration import CalibrationFile

    with pytest.raises(ConfigError, match=match):
        CalibrationFile("H100-SXM", 1, CostParams(), tail_params=tail)


def test_shipped_h100_calibration_is_deterministic_by_default_with_a_fitted_tail():
    from kvsched.envs.sim.calibration import calibration_path, load_calibration

    cal = load_calibration(calibration_path("H100-SXM"))
    assert not cal.cost.step_noise_on and not cal.cost.front_end_noise_on
    assert cal.cost_with_tail().front_end_noise_on


def test_validate_tail_without_fitted_tail_is_a_one_line_error(tmp_path):
    from kvsched.envs.sim.calibration import CalibrationFile, save_calibration
    from kvsched.experiments.validate import _with_tail

    save_calibration(CalibrationFile("H100-SXM", 1, CostParams()), tmp_path / "c.json")
    with pytest.raises(ConfigError, match="no tail_params") as e:
        _with_tail(tmp_path / "c.json", CostParams())
    assert "\n" not in str(e.value)
