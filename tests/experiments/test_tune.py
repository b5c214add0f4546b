"""kvsched tune: search spaces, objective, constraints, baseline, resume after a kill, workers, PostgreSQL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.runner.scenario import Scenario
from kvsched.experiments.tune import (Constraint, MetricRef, TuneConfig, baseline_params, make_storage,
                                      metric_value, open_study, run_scenario, tune)
from kvsched.policies.base import SearchDim, make_policy, policy_names

# a small, fast scenario: ~15 s of mixed traffic (one run ~0.1 s)
SYN = {"rate_per_s": 4.0, "duration_s": 40, "long_fraction": 0.03, "long_min_tokens": 16384,
       "long_max_tokens": 40000}
WINDOWS = ((0.0, 12.0), (20.0, 32.0))


def small_scenario() -> Scenario:
    return Scenario(name="tiny-mixed", trace=None, synthetic=dict(SYN), seed=0)


def cfg(**kw) -> TuneConfig:
    d = dict(policy="lars", objective=MetricRef.parse("goodput_rps"), windows_s=WINDOWS, seeds=(0, 1))
    d.update(kw)
    return TuneConfig(**d)


def test_every_search_space_contains_the_published_defaults():
    spaces = 0
    for name in policy_names():
        pcls = type(make_policy(name)).params_cls
        defaults = pcls()
        for field_name, dim in pcls.SEARCH_SPACE.items():
            spaces += 1
            assert isinstance(dim, SearchDim)
            assert dim.contains(getattr(defaults, field_name)), (name, field_name)
    assert spaces >= 10  # LARS and EWSJF declare theirs


def test_residency_knobs_tune_a_policy_with_no_space_of_its_own_from_its_defaults():
    from kvsched.policies.base import PolicyParams

    defaults = PolicyParams()
    for field_name, dim in PolicyParams.RESIDENCY_SEARCH_SPACE.items():
        assert dim.contains(getattr(defaults, field_name)) and dim.source, field_name
    with pytest.raises(ConfigError, match="--tune-residency"):
        cfg(policy="priority")
    c = cfg(policy="priority", tune_residency=True, seeds=(0,), windows_s=(WINDOWS[0],), pruner="none")
    assert set(c.space()) == set(PolicyParams.RESIDENCY_SEARCH_SPACE)
    assert set(cfg(tune_residency=True).space()) == set(PolicyParams.RESIDENCY_SEARCH_SPACE) | set(
        type(make_policy("lars")).params_cls.SEARCH_SPACE)
    res = tune(small_scenario(), c, "res", None, n_trials=3)
    assert res.study.trials[0].params == {"tier_aware_preemption": False, "prefetch": False,
                                          "admit_while_swapped": False, "admission_preemption": "never"}
    assert TuneConfig.from_dict(c.to_dict()) == c


def test_a_study_stored_before_tune_residency_existed_still_resumes(tmp_path):
    storage = f"journal:{tmp_path / 'old.journal'}"
    c = cfg(seeds=(0,), windows_s=(WINDOWS[0],), pruner="none")
    study = tune(small_scenario(), c, "old", storage, n_trials=1).study
    stored = dict(study.user_attrs["tune_config"])
    del stored["tune_residency"]
    study.set_user_attr("tune_config", stored)
    assert len(tune(small_scenario(), c, "old", storage, n_trials=2).study.trials) == 2  # resumed, no ConfigError


def test_bad_specs_name_the_allowed_values():
    with pytest.raises(ConfigError, match="goodput_rps"):
        MetricRef.parse("goodput")
    with pytest.raises(ConfigError, match="METRIC"):
        Constraint.parse("ttft_p99_s:short < 1")
    c = Constraint.parse("ttft_p99_s:short<=1.5")
    assert (c.metric.name, c.metric.cls, c.op, c.bound) == ("ttft_p99_s", "short", "<=", 1.5)
    assert c.violation(2.0) == pytest.approx(0.5) and c.violation(1.0) == pytest.approx(-0.5)
    assert Constraint.parse("slo_attainment:all>=0.9").violation(0.8) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="sampler"):
        cfg(sampler="bogus")
    with pytest.raises(ConfigError, match="no search space"):
        cfg(policy="fcfs")
    with pytest.raises(ConfigError, match="storage"):
        make_storage("ftp-server")
    # a class no summary reports would make every trial NaN (objective) or infeasible (constraint)
    with pytest.raises(ConfigError, match="unknown class 'shrt'; allowed: all, short, long"):
        MetricRef.parse("ttft_p99_s:shrt")
    with pytest.raises(ConfigError, match="--constraint.*unknown class 'nope'"):
        Constraint.parse("ttft_p99_s:nope<=1")
    with pytest.raises(ConfigError, match="unknown database 'ftp'.*postgresql://"):
        make_storage("ftp://host/db")
    for kw, bad, flag in (("n_trials", 0, "--trials=0"), ("n_trials", -3, "--trials=-3"),
                          ("workers", 0, "--workers=0"), ("holdout_seeds", -1, "--holdout-seeds=-1")):
        with pytest.raises(ConfigError, match=f"{flag} must be an integer"):
            tune(small_scenario(), cfg(), "bad", None, **{kw: bad})


def test_a_bare_postgresql_url_uses_the_installed_driver():
    import importlib.util

    from kvsched.experiments.tune import rdb_url

    assert rdb_url("postgresql+psycopg2://u@h:1/db") == "postgresql+psycopg2://u@h:1/db"  # explicit: kept
    assert rdb_url("sqlite:///x.db") == "sqlite:///x.db"
    bare = rdb_url("postgresql://u@h:1/db")
    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
        assert bare == "postgresql+psycopg2://u@h:1/db"  # SQLAlchemy 2.1 would pick the absent psycopg 3
    else:
        assert bare == "postgresql://u@h:1/db"
    import sqlalchemy

    sqlalchemy.engine.make_url(bare).get_dialect().import_dbapi()  # the chosen driver imports


def test_one_process_with_the_same_seed_repeats_the_study():
    c = cfg(seeds=(0,), windows_s=(WINDOWS[0],), pruner="none")
    a, b = (tune(small_scenario(), c, "det", None, n_trials=4).study for _ in range(2))
    assert [t.params for t in a.trials] == [t.params for t in b.trials]
    assert [t.value for t in a.trials] == [t.value for t in b.trials]
    assert len({str(t.params) for t in a.trials}) == 4  # the sampler did vary them
    other = tune(small_scenario(), cfg(seeds=(0,), windows_s=(WINDOWS[0],), pruner="none", sampler_seed=1),
                 "det", None, n_trials=4).study
    assert [t.params for t in other.trials][1:] != [t.params for t in a.trials][1:]


def test_trial_value_is_the_mean_of_its_runs_and_baseline_is_trial_zero():
    sc = small_scenario()
    c = cfg(pruner="none")
    res = tune(sc, c, "t", None, n_trials=3)
    trials = res.study.trials
    assert trials[0].user_attrs["baseline"] is True
    assert trials[0].params == baseline_params(c, sc)
    assert trials[0].params["kappa"] == 3.0 and trials[0].params["ttft_floor_s"] == 0.25
    # the value is the mean over windows x seeds, each run reproducible outside the study
    vals = [metric_value(run_scenario(sc, w, s, "lars", trials[0].params), c.objective)
            for w in WINDOWS for s in (0, 1)]
    assert trials[0].user_attrs["objective_values"] == vals
    assert trials[0].value == pytest.approx(sum(vals) / 4, rel=1e-12)
    assert trials[0].user_attrs["objective_std"] > 0  # seeds differ: a real spread
    assert sorted(trials[0].intermediate_values) == [0, 1]  # one report per window
    rep = res.report
    assert rep["baseline"]["trial"] == 0
    assert rep["best"]["objective_mean"] >= rep["baseline"]["objective_mean"]
    assert rep["trials"]["complete"] == 3


def test_constraints_infeasible_bound_and_cmaes_penalty():
    sc = small_scenario()
    # no run reaches a 1 microsecond short p99 TTFT: nothing is feasible, so no best is reported
    c = cfg(constraints=(Constraint.parse("ttft_p99_s:short<=0.000001"),), pruner="none", seeds=(0,))
    rep = tune(sc, c, "inf", None, n_trials=2).report
    assert rep["best"] is None and rep["baseline"]["feasible"] is False
    assert rep["baseline"]["constraints"]["ttft_p99_s:short<=1e-06"] > 0.01
    # CMA-ES has no constraint support: the told value is penalised, the raw mean kept
    c2 = cfg(constraints=(Constraint.parse("ttft_p99_s:short<=0.000001"),), pruner="none", seeds=(0,),
             sampler="cmaes", penalty=10.0)
    st = tune(sc, c2, "cma", None, n_trials=2).study
    t0 = st.trials[0]
    assert t0.value < t0.user_attrs["objective_mean"] - 1.0


def test_a_resumed_study_keeps_its_trials_and_objective(tmp_path):
    sc = small_scenario()
    url = f"journal:{tmp_path / 's.journal'}"
    c = cfg(seeds=(0,), pruner="none")
    first = tune(sc, c, "r", url, n_trials=3).study
    before = {t.number: t.value for t in first.trials}
    again = tune(sc, c, "r", url, n_trials=5).study
    assert len([t for t in again.trials if t.state.name == "COMPLETE"]) == 5
    assert {t.number: t.value for t in again.trials if t.number in before} == before
    assert sum(bool(t.user_attrs.get("baseline")) for t in again.trials) == 1  # enqueued once
    with pytest.raises(ConfigError, match="another objective"):
        tune(sc, cfg(seeds=(0,), objective=MetricRef.parse("ttft_p99_s:short")), "r", url, n_trials=6)


def _complete(url: str, name: str) -> dict[int, float]:
    st = open_study(name, url)
    return {t.number: t.value for t in st.trials if t.state.name == "COMPLETE"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from kvsched.experiments.cli import main; sys.exit(main())", *args]


def test_kill_and_restart_loses_no_finished_trial(tmp_path):
    # ~7-15 s; ~30 s more when the SIGKILL lands inside a journal append (about 1 in 4): the
    # restart then waits out Optuna's 30 s lock grace period, which is what a user sees too
    scen = tmp_path / "s.yaml"
    scen.write_text("name: tiny\nsynthetic: {rate_per_s: 4.0, duration_s: 30, long_fraction: 0.03, "
                    "long_min_tokens: 16384, long_max_tokens: 40000}\npolicy: lars\nseed: 0\n")
    journal = tmp_path / "k.journal"
    args = ["tune", "--policy", "lars", "--scenario", str(scen), "--windows", "1", "--window-s", "10",
            "--seeds", "1", "--study", "k", "--storage", f"journal:{journal}", "--out", str(tmp_path / "o")]
    proc = subprocess.Popen(_cli(*args, "--trials", "500"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        done: dict = {}
        while time.time() < deadline:
            time.sleep(0.5)
            if journal.exists():
                done = _complete(f"journal:{journal}", "k")
                if len(done) >= 3:
                    break
        assert len(done) >= 3, proc.stderr.read1().decode() if proc.poll() is not None else "no trials in 120 s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = _complete(f"journal:{journal}", "k")
    assert len(killed) >= 3
    target = len(killed) + 2
    r = subprocess.run(_cli(*args, "--trials", str(target)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    after = _complete(f"journal:{journal}", "k")
    assert len(after) == target
    assert {k: after[k] for k in killed} == killed  # nothing lost, nothing re-run
    rep = json.loads((tmp_path / "o" / "tune.json").read_text())
    assert rep["trials"]["complete"] == target and rep["baseline"]["trial"] == 0  # --trials counts COMPLETE
    assert "baseline (published defaults)" in r.stdout and "best" in r.stdout
    for f in ("history.png", "importances.png", "trials.csv"):
        assert (tmp_path / "o" / f).stat().st_size > 1000


def test_two_worker_processes_share_a_journal(tmp_path):
    sc = small_scenario()
    url = f"journal:{tmp_path / 'w.journal'}"
    res = tune(sc, cfg(seeds=(0,), windows_s=(WINDOWS[0],)), "w", url, n_trials=6, workers=2)
    states = [t.state.name for t in res.study.trials]
    assert states.count("COMPLETE") == 6 and "RUNNING" not in states  # the gate: no overshoot
    assert len({t.number for t in res.study.trials}) == len(res.study.trials)


POSTGRES_URL = os.environ.get("KVSCHED_TEST_POSTGRES_URL")


def _postgres_ok() -> str | None:
    if not POSTGRES_URL:
        return ("KVSCHED_TEST_POSTGRES_URL is not set: no PostgreSQL server (.ci/run starts one with "
                "initdb/pg_ctl when PostgreSQL is installed)")
    try:
        import sqlalchemy

        from kvsched.experiments.tune import rdb_url

        with sqlalchemy.create_engine(rdb_url(POSTGRES_URL)).connect() as c:  # the driver tune picks
            c.execute(sqlalchemy.text("select 1"))
    except Exception as e:  # driver missing or server down
        return f"PostgreSQL at KVSCHED_TEST_POSTGRES_URL not reachable: {type(e).__name__}: {e}"
    return None


def test_two_tune_commands_join_one_postgresql_study(tmp_path):
    why = _postgres_ok()
    if why:
        pytest.skip(why)
    scen = tmp_path / "s.yaml"
    scen.write_text("name: tiny\nsynthetic: {rate_per_s: 4.0, duration_s: 30, long_fraction: 0.03, "
                    "long_min_tokens: 16384, long_max_tokens: 40000}\npolicy: lars\nseed: 0\n")
    name = f"pg-{os.getpid()}-{time.time_ns()}"
    args = ["tune", "--policy", "lars", "--scenario", str(scen), "--windows", "1", "--window-s", "10",
            "--seeds", "1", "--study", name, "--storage", POSTGRES_URL, "--trials", "8"]
    procs = [subprocess.Popen(_cli(*args, "--seed", str(k), "--out", str(tmp_path / f"o{k}")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    st = open_study(name, POSTGRES_URL)
    complete = [t for t in st.trials if t.state.name == "COMPLETE"]
    assert 8 <= len(complete) <= 9  # RDB: no shared lock, two workers may both start the last trial
    assert sum(bool(t.user_attrs.get("baseline")) for t in st.trials) == 1
    assert all(math.isfinite(t.value) for t in st.trials if t.state.name == "COMPLETE")
    assert all(Path(tmp_path / f"o{k}" / "tune.json").exists() for k in range(2))


@pytest.mark.parametrize("sampler", ["gp", "cmaes"])
def test_other_samplers_run_with_engine_knobs_and_constraints(sampler):
    c = cfg(sampler=sampler, seeds=(0,), windows_s=(WINDOWS[0],), tune_engine=True,
            constraints=(Constraint.parse("ttft_p99_s:short<=5"),))
    st = tune(small_scenario(), c, sampler, None, n_trials=3).study
    done = [t for t in st.trials if t.state.name == "COMPLETE"]
    assert len(done) == 3
    assert done[0].params["engine.max_num_batched_tokens"] == 8192  # the scenario's vLLM default, as baseline
    assert len({t.params["engine.max_num_batched_tokens"] for t in done}) > 1  # the sampler varied it


def test_windows_spread_over_the_arrivals():
    from kvsched.experiments.tune import even_windows

    sc = small_scenario()
    span = float(sc.workload().arrival_s[-1])
    ws = even_windows(sc, 3, 10.0)
    assert len(ws) == 3 and ws[0] == (0.0, 10.0)
    assert ws[-1][1] == pytest.approx(span, abs=1e-5) and ws[1][0] == pytest.approx((span - 10.0) / 2, abs=1e-5)
    assert even_windows(sc, 1, 5.0) == ((0.0, 5.0),)
    with pytest.raises(ConfigError, match="longer than"):
        even_windows(sc, 2, span + 1.0)
    with pytest.raises(ConfigError, match="--windows"):
        even_windows(sc, 0, 5.0)
    # windows are cut before rate scaling and the request cap (as simulate --window): the span is
    # the unscaled one, so the last window still ends at the last arrival
    scaled = sc.with_overrides(rate_scale=2.0, max_requests=20)
    assert even_windows(scaled, 3, 10.0) == ws


def test_tune_out_that_is_a_file_fails_before_any_trial(tmp_path, capsys, monkeypatch):
    """`tune --out FILE` used to fail when the results were written, after every trial."""
    import kvsched.experiments.tune as tune_mod
    from kvsched.experiments.cli import main

    monkeypatch.setattr(tune_mod, "tune", lambda *a, **k: pytest.fail("trials ran"))
    f = tmp_path / "results.txt"
    f.write_text("keep")
    scen = Path(__file__).parents[2] / "experiments" / "scenarios" / "mixed-long-short.yaml"
    assert main(["tune", "--policy", "lars", "--scenario", str(scen), "--trials", "1", "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err and f.read_text() == "keep"


# ----------------------------------------------------------------------------- router studies
# two instances, multi-turn sessions (shared prefixes) and enough load that router parameters
# change the result (~0.1 s a run)
CLUSTER_SYN = dict(SYN, rate_per_s=8.0, turns_per_session=4)


def cluster_scenario(n_instances: int = 2, **kw) -> Scenario:
    return Scenario(name="tiny-cluster", trace=None, synthetic=dict(CLUSTER_SYN), seed=0, n_instances=n_instances,
                    **kw)


def rcfg(**kw) -> TuneConfig:
    d = dict(policy="fcfs", objective=MetricRef.parse("ttft_p99_s"), windows_s=(WINDOWS[0],), seeds=(0, 1),
             router="dynamo", pruner="none")
    d.update(kw)
    return TuneConfig(**d)


def test_every_router_search_space_contains_the_published_defaults_and_its_corners_are_valid():
    import dataclasses

    from kvsched.policies.routing import ROUTERS, make_router, router_names, tunable_router_names

    spaces = 0
    for name in router_names():
        pcls = ROUTERS.get(name).params_cls
        defaults, fields_ = pcls(), {f.name for f in dataclasses.fields(pcls)}
        for field_name, dim in pcls.SEARCH_SPACE.items():
            spaces += 1
            assert isinstance(dim, SearchDim) and dim.source, (name, field_name)
            assert field_name in fields_, (name, field_name)
            assert dim.contains(getattr(defaults, field_name)), (name, field_name)
        numeric = {k: d for k, d in pcls.SEARCH_SPACE.items() if d.kind != "categorical"}
        for corner in ("low", "high"):  # every bound is a valid parameter set (no trial fails on validation)
            make_router(name, {k: getattr(d, corner) for k, d in numeric.items()})
    assert spaces >= 14
    assert tunable_router_names() == ["cache-affinity", "dynamo", "least-loaded", "llm-d", "prefix", "session-affinity"]
    # the prefix router's infinite load-guard defaults lie in no finite range: not exposed
    assert set(ROUTERS.get("prefix").params_cls.SEARCH_SPACE) == {"routed_prefix_ttl_s"}


def test_tune_router_help_lists_the_tunable_routers():
    import argparse

    from kvsched.experiments.tune_cli import add_tune_arguments
    from kvsched.policies.routing import tunable_router_names

    p = argparse.ArgumentParser()
    add_tune_arguments(p)
    helptext = next(a.help for a in p._actions if a.dest == "router")
    assert helptext.startswith(f"cluster router whose SEARCH_SPACE is tuned instead "
                               f"({', '.join(tunable_router_names())})")


def test_router_study_trial_zero_is_the_routers_published_defaults():
    sc = cluster_scenario(router="least-loaded", router_params={"queue_weight": 5.0})
    for router, want in (("dynamo", {"overlap_score_weight": 1.0, "router_temperature": 0.0}),
                         ("llm-d", {"queue_weight": 2.0, "kv_cache_weight": 2.0, "prefix_weight": 3.0})):
        c = rcfg(router=router, seeds=(0,))
        assert set(c.space()) == set(want) and c.tuned == f"router {router}"
        assert baseline_params(c, sc) == want
        res = tune(sc, c, router, None, n_trials=2)
        t0 = res.study.trials[0]
        assert t0.user_attrs["baseline"] is True and t0.params == want
        assert res.report["baseline"]["trial"] == 0 and res.report["tuned"] == f"router {router}"


def test_router_trial_value_is_a_direct_run_with_those_router_params(monkeypatch):
    # the scenario routes round-robin and sets a policy parameter: the study replaces the router
    # (its params too) and keeps the policy with its parameters
    import kvsched.runner.simulate as simulate_mod

    sc = cluster_scenario(policy="lars", policy_params={"kappa": 5.0}, router="round-robin",
                          router_params={})
    c = rcfg(policy="lars")
    built = []
    real_build = simulate_mod.build_cluster

    def spy(specs, policy, policy_params, **kw):
        built.append((policy, policy_params, kw["router"], kw["router_params"], kw["seed"]))
        return real_build(specs, policy, policy_params, **kw)

    monkeypatch.setattr(simulate_mod, "build_cluster", spy)
    st = tune(sc, c, "direct", None, n_trials=3).study
    monkeypatch.setattr(simulate_mod, "build_cluster", real_build)
    assert len(built) == 3 * len(c.windows_s) * len(c.seeds)
    for (policy, pp, router, rp, seed), t in zip(built, [t for t in st.trials for _ in range(2)]):
        assert (policy, pp["kappa"], router) == ("lars", 5.0, "dynamo")  # the scenario's policy parameters kept
        assert rp == {**t.params, "seed": seed}  # the trial's router parameters, the run's seed
    assert len({t.value for t in st.trials}) > 1  # the router parameters matter here
    for t in st.trials:
        runs = [run_scenario(sc, w, s, "lars", {"kappa": 5.0}, router="dynamo", router_params=t.params)
                for w in c.windows_s for s in c.seeds]
        vals = [metric_value(r, c.objective) for r in runs]
        assert t.user_attrs["objective_values"] == vals
        assert t.value == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    rr = [metric_value(run_scenario(sc, w, s, "lars", {"kappa": 5.0}), c.objective) for w in c.windows_s
          for s in c.seeds]
    assert rr != st.trials[0].user_attrs["objective_values"]  # not the scenario's round-robin


def test_bad_router_inputs_give_one_line_config_errors():
    def err(fn) -> str:
        with pytest.raises(ConfigError) as e:
            fn()
        assert "\n" not in str(e.value)
        return str(e.value)

    m = err(lambda: rcfg(router="bogus"))
    assert "--router='bogus'" in m and "known: cache-affinity" in m and "round-robin" in m
    m = err(lambda: rcfg(router="rr"))  # an alias of round-robin, which has no parameters
    assert "--router='round-robin' declares no search space" in m and "llm-d" in m
    m = err(lambda: rcfg(tune_residency=True))
    assert "--tune-residency" in m and "--router='dynamo'" in m
    m = err(lambda: tune(cluster_scenario(n_instances=1), rcfg(), "one", None, n_trials=1))
    assert "n_instances=1" in m and "n_instances >= 2" in m and "tiny-cluster" in m
    m = err(lambda: tune(cluster_scenario(), rcfg(policy="lars"), "other-policy", None, n_trials=1))
    assert "policy='lars'" in m and "'fcfs'" in m
    assert rcfg(router="LLM-D").router == "llm-d"  # stored canonical


def test_one_process_with_the_same_seed_repeats_a_router_study():
    sc = cluster_scenario()
    a, b = (tune(sc, rcfg(seeds=(0,)), "det", None, n_trials=4).study for _ in range(2))
    assert [t.params for t in a.trials] == [t.params for t in b.trials]
    assert [t.user_attrs["objective_values"] for t in a.trials] == [t.user_attrs["objective_values"]
                                                                    for t in b.trials]
    assert len({str(t.params) for t in a.trials}) == 4


def test_router_config_round_trips_and_old_studies_resume(tmp_path):
    c = rcfg(tune_engine=True)
    assert TuneConfig.from_dict(c.to_dict()) == c and c.to_dict()["router"] == "dynamo"
    assert set(c.space()) == {"overlap_score_weight", "router_temperature", "engine.max_num_batched_tokens",
                              "engine.max_num_seqs", "engine.long_prefill_token_threshold"}
    # a study stored before --router existed (no "router" key) is a policy study and resumes
    storage = f"journal:{tmp_path / 'old.journal'}"
    p = cfg(seeds=(0,), windows_s=(WINDOWS[0],), pruner="none")
    assert TuneConfig.from_dict({k: v for k, v in p.to_dict().items() if k != "router"}) == p
    study = tune(small_scenario(), p, "old", storage, n_trials=1).study
    stored = dict(study.user_attrs["tune_config"])
    del stored["router"]
    study.set_user_attr("tune_config", stored)
    assert len(tune(small_scenario(), p, "old", storage, n_trials=2).study.trials) == 2  # resumed
    # a router study resumes as a router study, and a policy study of that name is refused
    sc = cluster_scenario()
    r = rcfg(seeds=(0,))
    first = {t.number: t.value for t in tune(sc, r, "rs", storage, n_trials=2).study.trials}
    again = tune(sc, r, "rs", storage, n_trials=3).study
    assert {t.number: t.value for t in again.trials if t.number in first} == first and len(again.trials) == 3
    with pytest.raises(ConfigError, match="another objective.*router"):
        tune(sc, rcfg(seeds=(0,), router="llm-d"), "rs", storage, n_trials=4)


def test_tune_router_command_line(tmp_path, capsys):
    from kvsched.experiments.cli import main

    scen = tmp_path / "c.yaml"
    scen.write_text(json.dumps({"name": "tiny-cluster", "synthetic": CLUSTER_SYN, "seed": 0, "n_instances": 2,
                                "policy": "fcfs"}))
    base = ["tune", "--scenario", str(scen), "--windows", "1", "--window-s", "12", "--seeds", "1",
            "--trials", "2", "--objective", "ttft_p99_s", "--pruner", "none"]
    assert main(base + ["--router", "llm-d", "--out", str(tmp_path / "o")]) == 0
    cap = capsys.readouterr()
    assert "tuning router llm-d (policy fcfs fixed) on tiny-cluster" in cap.err
    assert "(router llm-d)" in cap.out and "prefix_weight" in cap.out
    rep = json.loads((tmp_path / "o" / "tune.json").read_text())
    assert rep["tuned"] == "router llm-d" and rep["study"] == "router-llm-d-tiny-cluster"
    assert rep["baseline"]["params"] == {"queue_weight": 2.0, "kv_cache_weight": 2.0, "prefix_weight": 3.0}
    with pytest.raises(SystemExit) as e:  # tune the policy or the router, not both
        main(base + ["--router", "llm-d", "--policy", "lars"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    one = tmp_path / "one.yaml"
    one.write_text(json.dumps({"name": "one", "synthetic": CLUSTER_SYN, "seed": 0}))
    out = tmp_path / "never"
    assert main(["tune", "--scenario", str(one), "--router", "llm-d", "--out", str(out)]) == 2
    assert "n_instances=1 is not allowed with --router='llm-d'" in capsys.readouterr().err and not out.exists()
