"""Property-based fuzzing of the public loaders (Hypothesis): random and mutated scenario YAML
and trace CSV / JSONL texts either load or raise kvsched's own error types
(:class:`~kvsched.envs.sim.errors.KvschedError`: ``ConfigError``, ``TraceFormatError``) -- never
a ``TypeError``, ``KeyError``, ``RecursionError`` or any other exception a user would see as a
traceback.

Inputs are small (a few rows, a few keys) so each example takes milliseconds; the mutations
aim at the classes of bad input found before: wrong types in every field, YAML aliases, merge
keys, deep nesting, numbers written as text, duplicate keys and columns, nulls, huge and
non-finite numbers, empty files.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched.envs.sim.errors import KvschedError
from kvsched.envs.workload import synthetic as synth
from kvsched.envs.workload.traces import AZURE_COLUMNS, MOONCAKE_KEYS, load_generic, load_trace
from kvsched.runner.scenario import _build, load_scenario

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BASE_SCENARIO = {
    "name": "fuzz",
    "synthetic": {"rate_per_s": 2.0, "duration_s": 5, "long_fraction": 0.1},
    "instance": {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "tp": 1},
    "policy": "fcfs",
    "policy_params": {},
    "metrics": {"slos": {"short": {"ttft_s": 1.0, "tpot_s": 0.1}}},
    "seed": 0,
}
SCENARIO_KEYS = ["name", "trace", "window_s", "rate_scale", "max_requests", "synthetic", "instance", "n_instances",
                 "policy", "policy_params", "router", "router_params", "router_delay_s", "shared_kv",
                 "oracle_lengths", "metrics", "seed", "unknown_key"]
NESTED_KEYS = ["model", "gpu", "tp", "block_size_tokens", "max_num_seqs", "rate_per_s", "duration_s", "slos",
               "percentiles", "ttft_s", "tpot_s", "capacity_bytes", "victim_rule", "kappa", "short", "<<"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["1e12", "1.0e3", "0x10", "fcfs", "lars", "H100-SXM", "Llama-3.1-8B", "azure-conv-2023",
                     "", "~", "null", "yes", "-1", ".inf", "2e12"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(NESTED_KEYS), inner, max_size=4)), max_leaves=12)

# text-level mutations: YAML syntax that structured dumps never produce
YAML_SNIPPETS = ["&a ", "*a", "<<: *a\n", "<<: {tp: 2}\n", "[", "]", "{", "}", ": ", "\n  ", "\t", "- ",
                 "!!python/object:os.system ",
                 "!!binary ", "? ", "---\n", "...\n", "'", '"', "#", "%YAML 1.1\n", "\x00", "\ufeff", "1e12",
                 "[" * 400 + "]" * 400, "{a: " * 400 + "1" + "}" * 400, "&b [*a, *a, *a]"]


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _mutate(text: str, edits: list[tuple[int, int, str]]) -> str:
    for pos, cut, insert in edits:
        i = pos % (len(text) + 1)
        text = text[:i] + insert + text[i + cut:]
    return text


def _load_scenario_fully(path: Path) -> None:
    sc = load_scenario(path)
    sc.instance_spec()
    sc.metrics_config()
    sc.shared_kv_spec()
    sc.sha256()
    if sc.synthetic is not None:
        _build(synth.SyntheticConfig, sc.synthetic, "synthetic")  # validation only, nothing generated


edits = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3),
                           st.one_of(st.sampled_from(YAML_SNIPPETS), st.text(max_size=4))), max_size=4)


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(SCENARIO_KEYS), values, max_size=4), drop=st.sets(
    st.sampled_from(list(BASE_SCENARIO)), max_size=2), text_edits=edits)
def test_scenario_files_load_or_raise_kvsched_errors(folder, overrides, drop, text_edits):
    data = {k: v for k, v in BASE_SCENARIO.items() if k not in drop}
    data.update(overrides)
    text = _mutate(yaml.safe_dump(data, sort_keys=False), text_edits)
    path = folder / "scenario.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        _load_scenario_fully(path)
    except KvschedError:
        pass


cells = st.one_of(st.sampled_from(["2023-11-16 18:17:03.9799600", "2023-11-16 18:17:04", "1e300", "nan", "", " ",
                                   "-1", "0", "10", "3.5", "2**70", "9" * 30, "[1, 2]", '"q"', "1,2"]),
                  st.integers(-5, 10**6).map(str), st.text(max_size=6))


@FUZZ
@given(header=st.lists(st.sampled_from([*AZURE_COLUMNS, "priority", "n", "other", "ContextTokens"]),
                       min_size=0, max_size=6),
       rows=st.lists(st.lists(cells, min_size=0, max_size=6), max_size=4), text_edits=edits)
def test_csv_traces_load_or_raise_kvsched_errors(folder, header, rows, text_edits):
    text = _mutate("\n".join(",".join(r) for r in [header, *rows]) + "\n", text_edits)
    path = folder / "trace.csv"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    for load in (lambda: load_trace(path),
                 lambda: load_generic(path, {"arrival_s": "TIMESTAMP", "prompt_tokens": "ContextTokens",
                                             "output_tokens": "GeneratedTokens"}, time_unit="datetime"),
                 lambda: load_generic(path, {"arrival_s": "other", "prompt_tokens": "ContextTokens",
                                             "output_tokens": "GeneratedTokens", "prefix_hashes": "n",
                                             "session_id": "priority"}, time_unit="ms", hash_block_tokens=16)):
        try:
            load()
        except KvschedError:
            pass


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8)
JSONL_KEYS = [*MOONCAKE_KEYS, "priority", "n", "session", "slo"]


@FUZZ
@given(lines=st.lists(st.dictionaries(st.sampled_from(JSONL_KEYS), st.one_of(
    json_values, st.integers(0, 10**6), st.lists(st.integers(0, 99), max_size=40)), max_size=7), max_size=4),
       raw_lines=st.lists(st.sampled_from(['{"timestamp": 1, "timestamp": 2}', "[1]", "nul", "{", '"x"', "",
                                           "[" * 3000 + "]" * 3000, '{"hash_ids": null}', "\xff"]), max_size=2),
       text_edits=edits)
def test_jsonl_traces_load_or_raise_kvsched_errors(folder, lines, raw_lines, text_edits):
    text = _mutate("\n".join([*(json.dumps(o) for o in lines), *raw_lines]) + "\n", text_edits)
    path = folder / "trace.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    for load in (lambda: load_trace(path),
                 lambda: load_generic(path, {"arrival_s": "timestamp", "prompt_tokens": "input_length",
                                             "output_tokens": "output_length", "prefix_hashes": "hash_ids",
                                             "session_id": "session", "slo_class": "slo", "priority": "priority",
                                             "n": "n"}, time_unit="ms", hash_block_tokens=512)):
        try:
            load()
        except KvschedError:
            pass
