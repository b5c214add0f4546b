"""Reading ground-truth runs never seen before (experiments/groundtruth.py, replay.py, validate.py).

A synthetic ground-truth directory in the layout of ``shared/groundtruth`` holds one published-style
run and several new ones: a csv experiment absent from the blis experiments file on another GPU
with the knobs set (gpu_mem_util, cpu_offload, dp, max_num_batched_tokens), one of an unknown
workload family, one with an invalid column, and a training folder missing a file. The new run must
be replayed with its family's profile and the row's knobs; the others get skip reasons, never an
exception that stops the whole read or validate.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from synthetic_groundtruth import SP, csv_rows, make_root, write_training_run

from kvsched.experiments.groundtruth import METRICS, load_experiments

KNOWN = "70-qwen2-5-7b-instruct-tp1-codegen-1-1"
NEW = "91-qwen2-5-7b-instruct-tp1-codegen-a100-offload"
NO_FAMILY = "92-qwen2-5-7b-instruct-tp1-chat-1-1"
BAD_UTIL = "93-qwen2-5-7b-instruct-tp1-codegen-bad"
TRAIN = "20990101-000000-llama-2-7b-tp1-codegen"
BROKEN = "20990101-000001-llama-2-7b-tp1-general"
TOO_LONG = "20990101-000002-llama-2-7b-tp1-roleplay"  # prompts beyond Llama-2's 4,096-token context


@pytest.fixture(scope="module")
def gt(tmp_path_factory) -> Path:
    stages = [{"rate": 2.0, "duration": 6}]
    blis = [{"id": "70", "tp": 1, "max_num_seqs": 128, "max_num_batched_tokens": 2048, "total_kv_blocks": 5000,
             "cpu_kv_blocks": 0, "model": "Qwen/Qwen2.5-7B-Instruct",
             "workload": {"inference_perf": {"shared_prefix": SP, "stages": stages}}}]
    root = make_root(tmp_path_factory.mktemp("groundtruth"), blis)
    write_training_run(root, TRAIN)
    write_training_run(root, BROKEN, shared_prefix=None)  # BROKEN has no profile.yaml
    write_training_run(root, TOO_LONG, shared_prefix={**SP, "question_len": 5000})
    rows = (csv_rows(KNOWN, workload="codegen")
            + csv_rows(NEW, workload="codegen", hardware="A100-80GB", gpu_mem_util=0.95, cpu_offload=True, dp=2,
                    max_num_batched_tokens=1024)
            + csv_rows(NO_FAMILY, workload="chat")
            + csv_rows(BAD_UTIL, workload="codegen", gpu_mem_util="lots"))
    pd.DataFrame(rows).to_csv(root / "sim_to_real" / "trainval_error_records.csv", index=False)
    return root


@pytest.fixture(scope="module")
def exps(gt):
    return {e.exp_id: e for e in load_experiments(gt)}


def test_an_unseen_csv_run_is_replayed_with_its_familys_workload_and_its_rows_knobs(exps):
    e = exps[NEW]
    assert e.skip_reason is None, e.skip_reason
    assert e.workload_source == "blis:70"  # same model and family in the blis file beats the §1 profile
    assert (e.hardware, e.gpu_memory_utilization, e.cpu_offload, e.dp, e.max_num_batched_tokens) == \
        ("A100-80GB", 0.95, True, 2, 1024)
    assert e.total_kv_blocks is None  # not logged for this configuration: derived from memory
    assert any("derived from memory" in n for n in e.notes)
    assert exps[KNOWN].total_kv_blocks == 5000 and exps[KNOWN].workload_source == "run"


def test_runs_that_cannot_be_read_get_a_skip_reason_naming_the_cause(exps):
    assert "family 'chat'" in exps[NO_FAMILY].skip_reason
    assert "gpu_mem_util" in exps[BAD_UTIL].skip_reason and "'lots'" in exps[BAD_UTIL].skip_reason
    assert "profile.yaml" in exps[BROKEN].skip_reason
    assert exps[TRAIN].skip_reason is None


def test_the_served_system_of_an_unseen_run_follows_its_gpu_utilisation_and_offload(exps):
    from kvsched.envs.sim.specs import CostParams
    from kvsched.experiments.replay import cost_source, instance_spec_for

    e = exps[NEW]
    spec = instance_spec_for(e, CostParams(mfu_max=0.3))
    assert spec.gpu.name == "A100-80GB" and spec.gpu_memory_utilization == 0.95
    assert spec.cost_params.mfu_max != 0.3  # the given cost is the H100's: A100 runs keep their own
    assert cost_source(e) == "calibration"  # A100-80GB ships one (fitted on operator profiles)
    assert cost_source(e.__class__(**{**e.__dict__, "hardware": "L40S"})) == "host terms transferred"
    h200 = e.__class__(**{**e.__dict__, "hardware": "H200"})
    assert cost_source(h200) == "given"  # the H100's chip: a candidate H100 calibration applies
    assert instance_spec_for(h200, CostParams(mfu_max=0.3)).cost_params.mfu_max == 0.3
    assert spec.prefix_offload is not None and spec.prefix_offload.load_policy == "always"
    assert spec.num_dram_blocks > 0
    lower = instance_spec_for(e.__class__(**{**e.__dict__, "gpu_memory_utilization": 0.9}))
    assert lower.num_hbm_blocks < spec.num_hbm_blocks


def test_validate_replays_unseen_runs_lists_skips_and_says_which_gpu_uses_default_costs(gt, exps):
    """A run that fails in its replay (its prompts exceed the model's context) is skipped with its
    error; the others are scored."""
    from kvsched.envs.sim.calibration import default_cost_params
    from kvsched.experiments.validate import cost_notes, score

    report = score(list(exps.values()), default_cost_params("H100-SXM"), jobs=1,
                   stage_cap_s=4.0)
    replayed = set(report.rows["exp_id"])
    assert {NEW, KNOWN, TRAIN} <= replayed
    assert {s[0] for s in report.skipped} == {NO_FAMILY, BAD_UTIL, BROKEN, TOO_LONG}
    assert "replay failed" in dict(report.skipped)[TOO_LONG]
    assert set(report.rows.loc[report.rows["exp_id"] == NEW, "metric"]) == set(METRICS)
    notes = cost_notes(list(exps.values()))
    assert any("A100-80GB" in n and "its shipped calibration" in n for n in notes)
