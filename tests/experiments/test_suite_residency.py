"""kvsched bench on kvsched/Residency-v0 (experiments/suite/residency.py), on a tiny task:

- the session keep is tuned on train episodes only (the same requests the no-leak check rebuilds);
- the bound is the clairvoyant eviction order, replayable, and >= every baseline;
- a heuristic agent that plays a baseline's decisions gets that baseline's scores, episode by episode;
- the hard stratum is the pool's highest reuse pressure, measured from the prefix hashes alone;
- the clairvoyant order is refused as an agent, and a task record that is not a residency task's is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gymnasium")

from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.envs.sim.request import Request, Workload  # noqa: E402
from kvsched.experiments.suite.agents import check_agent, evaluate_agent  # noqa: E402
from kvsched.experiments.suite.bounds import reuse_pressure  # noqa: E402
from kvsched.experiments.suite.compute import (check_tuning_saw_no_heldout, episode_baselines,  # noqa: E402
                                               tune_task, tuning_requests)
from kvsched.experiments.suite.episodes import measure_pool, pool, strata, task_source  # noqa: E402
from kvsched.experiments.suite.results import FORMAT, check_results, leaderboard  # noqa: E402
from kvsched.experiments.suite.runs import score  # noqa: E402
from kvsched.experiments.suite.search import Schedule, run_schedule  # noqa: E402
from kvsched.experiments.suite.tasks import BenchTask, SearchBudget  # noqa: E402

SCENARIO = """name: tiny-residency
synthetic: {rate_per_s: 2.0, duration_s: 240, arrival: bursty, burstiness_cv: 3.0, prompt_median_tokens: 512,
  prompt_max_tokens: 4096, output_median_tokens: 64, output_max_tokens: 256, system_prompt_tokens: 1024,
  num_system_prompts: 2, concurrent_sessions: 24, turns_per_session: 6, max_session_tokens: 16384}
instance:
  model: Llama-3.1-8B
  gpu: H100-SXM
  gpu_memory_utilization: 0.25
  dram_kv_bytes: 2147483648
  prefix_offload: {tiers: [dram], write_policy: write_through, eviction: lru, load_policy: cost}
metrics: {slos: {short: {ttft_s: 0.3, tpot_s: 0.1}, long: {ttft_s: 2.0, tpot_s: 0.2}}}
seed: 0
"""


def tiny_residency_task(path: str, **kw) -> BenchTask:
    """60 s windows of 240 s (one held-out window per seed), two keep bins, two train episodes."""
    base = dict(task_id="tiny-residency", suite="test", description="tiny", lever="retention",
                env_id="kvsched/Residency-v0", scenario=path, window_s=60.0,
                env_kwargs=(("eviction", "lru"), ("keep_bins_s", (15.0, 30.0))), heuristics=("lru", "lfu", "session"),
                tuned=("session",), tune_trials=2, tune_episodes=2, pool_seeds=3, stratum_episodes=2,
                hard_by="reuse_pressure", search=SearchBudget(0, 0))
    base.update(kw)
    return BenchTask(**base)


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    """The tiny task, its tuning and its results on its two strata (no behaviour clone)."""
    tmp = tmp_path_factory.mktemp("residency")
    (tmp / "tiny.yaml").write_text(SCENARIO)
    t = tiny_residency_task(str(tmp / "tiny.yaml"))
    tuned = tune_task(t, tmp / "tune")
    eps = pool(t)
    stats = measure_pool(t, eps)
    st = strata(t, eps, stats)
    index = {k: i for i, k in enumerate(sorted({e.key() for v in st.values() for e in v}))}
    per = {}
    for ep in {e for v in st.values() for e in v}:
        per[ep.key()] = {**episode_baselines(t, ep, index[ep.key()], tuned), "isolation": stats[ep.key()].attainment}
    tr = {"tuning": tuned, "strata": {s: [e.key() for e in v] for s, v in st.items()}, "episodes": per}
    return t, tr, stats, tmp


def test_the_session_keep_is_tuned_on_train_episodes_only(computed):
    t, tr, _, tmp = computed
    tuned = tr["tuning"]
    check_tuning_saw_no_heldout(t, tuned)
    assert (tmp / "tune" / "session.journal").is_file()
    assert tuned["session"]["trials"]["complete"] == 2 and tuned["session"]["params"]["keep_s"] in (15.0, 30.0)
    assert tuned["lru"] == {"params": {}, "train_objective": tuned["lru"]["train_objective"], "tuned": False}
    assert tuned["reference"] in t.heuristics
    # the requests the no-leak check rebuilds from the study's windows are the ones the episodes served
    src = task_source(t, "train")
    windows = [int(round(w0 / t.window_s)) for w0, _ in tuned["session"]["windows_s"]]
    assert set(windows) <= set(src.train_windows)
    served = {(s, int(i)) for s in tuned["session"]["seeds"] for w in windows for i in src.workload(s, w).request_id}
    assert tuning_requests(t, tuned, "session") == served


def test_the_bound_is_the_clairvoyant_order_replayable_and_at_least_every_baseline(computed):
    t, tr, _, _ = computed
    for key, ep in tr["episodes"].items():
        scores = [s for s in ep["scores"].values() if s is not None]
        assert ep["bound"]["score"] >= max(scores), key
        assert ep["bound"]["clairvoyant"] is not None
        if ep["bound"]["schedule"] is not None:  # the clairvoyant order reached the bound: replaying it gives it
            e = next(e for e in pool(t) if e.key() == key)
            again = score(run_schedule(t, e, Schedule.from_dict(ep["bound"]["schedule"])).summary)
            assert again == ep["bound"]["score"] == ep["bound"]["clairvoyant"]
    check_results({"tasks": {"tiny-residency": tr}}, "tiny")
    assert {"lru (default)", "session (tuned)", "constant drop", "constant keep=15s", "random"} <= set(
        next(iter(tr["episodes"].values()))["scores"])


def test_a_heuristic_agent_gets_the_scores_of_the_baseline_whose_decisions_it_plays(computed):
    """session:15 keeps every conversation 15 s: the constant keep=15s baseline; random
    reproduces the random baseline (the same seeds)."""
    t, tr, _, _ = computed
    for agent, label in (("session:15", "constant keep=15s"), ("random", "random")):
        got = evaluate_agent(t, tr, agent)
        for stratum, keys in tr["strata"].items():
            assert got[stratum] == [tr["episodes"][k]["scores"][label] for k in keys], (agent, stratum)
    rows = leaderboard({"format": FORMAT, "tasks": {"tiny-residency": tr}})
    assert {r["tuned_best"] for r in rows} == {f"{tr['tuning']['reference']} " + (
        "(tuned)" if tr["tuning"]["reference"] == "session" else "(default)")}


def test_the_hard_stratum_is_the_pools_highest_reuse_pressure(computed):
    t, tr, stats, _ = computed
    measured = sorted((s.reuse_pressure for s in stats.values() if s.requests), reverse=True)
    assert sorted((stats[k].reuse_pressure for k in tr["strata"]["hard"]), reverse=True) == measured[:2]
    assert all(0 < s.reuse_pressure for s in stats.values() if s.requests)


def test_reuse_pressure_is_the_live_set_of_blocks_awaiting_reuse_over_the_cache():
    """Two 16-token blocks read at 0 s and again at 10 s (a third block read once) wait 10 s each:
    320 token-seconds over a 20 s window is 16 tokens, a quarter of a 64-token cache."""
    w = Workload.from_requests([Request(0, 0.0, 48, 4, prefix_hashes=(1, 2, 3), hash_block_tokens=16),
                                Request(1, 10.0, 32, 4, prefix_hashes=(1, 2), hash_block_tokens=16)])
    assert reuse_pressure(w, 64, 20.0) == pytest.approx(0.25)
    assert reuse_pressure(Workload.from_requests([Request(0, 0.0, 48, 4)]), 64, 20.0) == 0.0
    with pytest.raises(ValueError):
        reuse_pressure(w, 0, 20.0)


@pytest.mark.parametrize("agent, says", [
    ("clairvoyant", "bound"),
    ("session:45", "one of the keep bins 15, 30"),
    ("lars", "residency heuristic"),
])
def test_the_clairvoyant_order_and_names_the_task_cannot_play_are_refused_as_agents(computed, agent, says):
    t = computed[0]
    with pytest.raises(ConfigError, match=says):
        check_agent(t, agent)


@pytest.mark.parametrize("change, says", [
    ({"search": SearchBudget(8, 48)}, "clairvoyant eviction order"),
    ({"tuned": ("lru",)}, "only session"),
    ({"heuristics": ("lru", "fcfs"), "tuned": ("lru",)}, "residency heuristics"),
    ({"hard_by": "cache_misses"}, "reuse_pressure"),
])
def test_a_residency_task_record_that_cannot_be_computed_is_refused(tmp_path, change, says):
    with pytest.raises(ConfigError, match=says):
        tiny_residency_task(str(tmp_path / "tiny.yaml"), **change)


def test_the_suite_runs_a_residency_heuristic_as_the_environment_plays_it(computed):
    """The suite's run of the session keep equals kvsched evaluate's (HeuristicAgent through the
    environment): one vocabulary for the heuristics on the leaderboard and in evaluate."""
    from kvsched.agents.evaluate import run_heuristic as evaluate_heuristic
    from kvsched.experiments.suite.runs import run_heuristic

    t = computed[0]
    ep = pool(t)[0]
    mine = run_heuristic(t, ep, "session", {"keep_s": 15.0}).summary
    rows, _ = evaluate_heuristic("session:15", task_source(t), [(ep.workload_seed, ep.window_index, 0)],
                                 "kvsched/Residency-v0", dict(t.env_kwargs))
    (row,) = [r for r in rows if r["class"] == "all"]
    assert row["slo_attainment"] == mine["classes"]["all"]["slo"]["attainment"]
    assert np.isfinite(row["slo_attainment"])
