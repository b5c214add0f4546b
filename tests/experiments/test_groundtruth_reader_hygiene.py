"""The ground-truth reader refuses what the scores cannot use and says what it leaves out
(experiments/groundtruth.py): a measured latency of 0 (every score divides by it), conflicting
duplicate csv rows, conflicting offload / data-parallel knobs, non-integer integers, and malformed
fields -- each a one-line skip reason naming the file, the field and the value -- while a malformed
peer prediction only drops that peer's value; stage files, simulators and a preset's config.json
that are not used are named in the run's notes. ``kv_offloading_size`` sizes the replay's DRAM tier
as vLLM splits it over the TP ranks (experiments/replay.py ``instance_spec_for``)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from synthetic_groundtruth import SP, csv_rows, make_root, write_training_run

from kvsched.envs.sim.hardware import GiB
from kvsched.experiments.groundtruth import load_experiments

RUN = "20990101-000000-llama-2-7b-tp1-codegen"
CSV_RUN = "95-qwen2-5-7b-instruct-tp1-codegen-1-1"


def _root(tmp_path: Path, exp_config_extra: str = "", rows: list | None = None) -> Path:
    (tmp_path / "gt").mkdir()
    root = make_root(tmp_path / "gt")
    write_training_run(root, RUN, exp_config_extra=exp_config_extra)
    pd.DataFrame(rows if rows is not None else csv_rows(CSV_RUN)).to_csv(
        root / "sim_to_real" / "trainval_error_records.csv", index=False)
    return root


def _stage_file(root: Path) -> Path:
    return root / "training_default_args" / RUN / "results" / "stage_0_lifecycle_metrics.json"


def _edit_stage(root: Path, edit) -> None:
    p = _stage_file(root)
    doc = json.loads(p.read_text())
    edit(doc)
    p.write_text(json.dumps(doc))


def _by_id(root: Path, **kw) -> dict:
    return {e.exp_id: e for e in load_experiments(root, **kw)}


def _one_line(reason: str | None) -> str:
    assert reason is not None and "\n" not in reason and len(reason) < 700, reason
    assert "\\'" not in reason and not reason.startswith("unreadable: ConfigError: '"), reason  # quoted once
    return reason


# -- 1. a measured latency of 0 -----------------------------------------------------------------
def test_a_zero_latency_in_a_stage_json_skips_the_run_naming_file_and_field(tmp_path):
    root = _root(tmp_path)
    _edit_stage(root, lambda d: d["successes"]["latency"]["time_to_first_token"].update(p99=0.0))
    reason = _one_line(_by_id(root)[RUN].skip_reason)
    assert "stage_0_lifecycle_metrics.json" in reason and "time_to_first_token.p99=0.0" in reason and "> 0" in reason


def test_a_zero_csv_actual_skips_the_run_naming_column_stage_and_metric(tmp_path):
    rows = csv_rows(CSV_RUN)
    rows[1]["actual"] = 0.0  # ttft_p90
    write = _root(tmp_path, rows=rows)
    reason = _one_line(_by_id(write)[CSV_RUN].skip_reason)
    assert "actual=0.0" in reason and "'ttft_p90'" in reason and "> 0" in reason


# -- 4. conflicting duplicate csv rows --------------------------------------------------------------
@pytest.mark.parametrize("column,needle", [("predicted", "predict 40.0 and 99.0"), ("actual", "actual=40.0 and 99.0")])
def test_conflicting_duplicate_csv_rows_skip_the_run_naming_both_values(tmp_path, column, needle):
    rows = csv_rows(CSV_RUN)
    rows.append({**rows[1], column: 99.0})  # ttft_p90 again, another value
    reason = _one_line(_by_id(_root(tmp_path, rows=rows))[CSV_RUN].skip_reason)
    assert needle in reason and "ttft_p90" in reason


def test_identical_duplicate_csv_rows_are_read_once(tmp_path):
    rows = csv_rows(CSV_RUN)
    e = _by_id(_root(tmp_path, rows=rows + [dict(rows[1])]))[CSV_RUN]
    assert e.skip_reason is None and e.stages[0].peers_ms["ttft_p90"] == {"vidur": 40.0}


# -- 5. kv_offloading_size and conflicting knobs ---------------------------------------------------
@pytest.mark.parametrize("tp,gib", [(1, 2.0), (2, 2.0), (2, 16.0)])
def test_kv_offloading_size_sets_the_dram_tier_split_over_tp_ranks(tmp_path, tp, gib):
    from kvsched.experiments.replay import instance_spec_for

    root = _root(tmp_path, exp_config_extra=f"kv_offloading_size: {gib}\n")
    cfg = root / "training_default_args" / RUN / "exp-config.yaml"
    cfg.write_text(cfg.read_text().replace("tensor_parallelism: 1", f"tensor_parallelism: {tp}"))
    e = _by_id(root)[RUN]
    assert e.skip_reason is None and e.cpu_offload and e.kv_offloading_gib == gib
    spec = instance_spec_for(e)
    block = spec.kv_bytes_per_block_per_gpu * tp  # vLLM: one CPU block holds every TP rank's share
    assert spec.dram_kv_bytes == (gib * GiB // block) * spec.kv_bytes_per_block
    assert gib * GiB - block < spec.dram_kv_bytes <= gib * GiB  # the whole engine's buffer, not gib per rank


@pytest.mark.parametrize("extra,needles", [
    ("data_parallelism: 2\ndata_parallel_size: 4\n", ("data_parallelism=2", "data_parallel_size=4")),
    ("cpu_offload: false\nkv_offloading_size: 8\n", ("cpu_offload=False", "kv_offloading_size=8")),
    ("kv_offloading_size: 0\n", ("kv_offloading_size=0", "> 0")),
    ("max_model_len_extra: 1\n", None),
])
def test_conflicting_offload_and_data_parallel_knobs_skip_the_run_naming_both(tmp_path, extra, needles):
    e = _by_id(_root(tmp_path, exp_config_extra=extra))[RUN]
    if needles is None:  # an unknown key is a note, not a skip
        assert e.skip_reason is None
        return
    reason = _one_line(e.skip_reason)
    assert "exp-config.yaml" in reason and all(n in reason for n in needles), reason


def test_equal_data_parallel_keys_are_read(tmp_path):
    e = _by_id(_root(tmp_path, exp_config_extra="data_parallelism: 2\ndata-parallel-size: 2\n"))[RUN]
    assert e.skip_reason is None and e.dp == 2


# -- 6. skip reasons name the file, the field and the value ----------------------------------------
def _set(path, value):
    def edit(doc):
        cur = doc
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_set(("load_summary", "count"), float("nan")), "load_summary.count=nan"),
    (_set(("successes", "latency"), None), "successes.latency=None"),
    (_set(("successes", "latency", "time_to_first_token", "p90"), "0.04"), "time_to_first_token.p90='0.04'"),
    (_set(("successes", "latency", "request_latency", "mean"), 0.02), "request_latency.mean=0.02 s is not above"),
    (lambda d: d["successes"].pop("output_len"), "successes.output_len is missing"),
])
def test_a_malformed_stage_json_field_is_named_with_its_file(tmp_path, edit, needle):
    root = _root(tmp_path)
    _edit_stage(root, edit)
    reason = _one_line(_by_id(root)[RUN].skip_reason)
    assert "stage_0_lifecycle_metrics.json" in reason and needle in reason, reason


def test_a_resolved_config_without_num_groups_is_named(tmp_path):
    root = _root(tmp_path)
    (root / "training_default_args" / RUN / "results" / "config.yaml").write_text(
        "data:\n  shared_prefix:\n    num_prompts_per_group: 10\n")
    reason = _one_line(_by_id(root)[RUN].skip_reason)
    assert "results/config.yaml" in reason and "data.shared_prefix.num_groups is missing" in reason


@pytest.mark.parametrize("stage,needle", [({"rate": 0, "duration": 6}, "load.stages[0].rate=0"),
                                          ({"rate": 2.0, "duration": "6"}, "load.stages[0].duration='6'")])
def test_a_profile_stage_out_of_range_is_named_with_its_file(tmp_path, stage, needle):
    root = _root(tmp_path)
    (root / "training_default_args" / RUN / "profile.yaml").write_text(json.dumps(
        {"data": {"shared_prefix": SP, "type": "shared_prefix"}, "load": {"stages": [stage], "type": "constant"}}))
    reason = _one_line(_by_id(root)[RUN].skip_reason)
    assert "profile.yaml" in reason and needle in reason


def test_a_text_csv_actual_is_named_with_its_column_and_row(tmp_path):
    rows = csv_rows(CSV_RUN)
    rows[0]["actual"] = "oops"
    reason = _one_line(_by_id(_root(tmp_path, rows=rows))[CSV_RUN].skip_reason)
    assert "column actual='oops'" in reason and "'ttft_mean'" in reason and "'vidur'" in reason


def test_a_malformed_peer_prediction_drops_that_peer_not_the_run(tmp_path):
    rows = csv_rows(CSV_RUN)
    rows.append({**rows[0], "simulator": "blis-evolved", "predicted": "abc"})
    rows.append({**rows[1], "simulator": "blis-evolved", "predicted": 41.0})
    e = _by_id(_root(tmp_path, rows=rows))[CSV_RUN]
    assert e.skip_reason is None
    assert e.stages[0].peers_ms["ttft_mean"] == {"vidur": 30.0}  # blis-evolved's 'abc' dropped
    assert e.stages[0].peers_ms["ttft_p90"] == {"vidur": 40.0, "blis-evolved": 41.0}
    assert any("predicted='abc'" in n and "blis-evolved" in n for n in e.notes), e.notes


# -- 10. nothing dropped or truncated without a word -----------------------------------------------
def test_a_stage_json_beyond_the_profile_is_named_in_the_notes(tmp_path):
    root = _root(tmp_path)
    stage0 = _stage_file(root)
    (stage0.parent / "stage_1_lifecycle_metrics.json").write_text(stage0.read_text())
    e = _by_id(root)[RUN]
    assert e.skip_reason is None and len(e.stages) == 1
    assert any("stage_1_lifecycle_metrics.json beyond profile.yaml's 1 load stage" in n for n in e.notes), e.notes


def test_csv_rows_of_an_unknown_simulator_are_named_in_the_notes(tmp_path):
    rows = csv_rows(CSV_RUN) + [{**r, "simulator": "my-sim"} for r in csv_rows(CSV_RUN)]
    e = _by_id(_root(tmp_path, rows=rows))[CSV_RUN]
    assert e.skip_reason is None and any("my-sim" in n and "not scored" in n for n in e.notes), e.notes


def test_a_fractional_stage_index_is_refused_not_truncated(tmp_path):
    rows = csv_rows(CSV_RUN)
    for r in rows:
        r["stage_index"] = 0.5
    reason = _one_line(_by_id(_root(tmp_path, rows=rows))[CSV_RUN].skip_reason)
    assert "stage_index=0.5" in reason and "integer" in reason


@pytest.mark.parametrize("key,value", [("max_model_len", "4096.7"), ("tensor_parallelism", "1.5"),
                                       ("max_num_seqs", "0")])
def test_a_non_integer_engine_integer_is_refused_not_truncated(tmp_path, key, value):
    root = _root(tmp_path)
    cfg = root / "training_default_args" / RUN / "exp-config.yaml"
    cfg.write_text("\n".join(f"{key}: {value}" if line.startswith(f"{key}:") else line
                             for line in cfg.read_text().splitlines()) + "\n")
    reason = _one_line(_by_id(root)[RUN].skip_reason)
    assert f"exp-config.yaml: {key}={value}" in reason and "an integer >= 1" in reason


def test_a_presets_differing_config_json_is_named_in_the_notes(tmp_path):
    root = _root(tmp_path)
    d = tmp_path / "configs" / "llama-2-7b-hf"
    d.mkdir(parents=True)
    d.joinpath("config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "max_position_embeddings": 4096, "torch_dtype": "float16"}))
    e = _by_id(root, model_configs=tmp_path / "configs")[RUN]
    assert e.skip_reason is None and e.model is not None and e.model.n_layers == 32  # the preset, as documented
    assert any("preset Llama-2-7B used" in n and "n_layers 32 vs 16" in n for n in e.notes), e.notes

