"""An adversarial ground-truth directory never stops ``load_experiments`` with a traceback: a run
whose measured values are NaN, negative, or make the ITL identity divide by zero (mean output
length <= 1, csv itl_mean 0), or whose JSON nests too deeply, is skipped with a one-line reason;
a malformed index file (csv without its columns or not a csv, blis experiments file of another
shape) is one ConfigError naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.groundtruth import load_experiments

SP = {"system_prompt_len": 32, "question_len": 200, "output_len": 12}
RUN = "20990101-000000-llama-2-7b-tp1-codegen"
CSV_RUN = "91-qwen2-5-7b-instruct-tp1-codegen-1-1"
MEASURED = {"ttft_mean": 30.0, "ttft_p90": 40.0, "ttft_p99": 50.0, "itl_mean": 8.0, "e2e_mean": 120.0,
            "e2e_p90": 130.0, "e2e_p99": 140.0}


def _stage_json(output_len_mean: float = 12.0, ttft_mean: float = 0.03) -> dict:
    return {"load_summary": {"count": 12}, "failures": {"count": 0},
            "successes": {"latency": {"time_to_first_token": {"mean": ttft_mean, "p90": 0.04, "p99": 0.05},
                                      "request_latency": {"mean": 0.12, "p90": 0.13, "p99": 0.14}},
                          "output_len": {"mean": output_len_mean},
                          "prompt_len": {"mean": 1.0, "min": 1.0, "max": 1.0, "p10": 1.0, "p90": 1.0}}}


def _write(root: Path, stage_text: str | None = None, csv_actual: dict | None = None) -> Path:
    d = root / "training_default_args" / RUN
    (d / "results").mkdir(parents=True)
    (root / "blis").mkdir()
    (root / "sim_to_real").mkdir()
    (root / "README.md").write_text("adversarial ground truth\n")
    (d / "exp-config.yaml").write_text("model: meta-llama/Llama-2-7b-hf\ntensor_parallelism: 1\n"
                                       "max_model_len: 4096\nmax_num_batched_tokens: 2048\nmax_num_seqs: 128\n")
    (d / "profile.yaml").write_text(json.dumps({"data": {"shared_prefix": SP, "type": "shared_prefix"},
                                                "load": {"stages": [{"rate": 2.0, "duration": 6}],
                                                         "type": "constant"}}))
    (d / "results" / "stage_0_lifecycle_metrics.json").write_text(stage_text or json.dumps(_stage_json()))
    (root / "blis" / "trained_physics_iter29_experiments.json").write_text(json.dumps({"experiments": []}))
    actual = {**MEASURED, **(csv_actual or {})}
    pd.DataFrame([{"simulator": "vidur", "experiment_folder": f"/x/{CSV_RUN}", "model": "Qwen/Qwen2.5-7B-Instruct",
                   "workload": "codegen", "stage_index": 0, "metric_name": m, "predicted": v, "actual": v,
                   "hardware": "H100", "tp": 1} for m, v in actual.items()]).to_csv(
        root / "sim_to_real" / "trainval_error_records.csv", index=False)
    return root


def _reason(exps, exp_id: str) -> str:
    return next(e.skip_reason or "" for e in exps if e.exp_id == exp_id)


@pytest.mark.parametrize("stage_text,needle", [
    (json.dumps(_stage_json(output_len_mean=1.0)), "output_len.mean=1.0"),  # was ZeroDivisionError
    (json.dumps(_stage_json(output_len_mean=0.0)), "output_len.mean=0.0"),  # was a negative ITL
    (json.dumps(_stage_json()).replace('"mean": 0.03', '"mean": NaN'), "time_to_first_token.mean=nan"),
    (json.dumps(_stage_json(ttft_mean=-0.01)), "time_to_first_token.mean=-0.01"),
    ("[" * 100_000 + "]" * 100_000, "invalid JSON"),  # was RecursionError
])
def test_a_run_with_unusable_measurements_is_skipped_with_a_one_line_reason(tmp_path, stage_text, needle):
    exps = load_experiments(_write(tmp_path, stage_text=stage_text))
    reason = _reason(exps, RUN)
    assert needle in reason and "\n" not in reason and len(reason) < 700
    assert not _reason(exps, CSV_RUN).startswith("unreadable")  # the other run is still read


@pytest.mark.parametrize("edit,needle", [({"itl_mean": 0.0}, "actual=0.0 (stage 0, 'itl_mean'"),  # was ZeroDivision
                                         ({"ttft_p99": -5.0}, "actual=-5.0 (stage 0, 'ttft_p99'"),
                                         ({"e2e_mean": float("nan")}, "nan")])
def test_a_csv_run_with_unusable_measurements_is_skipped(tmp_path, edit, needle):
    reason = _reason(load_experiments(_write(tmp_path, csv_actual=edit)), CSV_RUN)
    assert reason.startswith("unreadable") and needle in reason


@pytest.mark.parametrize("index,text,needle", [
    ("sim_to_real/trainval_error_records.csv", "simulator,model\nvidur,x\n", "missing column(s) experiment_folder"),
    ("sim_to_real/trainval_error_records.csv", 'a,b\n"unterminated\n1,2,3\n', "not a readable csv"),
    ("blis/trained_physics_iter29_experiments.json", "{}", "'experiments' is a list of objects"),
    ("blis/trained_physics_iter29_experiments.json", "[1, 2]", "'experiments' is a list of objects"),
])
def test_a_malformed_index_file_is_one_config_error_naming_it(tmp_path, index, text, needle):
    root = _write(tmp_path)
    (root / index).write_text(text)
    with pytest.raises(ConfigError, match=r"trainval_error_records|trained_physics") as e:
        load_experiments(root)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_validate_with_every_selected_run_skipped_is_one_config_error(tmp_path):
    from kvsched.envs.sim.cost_params import CostParams
    from kvsched.experiments.validate import score

    exps = load_experiments(_write(tmp_path, stage_text=json.dumps(_stage_json(output_len_mean=1.0))))
    with pytest.raises(ConfigError, match=rf"no experiment to replay: all 1 selected were skipped; first: {RUN}"):
        score(exps, CostParams(), only=[RUN])  # the summary table used to fail with KeyError 'metric'


@pytest.mark.parametrize("dp", [0, 65, 10 ** 9, 1.5])
def test_data_parallel_replicas_outside_one_to_max_dp_skip_the_run(tmp_path, dp):
    root = _write(tmp_path)
    cfg = root / "training_default_args" / RUN / "exp-config.yaml"
    cfg.write_text(cfg.read_text() + f"data_parallelism: {dp}\n")
    reason = _reason(load_experiments(root), RUN)
    assert "data_parallelism=" in reason and "[1, 64]" in reason  # 10**9 replicas used to run for hours


def test_calibrate_errors_bound_the_experiment_lists_they_print(tmp_path):
    from kvsched.experiments.calibrate import calibrate

    exps = load_experiments(_write(tmp_path, stage_text=json.dumps(_stage_json(output_len_mean=1.0))))
    with pytest.raises(ConfigError, match="unknown training experiment") as e:
        calibrate(exps, [f"no-such-run-{i}" for i in range(10_000)])
    assert len(str(e.value)) < 800
    with pytest.raises(ConfigError, match="cannot be replayed") as e:
        calibrate(exps, [RUN])
    assert len(str(e.value)) < 1000 and "\n" not in str(e.value)
