"""Inputs of ``kvsched validate`` / ``calibrate`` / ``bench`` that used to be mis-reported or crash
(experiments/validate.py, calibrate.py, bench.py, plot_files.py; envs/sim/calibration.py):

- runs that could not be built or replayed are "not replayed" with their reason in runs.csv and
  csv_coverage.csv, not held-out or train rows;
- a training run that cannot be built or served, or one given twice, is a one-line ConfigError
  naming it, not a traceback; a TP1-only training set does not call the all-reduce fields fitted;
- a calibration file without the value of a field it calls fitted is refused;
- the tail fit scores the TTFT quantiles a stage publishes (no KeyError);
- a --plot matplotlib cannot write is refused before any work;
- bench's BLIS column says it is a quoted figure and gives CPU-time ratios beside wall ones.

The experiments are tiny, in memory (a short shared-prefix workload on Llama-2-7B, TP1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvsched.envs.sim.calibration import DEFAULT_FIT_PARAMS, CalibrationFile, load_calibration
from kvsched.envs.sim.errors import ConfigError, KvschedError
from kvsched.envs.sim.specs import CostParams, get_model
from kvsched.experiments.groundtruth import Experiment, StageMeasurement, _workload
from kvsched.experiments.replay import replay

MODEL = "meta-llama/Llama-2-7b-hf"
HUGE = "x" * 20_000


def _experiment(exp_id: str, source: str = "training_default_args", **kw) -> Experiment:
    """A replayable TP1 experiment whose measurement is kvsched's own replay (APE 0)."""
    sp = {"num_unique_system_prompts": 2, "num_users_per_system_prompt": 2, "system_prompt_len": 64,
          "question_len": 200, "output_len": 12, "enable_multi_turn_chat": False}
    st = [{"rate": 4, "duration": 4}]
    e = Experiment(exp_id, source, MODEL, get_model(MODEL).name, "H100", 1, 2048, 128, 4096, None, None, False,
                   _workload(sp, st, MODEL, 4096), (StageMeasurement(0, {}, 12.0),))
    res = replay(e, CostParams())
    e = dataclasses.replace(e, stages=(StageMeasurement(0, dict(res.stages_ms[0]), 12.0),))
    return dataclasses.replace(e, **kw)


@pytest.fixture(scope="module")
def runs():
    ok = _experiment("20990101-000000-llama-2-7b-tp1-general")
    unbuildable = dataclasses.replace(ok, exp_id="20990101-000001-llama-2-7b-tp3-codegen", source="sim_to_real",
                                      tp=3)
    unservable = dataclasses.replace(ok, exp_id="20990101-000002-llama-2-7b-tp1-roleplay", source="sim_to_real",
                                     max_model_len=128)
    return ok, unbuildable, unservable


# ------------------------------------------------------------------------------------------------
# validate: runs.csv and csv_coverage.csv


def test_runs_that_could_not_be_built_or_replayed_are_not_replayed_in_runs_and_coverage(runs):
    from kvsched.experiments.validate import csv_coverage, score

    ok, unbuildable, unservable = runs
    rep = score(list(runs), CostParams(), train=[ok.exp_id, unservable.exp_id], jobs=1)
    assert set(rep.rows["exp_id"]) == {ok.exp_id}
    table = rep.runs.set_index("exp_id")
    assert table.loc[ok.exp_id, "split"] == "train" and table.loc[ok.exp_id, "skip_reason"] == ""
    for e, why in ((unbuildable, "tp=3"), (unservable, "not served")):
        assert table.loc[e.exp_id, "split"] == "not replayed"
        assert why in table.loc[e.exp_id, "skip_reason"]
    cov = csv_coverage(rep).set_index("exp_id")
    assert set(cov.index) == {unbuildable.exp_id, unservable.exp_id}
    assert (cov["split"] == "not replayed").all() and (cov["stages_scored"] == 0).all()
    assert "tp=3" in cov.loc[unbuildable.exp_id, "reason"] and "not served" in cov.loc[unservable.exp_id, "reason"]


def test_runs_table_has_the_serving_flags_a_run_was_replayed_with(runs):
    from kvsched.experiments.validate import runs_table

    ok = dataclasses.replace(runs[0], dp=2, gpu_memory_utilization=0.85, precision="FP8", weight_dtype="fp8")
    row = runs_table([ok], []).iloc[0]
    assert (row["dp"], row["gpu_memory_utilization"], row["precision"], row["weight_dtype"]) == (2, 0.85, "FP8", "fp8")
    assert (row["max_num_batched_tokens"], row["max_num_seqs"], row["cpu_offload"]) == (2048, 128, False)


def test_validate_titles_name_the_gpus_scored(runs):
    from kvsched.experiments.validate import gpus_scored, score

    ok = runs[0]
    rep = score([ok, dataclasses.replace(ok, exp_id="20990101-000003-llama-2-7b-tp1-x", hardware="H200")],
                CostParams(), jobs=1)
    assert gpus_scored(rep) == "H100, H200"


# ------------------------------------------------------------------------------------------------
# calibrate: training runs that cannot be replayed, duplicates, unconstrained fields


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) < 1200, text[:300]
    return text


def test_calibrate_names_a_training_run_whose_requests_cannot_be_served(runs):
    from kvsched.experiments.calibrate import calibrate

    _, _, unservable = runs
    with pytest.raises(ConfigError, match="not served") as err:
        calibrate([unservable], [unservable.exp_id], max_nfev=1, jobs=1, stage_cap_s=None)
    assert unservable.exp_id in _one_line(err)


def test_calibrate_names_a_training_run_whose_system_cannot_be_built(runs):
    from kvsched.experiments.calibrate import calibrate

    _, unbuildable, _ = runs
    with pytest.raises(ConfigError, match="tp=3") as err:
        calibrate([unbuildable], [unbuildable.exp_id], max_nfev=1, jobs=1, stage_cap_s=None)
    assert unbuildable.exp_id in _one_line(err)


def test_calibrate_refuses_a_training_id_given_twice_with_a_bounded_message(runs):
    from kvsched.experiments.calibrate import calibrate

    ok = runs[0]
    with pytest.raises(ConfigError, match="more than once") as err:
        calibrate([ok], [ok.exp_id, ok.exp_id], max_nfev=1, jobs=1)
    assert ok.exp_id in _one_line(err)
    long = dataclasses.replace(ok, exp_id=HUGE)
    with pytest.raises(ConfigError) as err:
        calibrate([long], [HUGE, HUGE], max_nfev=1, jobs=1)
    _one_line(err)


def test_calibrate_on_tp1_runs_only_leaves_the_allreduce_fields_out_of_fitted(runs):
    from kvsched.experiments.calibrate import ALLREDUCE_FIT_FIELDS, calibrate

    ok = runs[0]
    cal, fit = calibrate([ok], [ok.exp_id], max_nfev=1, jobs=1, stage_cap_s=None)
    assert cal.fitted and not set(cal.fitted) & set(ALLREDUCE_FIT_FIELDS)
    assert set(fit.values) == set(cal.fitted)
    assert any(n.startswith("not fitted: allreduce_bw_efficiency, allreduce_hop_latency_s") for n in cal.notes)
    assert cal.cost.allreduce_bw_efficiency == CostParams().allreduce_bw_efficiency
    # with a TP > 1 run the default fields stay fitted
    from kvsched.experiments.calibrate import _constrained

    kept, dropped = _constrained(DEFAULT_FIT_PARAMS, [dataclasses.replace(ok, tp=2)])
    assert list(kept) == list(DEFAULT_FIT_PARAMS) and dropped == ()


# ------------------------------------------------------------------------------------------------
# calibration files


def test_calibration_file_missing_a_fitted_fields_value_is_refused_naming_it(tmp_path):
    doc = CalibrationFile("H100-SXM", 1, CostParams(mbu=0.7), fitted=("mbu", "mfu_max")).to_dict()
    del doc["cost_params"]["mfu_max"]
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="mfu_max") as err:
        load_calibration(p)
    assert "fitted" in _one_line(err)
    del doc["cost_params"]["mbu"]  # an unfitted field missing still takes its default
    doc["fitted"] = []
    p.write_text(json.dumps(doc))
    assert load_calibration(p).cost == CostParams()


# ------------------------------------------------------------------------------------------------
# the tail fit on stages that publish only some TTFT quantiles


@dataclasses.dataclass
class _Res:
    ttft_quantiles_ms: dict


def test_tail_residuals_score_only_the_quantiles_a_stage_publishes(runs):
    from kvsched.experiments.calibrate import tail_quantiles, tail_residuals

    ok = runs[0]
    partial = dataclasses.replace(ok, stages=(dataclasses.replace(ok.stages[0], ttft_quantiles_ms={"p95": 10.0,
                                                                                                   "p99": 20.0}),))
    none = dataclasses.replace(ok, exp_id="none", stages=(dataclasses.replace(ok.stages[0], ttft_quantiles_ms=None),))
    stages = ((partial.exp_id, 0), (none.exp_id, 0))
    assert tail_quantiles([partial, none], stages) == {(partial.exp_id, 0): ("p95", "p99"), ("none", 0): ()}
    pred = _Res({0: {"p95": 10.0, "p99": 40.0, "p99.9": 50.0}})
    r = tail_residuals([partial, none], [[pred, pred]], stages)
    assert np.allclose(r, [0.0, np.log(2.0)])
    with pytest.raises(ConfigError, match="no TTFT quantiles"):
        tail_quantiles([none], ((none.exp_id, 0),))


def test_tail_fit_runs_on_a_stage_with_some_quantiles(runs):
    from kvsched.experiments.calibrate import fit_tail

    ok = runs[0]
    res = replay(ok, CostParams(), client_jitter=True)
    q = {"p95": res.ttft_quantiles_ms[0]["p95"]}  # the stage JSON publishes p95 only
    e = dataclasses.replace(ok, stages=(dataclasses.replace(ok.stages[0], ttft_quantiles_ms=q),))
    tf = fit_tail([e], CostParams(), seeds=1, stage_cap_s=None, jobs=1, grid={"step_time_sigma": (0.0,)},
                  stages=((e.exp_id, 0),))
    assert tf.rms == 0.0


# ------------------------------------------------------------------------------------------------
# --plot


@pytest.mark.parametrize("name", ["p.xyz", "plot", "p.PNG.bak"])
def test_validate_and_bench_refuse_a_plot_suffix_matplotlib_cannot_write_before_any_work(tmp_path, capsys, name):
    from kvsched.experiments.cli import main

    bad = tmp_path / name
    assert main(["validate", "--groundtruth", str(tmp_path / "missing"), "--plot", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and ".png" in err and "ground" not in err
    assert main(["bench", "--cases", "blis-1k", "--plot", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and ".png" in err and "case 1/1" not in err


def test_plot_path_check_makes_a_missing_folder_and_bounds_a_long_path(tmp_path):
    from kvsched.experiments.plot_files import check_plot_suffix, prepare_plot_file

    p = tmp_path / "new" / "dir" / "p.svg"
    prepare_plot_file(p)
    assert p.parent.is_dir() and not p.exists()
    with pytest.raises(KvschedError):  # a refused suffix leaves no folder behind
        prepare_plot_file(tmp_path / "other" / "sub" / "p.foo")
    assert not (tmp_path / "other").exists()
    with pytest.raises(KvschedError) as err:
        check_plot_suffix(tmp_path / (HUGE + ".xyz"))
    _one_line(err)
    with pytest.raises(KvschedError, match="no '.x" + "x" * 20):
        check_plot_suffix(tmp_path / ("p." + HUGE))


# ------------------------------------------------------------------------------------------------
# bench: the quoted BLIS figure and CPU time beside wall time


def _render(table) -> str:
    from rich.console import Console

    c = Console(width=400, record=True)
    c.print(table)
    return c.export_text()


def test_bench_blis_column_is_marked_quoted_with_cpu_beside_wall():
    from kvsched.experiments import bench

    entry = {"case": "blis-1k", "group": "blis", "requests": 1000, "instances": 1, "sim_wall_s": 0.5,
             "sim_cpu_s": 0.25, "requests_per_s": 2000.0, "requests_per_cpu_s": 4000.0, "events": 10,
             "events_per_s": 20.0, "steps": 5, "fast_forward_steps": 1, "fast_forward_share": 0.2,
             "folded_steps": 0, "preemptions": 0, "peak_rss_mib": 100.0}
    text = _render(bench.cases_table([entry]))
    assert "x quoted BLIS (wall, CPU)" in text and "not measured in this run" in text
    ratio = 2000.0 / bench.BLIS_REFERENCE_REQ_PER_S
    assert f"{ratio:,.1f}x, {2 * ratio:,.1f}x" in text and "4,000" in text
    doc = bench.bench_report([dict(entry)])
    assert doc["cases"][0]["speedup_vs_blis_quoted_cpu"] == pytest.approx(2 * ratio)


def test_bench_peer_table_gives_cpu_time_beside_wall_time():
    from kvsched.experiments import bench

    lat = {m: {"p50": 1.0, "p99": 2.0} for m in ("ttft", "tpot", "e2e")}
    row = {"qps": 1.0, "requests": 100, "kvsched_kv_blocks": 10,
           "vidur": {"version": "0.0.26", "wall_s": 40.0, "cpu_s": 30.0, "event_loop_s": 8.0, "peak_rss_mib": 900.0,
                     "completed": 100, "num_blocks": 10, "latency_s": lat},
           "kvsched": {"process_wall_s": 2.0, "process_cpu_s": 1.5, "sim_wall_s": 0.5, "sim_cpu_s": 0.4,
                       "peak_rss_mib": 150.0, "finished": 100, "latency_s": lat}}
    text = _render(bench.peer_table(row))
    cpu = next(line for line in text.splitlines() if "CPU s (whole process" in line)
    assert "30.00" in cpu and "1.50" in cpu and "20.0" in cpu


def test_children_cpu_time_counts_a_finished_subprocess():
    import subprocess
    import sys

    from kvsched.experiments.bench import children_cpu_s

    c0 = children_cpu_s()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert children_cpu_s() - c0 > 0.05


def test_validate_only_notes_the_cost_parameters_of_the_selected_runs_gpus(runs, monkeypatch, tmp_path, capsys):
    import kvsched.experiments.groundtruth as gt
    from kvsched.experiments.cli import main

    ok = runs[0]
    a100 = dataclasses.replace(ok, exp_id="20990101-000004-llama-2-7b-tp1-a100", hardware="A100")
    monkeypatch.setattr(gt, "find_groundtruth", lambda path=None: tmp_path)
    monkeypatch.setattr(gt, "load_experiments", lambda root, model_configs=None: [ok, a100])
    assert main(["validate", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "cost parameters for runs on A100-80GB" in out and "(A100, H100)" in out
    assert main(["validate", "--jobs", "1", "--only", ok.exp_id]) == 0
    out = capsys.readouterr().out
    assert "cost parameters for runs on A100" not in out and "kvsched vs real vLLM (H100)" in out
