"""Scenario files (runner/scenario.py): router fields, wrong types and duplicate keys are refused
with the field named. (What the CLI prints for a bad scenario: tests/experiments/test_cli.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError, UnknownPresetError
from kvsched.runner.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_scenario_router_fields_and_errors(tmp_path):
    sc = Scenario(trace="mooncake-conversation", n_instances=4, router="cache-affinity",
                  router_params={"cache_threshold": 0.5}, router_delay_s=1.0,
                  shared_kv={"capacity_bytes": 1e12})
    assert sc.shared_kv_spec().capacity_bytes == 1e12
    assert "router" in sc.hashed_dict() and "router" not in Scenario().hashed_dict()
    with pytest.raises(UnknownPresetError, match="unknown router 'nope'"):
        Scenario(router="nope")
    with pytest.raises(ConfigError, match="router_delay_s=-1"):
        Scenario(router_delay_s=-1)
    with pytest.raises(ConfigError, match="unknown parameters"):
        Scenario(router="dynamo", router_params={"temperature": 1})
    with pytest.raises(ConfigError, match="shared_kv: unknown key"):
        Scenario(shared_kv={"capacity_bytes": 1e12, "bandwidth": 5})


@pytest.mark.parametrize("yaml_text, field", [
    ("rate_scale: true\n", "rate_scale"),             # bool accepted as the number 1
    ("n_instances: true\n", "n_instances"),
    ("seed: true\n", "seed"),
    ("max_requests: true\n", "max_requests"),
])
def test_scenario_numbers_that_are_booleans_are_refused(tmp_path, yaml_text, field):
    """Scenario number fields are checked with ``isinstance(x, (int, float))``, which accepts
    booleans.

    Defect (experiments/scenario.py ``Scenario.__post_init__``): ``rate_scale: true`` silently
    runs at rate x1, ``n_instances: true`` on one instance, ``seed: true`` with seed 1,
    ``max_requests: true`` keeps one request. (``oracle_lengths: "false"``, which turned the
    oracle ON, was fixed while this review ran.)

    Expected: a ConfigError naming the field and the value (numbers must not be booleans).
    """
    p = tmp_path / "s.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ConfigError, match=field):
        load_scenario(p)


def test_a_key_given_twice_is_refused(tmp_path):
    """A scenario YAML that sets a key twice (easy to do when editing a long file).

    Defect (experiments/scenario.py ``load_scenario`` uses ``yaml.safe_load``, which keeps the
    last value): the first ``rate_scale`` is silently dropped, against README "unknown keys
    are errors ... nothing is silently dropped".

    Expected: a ConfigError naming the file and the duplicated key.
    """
    p = tmp_path / "dup.yaml"
    p.write_text("trace: azure-conv-2023\nrate_scale: 2\npolicy: fcfs\nrate_scale: 3\n")
    with pytest.raises(ConfigError, match="rate_scale"):
        load_scenario(p)


BOMB_LIST = ('[&a ["xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx","xxxxxxxxxx"], '
             '&b [*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c], '
             '&e [*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e]]')


@pytest.mark.parametrize("key", ["policy", "router", "trace", "name", "seed", "n_instances", "rate_scale",
                                 "max_requests", "window_s", "oracle_lengths", "policy_params", "router_params",
                                 "metrics", "metrics_percentiles", "metrics_slo", "router_delay_s",
                                 "synthetic_rate", "synthetic_duration"])
def test_a_huge_value_is_named_in_a_bounded_message(tmp_path, key):
    """A YAML alias bomb (a 300-byte value that expands to ~50,000 strings) in a scenario field is
    refused with a message of bounded length (errors.bounded_repr), not its whole expansion (the
    message was ~0.7 MB here, ~8.5 MB one level deeper, and grows ninefold per level)."""
    if key == "metrics_percentiles":
        text = f"trace: azure-conv-2023\nmetrics: {{percentiles: {{x: {BOMB_LIST}}}}}\n"
    elif key == "metrics_slo":
        text = f"trace: azure-conv-2023\nmetrics: {{slos: {{short: {BOMB_LIST}}}}}\n"
    else:
        text = f"trace: azure-conv-2023\n{key}: {BOMB_LIST}\n" if key != "trace" else f"trace: {BOMB_LIST}\n"
    if key == "metrics":
        text = f"trace: azure-conv-2023\nmetrics: {BOMB_LIST}\n"
    if key == "synthetic_rate":  # SyntheticConfig is checked when the workload is built
        text = f"synthetic: {{rate_per_s: {BOMB_LIST}, duration_s: 10}}\n"
    if key == "synthetic_duration":
        text = f"synthetic: {{rate_per_s: 1.0, duration_s: {BOMB_LIST}}}\n"
    p = tmp_path / "bomb.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_scenario(p).workload()
    assert len(str(e.value)) < 1000, str(e.value)[:300]


def test_policy_and_router_names_are_stored_as_registered():
    """A scenario may name the policy and router in any case or by an alias (the registries accept
    them); it keeps the registered name, so labels, the scenario hash and the environments'
    "is this the scenario's policy" check (its policy_params) see one name."""
    sc = Scenario(trace="mooncake-conversation", policy="LARS", policy_params={"tier_aware_preemption": True},
                  router="RR", n_instances=2)
    assert sc.policy == "lars" and sc.router == "round-robin"
    same = Scenario(trace="mooncake-conversation", policy="lars", policy_params={"tier_aware_preemption": True},
                    n_instances=2)
    assert sc.sha256() == same.sha256()


def test_an_environment_reference_gets_the_scenarios_params_whatever_the_case(tmp_path):
    from kvsched.envs.common import reference
    from kvsched.envs.episodes import EpisodeConfig, EpisodeSource

    p = tmp_path / "sc.yaml"
    p.write_text("synthetic: {rate_per_s: 2.0, duration_s: 30}\npolicy: LARS\n"
                 "policy_params: {tier_aware_preemption: true}\n")
    src = EpisodeSource(EpisodeConfig(str(p), window_s=10.0))
    for name in ("lars", "Lars"):
        assert reference(name, None, src).params.tier_aware_preemption is True
    assert reference("fcfs", None, src).params.tier_aware_preemption is False


def test_a_scenario_without_extra_tiers_keeps_the_hash_it_had_before_tiers_existed():
    """Provenance hashes (run.json, compare, tune studies) of scenarios written before a field
    existed stay as they were: routing fields at their defaults are left out of the hashed form,
    and so is an empty ``extra_tiers`` (it had changed every scenario's ``scenario_sha256``)."""
    import yaml

    # the H100 cost parameters pinned to the calibration of 007aee3 (version 1), as bench v1's
    # scenarios pin them: the resolved instance holds the cost, so a recalibration changes the
    # content and the hash of a scenario that leaves ``cost`` unset
    bench = yaml.safe_load((ROOT / "experiments" / "scenarios" / "bench-v1-azure-conv-3x.yaml").read_text())
    v1_cost = bench["instance"]["cost"]
    sc = Scenario(source="command line", instance={"model": "Llama-3.1-8B", "gpu": "H100-SXM", "cost": v1_cost})
    assert "extra_tiers" not in sc.hashed_dict()["instance"]
    # the default scenario's hash at 007aee3, before the house (change it only with the scenario's content)
    assert sc.sha256() == "7a4abc9744c0365245aa63d3e6398b7e982a1153740fcfd141fad9ffeac9b666"
    assert Scenario(source="command line").sha256() != sc.sha256()  # calibration 2 is other content
    tier = {"name": "cxl", "capacity_bytes": 1e9, "write_link": "pcie5", "read_link": "pcie5"}
    with_tier = Scenario(instance={"model": "Llama-3.1-8B", "gpu": "H100-SXM", "extra_tiers": [tier]})
    assert with_tier.hashed_dict()["instance"]["extra_tiers"][0]["name"] == "cxl"


def test_no_partial_prefill_limit_keeps_the_hash_and_a_limit_of_one_gets_its_own():
    """max_num_partial_prefills took None for no limit (1 meant no limit before): the hashed form
    still writes 1 for no limit, so provenance hashes stay; a limit of one, new, hashes apart."""
    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"}
    default = Scenario(source="command line")
    explicit_none = Scenario(instance={**base, "max_num_partial_prefills": None})
    one = Scenario(instance={**base, "max_num_partial_prefills": 1})
    two = Scenario(instance={**base, "max_num_partial_prefills": 2})
    assert default.hashed_dict()["instance"]["max_num_partial_prefills"] == 1
    assert explicit_none.sha256() == Scenario(instance=base).sha256()
    assert one.instance_spec().max_num_partial_prefills == 1
    assert one.hashed_dict()["instance"]["partial_prefill_limit_of_one"] is True
    assert len({Scenario(instance=base).sha256(), one.sha256(), two.sha256()}) == 3
    assert "partial_prefill_limit_of_one" not in two.hashed_dict()["instance"]


def test_the_ring_all_reduce_keeps_the_hash_and_vllms_all_reduce_gets_its_own():
    """``cost.allreduce_algorithm`` "ring" is what every scenario priced before the field existed:
    left out of the hashed form (like the other issue #22 cost fields at their defaults)."""
    base = {"model": "Llama-3.1-70B", "gpu": "H100-SXM", "tp": 4}
    plain = Scenario(instance={**base, "cost": {"mbu": 0.8}})
    ring = Scenario(instance={**base, "cost": {"mbu": 0.8, "allreduce_algorithm": "ring"}})
    vllm = Scenario(instance={**base, "cost": {"mbu": 0.8, "allreduce_algorithm": "vllm"}})
    assert "allreduce_algorithm" not in ring.hashed_dict()["instance"]["cost"]
    assert ring.sha256() == plain.sha256() != vllm.sha256()
    assert vllm.hashed_dict()["instance"]["cost"]["allreduce_algorithm"] == "vllm"


def test_a_scenario_written_from_its_plain_data_form_runs_as_the_scenario_did(tmp_path):
    """``to_dict`` is the provenance form (run.json's ``scenario``, compare.json's): loaded back it
    gives the same instance spec and hash, a limit of no partial prefills included (the hashed form
    writes it as 1, which read back would set a limit of one)."""
    import json

    import yaml

    from kvsched.runner.scenario import load_scenario

    base = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"}
    for inst in (base, {**base, "max_num_partial_prefills": None}, {**base, "max_num_partial_prefills": 1},
                 {**base, "max_num_partial_prefills": 3, "cost": {"allreduce_algorithm": "vllm"}}):
        sc = Scenario(name="s", trace=None, synthetic={"n_requests": 20}, seed=3, window_s=(0.0, 5.0),
                      policy="lars", router="least-loaded", instance=inst)
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump(json.loads(json.dumps(sc.to_dict(), default=str))))
        again = load_scenario(path)
        assert again.instance_spec() == sc.instance_spec()
        assert again.sha256() == sc.sha256()
        assert again.to_dict() == sc.to_dict()
    assert Scenario(instance=base).to_dict()["instance"]["max_num_partial_prefills"] is None


def test_a_cluster_role_on_another_gpu_resolves_its_own_cost_when_rerun_from_the_plain_data_form(tmp_path):
    """The plain-data form wrote the base instance's resolved H100 cost inline, which a decode role
    on an L40S then merged as its own (same hash, other records); the cost is written as given."""
    import json

    import yaml

    from kvsched.runner.scenario import load_scenario

    for cost in (None, {"mbu": 0.7}):
        inst = {"model": "Llama-3.1-8B", "gpu": "H100-SXM"} | ({} if cost is None else {"cost": cost})
        sc = Scenario(name="pd", trace=None, synthetic={"rate_per_s": 4.0, "duration_s": 5}, instance=inst,
                      router="least-loaded", cluster={"prefill": {"count": 1},
                                                      "decode": {"count": 1, "instance": {"gpu": "L40S"}},
                                                      "link": "ib_ndr_400g"})
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump(json.loads(json.dumps(sc.to_dict(), default=str))))
        again = load_scenario(path)
        assert again.instance_specs() == sc.instance_specs()
        assert again.sha256() == sc.sha256()


@pytest.mark.parametrize("body, fragment", [
    ("policy: lars\npolicy_params: {1: 2, foo: 3}\n", "policy 'lars': unknown parameters [1, 'foo']"),
    ("router: least-loaded\nrouter_params: {1: 2, foo: 3}\n", "router 'least-loaded': unknown parameters [1, 'foo']"),
    ("metrics: {1: 2, foo: 3}\n", "metrics has unknown keys [1, 'foo']"),
    ("1: 2\nfoo: 3\n", "unknown keys [1, 'foo']"),
])
def test_unknown_keys_of_mixed_types_are_named_not_a_type_error(tmp_path, body, fragment):
    """YAML reads ``1:`` as an integer key; sorting it with text keys for the message raised
    ``TypeError: '<' not supported between instances of 'int' and 'str'`` (a traceback, exit 1)."""
    p = tmp_path / "sc.yaml"
    p.write_text("synthetic: {rate_per_s: 1.0, duration_s: 5}\n" + body)
    with pytest.raises(ConfigError, match=fragment.replace("[", "\\[").replace("]", "\\]")):
        load_scenario(p)


def test_a_policy_or_router_named_with_padding_is_named_as_registered_in_messages():
    """A name the registry matches after stripping spaces (a quoted YAML string may carry
    100,000 of them) is named as registered in later messages, so they stay short."""
    padded = "lars" + " " * 100_000
    with pytest.raises(ConfigError) as e:
        Scenario(trace="mooncake-conversation", policy=padded, policy_params={"nope": 1})
    assert "policy 'lars': unknown parameters ['nope']" in str(e.value) and len(str(e.value)) < 1000
    with pytest.raises(ConfigError) as e:
        Scenario(trace="mooncake-conversation", router="least-loaded" + " " * 100_000, router_params={"nope": 1})
    assert "router 'least-loaded': unknown parameters ['nope']" in str(e.value) and len(str(e.value)) < 1000
