"""Input defects a breaker found, fixed as classes: integers of too many digits in JSON and YAML,
out-of-range scenario seeds, deep or non-regular checkpoint sidecars and files, empty comma-list
items, timeline windows, train.json's algo, study sibling files, compressed traces, parity --json,
and --hyperparameters values Stable-Baselines3 accepts but fails on."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError, TraceFormatError
from kvsched.envs.sim.strict_json import NumberTooLongError, loads, parse_object
from kvsched.envs.sim.yaml_loading import load_yaml
from kvsched.experiments.cli import main

ROOT = Path(__file__).resolve().parents[2]
HUGE = "9" * 5000
ES_CKPT = ROOT / "agents" / "checkpoints" / "bench-v1" / "es-overload-burst-s0.zip"
SCENARIO = ("name: s\nsynthetic:\n  rate_per_s: 2.0\n  duration_s: 5\ninstance:\n  model: Llama-3.1-8B\n"
            "  gpu: H100-SXM\npolicy: fcfs\n")


def test_json_integer_of_too_many_digits_is_a_decode_error_at_its_position():
    with pytest.raises(NumberTooLongError, match="more than 4,300 digits") as e:
        loads('{"a": ' + HUGE + "}")
    assert e.value.pos == 6
    with pytest.raises(ConfigError, match=r"^--router-params: a number with more than 4,300 digits is not allowed"):
        parse_object('{"k": -' + HUGE + "}", "--router-params", "parameters")


@pytest.mark.parametrize("flag", ["--policy-params", "--router-params"])
def test_every_json_flag_refuses_a_huge_integer_in_one_line(tmp_path, capsys, flag):
    (tmp_path / "s.yaml").write_text(SCENARIO)
    assert main(["simulate", "--scenario", str(tmp_path / "s.yaml"), flag, '{"x": ' + HUGE + "}"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: a number with more than 4,300 digits" in err and "Traceback" not in err


@pytest.mark.parametrize("value", [HUGE, "0x" + "f" * 4000, "-" + HUGE])
def test_yaml_integer_too_long_to_print_is_refused_with_line_and_column(value):
    with pytest.raises(ConfigError, match=r"^f\.yaml: invalid YAML: line 2, column 7: a number with more than"):
        load_yaml(f"name: s\nseed: {value}\n", "f.yaml")


def test_yaml_value_a_constructor_cannot_build_is_one_marked_line():
    with pytest.raises(ConfigError, match=r"line 1, column 7: cannot read '2024-13-01' as timestamp"):
        load_yaml("when: 2024-13-01\n", "f.yaml")


@pytest.mark.parametrize("seed", ["-1", "2147483648", "0x" + "f" * 100])
def test_scenario_seed_outside_the_seed_flags_range_is_refused(tmp_path, seed):
    from kvsched.runner.scenario import load_scenario

    (tmp_path / "s.yaml").write_text(SCENARIO + f"seed: {seed}\n")
    with pytest.raises(ConfigError, match=r"seed=.* must be an integer in \[0, 2\*\*31-1\]"):
        load_scenario(tmp_path / "s.yaml")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_deeply_nested_or_huge_sidecar_is_not_a_checkpoint_record(tmp_path):
    from kvsched.agents import trust

    ckpt = tmp_path / "a.zip"
    ckpt.write_bytes(b"not shipped")
    for text in ("[" * 5000 + "]" * 5000, "[" * 200_000 + "]" * 200_000):
        trust.sidecar(ckpt).write_text(text)
        with pytest.raises(ConfigError, match="is not a kvsched checkpoint record"):
            trust.check(ckpt)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_checkpoint_sidecar_or_metadata_is_not_a_regular_file(tmp_path):
    from kvsched.agents import trust
    from kvsched.agents.evaluate import _read_metadata
    from kvsched.agents.train import train

    fifo = _fifo(tmp_path / "f.zip")
    with pytest.raises(ConfigError, match="is not a regular file"):
        trust.check(fifo)
    ckpt = tmp_path / "a.zip"
    ckpt.write_bytes(b"x")
    _fifo(trust.sidecar(ckpt))
    with pytest.raises(ConfigError, match=r"a\.zip\.sha256 is not a regular file"):
        trust.check(ckpt)
    with pytest.raises(ConfigError, match="training metadata .* is not a regular file"):
        _read_metadata(_fifo(tmp_path / "train.json"))
    with pytest.raises(ConfigError, match="--resume .* is not a regular file"):
        train("kvsched/Scheduling-v0", "ppo", 64, tmp_path / "o", resume=str(fifo))


def test_evaluate_names_train_json_and_its_algo_key_not_a_flag(tmp_path):
    from kvsched.agents.evaluate import evaluate

    ckpt = tmp_path / "a.zip"
    shutil.copyfile(ES_CKPT, ckpt)
    (tmp_path / "a.json").write_text(json.dumps({"env_id": "kvsched/Scheduling-v0", "env_kwargs": {},
                                                 "algo": "a2c"}))
    with pytest.raises(ConfigError, match=r"training metadata .*a\.json: algo='a2c' is not allowed") as e:
        evaluate([str(ckpt)], None, 1, 1, tmp_path / "o")
    assert "--algo" not in str(e.value)


@pytest.mark.parametrize("argv", [["compare", "--policies", "fcfs,,lars"], ["compare", "--policies", "fcfs,"],
                                  ["compare", "--routers", "round-robin,"],
                                  ["evaluate", "--agents", "fcfs,,lars", "--out", "{tmp}/o"]])
def test_an_empty_item_in_a_comma_list_is_refused(tmp_path, capsys, argv):
    (tmp_path / "s.yaml").write_text(SCENARIO)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv[:1], "--scenario", str(tmp_path / "s.yaml"), *argv[1:]]) == 2
    assert "empty item in a comma list" in capsys.readouterr().err


def test_bench_cases_refuse_an_empty_item():
    from kvsched.experiments.bench import case_names

    assert case_names(["a,b", "c"]) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="--cases='a,,b': empty item"):
        case_names(["a,,b"])


def test_timeline_window_needs_a_start_and_a_window_past_the_end_is_noted(tmp_path, capsys):
    from kvsched.runner.timeline import parse_window

    with pytest.raises(ConfigError, match="START is empty"):
        parse_window(":5")
    assert parse_window("0:") == (0.0, float("inf"))
    (tmp_path / "s.yaml").write_text(SCENARIO)
    assert main(["simulate", "--scenario", str(tmp_path / "s.yaml"), "--timeline", str(tmp_path / "t.json"),
                 "--timeline-window", "100000:"]) == 0
    assert "after the run's end" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["j.journal", "j.journal.gate", "j.journal.lock", "j.journal.torn-1.bak",
                                  "j.journal.workers/x"])
def test_export_refuses_the_journal_and_the_files_the_tuner_keeps_beside_it(tmp_path, name):
    from kvsched.experiments.export import _study_owned

    (tmp_path / "j.journal").write_text("")
    assert _study_owned(tmp_path / name, tmp_path / "j.journal")
    assert not _study_owned(tmp_path / "j-export.yaml", tmp_path / "j.journal")


@pytest.mark.parametrize("compress, kind", [(lzma.compress, "xz"), (bz2.compress, "bzip2"),
                                            (lambda b: gzip.compress(gzip.compress(b)), "itself compressed")])
def test_a_trace_compressed_another_way_is_named(tmp_path, compress, kind):
    from kvsched.envs.workload.traces import load_trace

    p = tmp_path / "t.csv"
    p.write_bytes(compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,10\n"))
    with pytest.raises(TraceFormatError, match=kind):
        load_trace(p)


def test_parity_json_that_cannot_be_written_fails_before_the_cases(tmp_path, capsys):
    assert main(["parity", "--json", str(tmp_path)]) == 2
    assert "is not allowed: it is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("given, key", [({"gamma": float("inf")}, "gamma"), ({"gae_lambda": -0.1}, "gae_lambda"),
                                        ({"learning_rate": float("nan")}, "learning_rate"),
                                        ({"n_steps": 100_000_000_000}, "n_steps"), ({"batch_size": 0}, "batch_size"),
                                        ({"buffer_size": 1.5}, "buffer_size"), ({"n_epochs": -3}, "n_epochs"),
                                        ({"policy_kwargs": {"net_arch": [100_000_000]}}, "net_arch"),
                                        ({"policy_kwargs": {"net_arch": {"pi": [64], "vf": [0]}}}, "net_arch"),
                                        ({"policy_kwargs": {"net_arch": [65_536] * 3}}, "net_arch")])
def test_hyperparameters_sb3_accepts_but_fails_on_are_refused(given, key):
    from kvsched.agents.train import check_hyperparameters

    with pytest.raises(ConfigError, match=rf"^--hyperparameters: (policy_kwargs\.)?{key}=.* is not allowed"):
        check_hyperparameters(given, 4, 154)
    check_hyperparameters({"gamma": 0.99, "learning_rate": 3e-4, "n_steps": 256, "batch_size": 64,
                           "policy_kwargs": {"net_arch": {"pi": [64, 64], "vf": [64, 64]}}}, 4, 154)
