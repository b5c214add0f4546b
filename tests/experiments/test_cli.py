"""The `kvsched` command line: outputs, provenance, and clean errors on bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import RECORD_COLUMNS
from kvsched.experiments.cli import main
from kvsched.runner.scenario import load_scenario


def test_simulate_writes_records_summary_occupancy_and_provenance(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["simulate", "--max-requests", "300", "--out", str(out), "--json", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(printed) == summary
    assert summary["classes"]["all"]["counts"]["arrived"] == 300
    rec = pd.read_csv(out / "records.csv")
    assert list(rec.columns) == list(RECORD_COLUMNS) and len(rec) == 300
    assert (rec.status == "finished").all()
    # TTFT in the summary is the mean over the records' first_token - arrival
    ttft = (rec.first_token_s - rec.arrival_s).mean()
    assert summary["classes"]["all"]["ttft_s"]["mean"] == pytest.approx(ttft, rel=1e-12)
    run = json.loads((out / "run.json").read_text())
    assert run["workload"]["source_sha256"] == "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8"
    assert run["instance"]["model"]["name"] == "Llama-3.1-8B"
    assert len(run["scenario_sha256"]) == 64
    occ = pd.read_csv(out / "occupancy.csv")
    assert (occ.used_blocks_hbm <= occ.capacity_blocks_hbm).all() and occ.used_blocks_hbm.max() > 0


def test_a_run_reruns_from_the_scenario_its_run_json_records(tmp_path):
    """run.json's ``scenario``, written as a scenario file, runs the same requests on the same
    instance: the same hash and byte-identical records and summary (its older hashed form wrote no
    limit of partial prefills as 1, which read back set a limit of one)."""
    import yaml

    sc = tmp_path / "sc.yaml"
    sc.write_text("synthetic: {rate_per_s: 8.0, duration_s: 20, prompt_median_tokens: 3000}\npolicy: fcfs\n"
                  "instance: {model: Llama-3.1-8B, gpu: H100-SXM, max_num_batched_tokens: 2048,\n"
                  "  long_prefill_token_threshold: 256, max_num_partial_prefills: null}\n")
    assert main(["simulate", "--scenario", str(sc), "--out", str(tmp_path / "a"), "--json", "--no-progress"]) == 0
    first = json.loads((tmp_path / "a" / "run.json").read_text())
    assert first["scenario"]["instance"]["max_num_partial_prefills"] is None
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(first["scenario"]))
    assert main(["simulate", "--scenario", str(again), "--out", str(tmp_path / "b"), "--json", "--no-progress"]) == 0
    second = json.loads((tmp_path / "b" / "run.json").read_text())
    assert second["scenario_sha256"] == first["scenario_sha256"] and second["instance"] == first["instance"]
    for name in ("records.csv", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_records_of_an_earlier_run_in_the_other_format_do_not_stay_beside_a_new_run(tmp_path):
    """--out written in CSV, then in Parquet: the CSV records were the earlier run's, left beside the
    new summary and run.json; run.json names its records file."""
    pytest.importorskip("pyarrow")
    out = tmp_path / "o"
    assert main(["simulate", "--scenario", "short-only", "--max-requests", "30", "--out", str(out), "--json",
                 "--no-progress"]) == 0
    assert json.loads((out / "run.json").read_text())["records"] == "records.csv"
    assert main(["simulate", "--scenario", "mixed-long-short", "--max-requests", "40", "--out", str(out),
                 "--format", "parquet", "--json", "--no-progress"]) == 0
    assert not (out / "records.csv").exists() and (out / "records.parquet").is_file()
    assert json.loads((out / "run.json").read_text())["records"] == "records.parquet"


def test_same_arguments_same_summary_bytes(tmp_path):
    for name in ("a", "b"):
        assert main(["simulate", "--max-requests", "200", "--out", str(tmp_path / name), "--json",
                     "--no-progress"]) == 0
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()


def test_table_output_names_the_setup(capsys):
    assert main(["simulate", "--max-requests", "100", "--no-progress", "--model", "Qwen2.5-7B"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-7B" in out and "TTFT p99 ms" in out and "goodput" in out


def test_a_bundled_scenario_by_name_from_any_folder_and_an_empty_file(tmp_path, monkeypatch, capsys):
    """The scenarios ship in the package: `--scenario NAME` finds one outside a checkout (the
    same run as by path); an unknown name lists the bundled ones; an empty file is refused
    rather than run with every default."""
    path = Path(__file__).parents[2] / "experiments" / "scenarios" / "mixed-long-short.yaml"
    monkeypatch.chdir(tmp_path)
    args = ["simulate", "--max-requests", "30", "--no-progress", "--json"]
    assert main(args + ["--scenario", str(path)]) == 0
    by_path = capsys.readouterr().out
    assert main(args + ["--scenario", "mixed-long-short"]) == 0
    assert capsys.readouterr().out == by_path
    assert main(args + ["--scenario", "mixed-long"]) == 2
    err = capsys.readouterr().err
    assert "nor is it a bundled scenario" in err and "mixed-long-short" in err and "short-only" in err
    (tmp_path / "empty.yaml").write_text("")
    assert main(args + ["--scenario", "empty.yaml"]) == 2
    assert "the file is empty" in capsys.readouterr().err
    for text, why in (("# a comment only\n", "the file is empty"), ("{}\n", "an empty mapping"),
                      ("[]\n", "top level must be a mapping, got list"),
                      ("false\n", "top level must be a mapping, got bool")):  # `[]`, `false` were "empty"
        (tmp_path / "empty.yaml").write_text(text)
        assert main(args + ["--scenario", "empty.yaml"]) == 2
        assert why in capsys.readouterr().err


def test_an_out_folder_named_as_the_bundled_scenario_does_not_hide_it(tmp_path, monkeypatch, capsys):
    """`simulate --scenario short-only --out short-only` made the folder short-only/ (before the
    scenario is read), which then "was" the scenario: 'is not a file', every time; a file of
    that name still wins over the bundled one."""
    from kvsched.runner.scenario import bundled_scenario_dir, scenario_path

    monkeypatch.chdir(tmp_path)
    args = ["simulate", "--scenario", "short-only", "--max-requests", "10", "--no-progress"]
    for _ in range(2):
        assert main(args + ["--out", "short-only"]) == 0
        assert (tmp_path / "short-only" / "summary.json").is_file()
    assert scenario_path("short-only") == bundled_scenario_dir() / "short-only.yaml"
    (tmp_path / "mixed-long-short.yaml").write_text("name: here\nsynthetic: {rate_per_s: 1, duration_s: 10}\n")
    assert scenario_path("mixed-long-short.yaml") == Path("mixed-long-short.yaml")
    (tmp_path / "folder").mkdir()
    assert main(["simulate", "--scenario", "folder", "--no-progress"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_output_to_a_file_keeps_table_titles_and_errors_on_one_line(capsys):
    """Off a terminal (pytest captures: not a tty) a table's title is one line above the table,
    not wrapped to the table's width, and an error is one line however long."""
    assert main(["simulate", "--max-requests", "30", "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "default: fcfs on 1 x Llama-3.1-8B / H100-SXM TP1"
    for flag in ("--scenario", "--trace", "--out"):  # a name longer than the file system allows
        assert main(["simulate", flag, "x" * 300 + ".yaml", "--max-requests", "10", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "x" * 300 in err and "Traceback" not in err


def test_output_to_a_file_keeps_table_captions_on_one_line_and_renders_title_markup(capsys):
    """Off a terminal a table's caption was wrapped to the table's width (`kvsched presets`'s
    links caption over two lines), and a str title's markup was printed as literal text (rich's
    Table renders it: on a terminal `[bold]` is not shown)."""
    from rich.table import Table

    from kvsched.experiments.consoles import stdout_console

    assert main(["presets"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "cmx-400g: only for the cluster KV tier's network (shared_kv.network)" in [line.strip() for line in out]
    t = Table(title="[bold]a title[/] over [0, 1]", caption="[dim]a caption[/] " + "long " * 30)
    t.add_column("x")
    t.add_row("1")
    stdout_console().print(t)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a title over [0, 1]" and lines[-1].rstrip() == "a caption " + " ".join(["long"] * 30)


def test_router_flags_on_one_instance_are_noted(capsys):
    """A router only acts with several instances: on one, its flags are said to have no effect
    rather than passing unremarked."""
    assert main(["simulate", "--router", "cache-affinity", "--max-requests", "10", "--no-progress"]) == 0
    assert "note: --router has no effect on 1 instance" in capsys.readouterr().err
    assert main(["simulate", "--router", "cache-affinity", "--instances", "2", "--max-requests", "10",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "no effect" not in err and "router cache-affinity" in err


def test_scenario_value_errors_name_the_file_or_the_command_line(tmp_path, capsys):
    """A bad value inside a scenario's `synthetic:` or `policy_params:` names the file it came
    from; one from the flags says "command line" (not "scenario command line")."""
    bad = {"synthetic": "name: t\nsynthetic: {rate_per_s: -1, duration_s: 10}\n",
           "policy_params": "name: t\nsynthetic: {rate_per_s: 1, duration_s: 10}\npolicy: lars\n"
                            "policy_params: {kappa: -1}\n"}
    for key, text in bad.items():
        f = tmp_path / f"{key}.yaml"
        f.write_text(text)
        assert main(["simulate", "--scenario", str(f), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert str(f) in err and ("rate_per_s=-1" in err or "kappa=-1" in err), err
    assert main(["simulate", "--policy", "lars", "--policy-params", '{"kappa": -1}', "--no-progress"]) == 2
    assert "error: command line: LARSParams.kappa=-1 is not allowed" in capsys.readouterr().err


#: the flags every `kvsched train` needs
TRAIN = ["train", "--env", "kvsched/Scheduling-v0", "--algo", "ppo"]


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "--model", "llama-9b"], "Llama-3.1-8B"),           # lists known models
    (["simulate", "--gpu", "H900"], "H100-SXM"),                     # lists known GPUs
    (["simulate", "--trace", "no-such-trace"], "azure-conv-2023"),   # lists bundled traces
    (["simulate", "--scenario", "/nonexistent.yaml"], "does not exist"),
    (["simulate", "--policy", "lars", "--policy-params", '{"kappa": -1}'], "LARSParams.kappa=-1"),
    (["simulate", "--model", "Llama-3.1-70B", "--tp", "1"], "Llama-3.1-70B"),  # weights do not fit
    (["simulate", "--policy", "magic"], "fcfs"),                      # lists known policies
    (["simulate", "--policy-params", '{"admission_preemption": "maybe"}'], "cost-gated"),  # lists the modes
    (["simulate", "--policy-params", '{"no_such": 1}'], "admission_preemption"),  # lists the parameters
    (["simulate", "--policy-params", "[1]"], "JSON object"),
])
def test_bad_input_gives_a_clean_error(argv, fragment, capsys):
    rc = main(argv + ["--no-progress", "--max-requests", "10"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "error" in err and fragment in err
    assert "Traceback" not in err


def test_evaluate_names_an_unknown_agent_before_checking_windows(tmp_path, capsys):
    """A misspelt agent is reported as that agent: it was checked only after the held-out
    windows, so ``--agents fcfs,lasr`` with the default --windows 4 (the bundled scenario has 3
    held-out 60 s windows) was reported as ``--windows=4 is more than the 3 held-out windows``."""
    rc = main(["evaluate", "--agents", "fcfs,lasr", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "agent 'lasr' is neither a checkpoint" in err and "--windows" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [TRAIN + ["--timesteps", "10"], ["evaluate", "--agents", "fcfs"]])
def test_train_and_evaluate_out_that_cannot_be_written_is_a_clean_error(argv, tmp_path, capsys):
    """--out under a file was a NotADirectoryError traceback (simulate and compare said so)."""
    (tmp_path / "f").write_text("")
    rc = main(argv + ["--out", str(tmp_path / "f" / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--out '{tmp_path / 'f' / 'run'}': cannot write there" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, flag", [
    (["simulate", "--max-requests", "0"], "--max-requests"),
    (["simulate", "--instances", "-2"], "--instances"),
    (["compare", "--policies", "fcfs", "--seeds", "0"], "--seeds"),
    (["compare", "--policies", "fcfs", "--windows", "two"], "--windows"),
    (["compare", "--policies", "fcfs", "--instances", "0"], "--instances"),
    # tune's counts were checked only after it printed its "tuning ... 0 trials" banner
    (["tune", "--policy", "lars", "--trials", "0"], "--trials"),
    (["tune", "--policy", "lars", "--workers", "-1"], "--workers"),
    (["tune", "--policy", "lars", "--windows", "0"], "--windows"),
    (["tune", "--policy", "lars", "--seeds", "0"], "--seeds"),
    (TRAIN + ["--timesteps", "0"], "--timesteps"),
    (TRAIN + ["--timesteps", "10", "--n-envs", "0"], "--n-envs"),
    (TRAIN + ["--timesteps", "10", "--eval-episodes", "0"], "--eval-episodes"),
    (["evaluate", "--agents", "fcfs", "--windows", "0"], "--windows"),
    (["evaluate", "--agents", "fcfs", "--seeds", "-1"], "--seeds"),
])
def test_count_flags_below_one_name_the_flag(argv, flag, capsys):
    """A count given on the command line is checked as the flag (argparse, exit status 2), not
    as the scenario field it overrides."""
    with pytest.raises(SystemExit) as e:
        main(argv + ["--no-progress"])
    cap = capsys.readouterr()
    err = cap.err
    assert e.value.code == 2 and f"argument {flag}:" in err
    assert "expected an integer >= 1" in err or "expected an integer in [1, " in err
    assert "scenario" not in err.split("error:")[-1] and "tuning" not in cap.out + err


@pytest.mark.parametrize("argv, flag, allowed", [
    (["--rate-scale", "-1"], "--rate-scale", "expected a finite number > 0"),
    (["--rate-scale", "0"], "--rate-scale", "expected a finite number > 0"),
    (["--rate-scale", "inf"], "--rate-scale", "expected a finite number > 0"),
    (["--tp", "3"], "--tp", "invalid choice: 3 (choose from 1, 2, 4, 8)"),
    (["--window", "5", "2"], "--window", "5 2 is not allowed: expected START_S < END_S"),
    (["--window", "-1", "5"], "--window", "-1 is not allowed: expected a finite number >= 0"),
    (["--router-delay", "-0.5"], "--router-delay", "expected a finite number >= 0"),
])
def test_number_flags_name_the_flag(argv, flag, allowed, capsys):
    """Number flags of simulate are checked as flags: the message names the flag, the value
    and what is allowed (not the scenario field the flag overrides)."""
    with pytest.raises(SystemExit) as e:
        main(["simulate", *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"kvsched simulate: error: argument {flag}: " in err and allowed in err


@pytest.mark.parametrize("argv, flag, allowed", [
    (TRAIN + ["--timesteps", "10", "--window-s", "-1"], "--window-s",
     "-1 is not allowed: expected a finite number > 0"),
    (TRAIN + ["--timesteps", "10", "--max-cpu-s", "nan"], "--max-cpu-s",
     "nan is not allowed: expected a finite number > 0"),
    (TRAIN + ["--timesteps", "10", "--max-wall-s", "0"], "--max-wall-s",
     "0 is not allowed: expected a finite number > 0"),
    (TRAIN + ["--timesteps", "10", "--num-env-runners", "-1"], "--num-env-runners",
     "-1 is not allowed: expected an integer >= 0"),
    (["evaluate", "--agents", "fcfs", "--window-s", "0"], "--window-s",
     "0 is not allowed: expected a finite number > 0"),
    (TRAIN + ["--timesteps", "10", "--threads", "0"], "--threads", "0 is not allowed: expected an integer in [1, "),
    # torch.set_num_threads(100_000) was a segmentation fault
    (TRAIN + ["--timesteps", "10", "--threads", "100000"], "--threads",
     "100000 is not allowed: expected an integer in [1, "),
])
def test_train_and_evaluate_flags_name_the_flag(argv, flag, allowed, capsys):
    """train's and evaluate's numbers are checked as flags (the episode window used to be
    reported as ``EpisodeConfig.window_s``, the field the flag reaches)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"kvsched {argv[0]}: error: argument {flag}: {allowed}" in err


@pytest.mark.parametrize("argv", [
    ["simulate", "--seed", "-1", "--no-progress"],
    ["train", "--env", "kvsched/Scheduling-v0", "--algo", "ppo", "--timesteps", "10", "--seed", "-3"],
    ["tune", "--policy", "lars", "--scenario", "experiments/scenarios/mixed-long-short.yaml", "--seed", "-1"],
    ["tune", "--policy", "lars", "--scenario", "experiments/scenarios/mixed-long-short.yaml", "--seed", str(2**31)],
])
def test_seed_flags_are_checked_as_flags(argv, capsys):
    """A negative (or too large) --seed is a flag error naming the range, for every command that
    takes one; it used to reach Gymnasium or Optuna and end in a traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"kvsched {argv[0]}: error: argument --seed: " in err
    assert "expected an integer in [0, 2147483647]" in err and "Traceback" not in err


def test_unknown_scenario_key_is_an_error(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("trace: azure-conv-2023\npolicy: fcfs\nrate_scael: 2\n")
    assert main(["simulate", "--scenario", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "rate_scael" in err and "rate_scale" in err


def test_messages_to_a_pipe_are_one_line_each(tmp_path, capsys):
    """Off a terminal (capsys is a pipe) errors and notes are not wrapped at rich's assumed 80
    columns: a logged message stays on one line, with the value and the allowed ones."""
    p = tmp_path / "s.yaml"
    p.write_text("trace: azure-conv-2023\npolicy: fcfs\nrate_scael: 2\n")
    assert main(["simulate", "--scenario", str(p), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) > 200
    assert lines[0].startswith("error: ") and "rate_scael" in lines[0] and lines[0].endswith("'window_s']")
    assert main(["simulate", "--window", "0", "600", "--rate-scale", "2", "--max-requests", "5", "--no-progress"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    assert any("scale_rate x2" in ln and ln.endswith("299.986 s)") for ln in notes), notes


def test_presets_and_traces_list_names(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("Llama-3.1-8B", "Llama-2-70B", "Qwen2.5-72B", "H100-SXM", "A100-80GB", "B200", "L40S",
                 "pcie5", "nvme_gen4_read", "cmx-400g", "cxl-pnm-ocp2025"):  # cmx-400g: shared_kv.network
        assert name in out
    assert main(["traces"]) == 0
    out = capsys.readouterr().out
    assert "azure-conv-2023" in out and "mooncake-conversation" in out


def test_out_path_that_is_a_file_fails_before_simulating(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["simulate", "--out", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("body, fragment", [
    ("window_s: 600\n", "window_s"),
    ("window_s: [a, 300]\n", "window_s"),
    ("oracle_lengths: maybe\n", "oracle_lengths"),
    ("metrics:\n  slos:\n    shrt: {ttft_s: 1.0, tpot_s: 0.1}\n", "shrt"),
    ("metrics:\n  slos:\n    short: {ttft_s: 1.0}\n", "tpot_s"),
    # a value error says where it is (it used to be only "SLO.ttft_s=-1 ...")
    ("metrics:\n  slos:\n    long: {ttft_s: -1, tpot_s: 0.1}\n", "s.yaml: metrics.slos.long="),
    ("metrics:\n  long_prompt_tokens: 0\n", "s.yaml: metrics: MetricsConfig.long_prompt_tokens=0"),
    ("metrics:\n  slos:\n    short: {ttft: 1.0, tpot_s: 0.1}\n",
     "unknown keys ['ttft']; missing ['ttft_s']; allowed: ttft_s, tpot_s (required), e2e_s (optional)"),
])
def test_malformed_scenario_values_are_clean_errors(tmp_path, capsys, body, fragment):
    p = tmp_path / "s.yaml"
    p.write_text("trace: azure-conv-2023\nmax_requests: 20\n" + body)
    assert main(["simulate", "--scenario", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert fragment in " ".join(err.split()) and "Traceback" not in err  # the console wraps long lines


def test_parquet_without_out_is_an_error(capsys):
    assert main(["simulate", "--format", "parquet", "--max-requests", "5", "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err


def test_records_carry_the_length_class_the_summary_groups_by(tmp_path):
    out = tmp_path / "r"
    assert main(["simulate", "--trace", "mooncake-conversation", "--max-requests", "200", "--out", str(out),
                 "--json", "--no-progress"]) == 0
    rec = pd.read_csv(out / "records.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert set(rec.length_class) == {"short", "long"}
    assert (rec.length_class == "long").sum() == summary["classes"]["long"]["counts"]["arrived"]
    assert ((rec.prompt_tokens >= 8192) == (rec.length_class == "long")).all()
    assert summary["run"]["workload"] == "mooncake-conversation" and summary["run"]["requests"] == 200


def test_policy_params_flag_sets_the_policy_parameters(tmp_path):
    """--policy-params merges over the scenario's parameters; the run records them and they act."""
    sc = "experiments/scenarios/long-context-swap-dram.yaml"
    runs = {}
    for name, extra in (("plain", []), ("gated", ["--policy-params", '{"admission_preemption": "cost-gated"}'])):
        assert main(["simulate", "--scenario", sc, "--out", str(tmp_path / name), "--json", "--no-progress"]
                    + extra) == 0
        runs[name] = json.loads((tmp_path / name / "run.json").read_text())
    assert runs["gated"]["stats"]["admission_preemptions"] > 0 == runs["plain"]["stats"]["admission_preemptions"]
    assert runs["gated"]["scenario"]["policy_params"]["admission_preemption"] == "cost-gated"


def test_tables_written_to_a_pipe_are_not_truncated(capsys):
    """Output to a file or pipe: the comparison table prints at its full width (rich would cut
    a cell that does not fit with an ellipsis, e.g. a max-wait mean ± std)."""
    from importlib.resources import files

    scenario = str(files("kvsched.experiments") / "scenarios" / "mixed-long-short.yaml")
    assert main(["compare", "--scenario", scenario, "--policies", "fcfs,lars", "--seeds", "2",
                 "--max-requests", "300", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "max wait s" in out and "…" not in out


def test_output_path_checks_accept_a_long_file_name_and_leave_no_probe(tmp_path):
    """The write probe of an --out file was named after it (`.NAME.kvsched-write-test`): a
    valid name of 236-255 bytes made the probe's name too long and a writable folder was
    refused ('its folder cannot be written (File name too long)')."""
    from kvsched.envs.sim.errors import KvschedError
    from kvsched.experiments.outputs import prepare_out_dir, prepare_out_file

    long = tmp_path / ("y" * 245 + ".json")
    prepare_out_file(long)
    long.write_text("{}")  # the name itself is fine
    prepare_out_dir(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", long.name] and not any((tmp_path / "d").iterdir())
    (tmp_path / "f").write_text("")
    with pytest.raises(KvschedError, match="/f' is not a folder"):
        prepare_out_file(tmp_path / "f" / "x.json")
    with pytest.raises(KvschedError, match="exists and is not a directory"):
        prepare_out_dir(tmp_path / "f")


def test_every_command_of_the_table_is_in_the_help_and_has_a_handler(capsys, monkeypatch):
    """The command table is the parser: each registered subcommand is listed by `kvsched --help`
    with its help line, loads its options function and handler, its sub-parser dispatches to
    that handler and prints its own help; the parser has no subcommand the table lacks."""
    from kvsched.experiments.cli import build_parser
    from kvsched.experiments.commands import COMMANDS

    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps help to the terminal width
    names = [c.name for c in COMMANDS]
    assert len(set(names)) == len(names)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    help_lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "{" + ",".join(names) + "}" in help_lines
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == names
    for c in COMMANDS:
        assert f"{c.name} {c.help.replace('%%', '%')}" in help_lines
        add_arguments, run = c.load()
        assert callable(run) and (add_arguments is None or callable(add_arguments))
        sub.choices[c.name].format_usage()  # fills the sub-parser in
        assert sub.choices[c.name].get_default("func") is run
        with pytest.raises(SystemExit) as exit_:
            main([c.name, "--help"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: kvsched {c.name} ")


def test_help_and_parsing_simulate_import_no_heavy_library():
    """`kvsched --help` imports no command module, and neither it nor parsing `simulate` imports
    torch, Stable-Baselines3, Optuna or Ray (they stay behind train / evaluate / tune / compare)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from kvsched.experiments.cli import build_parser, main\n"
        "from kvsched.experiments.commands import COMMANDS\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "after_help = sorted(c.module for c in COMMANDS if c.module in sys.modules)\n"
        "args = build_parser().parse_args(['simulate', '--max-requests', '5', '--no-progress'])\n"
        "assert args.func.__name__ == 'cmd_simulate' and args.max_requests == 5\n"
        "heavy = sorted(m for m in ('torch', 'stable_baselines3', 'sb3_contrib', 'optuna', 'ray') "
        "if m in sys.modules)\n"
        "print(json.dumps({'after_help': after_help, 'heavy': heavy}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"after_help": [], "heavy": []}


def run_cli(argv, capsys):
    """Run the CLI; an exception escaping ``main`` is itself a failure (a traceback for the user)."""
    try:
        rc = main(argv)
    except BaseException as e:  # noqa: BLE001 - SystemExit from argparse would also be a finding
        captured = capsys.readouterr()
        pytest.fail(f"kvsched {' '.join(map(str, argv))} raised {type(e).__name__}: {e} "
                    f"(stderr: {captured.err[-300:]!r}) instead of exiting with a clean error")
    return rc, capsys.readouterr()


@pytest.mark.parametrize("yaml_text", [
    "trace: 5\n",                         # TypeError in os.fspath
    "metrics: {percentiles: 50}\n",       # TypeError in tuple()
    "metrics: abc\n",                     # ValueError in dict()
    "synthetic: [1, 2]\ntrace: null\n",   # TypeError in dict()
])
def test_scenario_fields_of_the_wrong_type_are_clean_errors(tmp_path, capsys, yaml_text):
    """Scenario YAML fields of the wrong type.

    Defect (experiments/scenario.py ``load_scenario``/``Scenario.__post_init__``/
    ``metrics_config``/``_build``): these values reach ``tuple()``, ``float()``, ``dict()`` or
    ``os.fspath`` unchecked; the resulting TypeError/ValueError is not a KvschedError, so
    ``kvsched simulate --scenario`` dies with a traceback. (``window_s`` and ``oracle_lengths``
    were fixed while this review ran; see the promise test below.)

    Expected: exit code 2 and a one-line error naming the scenario file and the field.
    """
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    rc, cap = run_cli(["simulate", "--scenario", str(p), "--no-progress", "--max-requests", "3"], capsys)
    assert rc == 2
    assert "Traceback" not in cap.err and "error" in cap.err
    assert "bad.yaml" in cap.err.replace("\n", "")


def test_a_scenario_file_that_is_not_utf8_is_a_clean_error(tmp_path, capsys):
    """A scenario file with non-UTF-8 bytes: ``Path.read_text`` raises UnicodeDecodeError in
    ``load_scenario`` (not caught), so the CLI prints a traceback.

    Expected: exit code 2 and an error naming the file.
    """
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"\xff\xfe\x00bad")
    rc, cap = run_cli(["simulate", "--scenario", str(p), "--no-progress"], capsys)
    assert rc == 2 and "binary.yaml" in cap.err.replace("\n", "") and "Traceback" not in cap.err


@pytest.mark.parametrize("value", ["[/x]", "[bold]"])
def test_error_messages_print_values_verbatim_not_as_rich_markup(capsys, value):
    """``kvsched simulate --model '[/x]'`` (any bad value that looks like a Rich tag).

    Defect (experiments/cli.py ``main``: ``Console.print(f"[bold red]error:[/] {e}")`` renders
    the exception text as Rich markup): ``[bold]`` vanishes from the message ("unknown model
    ''"), ``[/x]`` raises rich.errors.MarkupError inside the error handler (traceback). The
    same happens to any message holding a list that starts with a letter, e.g.
    ``--window nan 5`` prints "window_s= must be ..." without the value.

    Expected: exit code 2 and the offending value printed verbatim.
    """
    rc, cap = run_cli(["simulate", "--model", value, "--no-progress", "--max-requests", "3"], capsys)
    assert rc == 2 and "Traceback" not in cap.err
    assert value in cap.err


@pytest.mark.parametrize("yaml_text, field", [
    ("window_s: 5\n", "window_s"),
    ("window_s: [a, b]\n", "window_s"),
    ("window_s: [0, 10, 20]\n", "window_s"),
    ('oracle_lengths: "false"\n', "oracle_lengths"),
    ("oracle_lengths: 1\n", "oracle_lengths"),
    ("policy: [fcfs]\n", "policy"),
])
def test_scenario_window_oracle_and_policy_types_are_checked(tmp_path, capsys, yaml_text, field):
    """Regression guard (these crashed or were silently misread when the review began): a
    scenario with a malformed window, a non-boolean ``oracle_lengths`` (the string "false" used
    to turn the oracle on) or a non-string policy is refused with an error naming the field,
    and the CLI exits cleanly."""
    p = tmp_path / "s.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ConfigError, match=field):
        load_scenario(p)
    rc, cap = run_cli(["simulate", "--scenario", str(p), "--no-progress"], capsys)
    assert rc == 2 and field in cap.err and "Traceback" not in cap.err


def test_an_out_path_that_is_a_file_is_a_clean_error_after_simulating_too(tmp_path, capsys):
    """Regression guard: ``--out`` naming an existing file used to crash after simulating
    (FileExistsError); it must exit with code 2 and name the path."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    rc, cap = run_cli(["simulate", "--max-requests", "3", "--no-progress", "--out", str(f)], capsys)
    assert rc == 2 and "not-a-dir" in cap.err.replace("\n", "") and "Traceback" not in cap.err
    assert f.read_text() == "x"


def test_help_prints_with_a_percent_sign_in_a_help_text(capsys):
    """``kvsched --help`` raised ``ValueError: unsupported format character 'C'``: the evaluate
    sub-command's help says "95% CIs" and argparse %-formats help strings. It must print the
    usage and exit 0."""
    import pytest

    from kvsched.experiments.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "evaluate" in capsys.readouterr().out


def test_cli_simulate_router_and_compare_routers(tmp_path, capsys):
    y = tmp_path / "s.yaml"
    y.write_text("name: t\nsynthetic: {duration_s: 20, rate_per_s: 4}\nn_instances: 3\n"
                 "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\n")
    assert main(["simulate", "--scenario", str(y), "--router", "llm-d", "--router-delay", "0.5",
                 "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["routing"]["router"] == "llm-d" and summary["run"]["router"] == "llm-d"
    assert main(["simulate", "--scenario", str(y), "--router", "nope", "--no-progress"]) == 2
    assert "router 'nope'; known:" in " ".join(capsys.readouterr().err.split())
    out = tmp_path / "cmp"
    assert main(["compare", "--scenario", str(y), "--routers", "rr,cache-affinity", "--instances", "2",
                 "--router-params", '{"cache-affinity": {"cache_threshold": 0.1}}', "--no-progress",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cache-affinity" in text and "rr" in text
    rows = (out / "compare.csv").read_text().splitlines()
    assert rows[0].startswith("router,class,seeds") and len(rows) > 2
    assert "prefix_hit_rate" in rows[0] and "load_imbalance" in rows[0]
    meta = json.loads((out / "compare.json").read_text())
    assert meta["routers"] == ["rr", "cache-affinity"] and meta["policy"] == "fcfs"
    assert main(["compare", "--scenario", str(y), "--routers", "rr,rr", "--no-progress"]) == 2
    assert main(["compare", "--scenario", str(y), "--routers", "rr", "--policies", "fcfs", "--no-progress"]) == 2


def test_cli_router_params_errors(capsys):
    assert main(["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--instances", "2",
                 "--router", "cache-affinity", "--router-params", "{bad", "--no-progress"]) == 2
    assert "--router-params: invalid JSON" in capsys.readouterr().err
    assert main(["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--instances", "2",
                 "--router", "cache-affinity", "--router-params", '{"cache_threshold": 2}', "--no-progress"]) == 2
    assert "cache_threshold=2" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags", [["--policy", "FCFS"], ["--policy", " fcfs "], ["--router", "Least-Loaded"]])
def test_naming_the_scenarios_policy_or_router_in_another_case_keeps_its_parameters(tmp_path, flags):
    """The registries accept "FCFS" / "RR" for "fcfs" / "round-robin"; the CLI compared the flag
    with the scenario's name as typed, took "FCFS" for another policy and silently dropped the
    scenario's policy_params (tier-aware preemption and prefetch here), as a router's its router_params."""
    sc = tmp_path / "sc.yaml"
    sc.write_text("synthetic: {rate_per_s: 2.0, duration_s: 5}\nn_instances: 2\npolicy: fcfs\n"
                  "policy_params: {tier_aware_preemption: true, prefetch: true}\nrouter: least-loaded\n"
                  "router_params: {kv_weight: 0.5}\n")
    assert main(["simulate", "--scenario", str(sc), "--out", str(tmp_path / "o"), "--json", "--no-progress"]
                + flags) == 0
    run = json.loads((tmp_path / "o" / "run.json").read_text())["scenario"]
    assert run["policy"] == "fcfs" and run["policy_params"] == {"tier_aware_preemption": True, "prefetch": True}
    assert run["router"] == "least-loaded" and run["router_params"] == {"kv_weight": 0.5}


def test_a_huge_bad_argument_is_named_in_a_bounded_message(capsys):
    from kvsched.experiments.cli import main

    for argv in (["simulate", "--format", "y" * 100_000], ["tune", "--trials", "-" + "9" * 3000],
                 ["simulate", "--max-requests", "z" * 100_000]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and len(err.splitlines()[-1]) < 600, argv[:2]


def test_simulate_prints_the_prefix_hit_rate_of_hbm_and_of_each_lower_tier(capsys):
    scenario = Path(__file__).resolve().parents[2] / "experiments" / "scenarios" / "residency-sessions.yaml"
    rc = main(["simulate", "--scenario", str(scenario), "--max-requests", "400", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefix cache: HBM hit rate" in printed and "dram (lru): hit rate" in printed


def test_simulate_prints_each_lower_tiers_self_hits_beside_its_hit_rate():
    """A tier's loads include preempted requests' own work, which its hit rate leaves out: the line
    shows the self-hit tokens so that loads at a 0 % hit rate do not read as a contradiction."""
    import io

    from rich.console import Console

    from kvsched.experiments.simulate_cli import _print_routing

    tier = {"eviction": "lru", "hit_rate": 0.0, "self_hit_tokens": 3168, "loads": 3, "bytes_loaded": 415236096,
            "bytes_written": 0, "writes": 0, "skipped_writes": 0, "evicted_segments": 0}
    out = io.StringIO()
    _print_routing({"classes": {"all": {"prefix": {"hit_tokens": 0, "hit_rate": 0.0}}},
                    "prefix_tiers": {"tiers": {"nvme": tier}}}, Console(file=out, width=300))
    assert "nvme (lru): hit rate 0.00 % (+3,168 self-hit tokens), 3 loads (0.4 GB)" in out.getvalue()
