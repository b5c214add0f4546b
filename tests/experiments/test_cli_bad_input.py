"""The command line under careless input: empty values (which used to run the bundled default
trace), JSON flags with a key given twice, training metadata missing a key, a KV block size
that does not divide the trace's hash block -- one error line naming what the user gave, exit 2."""

from __future__ import annotations

import json

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.strict_json import DuplicateKeyError, loads, parse_object
from kvsched.experiments.cli import main


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, flag", [
    (["simulate", "--trace", ""], "--trace"),
    (["simulate", "--scenario="], "--scenario"),
    (["simulate", "--scenario", "short-only", "--out", "  "], "--out"),
    (["compare", "--scenario", "", "--policies", "fcfs"], "--scenario"),
    (["tune", "--policy", "lars", "--scenario", "short-only", "--study", ""], "--study"),
    (["export", "--study", "s", "--storage", "", "--target", "vllm", "--out", "x"], "--storage"),
    (["evaluate", "--agents", "fcfs", "--scenario", ""], "--scenario"),
])
def test_an_empty_value_is_refused_for_every_command_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}: an empty" in _one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--policy-params", "--router-params"])
def test_duplicate_keys_in_a_json_flag_are_refused(flag, capsys):
    key = "cache_threshold" if flag == "--router-params" else "prefetch"
    value = f'{{"{key}": true, "{key}": false}}'
    assert main(["simulate", "--trace", "azure-conv-2023", "--max-requests", "5", "--instances", "2",
                 "--router", "cache-affinity", flag, value, "--no-progress"]) == 2
    assert f"{flag}: key '{key}' appears twice" in _one_error_line(capsys)


def test_duplicate_keys_in_compare_and_train_json_flags_are_refused(capsys, tmp_path):
    from kvsched.experiments.compare import parse_policy_params

    with pytest.raises(ConfigError, match="--policy-params: key 'fcfs' appears twice"):
        parse_policy_params('{"fcfs": {}, "fcfs": {"prefetch": true}}', ["fcfs"])
    with pytest.raises(ConfigError, match="--policy-params: key 'prefetch' appears twice"):
        parse_policy_params('{"fcfs": {"prefetch": true, "prefetch": false}}', ["fcfs"])
    from kvsched.experiments.rl_cli import _json_arg

    with pytest.raises(ConfigError, match="--env-kwargs: key 'window_s' appears twice"):
        _json_arg('{"window_s": 5, "window_s": 6}', "--env-kwargs")


def test_strict_json_refuses_duplicates_at_any_depth_and_keeps_other_errors_apart():
    assert loads('{"a": {"b": 1}, "c": [1, {"d": 2}]}') == {"a": {"b": 1}, "c": [1, {"d": 2}]}
    with pytest.raises(DuplicateKeyError, match="key 'd' appears twice"):
        loads('{"c": [{"d": 1, "d": 2}]}')
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_object("[" * 100_000, "--x", "things")
    with pytest.raises(ConfigError, match=r"--x='\[1\]': must be a JSON object of things"):
        parse_object("[1]", "--x", "things")


@pytest.mark.parametrize("meta, key", [({"env_kwargs": {}, "algo": "ppo"}, "env_id"),
                                       ({"env_id": "kvsched/Scheduling-v0", "algo": "ppo"}, "env_kwargs"),
                                       ({"env_id": "kvsched/Scheduling-v0", "env_kwargs": {}}, "algo")])
def test_evaluate_names_the_metadata_file_and_the_missing_key(tmp_path, meta, key):
    from kvsched.agents.evaluate import _sidecar

    ckpt = tmp_path / "model.zip"
    ckpt.write_bytes(b"")
    (tmp_path / "model.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as e:
        _sidecar(ckpt)
    assert f"training metadata {tmp_path / 'model.json'}: missing key {key!r}" in str(e.value)
    (tmp_path / "model.json").write_text('{"env_id": 1, "env_id": 2}')
    with pytest.raises(ConfigError, match="appears twice"):
        _sidecar(ckpt)
    (tmp_path / "model.json").write_text("[]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        _sidecar(ckpt)


def test_a_block_size_that_does_not_divide_the_hash_block_names_the_users_key(tmp_path, capsys):
    y = tmp_path / "s.yaml"
    y.write_text("trace: mooncake-conversation\nmax_requests: 5\n"
                 "instance: {model: Llama-3.1-8B, gpu: H100-SXM, block_size_tokens: 7}\n")
    assert main(["simulate", "--scenario", str(y), "--json"]) == 2
    line = _one_error_line(capsys)
    assert "block_size_tokens=7 is not allowed" in line and "divisor of 512" in line and "e.g. 16, 32, 64" in line
    assert "hash_block_tokens=" not in line  # not the key the trace set


def test_an_out_nested_thousands_of_folders_deep_is_a_clean_error(tmp_path, capsys):
    """Path.mkdir recurses once per missing folder: ~1,600 levels was a RecursionError traceback."""
    from kvsched.experiments.cli import main

    deep = tmp_path.joinpath(*(["d"] * 1600))
    rc = main(["simulate", "--max-requests", "5", "--out", str(deep), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "nested too deeply" in err and "Traceback" not in err
