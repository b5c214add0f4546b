"""Scenario and spec YAML under hostile or careless input: alias bombs, deep nesting, merge
keys, numbers YAML 1.1 reads as text, a scenario without a workload, empty paths -- each a
one-line ConfigError (or, for merge keys, the merged mapping), never a hang or a traceback."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.spec_io import load_instance_spec
from kvsched.envs.sim.yaml_loading import MAX_YAML_ALIASES, MAX_YAML_DEPTH, load_yaml
from kvsched.runner.scenario import Scenario, load_scenario

# 9**9 leaves in ~300 bytes: PyYAML shares the aliased lists, anything that walks them does not
BOMB = ("&i [&h [&g [&f [&e [&d [&c [&b [&a [lol,lol,lol,lol,lol,lol,lol,lol,lol]" + ",*a" * 8 + "]" + ",*b" * 8 + "]"
        + ",*c" * 8 + "]" + ",*d" * 8 + "]" + ",*e" * 8 + "]" + ",*f" * 8 + "]" + ",*g" * 8 + "]" + ",*h" * 8 + "]")


def _scenario(tmp_path, text: str):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load_scenario(p)


@pytest.mark.parametrize("where", ["name: {}", "policy_params: {{victim_rule: {}}}", "policy_params: {}",
                                   "metrics: {{slos: {{short: {}}}}}", "instance: {{model: {}, gpu: H100-SXM}}"])
def test_an_alias_bomb_anywhere_is_refused_in_one_line(tmp_path, where):
    with pytest.raises(ConfigError) as e:
        _scenario(tmp_path, "trace: azure-conv-2023\n" + where.format(BOMB) + "\n")
    msg = str(e.value)
    assert "s.yaml" in msg and "alias" in msg and "100,000" in msg and "\n" not in msg and len(msg) < 300


def test_alias_uses_beyond_the_limit_and_recursive_aliases_are_refused():
    many = "a: &x 1\nb: [" + ", ".join(["*x"] * (MAX_YAML_ALIASES + 1)) + "]\n"
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_ALIASES} alias uses"):
        load_yaml(many, "f.yaml")
    assert load_yaml("a: &x 1\nb: [*x, *x]\n", "f.yaml") == {"a": 1, "b": [1, 1]}  # aliases below the limit work
    with pytest.raises(ConfigError, match="used inside its own anchor"):
        load_yaml("a: &x [1, *x]\n", "f.yaml")


@pytest.mark.parametrize("nest", ["[" * 5000 + "]" * 5000, "{a: " * 2000 + "1" + "}" * 2000,
                                  "\n".join("  " * i + "- " for i in range(500)) + "x"])
def test_deep_nesting_is_a_config_error_not_a_recursion_error(tmp_path, nest):
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_YAML_DEPTH} levels"):
        _scenario(tmp_path, f"trace: azure-conv-2023\nname: {nest}\n" if nest[0] in "[{" else nest)


def test_merge_keys_merge_and_the_mappings_own_keys_win(tmp_path):
    sc = _scenario(tmp_path, "trace: azure-conv-2023\nmetrics:\n  slos:\n    short: &slo {ttft_s: 1.0, tpot_s: 0.1}\n"
                             "    long: {<<: *slo, ttft_s: 9.0}\n")
    assert sc.metrics["slos"]["long"] == {"ttft_s": 9.0, "tpot_s": 0.1}
    assert load_yaml("b: &b {x: 1}\nm: {<<: [*b, {y: 2}], z: 3}\n", "f")["m"] == {"x": 1, "y": 2, "z": 3}
    with pytest.raises(ConfigError, match="key 'z' appears twice"):
        load_yaml("b: &b {x: 1}\nm: {<<: *b, z: 3, z: 4}\n", "f")


def test_unhashable_and_duplicate_keys_are_yaml_errors_naming_the_line():
    with pytest.raises(ConfigError, match=r"line 2, column \d+: a mapping key must be text or a number, got a list"):
        load_yaml("a: 1\nb: {? [1, 2] : 3}\n", "f.yaml")
    with pytest.raises(ConfigError, match=r"f.yaml: invalid YAML: line 2, column 1: key 'a' appears twice"):
        load_yaml("a: 1\na: 2\n", "f.yaml")


@pytest.mark.parametrize("text, hint", [("rate_scale: 1e3", "write 1.0e+3 or 1000"),
                                        ("seed: 5e0", "as text, not a number: write 5)"),
                                        ("max_requests: '12'", "this is text, not a number: write 12")])
def test_a_number_read_as_text_is_explained(tmp_path, text, hint):
    with pytest.raises(ConfigError) as e:
        _scenario(tmp_path, f"trace: azure-conv-2023\n{text}\n")
    assert hint in str(e.value)
    if "e" in text.split(":")[1]:
        assert "YAML 1.1 reads" in str(e.value) and "as text" in str(e.value)


@pytest.mark.parametrize("text", ["1e12", "1.0e12", "5E-3", "2.5e3", "7e+2", "1_000e3", "1e30", "5e-7", "'12'"])
def test_the_number_a_hint_suggests_is_a_number_in_yaml(text):
    """The hint's spelling must parse: YAML 1.1 wants a dot and a signed exponent (1.0e12 is text too)."""
    import re

    import yaml

    from kvsched.envs.sim.errors import text_number_hint

    hint = text_number_hint(text)
    if not hint:  # not a number Python reads either (1_000e3 is, so it gets a hint)
        return
    as_int = text_number_hint(text, integer=True)  # an integer field: digits only, which parse as an int
    if "write " in as_int:
        assert isinstance(yaml.safe_load(f"a: {as_int.split('write ')[1].rstrip(')')}")["a"], int), as_int
    suggested = re.search(r"write (\S+?)(?: or (\S+?))?(?:\)| without)", hint)
    assert suggested, hint
    for spelling in filter(None, suggested.groups()):
        assert isinstance(yaml.safe_load(f"a: {spelling}")["a"], (int, float)), (text, hint)


def test_a_policy_parameter_read_as_text_is_explained(tmp_path):
    with pytest.raises(ConfigError, match=r"YAML 1\.1 reads 1e9 as text.*write 1\.0e\+9 or 1000000000"):
        _scenario(tmp_path, "trace: azure-conv-2023\npolicy: lars\npolicy_params: {kappa: 1e9}\n")


def test_a_scenario_without_a_workload_is_refused_naming_the_keys_to_add(tmp_path):
    with pytest.raises(ConfigError, match=r"no workload; add `trace:`.*or `synthetic:`"):
        _scenario(tmp_path, "name: x\npolicy: fcfs\n")


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_scenario_and_trace_paths_are_refused(bad):
    with pytest.raises(ConfigError, match="empty path"):
        load_scenario(bad)
    with pytest.raises(ConfigError, match="not empty"):
        Scenario(trace=bad)


def test_instance_spec_files_have_the_same_limits(tmp_path):
    p = tmp_path / "spec.yaml"
    p.write_text(f"model: {BOMB}\ngpu: H100-SXM\n")
    with pytest.raises(ConfigError, match="alias"):
        load_instance_spec(p)
    p.write_text("model: Llama-3.1-8B\nmodel: Llama-3.1-8B\ngpu: H100-SXM\n")
    with pytest.raises(ConfigError, match="appears twice"):
        load_instance_spec(p)
