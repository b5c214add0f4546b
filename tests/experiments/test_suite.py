"""kvsched bench (experiments/suite): the protocol's guarantees on tiny tasks.

- the hindsight bound is >= every baseline on every episode (it starts from them and keeps the best);
- tuning never serves a request of a held-out episode (and a planted leak is caught);
- the constant action "reference" through the environment equals the reference's direct run;
- the results of a task are byte-identical across processes for the same seed;
- an agent equal to the tuned heuristic gets normalised score 0 with a CI containing 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.envs.sim.metrics import summary_to_json  # noqa: E402
from kvsched.experiments.suite.compute import (check_tuning_saw_no_heldout, compute_task,  # noqa: E402
                                               episode_baselines, tune_task)
from kvsched.experiments.suite.episodes import Episode, measure_pool, pool, strata  # noqa: E402
from kvsched.experiments.suite.results import FORMAT, leaderboard, write_json  # noqa: E402
from kvsched.experiments.suite.runs import make_env, run_env, run_heuristic, score  # noqa: E402
from kvsched.experiments.suite.search import Schedule, run_schedule  # noqa: E402
from kvsched.experiments.suite.stats import paired  # noqa: E402
from kvsched.experiments.suite.tasks import BenchTask, SearchBudget  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def scenario(tmp: Path, rate: float = 14.0, cv: float = 3.0, ttft: float = 0.3) -> str:
    p = tmp / f"tiny-{rate}-{cv}-{ttft}.yaml"
    p.write_text("name: tiny\nsynthetic: {rate_per_s: %s, duration_s: 40, arrival: bursty, burstiness_cv: %s, "
                 "prompt_median_tokens: 1024, output_median_tokens: 64, output_max_tokens: 128}\n"
                 "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\n"
                 "metrics: {slos: {short: {ttft_s: %s, tpot_s: 0.05}, long: {ttft_s: 5.0, tpot_s: 0.1}}}\n"
                 "seed: 0\n" % (rate, cv, ttft))
    return str(p)


def tiny_task(path: str, **kw) -> BenchTask:
    base = dict(task_id="tiny", suite="test", description="tiny", lever="ordering", env_id="kvsched/Scheduling-v0",
                scenario=path, window_s=10.0, heuristics=("fcfs", "lars", "priority"), tuned=("lars",),
                tune_trials=2, tune_episodes=2, pool_seeds=1, stratum_episodes=2, search=SearchBudget(2, 3))
    base.update(kw)
    return BenchTask(**base)


def test_the_reference_action_through_the_environment_equals_the_references_direct_run(tmp_path):
    t = tiny_task(scenario(tmp_path))
    ep = pool(t)[0]
    params = {"kappa": 2.5, "min_chunk_tokens": 64}
    direct = run_heuristic(t, ep, "lars", params)
    env = make_env(t, "lars", params)
    via_env = run_env(env, ep, lambda o, i, e: [0, 0, 0, 0])
    assert summary_to_json(via_env) == summary_to_json(direct.summary)
    assert summary_to_json(run_schedule(t, ep, Schedule("lars", params)).summary) == summary_to_json(direct.summary)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=hst.sampled_from([8.0, 14.0, 20.0]), cv=hst.sampled_from([2.0, 4.0]),
       ttft=hst.sampled_from([0.2, 0.5]))
def test_the_hindsight_bound_is_at_least_every_baseline_on_every_episode(tmp_path, rate, cv, ttft):
    t = tiny_task(scenario(tmp_path, rate, cv, ttft))
    tuned = {"lars": {"params": {}}, "fcfs": {"params": {}}, "priority": {"params": {}}, "reference": "lars"}
    for ep in pool(t)[:1]:
        out = episode_baselines(t, ep, 0, tuned)
        scores = [s for s in out["scores"].values() if s is not None]
        assert scores and all(out["bound"]["score"] >= s for s in scores)
        sched = out["bound"]["schedule"]
        if sched is not None:  # the bound is a real schedule: replaying it gives its score
            again = score(run_schedule(t, ep, Schedule.from_dict(sched)).summary)
            assert again == out["bound"]["score"]


def test_tuning_serves_no_request_of_a_held_out_episode_and_a_planted_leak_is_caught(tmp_path):
    t = tiny_task(scenario(tmp_path), tune_trials=1)
    tuned = tune_task(t, tmp_path / "studies")
    check_tuning_saw_no_heldout(t, tuned)  # train windows and train seeds only
    assert (tmp_path / "studies" / "lars.journal").is_file()
    leak = json.loads(json.dumps(tuned))
    held = pool(t)[0]
    leak["lars"]["seeds"] = [held.workload_seed]
    leak["lars"]["windows_s"] = [[held.window_index * t.window_s, (held.window_index + 1) * t.window_s]]
    with pytest.raises(ConfigError, match="held-out"):
        check_tuning_saw_no_heldout(t, leak)


def test_strata_come_from_the_workload_alone_and_the_hard_one_has_the_highest_load(tmp_path):
    t = tiny_task(scenario(tmp_path), pool_seeds=3, stratum_episodes=2)
    eps = pool(t)
    stats = measure_pool(t, eps)
    st = strata(t, eps, stats)
    assert len(st["all"]) == len(st["hard"]) == 2
    loads = sorted((stats[e.key()].offered_load for e in eps if stats[e.key()].requests), reverse=True)
    assert sorted((stats[e.key()].offered_load for e in st["hard"]), reverse=True) == loads[:2]
    assert all(0 < stats[e.key()].attainment <= 1 for e in st["hard"])  # isolation bound defined


def _results(tmp_path: Path) -> dict:
    t = tiny_task(scenario(tmp_path))
    tuned = {"lars": {"params": {}, "train_objective": 0.5}, "fcfs": {"params": {}, "train_objective": 0.4},
             "priority": {"params": {}, "train_objective": 0.3}, "reference": "lars"}
    res = compute_task(t, tmp_path / "r", tuned=tuned)
    return {"format": FORMAT, "suite": "test", "tasks": {"tiny": res}}


def test_an_agent_equal_to_the_tuned_heuristic_scores_zero_with_a_ci_containing_zero(tmp_path):
    res = _results(tmp_path)
    tr = res["tasks"]["tiny"]
    planted = {s: [tr["episodes"][k]["scores"]["lars (default)"] for k in keys] for s, keys in tr["strata"].items()}
    rows = leaderboard(res, {"planted": {"tiny": planted}})
    mine = [r for r in rows if r["agent"] == "planted"]
    assert len(mine) == 2
    for r in mine:
        assert r["diff"] == 0.0 and r["diff_lo"] <= 0.0 <= r["diff_hi"] and r["worse"] == 0
        assert r["normalised"] in (0.0, None)
    p = paired([0.5, 0.7, 0.9], [0.4, 0.7, 1.0], [0.6, 0.8, 1.0])
    assert p.worse == 1 and abs(p.diff_mean - 0.0) < 1e-12 and p.diff_lo <= 0 <= p.diff_hi


def test_the_leaderboard_and_results_are_byte_identical_across_processes(tmp_path):
    """Same seed, two processes: the same leaderboard bytes, and the same results but for the
    timings (CPU and wall seconds, kept to report what the suite costs)."""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, %r)\n"
            "from test_suite import _results\n"
            "from kvsched.experiments.suite.results import leaderboard, write_json\n"
            "r = _results(Path(sys.argv[1]))\n"
            "write_json(Path(sys.argv[1]) / 'r.json', r)\n"
            "write_json(Path(sys.argv[1]) / 'l.json', leaderboard(r))\n") % str(Path(__file__).parent)
    outs = []
    dirs, procs = [], []
    for i in range(2):  # the two processes run side by side (2 cores): half the wall time
        d = tmp_path / f"p{i}"
        d.mkdir()
        dirs.append(d)
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    for d in dirs:
        data = json.loads((d / "r.json").read_text())
        for ep in data["tasks"]["tiny"]["episodes"].values():
            ep.pop("cpu_s")
        data["tasks"]["tiny"].pop("wall_s")
        outs.append((json.dumps(data, sort_keys=True).replace(str(d), "<dir>"), (d / "l.json").read_bytes()))
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]


def test_the_suite_table_summarises_each_task_and_stratum_with_the_best_of_each_baseline_family():
    from kvsched.experiments.suite.results import format_suite_markdown, suite_table

    base = {"task": "t", "stratum": "hard", "episodes": 24, "isolation_mean": 1.0, "bound_mean": 0.9,
            "tuned_best": "lars (tuned)", "tuned_mean": 0.8, "headroom": 0.1, "headroom_lo": 0.05, "headroom_hi": 0.15}
    rows = [{**base, "agent": a, "kind": k, "mean": m, "normalised": n, "norm_lo": lo, "norm_hi": hi}
            for a, k, m, n, lo, hi in [("fcfs (default)", "baseline", 0.6, -2.0, -3.0, -1.0),
                                       ("lars (default)", "baseline", 0.7, -1.0, -2.0, 0.0),
                                       ("constant cap 512", "baseline", 0.75, -0.5, -1.0, 0.0),
                                       ("constant reference", "baseline", 0.8, 0.0, 0.0, 0.0),
                                       ("random", "baseline", 0.5, -3.0, -4.0, -2.0),
                                       ("ppo.zip", "agent", 0.85, 0.5, 0.2, 0.8)]]
    (row,) = suite_table(rows)
    assert row["best_default"] == ("lars (default)", 0.7) and row["best_constant"] == ("constant reference", 0.8)
    assert row["random"] == 0.5 and "behaviour clone" not in row and row["agent ppo.zip"][1] == 0.5
    md = format_suite_markdown([row]).splitlines()
    assert len(md) == 3 and "+10.0 [+5.0, +15.0]" in md[2] and "lars 0.700" in md[2]
    assert "0.850 (0.500 [0.200, 0.800])" in md[2] and md[0].count("|") == md[2].count("|")


def test_alone_runs_in_one_spaced_simulation_equal_one_simulation_per_request(tmp_path):
    from kvsched.envs.common import build_cluster
    from kvsched.envs.sim.request import Request, Workload
    from kvsched.experiments.suite.bounds import alone_records
    from kvsched.experiments.suite.episodes import task_source
    from kvsched.policies.base import make_policy

    src = task_source(tiny_task(scenario(tmp_path)))

    def run(w):
        return build_cluster(src, lambda i: make_policy("fcfs"), n_instances=1).run(w).records

    keys = [(64, 8, "short"), (3000, 40, "short"), (900, 200, "short")]
    together = alone_records(keys, run, spacing_s=0.01)  # too close at first: the spacing doubles until alone
    for i, (p, o, c) in enumerate(keys):
        one = run(Workload.from_requests([Request(0, 0.0, p, o, slo_class=c)])).iloc[0]
        for col in ("first_scheduled_s", "first_token_s", "finish_s"):
            assert together.loc[i, col] == pytest.approx(one[col], abs=1e-9), (keys[i], col)


def test_a_routing_task_tunes_routers_on_train_episodes_only_and_its_bound_tops_every_baseline(tmp_path):
    p = tmp_path / "tiny-cluster.yaml"
    p.write_text("name: tiny-cluster\nsynthetic: {rate_per_s: 30, duration_s: 40, arrival: bursty, burstiness_cv: 3, "
                 "prompt_median_tokens: 2048, output_median_tokens: 64, output_max_tokens: 128}\n"
                 "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\nn_instances: 2\nrouter_delay_s: 1.0\n"
                 "metrics: {slos: {short: {ttft_s: 0.3, tpot_s: 0.05}, long: {ttft_s: 5.0, tpot_s: 0.1}}}\nseed: 0\n")
    t = tiny_task(str(p), env_id="kvsched/Routing-v0", instances=2, heuristics=("round-robin", "least-loaded", "llm-d"),
                  tuned=("llm-d",))
    tuned = tune_task(t, tmp_path / "tune")
    check_tuning_saw_no_heldout(t, tuned)
    assert tuned["llm-d"]["trials"]["complete"] == 2 and tuned["reference"] in t.heuristics
    ep = pool(t)[0]
    out = episode_baselines(t, ep, 0, tuned)
    assert {"round-robin (default)", "llm-d (tuned)", "constant instance=0", "constant instance=1", "random"} <= set(
        out["scores"])
    assert all(out["bound"]["score"] >= s for s in out["scores"].values() if s is not None)


def test_the_printed_leaderboard_shows_strata_and_agent_names_verbatim_not_as_markup():
    """Rich reads '[hard, 24 episodes]' or a checkpoint named 'runs/[a]/ppo.zip' as markup tags
    and drops them; the leaderboard prints them as text."""
    import io

    from rich.console import Console

    from kvsched.experiments.leaderboard_cli import _print

    base = {"task": "t", "stratum": "hard", "episodes": 24, "isolation_mean": 1.0, "bound_mean": 0.9,
            "tuned_best": "lars (tuned)", "tuned_mean": 0.8, "headroom": 0.1, "headroom_lo": 0.05, "headroom_hi": 0.15}
    rows = [{**base, "agent": a, "kind": k, "mean": 0.8, "diff": 0.0, "diff_lo": 0.0, "diff_hi": 0.0,
             "normalised": 0.0, "worse": 0, "paired_episodes": 24} for a, k in [("lars (tuned)", "baseline"),
                                                                    ("runs/[bold]/ppo.zip", "agent")]]
    buf = io.StringIO()
    _print(rows, {"provenance": {"command": "kvsched leaderboard --out [x]", "kvsched_version": "0"}},
           Console(file=buf, width=200))
    text = buf.getvalue()
    assert "t [hard, 24 episodes]: bound 0.900" in text
    assert "* runs/[bold]/ppo.zip" in text and "--out [x]" in text
