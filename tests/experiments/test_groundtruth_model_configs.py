"""Ground-truth runs of models that are no preset, read from their Hugging Face config.json
(experiments/groundtruth.py ``resolve_model``, ``kvsched validate --model-configs``).

A synthetic ground truth holds one training run of a preset (the family's workload) and csv runs of
models kvsched has no preset for: one with its config.json in ``model_configs/`` (replayed, in
worker processes too), one with an int4 precision (its W4A16 checkpoint), one without a config
(skipped, the reason says how to give one) and one whose config kvsched cannot model (skipped
with the config's own error).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from synthetic_groundtruth import csv_rows, make_root, write_training_run

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.groundtruth import config_dir_for, load_experiments

TRAIN = "20990101-000000-llama-2-7b-tp1-codegen"
CONFIGURED = "81-tiny-llama-tp1-codegen-1-1"
INT4 = "82-tiny-llama-tp1-codegen-w4a16"
NO_CONFIG = "83-unknown-13b-tp1-codegen-1-1"
UNMODELLED = "84-gpt-oss-20b-tp1-codegen-1-1"
TINY = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def gt(tmp_path_factory) -> Path:
    root = make_root(tmp_path_factory.mktemp("groundtruth"))
    write_training_run(root, TRAIN)
    rows = (csv_rows(CONFIGURED, "acme/Tiny-Llama", precision="BF16")
            + csv_rows(INT4, "acme/Tiny-Llama", precision="W4A16")
            + csv_rows(NO_CONFIG, "acme/Unknown-13B", precision="BF16")
            + csv_rows(UNMODELLED, "openai/gpt-oss-20b", precision="BF16"))
    pd.DataFrame(rows).to_csv(root / "sim_to_real" / "trainval_error_records.csv", index=False)
    configs = root / "model_configs"
    (configs / "tiny-llama").mkdir(parents=True)  # inference-sim's layout: the lower-cased repo name
    (configs / "tiny-llama" / "config.json").write_text(json.dumps(TINY))
    (configs / "gpt-oss-20b").mkdir()
    (configs / "gpt-oss-20b" / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt_oss"}))
    return root


@pytest.fixture(scope="module")
def exps(gt):
    return {e.exp_id: e for e in load_experiments(gt)}


def test_a_model_with_a_config_in_model_configs_is_replayed_as_read(exps):
    e = exps[CONFIGURED]
    assert e.skip_reason is None, e.skip_reason
    assert e.model is not None and e.model.name == "Tiny-Llama" and e.model.tied_embeddings
    assert e.preset == "Tiny-Llama"
    int4 = exps[INT4]
    assert int4.skip_reason is None and int4.model.name == "Tiny-Llama-INT4"
    assert (int4.model.weight_dtype, int4.model.quantized_weights, int4.weight_dtype) == ("int4", "linear", "auto")


def test_a_model_without_preset_or_config_is_skipped_with_how_to_give_one(exps, gt):
    assert "no kvsched model preset" in exps[NO_CONFIG].skip_reason
    assert "no config.json in" in exps[NO_CONFIG].skip_reason
    assert "attention sinks" in exps[UNMODELLED].skip_reason
    assert {e.exp_id: e.skip_reason for e in load_experiments(gt, gt / "training_default_args")}[CONFIGURED] \
        .startswith("model 'acme/Tiny-Llama' matches no kvsched model preset")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_experiments(gt, gt / "nope")


def test_config_lookup_stays_inside_the_configs_folder(gt):
    configs = gt / "model_configs"
    assert config_dir_for("acme/Tiny-Llama", configs) == configs / "tiny-llama"
    assert config_dir_for("acme/..", configs) is None
    (gt / "outside").mkdir(exist_ok=True)
    (gt / "outside" / "config.json").write_text(json.dumps(TINY))
    assert config_dir_for("model_configs/../outside", configs) is None  # the id as folders, never above
    assert config_dir_for(str(gt / "outside"), configs) is None  # nor an absolute id (joined, it replaced the folder)
    assert config_dir_for("elsewhere/tiny-llama", configs) == configs / "tiny-llama"  # by its repo name
    assert config_dir_for("acme/Tiny-Llama", None) is None


def test_validate_scores_a_config_model_in_worker_processes(exps):
    from kvsched.envs.sim.calibration import default_cost_params
    from kvsched.experiments.validate import score

    chosen = [exps[TRAIN], exps[CONFIGURED], exps[INT4]]
    report = score(chosen, default_cost_params("H100-SXM"), jobs=2, stage_cap_s=4.0)
    assert {CONFIGURED, INT4} <= set(report.rows["exp_id"])
    pred = report.rows.set_index(["exp_id", "metric"])["kvsched_ms"]
    assert pred[(INT4, "itl_mean")] < pred[(CONFIGURED, "itl_mean")]  # 4-bit weights stream faster


def test_runs_table_names_the_model_spec_each_run_was_replayed_with(exps, gt):
    """runs.csv (``kvsched validate --out``) gave only the run's model id: whether a preset or a
    config.json (which one) was replayed, and whether the prompts were re-tokenised, was not said."""
    from kvsched.experiments.validate import runs_table

    runs = runs_table(list(exps.values()), [TRAIN]).set_index("exp_id")
    assert runs.loc[TRAIN, "model"] == "Llama-2-7B" and runs.loc[TRAIN, "model_source"].startswith("HF meta-llama")
    assert runs.loc[TRAIN, "prompt_scale"] > 1.0  # Llama-2's tokenizer: measured re-tokenisation
    assert runs.loc[CONFIGURED, "model"] == "Tiny-Llama"
    assert str(gt / "model_configs" / "tiny-llama" / "config.json") in runs.loc[CONFIGURED, "model_source"]
    assert runs.loc[CONFIGURED, "prompt_scale"] == 1.0  # no measurement for its tokenizer: nominal lengths
    assert runs.loc[INT4, "model"] == "Tiny-Llama-INT4"
    assert runs.loc[NO_CONFIG, "model"] == "" and runs.loc[NO_CONFIG, "split"] == "not replayed"


def test_validate_prints_a_model_configs_path_with_brackets_as_written(gt, tmp_path, capsys):
    """A skip reason names the --model-configs folder (and a config's error its file); a folder
    ``mc[`` holding ``b]`` made ``kvsched validate`` die with rich's MarkupError (``[/b]`` read as a
    closing tag) in the csv-coverage table and the skipped lines, after every replay had run."""
    import shutil

    from kvsched.experiments.cli import main

    odd = tmp_path / "mc[" / "b]"
    shutil.copytree(gt / "model_configs", odd)
    assert main(["validate", "--groundtruth", str(gt), "--model-configs", str(odd), "--stage-cap-s", "2",
                 "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert f"has no config.json in '{odd}'" in out
    assert f"{odd / 'gpt-oss-20b' / 'config.json'}" in out


def test_a_calibration_fitted_on_a_config_model_says_which_config_it_read(exps, gt):
    """The calibration file listed the training runs by id only: a run whose model came from a
    config.json of --model-configs (no preset) could not be replayed again, nor the fit reproduced,
    without knowing which file; its notes now name the model and the config.json read."""
    from kvsched.experiments.calibrate import DEFAULT_FIT_PARAMS, calibrate

    cal, _ = calibrate(list(exps.values()), [TRAIN, CONFIGURED], params=DEFAULT_FIT_PARAMS[:1], stage_cap_s=2.0,
                       max_nfev=1, jobs=1)
    read = [n for n in cal.notes if n.startswith("models read from a Hugging Face config.json")]
    assert len(read) == 1 and f"{CONFIGURED}: Tiny-Llama" in read[0]
    assert str(gt / "model_configs" / "tiny-llama" / "config.json") in read[0] and TRAIN not in read[0]
