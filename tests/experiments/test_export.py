"""kvsched export: real engine flags, unexpressible parameters listed, provenance, kvsched round trip."""

from __future__ import annotations

import io
import json
import zipfile
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments import export as ex
from kvsched.experiments.cli import main
from kvsched.experiments.tools import extract_engine_args as xa
from kvsched.experiments.tune import MetricRef, TuneConfig, tune

from test_tune import small_scenario

PROVENANCE_KEYS = {"kvsched_version", "study", "trial", "objective_mean", "scenario_sha256", "workload_sha256",
                   "seeds", "windows_s"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("study")
    url = f"journal:{d / 's.journal'}"
    cfg = TuneConfig(policy="lars", objective=MetricRef.parse("goodput_rps"), windows_s=((0.0, 12.0),),
                     seeds=(0,), tune_engine=True, pruner="none")
    tune(small_scenario(), cfg, "exp", url, n_trials=3)
    return url


def test_committed_engine_lists_are_real_releases():
    v, s = ex.engine_args("vllm"), ex.engine_args("sglang")
    assert v["version"] and s["version"] and len(v["flags"]) > 150 and len(s["flags"]) > 150
    for flag in ("max-num-batched-tokens", "max-num-seqs", "long-prefill-token-threshold", "block-size",
                 "enable-prefix-caching", "gpu-memory-utilization", "kv-cache-dtype", "scheduling-policy"):
        assert flag in v["flags"]
    assert v["choices"]["scheduling-policy"] == ["fcfs", "priority"]
    for flag in ("chunked-prefill-size", "max-running-requests", "schedule-policy", "schedule-conservativeness",
                 "enable-hierarchical-cache", "hicache-size", "config"):
        assert flag in s["flags"]


@pytest.mark.parametrize("target", ["vllm", "sglang", "llm-d", "kvsched"])
def test_every_export_carries_provenance_and_lists_what_it_cannot_express(study, tmp_path, target):
    out = tmp_path / f"x.{target}"
    res = ex.export_study("exp", study, target, out)
    text = out.read_text()
    assert PROVENANCE_KEYS <= set(res.provenance)
    assert res.provenance["trial"] in (0, 1, 2) and res.provenance["objective_mean"] is not None
    assert "# provenance:" in text or target == "kvsched"
    if target == "kvsched":
        d = json.loads(text)
        assert d["policy"] == "lars" and d["provenance"]["study"] == "exp" and d["not_expressible"] == []
        return
    cfg = yaml.safe_load(text)  # comments are YAML comments: the file stays loadable
    assert cfg == res.config
    if target in ("vllm", "sglang"):
        assert set(cfg) <= set(ex.engine_args(target)["flags"])
    names = [n for n, _, _ in res.unexpressible]
    assert "policy" in names and "policy_params.kappa" in names  # LARS has no engine flag
    for name in names:
        assert f"#   {name} = " in text


def test_vllm_values_follow_the_tuned_trial(study, tmp_path):
    res = ex.export_study("exp", study, "vllm", tmp_path / "v.yaml", trial=1)
    from kvsched.experiments.tune import open_study
    t = [x for x in open_study("exp", study).trials if x.number == 1][0]
    assert res.config["max-num-batched-tokens"] == t.params["engine.max_num_batched_tokens"]
    assert res.config["max-num-seqs"] == t.params["engine.max_num_seqs"]
    assert res.config["long-prefill-token-threshold"] == t.params["engine.long_prefill_token_threshold"]
    assert res.config["scheduling-policy"] == "fcfs"
    # what the file alone achieves: FCFS with the trial's engine settings, on the study's runs
    from kvsched.experiments.tune import metric_value, run_scenario
    from test_tune import small_scenario
    pol, eng = {}, {k[len("engine."):]: v for k, v in t.params.items() if k.startswith("engine.")}
    want = metric_value(run_scenario(small_scenario(), (0.0, 12.0), 0, "fcfs", pol, eng),
                        MetricRef.parse("goodput_rps"))
    assert res.provenance["target_policy_simulated"] == "fcfs"
    assert res.provenance["target_objective_mean"] == want
    assert "target_objective_mean" in (tmp_path / "v.yaml").read_text()


def test_a_renamed_flag_fails(monkeypatch):
    real = ex.engine_args

    def renamed(engine):
        d = real(engine)
        d["flags"] = [f for f in d["flags"] if f != "max-num-seqs"] + ["max-num-sequences"]
        return d

    monkeypatch.setattr(ex, "engine_args", renamed)
    with pytest.raises(ConfigError, match="max-num-seqs.*not a flag of vllm"):
        ex.check_keys("vllm", {"max-num-seqs": 8})
    with pytest.raises(ConfigError, match="choices"):
        real_check = ex.check_keys
        monkeypatch.setattr(ex, "engine_args", real)
        real_check("vllm", {"scheduling-policy": "lars"})


def test_kvsched_policy_file_round_trip_gives_identical_metrics(study, tmp_path):
    pf = tmp_path / "p.json"
    ex.export_study("exp", study, "kvsched", pf, trial=2)
    from kvsched.experiments.tune import open_study
    t = [x for x in open_study("exp", study).trials if x.number == 2][0]
    scen = tmp_path / "s.yaml"
    sc = small_scenario()
    scen.write_text(yaml.safe_dump({"name": sc.name, "synthetic": sc.synthetic, "seed": 0}))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["simulate", "--scenario", str(scen), "--window", "0", "12", "--policy-file", str(pf),
                     "--json", "--no-progress"]) == 0
    summary = json.loads(buf.getvalue())
    assert summary["run"]["policy"] == "lars"
    # exactly the value the trial measured on that window and seed (engine settings applied too)
    assert summary["classes"]["all"]["goodput_rps"] == t.user_attrs["objective_values"][0]
    with pytest.raises(SystemExit):
        main(["simulate", "--policy-file"])
    assert main(["simulate", "--scenario", str(scen), "--policy", "fcfs", "--policy-file", str(pf), "--json"]) == 2


def test_bad_policy_file_is_refused(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": ex.POLICY_FILE_FORMAT, "policy": "lars", "policy_params": {"kapa": 1},
                             "engine": {}}))
    with pytest.raises(ConfigError, match="kapa"):
        ex.load_policy_file(p)
    p.write_text("{}")
    with pytest.raises(ConfigError, match="format"):
        ex.load_policy_file(p)


def test_extraction_reads_engine_sources(tmp_path):
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/engine/arg_utils.py",
                   "from typing import ClassVar\n@dataclass\nclass EngineArgs:\n    model: str = 'x'\n"
                   "    max_num_seqs: int | None = None\n    _private: int = 0\n    registry: ClassVar[dict] = {}\n")
        z.writestr("vllm/config/cache.py", "CacheDType = Literal['auto', 'fp8']\n")
        z.writestr("vllm/config/scheduler.py", "SchedulerPolicy = Literal['fcfs', 'priority']\n")
    info = xa.extract("vllm", "9.9.9", wheel)
    assert info["flags"] == ["max-num-seqs", "model"]
    assert info["choices"] == {"kv-cache-dtype": ["auto", "fp8"], "scheduling-policy": ["fcfs", "priority"]}
    sg = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(sg, "w") as z:
        z.writestr("sglang/srt/server_args.py", "class ServerArgs:\n    def f(self): pass\n"
                   "def add_cli_args(parser):\n    parser.add_argument('--config', type=str)\n")
        z.writestr("sglang/srt/arg_groups/fields/schedule.py",
                   "class Schedule(msgspec.Struct):\n    max_running_requests: A[int, 'help'] = 1\n"
                   "    tp_size: A[int, Arg(help='h', cli_name='--tensor-parallel-size', aliases=['--tp-size'])] = 1\n"
                   "    hidden: A[int, Arg(help='h', no_cli=True)] = 0\n    plain: int = 0\n")
    info = xa.extract("sglang", "9.9.9", sg)
    assert info["flags"] == ["config", "max-running-requests", "tensor-parallel-size", "tp-size"]


def test_export_refuses_a_missing_journal_without_creating_it(tmp_path):
    missing = tmp_path / "nope.journal"
    with pytest.raises(ConfigError, match="no such journal file"):
        ex.export_study("exp", f"journal:{missing}", "vllm", tmp_path / "v.yaml")
    assert not missing.exists()


def test_export_refuses_a_missing_sqlite_file_and_a_file_that_is_no_journal(tmp_path):
    """A missing SQLite database is refused without being created (SQLAlchemy would create an
    empty one), and a file that is not an Optuna journal (here a text file) is named, not a
    JSONDecodeError traceback."""
    db = tmp_path / "nope.db"
    with pytest.raises(ConfigError, match="no such SQLite database file"):
        ex.export_study("exp", f"sqlite:///{db}", "vllm", tmp_path / "v.yaml")
    assert not db.exists()
    text = tmp_path / "notes.txt"
    text.write_text("not a journal\nat all\n")
    with pytest.raises(ConfigError, match="is not an Optuna journal file"):
        ex.export_study("exp", f"journal:{text}", "vllm", tmp_path / "v.yaml")
    assert text.read_text() == "not a journal\nat all\n"


def test_export_out_that_is_a_folder_fails_before_the_study_is_read(study, tmp_path, capsys, monkeypatch):
    """`export --out DIR` used to fail after the study was read and the target simulated."""
    monkeypatch.setattr(ex, "export_study", lambda *a, **k: pytest.fail("export ran"))
    assert main(["export", "--study", "exp", "--storage", study, "--target", "vllm", "--out", str(tmp_path)]) == 2
    assert "it is a folder; give a file name" in capsys.readouterr().err


def test_engine_values_have_the_engines_types_and_units(study, tmp_path):
    res = ex.export_study("exp", study, "vllm", tmp_path / "v.yaml", simulate_target=False)
    c = res.config
    for k in ("tensor-parallel-size", "max-num-batched-tokens", "max-num-seqs", "max-model-len", "block-size",
              "long-prefill-token-threshold"):
        assert type(c[k]) is int, (k, c[k])
    assert type(c["gpu-memory-utilization"]) is float and 0 < c["gpu-memory-utilization"] <= 1  # a fraction
    assert type(c["enable-prefix-caching"]) is bool


def test_sglang_hicache_size_is_whole_gb_per_rank_and_said_so():
    from kvsched.experiments.tune import scenario_for

    sc = small_scenario()
    spec = scenario_for(sc, (0.0, 12.0), 0, {"dram_kv_bytes": 25e9, "tp": 2}).instance_spec()
    res = ex.export_sglang("fcfs", {}, {}, spec, {"study": "x"})
    assert res.config["hicache-size"] == 12 and type(res.config["hicache-size"]) is int  # SGLang: int GB per rank
    assert res.config["enable-hierarchical-cache"] is True
    assert "rounded down from 12.5 GB" in res.text
    tiny = scenario_for(sc, (0.0, 12.0), 0, {"dram_kv_bytes": 0.5e9}).instance_spec()
    res = ex.export_sglang("fcfs", {}, {}, tiny, {"study": "x"})
    assert "hicache-size" not in res.config and "enable-hierarchical-cache" not in res.config
    assert [n for n, _, _ in res.unexpressible] == ["dram_kv_bytes"]  # listed, not dropped
    assert "#   dram_kv_bytes = 500000000.0" in res.text


def test_a_partial_prefill_limit_is_listed_as_not_expressible_and_no_limit_is_not():
    """vLLM 0.33 and SGLang have no partial-prefill limit flags (vLLM V1 never honoured V0's):
    a limit, one included, is listed; no limit (None, the default) is what they do."""
    from kvsched.experiments.tune import scenario_for

    sc = small_scenario()
    for limit in (None, 1, 2):
        spec = scenario_for(sc, (0.0, 12.0), 0, {"max_num_partial_prefills": limit}).instance_spec()
        for export in (ex.export_vllm, ex.export_sglang):
            res = export("fcfs", {}, {}, spec, {"study": "x"})
            listed = [v for n, v, _ in res.unexpressible if n == "max_num_partial_prefills"]
            assert listed == ([] if limit is None else [[limit, 1]]), (export.__name__, limit)
            assert "max-num-partial-prefills" not in res.config


def test_lpm_exports_to_sglangs_own_schedule_policy_and_not_to_vllm():
    """SGLang runs ``--schedule-policy lpm`` itself: the export sets it (its constants listed when
    tuned away from SGLang's); vLLM has no such scheduler: listed, FCFS runs."""
    from kvsched.experiments.tune import scenario_for

    spec = scenario_for(small_scenario(), (0.0, 12.0), 0, {}).instance_spec()
    params = {"fcfs_above_waiting": 128, "in_batch_check_tokens": 64}
    res = ex.export_sglang("lpm", params, {}, spec, {"study": "x"})
    assert res.config["schedule-policy"] == "lpm"
    assert [(n, v) for n, v, _ in res.unexpressible] == [("policy_params.in_batch_check_tokens", 64)]
    assert "IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD" in res.text
    res = ex.export_vllm("lpm", params, {}, spec, {"study": "x"})
    assert res.config["scheduling-policy"] == "fcfs" and res.unexpressible[0][:2] == ("policy", "lpm")


def test_routed_multi_instance_scenario_round_trips(tmp_path):
    """Trials run the cluster `simulate` runs: the scenario's router (not round-robin) and its seed."""
    from kvsched.runner.scenario import Scenario

    syn = dict(small_scenario().synthetic, rate_per_s=8.0)
    sc = Scenario(name="routed", trace=None, synthetic=syn, seed=0, n_instances=2, router="least-loaded")
    url = f"journal:{tmp_path / 'r.journal'}"
    cfg = TuneConfig(policy="lars", objective=MetricRef.parse("ttft_p99_s"), windows_s=((0.0, 12.0),),
                     seeds=(0,), pruner="none")
    st = tune(sc, cfg, "routed", url, n_trials=1).study
    pf = tmp_path / "p.json"
    ex.export_study("routed", url, "kvsched", pf)
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump({"name": "routed", "synthetic": syn, "seed": 0, "n_instances": 2,
                                    "router": "least-loaded"}))
    got = {}
    for router in ("least-loaded", "round-robin"):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["simulate", "--scenario", str(scen), "--window", "0", "12", "--policy-file", str(pf),
                         "--router", router, "--json", "--no-progress"]) == 0
        got[router] = json.loads(buf.getvalue())["classes"]["all"]["ttft_s"]["p99"]
    assert got["least-loaded"] != got["round-robin"]  # the router matters here, so the check below can fail
    assert st.trials[0].user_attrs["objective_values"] == [got["least-loaded"]]


def test_export_out_that_is_the_study_storage_is_refused_and_the_study_kept(study, tmp_path, capsys):
    """`export --storage s.journal --out s.journal` overwrote the journal with the export (the
    study, hours of trials, was gone); also through a symlink, and for a SQLite database."""
    journal = Path(study[len("journal:"):])
    before = journal.read_bytes()
    assert main(["export", "--study", "exp", "--storage", study, "--target", "kvsched", "--out", str(journal)]) == 2
    assert "it is the study's storage" in capsys.readouterr().err
    link = tmp_path / "link.yaml"
    link.symlink_to(journal)
    with pytest.raises(ConfigError, match="it is the study's storage"):
        ex.export_study("exp", study, "kvsched", link)
    db = tmp_path / "s.db"
    db.write_bytes(b"")
    with pytest.raises(ConfigError, match="it is the study's storage"):
        ex.export_study("exp", f"sqlite:///{db}", "kvsched", db)
    assert journal.read_bytes() == before
    res = ex.export_study("exp", study, "kvsched", tmp_path / "k.yaml")  # another file is written as before
    assert (tmp_path / "k.yaml").read_text() == res.text


# ----------------------------------------------------------------------------- router studies
@pytest.fixture(scope="module")
def router_studies(tmp_path_factory):
    """Two router studies (dynamo, llm-d) of a two-instance scenario that routes round-robin."""
    from test_tune import cluster_scenario

    url = f"journal:{tmp_path_factory.mktemp('rstudy') / 'r.journal'}"
    for router in ("dynamo", "llm-d"):
        cfg = TuneConfig(policy="fcfs", objective=MetricRef.parse("ttft_p99_s"), windows_s=((0.0, 12.0),),
                         seeds=(0,), router=router, pruner="none")
        tune(cluster_scenario(router="round-robin"), cfg, f"r-{router}", url, n_trials=3)
    return url


def _trial(url: str, name: str, number: int):
    from kvsched.experiments.tune import open_study

    return [x for x in open_study(name, url).trials if x.number == number][0]


def test_router_study_kvsched_file_carries_the_router_and_round_trips(router_studies, tmp_path, capsys):
    from test_tune import CLUSTER_SYN

    pf = tmp_path / "r.json"
    res = ex.export_study("r-dynamo", router_studies, "kvsched", pf, trial=1)
    t = _trial(router_studies, "r-dynamo", 1)
    d = json.loads(pf.read_text())
    assert d["policy"] == "fcfs" and d["router"] == "dynamo" and res.unexpressible == []
    assert d["router_params"] == {**t.params, "seed": 0}  # every field; the seed pinned to the study's first
    assert d["provenance"]["tuned"] == "router dynamo"
    assert ex.load_policy_file(pf)["router_params"] == d["router_params"]
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump({"name": "tiny-cluster", "synthetic": CLUSTER_SYN, "seed": 0, "n_instances": 2,
                                    "router": "round-robin"}))
    got = {}
    for key, extra in (("file", ["--policy-file", str(pf)]), ("scenario", [])):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["simulate", "--scenario", str(scen), "--window", "0", "12", *extra, "--json",
                         "--no-progress"]) == 0
        got[key] = json.loads(buf.getvalue())["classes"]["all"]["ttft_s"]["p99"]
    assert got["file"] != got["scenario"]  # the file's router matters, so the identity below can fail
    assert t.user_attrs["objective_values"] == [got["file"]]
    assert main(["simulate", "--scenario", str(scen), "--policy-file", str(pf), "--router", "llm-d",
                 "--no-progress"]) == 2
    assert "--router llm-d contradicts --policy-file" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["vllm", "sglang", "llm-d"])
def test_router_study_engine_targets_list_the_router_as_not_expressible(router_studies, tmp_path, target):
    res = ex.export_study("r-dynamo", router_studies, target, tmp_path / f"r.{target}",
                          simulate_target=target == "vllm")
    if target == "vllm":  # the engine file alone runs behind the scenario's router
        assert res.provenance["target_router_simulated"] == "round-robin"
    why = {n: w for n, _, w in res.unexpressible}
    assert "router" in why and "cannot configure it" in why["router"]
    assert "Dynamo --kv-overlap-score-weight" in why["router_params.overlap_score_weight"]
    assert "Dynamo --router-temperature" in why["router_params.router_temperature"]
    assert "router_params.seed" in why
    if target == "llm-d":  # only kvsched's llm-d router maps onto llm-d's scorers
        assert res.config["schedulingProfiles"][0]["plugins"] == [{"pluginRef": "random-picker"}]
        assert "kvsched's dynamo router" in res.text
    else:
        assert set(res.config) <= set(ex.engine_args(target)["flags"])
    for name in why:
        assert f"#   {name} = " in res.text


def test_llmd_router_study_exports_its_scorer_weights(router_studies, tmp_path):
    res = ex.export_study("r-llm-d", router_studies, "llm-d", tmp_path / "epp.yaml", trial=2)
    t = _trial(router_studies, "r-llm-d", 2)
    assert yaml.safe_load((tmp_path / "epp.yaml").read_text()) == res.config
    refs = res.config["schedulingProfiles"][0]["plugins"]
    assert refs == [{"pluginRef": "queue-scorer", "weight": t.params["queue_weight"]},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": t.params["kv_cache_weight"]},
                    {"pluginRef": "prefix-cache-scorer", "weight": t.params["prefix_weight"]},
                    {"pluginRef": "max-score-picker"}]
    assert [p["type"] for p in res.config["plugins"]] == ["single-profile-handler", "queue-scorer",
                                                          "kv-cache-utilization-scorer", "prefix-cache-scorer",
                                                          "max-score-picker"]
    names = [n for n, _, _ in res.unexpressible]
    assert "router_params.routed_prefix_ttl_s" in names and "router_params.track_routed_prefixes" in names
    assert not any(n in names for n in ("router", "router_params.queue_weight", "router_params.prefix_weight"))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_vllm_priority_exports_as_the_engines_priority_scheduler_and_lists_what_it_cannot_carry(engine):
    """vllm-priority is the engine's own priority scheduler; a victim rule the engine does not apply
    and V0's priority preemption are listed as not expressible, never dropped."""
    native, unexp = ex._policy_unexpressible(engine, "vllm-priority", {"victim_rule": "priority"})
    assert native == "priority" and unexp == []
    _, unexp = ex._policy_unexpressible(engine, "vllm-priority", {"victim_rule": "oldest", "priority_preemption": True})
    assert [k for k, _, _ in unexp] == ["policy_params.victim_rule", "policy_params.priority_preemption"]
    _, unexp = ex._policy_unexpressible(engine, "fcfs", {"victim_rule": "newest"})
    assert unexp == []  # what the engine's fcfs does anyway
    _, unexp = ex._policy_unexpressible(engine, "fcfs", {"victim_rule": "least-computed"})
    assert [(k, v) for k, v, _ in unexp] == [("policy_params.victim_rule", "least-computed")]


@pytest.mark.parametrize("policy", sorted(ex.VLLM_PLUGINS))
def test_vllm_export_of_a_policy_with_a_plugin_names_the_vllm_plugin_target(policy):
    """A tuned LARS / EWSJF exported as plain vLLM flags says which target carries the policy itself
    (--target vllm-plugin); SGLang, which has no such plugin, does not point there."""
    _, unexp = ex._policy_unexpressible("vllm", policy, {})
    assert unexp[0][0] == "policy" and "--target vllm-plugin" in unexp[0][2]
    _, unexp = ex._policy_unexpressible("sglang", policy, {})
    assert unexp[0][0] == "policy" and "vllm-plugin" not in unexp[0][2]
