"""`kvsched compare --clusters` (xPyD layouts) and the scenario's `cluster:` section
(prefill/decode roles, docs/disaggregation.md). Small synthetic workloads keep it fast."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.cli import main
from kvsched.experiments.compare import aggregate, parse_clusters, run_compare
from kvsched.runner.scenario import load_scenario
from kvsched.runner.simulate import scenario_cluster_kwargs, simulate

SCENARIO = """\
name: tiny-pd
synthetic: {rate_per_s: 8.0, duration_s: 8, long_fraction: 0.05, long_min_tokens: 9000, long_max_tokens: 12000}
instance: {model: Llama-3.1-8B, gpu: H100-SXM}
policy: fcfs
router: least-loaded
cluster:
  prefill: {count: 1, instance: {max_num_batched_tokens: 4096}}
  decode: {count: 1}
  link: nvlink4
seed: 2
"""


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("sc") / "tiny-pd.yaml"
    p.write_text(SCENARIO)
    return p


def test_cluster_section_builds_role_specs_in_instance_order(scenario_file):
    sc = load_scenario(scenario_file)
    assert sc.n_instances == 2 and sc.disagg_spec().roles == ("prefill", "decode")
    specs = sc.instance_specs()
    assert specs[0].max_num_batched_tokens == 4096 and specs[1].max_num_batched_tokens != 4096
    w = sc.workload()
    res = simulate(w, sc.instance_spec(), sc.policy, sc.metrics_config(), n_instances=sc.n_instances,
                   **scenario_cluster_kwargs(sc))
    d = res.summary["disaggregation"]
    assert d["link"]["name"] == "nvlink4" and d["remote_prefills"] == len(w) and d["bytes_moved"] > 0


def test_compare_layouts_at_equal_gpu_count(scenario_file):
    """2M vs 1P1D: one row set per layout, the same GPU count, KV bytes only with a prefill instance."""
    res = run_compare(load_scenario(scenario_file), clusters=["1P1D", "2M"])
    assert res.axis == "cluster" and res.policies == ["1P1D", "2M"]
    agg = aggregate(res.runs, res.policies)
    allrow = agg[agg["class"] == "all"].set_index("cluster")
    assert allrow.loc["1P1D", "gpus"] == allrow.loc["2M", "gpus"] == 2
    assert allrow.loc["1P1D", "kv_transfer_bytes"] > 0 and allrow.loc["2M", "kv_transfer_bytes"] == 0
    assert allrow.loc["1P1D", "remote_prefill_share"] == 1.0 and allrow.loc["2M", "remote_prefill_share"] == 0.0
    assert 0 < allrow.loc["1P1D", "kv_link_utilisation"] < 1


def test_compare_clusters_cli_writes_outputs(scenario_file, tmp_path, capsys):
    assert main(["compare", "--scenario", str(scenario_file), "--clusters", "1P1D,2M", "--no-progress",
                 "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "1P1D" in out and "GPUs" in out and (tmp_path / "o" / "compare.csv").is_file()


@pytest.mark.parametrize("argv, needle", [
    (["--clusters", "2P2D,2p2d"], "same layout"),
    (["--clusters", "2P2X"], "cluster layout"),
    (["--clusters", "2P"], "at least one decode or mixed"),
    (["--clusters", "1P1D", "--policies", "fcfs"], "--clusters compares"),
    (["--clusters", ","], "--clusters"),
])
def test_bad_clusters_flag_is_a_one_line_error(scenario_file, argv, needle, capsys):
    code = main(["compare", "--scenario", str(scenario_file), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code != 0 and needle in err


def test_clusters_need_a_cluster_section(tmp_path):
    p = tmp_path / "plain.yaml"
    p.write_text(SCENARIO.split("cluster:")[0])
    with pytest.raises(ConfigError, match="cluster:"):
        run_compare(load_scenario(p), clusters=["1P1D"])
    with pytest.raises(ConfigError, match="same layout"):
        parse_clusters("1P1D,1D1P")


@pytest.mark.parametrize("extra, needle", [
    ("n_instances: 3\n", "disagrees with cluster"),
    ("shared_kv: {capacity_bytes: 1.0e12}\n", "shared_kv and cluster"),
    ("router_delay_s: 1.0\n", "router_delay_s"),
])
def test_scenario_cluster_conflicts_are_one_line_errors(tmp_path, extra, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(SCENARIO + extra)
    with pytest.raises(ConfigError) as e:
        load_scenario(p)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("cluster, needle", [
    ("  prefill: {count: 1, instance: {tp: 3}}\n  decode: {count: 1}\n", "cluster.prefill.instance"),
    ("  prefill: {count: 1}\n  decode: {count: 1}\n  link: warp\n", "warp"),
    ("  prefill: {count: 1}\n  decode: {count: 1}\n  prefill_router: nearest\n", "prefill_router"),
])
def test_scenario_bad_cluster_values_are_one_line_errors(tmp_path, cluster, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(SCENARIO.split("cluster:")[0] + "cluster:\n" + cluster + "seed: 2\n")
    with pytest.raises(ConfigError) as e:
        load_scenario(p)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["{gpu: H200-SXM}", "{gpu: A100-80GB, tp: 2}", "{gpu: H200-SXM, cost: {}}"])
def test_role_on_another_gpu_shares_the_scenario_front_end(tmp_path, override):
    """A role on another GPU (whose default cost parameters differ from the calibrated H100's)
    builds and runs: it takes the scenario instance's API front-end fields, its own step costs."""
    from kvsched.envs.sim.calibration import default_cost_params
    from kvsched.envs.sim.cost_params import FRONT_END_FIELDS

    p = tmp_path / "het.yaml"
    p.write_text(SCENARIO.replace("decode: {count: 1}", f"decode: {{count: 1, instance: {override}}}"))
    sc = load_scenario(p)
    pre, dec = sc.instance_specs()
    assert dec.gpu.name != "H100-SXM"
    for f in FRONT_END_FIELDS:
        assert getattr(dec.cost_params, f) == getattr(pre.cost_params, f)
    own = default_cost_params(dec.gpu)
    assert (dec.cost_params.mfu_max, dec.cost_params.mbu) == (own.mfu_max, own.mbu)
    sc = replace(sc, max_requests=6)
    res = simulate(sc.workload(), sc.instance_spec(), sc.policy, sc.metrics_config(),
                   n_instances=sc.n_instances, **scenario_cluster_kwargs(sc))
    assert res.summary["disaggregation"]["remote_prefills"] == 6


def test_role_cost_giving_another_front_end_is_a_one_line_error(tmp_path):
    p = tmp_path / "het.yaml"
    p.write_text(SCENARIO.replace("decode: {count: 1}",
                                  "decode: {count: 1, instance: {gpu: H200-SXM, cost: {request_overhead_s: 0.5}}}"))
    with pytest.raises(ConfigError, match=r"cluster\.decode\.instance: cost\.request_overhead_s=0\.5 is not allowed"
                                          r".*share the API front end") as e:
        load_scenario(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag, value", [("--tp", "2"), ("--gpu", "H200-SXM")])
def test_an_instance_flag_a_role_also_sets_is_refused_not_half_applied(tmp_path, capsys, flag, value):
    """`--tp`/`--gpu`/`--model` change the scenario's `instance`; a role that sets the same field keeps
    its own, so the flag would reach only the other roles: refused in one line naming both."""
    p = tmp_path / "roles.yaml"
    p.write_text(SCENARIO.replace("instance: {max_num_batched_tokens: 4096}",
                                  "instance: {max_num_batched_tokens: 4096, tp: 4, gpu: A100-80GB}"))
    assert main(["simulate", "--scenario", str(p), flag, value, "--max-requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{flag}=" in err and "cluster.prefill.instance sets" in err


@pytest.mark.parametrize("override", ["{kv_dtype: fp8}", "{model: Qwen2.5-7B}"])
def test_roles_serving_another_model_or_kv_dtype_are_refused_when_the_scenario_loads(tmp_path, override):
    """KV moves between the roles: a role with another model or KV dtype is a one-line error when
    the scenario loads (it was found only when the cluster was built, after the run's header)."""
    p = tmp_path / "mixed-models.yaml"
    p.write_text(SCENARIO.replace("decode: {count: 1}", f"decode: {{count: 1, instance: {override}}}"))
    with pytest.raises(ConfigError, match=r"cluster\.decode\.instance serves .*expected one model and KV dtype") as e:
        load_scenario(p)
    assert "\n" not in str(e.value)


def test_simulate_header_names_each_roles_own_spec(tmp_path, capsys):
    """The run header's instance line is the scenario's `instance`; with roles a second line gives
    each role's GPU, TP and budget (a TP2 prefill role on H100 and an H200 decode role were shown as
    '2 x ... H100-SXM TP1')."""
    p = tmp_path / "het.yaml"
    p.write_text(SCENARIO.replace("instance: {max_num_batched_tokens: 4096}",
                                  "instance: {max_num_batched_tokens: 4096, tp: 2}")
                 .replace("decode: {count: 1}", "decode: {count: 1, instance: {gpu: H200-SXM}}"))
    assert main(["simulate", "--scenario", str(p), "--max-requests", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "1 x prefill Llama-3.1-8B / H100-SXM TP2" in err and "1 x decode Llama-3.1-8B / H200 TP" in err


def test_roles_serving_one_config_model_differently_are_refused_naming_the_fields(tmp_path):
    """Two roles on one config.json, one overriding a model field (or the file read through another
    path, whose source differs): 'serves q with 2-byte KV, the first role q with 2-byte KV', the same
    words twice, said nothing of what differed."""
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 32000,
           "max_position_embeddings": 4096, "tie_word_embeddings": True}
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    p = tmp_path / "roles.yaml"
    p.write_text(SCENARIO.replace("instance: {model: Llama-3.1-8B,", f"instance: {{model: '{tmp_path / 'q'}',")
                 .replace("decode: {count: 1}", "decode: {count: 1, instance: {model: {hf_config: '%s', "
                          "max_context_tokens: 2048}}}" % (tmp_path / "q")))
    with pytest.raises(ConfigError, match=r"cluster\.decode\.instance serves q .*the first role q .*differ in "
                                          r"max_context_tokens \(2048 vs 4096\), source"):
        load_scenario(p)
