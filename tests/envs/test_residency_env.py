"""kvsched/Residency-v0: the tier order played through the environment is the direct run, the
session heuristic is a keep action, masked actions fall back to the reference, observations stay
in their box, bad configuration is refused naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from simkit import assert_identical

import kvsched.envs  # noqa: F401  (registers the ids)
from kvsched.envs.residency_env import BASE_ACTIONS, EXTRA_FEATURES, FEATURES, KEEP_BINS_S, ResidencyEnv
from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.policies.base import make_policy

SCENARIOS = Path(__file__).resolve().parents[2] / "experiments" / "scenarios"
SCENARIO = str(SCENARIOS / "residency-mooncake.yaml")
SMALL = dict(scenario=SCENARIO, window_s=60.0, max_requests=60)


def _play(env, action, options=None):
    obs, info = env.reset(options=options or {"window_index": 1})
    steps = 0
    while True:
        a = action(env, obs) if callable(action) else action
        obs, r, term, trunc, info = env.step(a)
        assert env.observation_space.contains(obs)
        steps += 1
        if term or trunc:
            return info, steps


@pytest.mark.parametrize("eviction", ["lru", "clairvoyant"])
def test_the_tier_order_played_through_the_environment_is_the_direct_run(eviction):
    env = ResidencyEnv(eviction=eviction, **SMALL)
    info, steps = _play(env, 0)
    direct = Cluster([env.instance_spec], lambda: make_policy("fcfs"), seed=0).run(env.workload)
    played = env.cluster.result()
    assert played.summary["prefix_tiers"].pop("retention_decisions") == steps == len(env.workload)
    assert_identical(direct, played)
    assert info["summary"]["prefix_tiers"]["tiers"]["dram"]["eviction"] == eviction


def test_the_session_heuristic_is_a_keep_action_and_other_orders_need_their_environment():
    env = ResidencyEnv(**SMALL)
    env.reset(options={"window_index": 1})
    a = env.heuristic_action("session")
    assert env.decision_of(a).kind == "keep" and env.decision_of(a).keep_s == 30.0
    assert env.decision_of(env.heuristic_action("session", 300.0)).keep_s == 300.0
    assert env.heuristic_action("lru") == 0 and env.heuristic_action(None) == 0
    with pytest.raises(ConfigError, match="keep_s"):
        env.heuristic_action("session", 31.0)
    with pytest.raises(ConfigError, match="eviction='lfu'"):
        env.heuristic_action("lfu")
    with pytest.raises(ConfigError, match="not a residency heuristic"):
        env.heuristic_action("fcfs")


def test_keeping_every_conversation_changes_what_dram_holds():
    """The keep actions act: keeping every conversation 300 s serves the same requests with other
    DRAM contents than LRU (kept entries are never evicted by others' writes)."""
    env = ResidencyEnv(**SMALL)
    store = lambda: env.cluster.instances[0].kv.prefix_tiers.stores[0]  # noqa: E731
    _play(env, 0)
    lru = set(store().entries)
    assert store().protected_blocks == 0
    _play(env, lambda e, o: e.heuristic_action("session", 300.0))
    assert set(store().entries) != lru and store().protected_blocks > 0


def test_demote_is_masked_without_a_second_tier_and_a_masked_action_acts_as_the_reference(tmp_path):
    env = ResidencyEnv(**SMALL)
    env.reset(options={"window_index": 1})
    mask = env.action_masks()
    assert mask.tolist() == [True, True, False] + [True] * len(KEEP_BINS_S)
    _, _, _, _, info = env.step(2)
    assert info["invalid_action"] is True and info["action_mask"].tolist() == mask.tolist()
    two = tmp_path / "two.yaml"
    two.write_text(Path(SCENARIO).read_text().replace("tiers: [dram]", "tiers: [dram, nvme]")
                   .replace("  dram_kv_bytes:", "  nvme_kv_bytes: 68719476736\n  dram_kv_bytes:"))
    env2 = ResidencyEnv(scenario=str(two), window_s=60.0, max_requests=60)
    env2.reset(options={"window_index": 1})
    assert env2.action_masks()[2]
    _, _, _, _, info = env2.step(2)
    assert info["invalid_action"] is False


def test_the_observation_names_its_features_and_a_first_turn_is_flagged():
    env = ResidencyEnv(**SMALL)
    obs, _ = env.reset(options={"window_index": 1})
    assert obs.shape == (len(FEATURES),) == env.observation_space.shape
    assert obs[FEATURES.index("turns")] == pytest.approx(1 / 4) and obs[FEATURES.index("first_turn")] == 1.0
    assert env.action_space.n == len(BASE_ACTIONS) + len(KEEP_BINS_S)


@pytest.mark.parametrize("kw,match", [
    (dict(scenario=str(SCENARIOS / "mooncake-conversation.yaml")), "prefix_offload"),
    (dict(eviction="fifo"), "eviction"),
    (dict(keep_bins_s=[30.0, 5.0]), "keep_bins_s"),
    (dict(keep_bins_s=[]), "keep_bins_s"),
    (dict(keep_bins_s=[float("inf")]), "keep_bins_s"),
    (dict(n_instances=0), "n_instances"),
    (dict(reward={"shaping": 1.0}), "shaping"),
])
def test_bad_configuration_is_refused_naming_the_field(kw, match):
    args = dict(SMALL)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        ResidencyEnv(**args)


def test_an_action_out_of_range_is_refused():
    env = ResidencyEnv(**SMALL)
    env.reset(options={"window_index": 1})
    with pytest.raises(ConfigError, match="action"):
        env.step(env.action_space.n)


def test_an_eviction_override_keeps_the_rest_of_the_scenario():
    env = ResidencyEnv(eviction="lfu", **SMALL)
    po = env.instance_spec.prefix_offload
    assert isinstance(po, PrefixOffloadSpec) and po.eviction == ("lfu",) and po.tiers == ("dram",)
    base = ResidencyEnv(**SMALL).instance_spec
    assert dataclasses.replace(base, prefix_offload=po) == env.instance_spec


def test_gym_make_builds_it():
    env = gym.make("kvsched/Residency-v0", **SMALL)
    obs, _ = env.reset(seed=0)
    assert np.all((obs >= 0) & (obs <= 1))


def test_a_timeline_shows_each_retention_decision_on_its_track(tmp_path):
    import json

    env = ResidencyEnv(timeline=str(tmp_path / "ep-{episode}.json"), **SMALL)
    _, steps = _play(env, lambda e, o: e.heuristic_action("session", 60.0))
    events = json.loads((tmp_path / "ep-0.json").read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    kept = [e for e in events if e.get("cat") == "retention"]
    assert len(kept) == steps and all(e["name"] == "keep 60s" for e in kept)
    assert {tracks[(e["pid"], e["tid"])] for e in kept} == {"retention"}


def test_the_heuristic_agent_plays_the_tier_order_and_the_session_keep():
    from kvsched.agents.heuristic import HeuristicAgent

    env = ResidencyEnv(eviction="lfu", **SMALL)
    agent = HeuristicAgent("lfu", env)
    obs, _ = env.reset(options={"window_index": 1})
    assert int(agent.predict(obs)[0]) == 0
    sess = HeuristicAgent("session", env, params={"keep_s": 120.0})
    assert env.decision_of(int(sess.predict(obs)[0])).keep_s == 120.0
    with pytest.raises(ConfigError, match="eviction='lru'"):
        HeuristicAgent("lru", env)
    with pytest.raises(ConfigError, match="params"):
        HeuristicAgent("lfu", env, params={"keep_s": 30.0})
    with pytest.raises(ConfigError, match="keep_s"):
        HeuristicAgent("session", env, params={"keep_s": 7.0})


def test_evaluate_plays_residency_heuristics_on_the_same_episodes(tmp_path):
    from kvsched.agents.evaluate import evaluate

    table = evaluate(["lru", "session:300", "clairvoyant"], SCENARIO, 1, 1, tmp_path, window_s=60.0,
                     env_id="kvsched/Residency-v0")
    assert set(table["agent"]) == {"lru", "session:300", "clairvoyant"}
    assert table.groupby("agent")["episodes"].max().tolist() == [1, 1, 1]
    with pytest.raises(ConfigError, match="keep bins"):
        evaluate(["session:7"], SCENARIO, 1, 1, tmp_path, window_s=60.0, env_id="kvsched/Residency-v0")
    with pytest.raises(ConfigError, match="residency heuristic"):
        evaluate(["fcfs"], SCENARIO, 1, 1, tmp_path, window_s=60.0, env_id="kvsched/Residency-v0")


def test_made_without_a_scenario_it_serves_the_bundled_residency_scenario_and_passes_the_env_checker():
    """``gym.make("kvsched/Residency-v0")`` with no scenario must build (the generic default
    scenario has no prefix tier below HBM) and pass Gymnasium's checker."""
    from gymnasium.utils.env_checker import check_env

    env = ResidencyEnv(window_s=60.0, max_requests=40)
    assert env.source.scenario.name == "residency-mooncake"
    check_env(env, skip_render_check=True)


def test_a_scenario_with_cluster_roles_is_refused_when_made(tmp_path):
    p = tmp_path / "roles.yaml"
    p.write_text(Path(SCENARIO).read_text() + "cluster: {prefill: {count: 1}, decode: {count: 1}}\n")
    with pytest.raises(ConfigError, match=r"scenario=.*cluster: section") as e:
        ResidencyEnv(scenario=str(p), window_s=60.0, max_requests=40)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("agent", ["session:", "session:0", "session:-5", "session:abc", "session:nan", "session:7"])
def test_evaluate_refuses_a_session_keep_outside_the_keep_bins_naming_them(tmp_path, monkeypatch, agent):
    """Every malformed ``session:<s>`` is refused before any episode with the same message naming
    the keep bins (session:0 and session:abc were a generic 'neither a checkpoint' error)."""
    from kvsched.agents import evaluate as ev

    monkeypatch.setattr(ev, "_run_residency_heuristic", lambda *a, **k: pytest.fail("an episode ran"))
    with pytest.raises(ConfigError, match=r"is not allowed: expected session:<seconds> .*keep bins 5, 15") as e:
        ev.evaluate([agent], SCENARIO, 1, 1, tmp_path, window_s=60.0, env_id="kvsched/Residency-v0")
    assert "\n" not in str(e.value)


TIERS = str(SCENARIOS / "residency-tiers.yaml")
TIERS_SMALL = dict(scenario=TIERS, window_s=120.0, max_requests=120)


def test_hbm_actions_and_prefetch_extend_the_actions_and_the_observation_and_change_nothing_when_declined():
    plain = ResidencyEnv(**TIERS_SMALL)
    env = ResidencyEnv(hbm_actions=True, prefetch=True, **TIERS_SMALL)
    k = len(KEEP_BINS_S)
    assert env.action_space.n == len(BASE_ACTIONS) + 2 * k + 2 and env.prefetch_action == env.action_space.n - 1
    assert env.labels[len(BASE_ACTIONS) + k] == "hbm_first" and env.labels[-1] == "prefetch"
    assert env.observation_space.shape == (len(FEATURES) + len(EXTRA_FEATURES),)
    episode = {"workload_seed": 3, "window_index": 1}
    info_plain, _ = _play(plain, 0, episode)
    kinds = {"prefetch": 0, "residency": 0}

    def declining(e, obs):
        kinds[e._point.kind] += 1
        m = e.action_masks()
        if e._point.kind == "prefetch":  # only "no prefetch" and "prefetch" are valid here
            assert obs[len(FEATURES) + EXTRA_FEATURES.index("prefetch_point")] == 1.0
            assert m.sum() == 2 and m[0] and m[e.prefetch_action]
        else:
            assert not m[e.prefetch_action]
        return 0

    info, _ = _play(env, declining, episode)
    assert kinds["prefetch"] > 0 and kinds["residency"] == len(env.workload)
    a, b = info_plain["summary"], info["summary"]
    assert "prefetch_decisions" not in b["prefix_tiers"]  # counts the prefetches asked: none
    assert a == b  # declining every prefetch and playing 0 is the environment without the options


def test_prefetching_and_keeping_in_hbm_act():
    env = ResidencyEnv(hbm_actions=True, prefetch=True, **TIERS_SMALL)
    info, _ = _play(env, lambda e, o: e.heuristic_action("session-hbm+prefetch", 30.0),
                    {"workload_seed": 3, "window_index": 1})
    pt = info["summary"]["prefix_tiers"]
    assert pt["hbm_kept_blocks"] > 0 and pt["tiers"]["nvme"]["prefetches"] > 0
    assert pt["tiers"]["nvme"]["bytes_prefetched"] > 0
    assert env.decision_of(env.heuristic_action("session-hbm", 30.0)).label == "keep 30s +hbm"


def test_the_new_heuristics_need_their_options_and_bad_options_are_refused():
    env = ResidencyEnv(**SMALL)
    env.reset(options={"window_index": 1})
    with pytest.raises(ConfigError, match="hbm_actions=True"):
        env.heuristic_action("session-hbm", 30.0)
    with pytest.raises(ConfigError, match="prefetch=True"):
        env.heuristic_action("lru+prefetch")
    for kw in ("hbm_actions", "prefetch"):
        with pytest.raises(ConfigError, match=kw):
            ResidencyEnv(**{kw: 1}, **SMALL)
    with pytest.raises(ConfigError, match=r"prefetch=True.*lists one tier") as e:  # nothing to prefetch from
        ResidencyEnv(prefetch=True, **SMALL)
    assert "\n" not in str(e.value)


def test_a_misused_heuristic_is_refused_at_a_prefetch_point_too():
    """heuristic_action validated the name, keep time and options only at a retention point: at
    a prefetch point any name played 0."""
    env = ResidencyEnv(prefetch=True, **TIERS_SMALL)
    env.reset(options={"workload_seed": 3, "window_index": 1})
    while env._point.kind != "prefetch":
        env.step(0)
    for policy, keep_s, field in (("nonsense", None, "nonsense"), ("session", 31.0, "keep_s"),
                                  ("session-hbm", 30.0, "hbm_actions=True"), ("lfu", None, "eviction='lfu'"),
                                  ("session+prefetch", 31.0, "keep_s")):
        with pytest.raises(ConfigError, match=field):
            env.heuristic_action(policy, keep_s)
    assert env.heuristic_action("session", 30.0) == 0
    assert env.heuristic_action("session+prefetch") == env.prefetch_action


def test_a_retention_point_observes_the_same_with_prefetch_points_declined_in_between():
    """The eviction- and arrival-rate averages advanced at every observation, so prefetch points
    in between changed what the retention points showed (the first 17 features)."""
    episode = {"workload_seed": 3, "window_index": 1}

    def retention_observations(env):
        obs, _ = env.reset(options=episode)
        seen, kinds = [], set()
        while True:
            kinds.add(env._point.kind if env._point is not None else None)
            if env._point is not None and env._point.kind == "residency":
                seen.append(obs[:len(FEATURES)].copy())
            obs, _, term, trunc, _ = env.step(0)
            if term or trunc:
                return np.array(seen), kinds

    plain, _ = retention_observations(ResidencyEnv(**TIERS_SMALL))
    env = ResidencyEnv(prefetch=True, **TIERS_SMALL)
    watched, kinds = retention_observations(env)
    assert "prefetch" in kinds
    assert "prefetch_decisions" not in env.cluster.result().summary["prefix_tiers"]  # none asked
    np.testing.assert_array_equal(plain, watched)


def test_evaluate_plays_the_hbm_and_prefetch_heuristics_with_their_options(tmp_path):
    from kvsched.agents.evaluate import evaluate, residency_heuristic
    from kvsched.agents.heuristic import HeuristicAgent

    assert residency_heuristic("session-hbm:30+prefetch") == ("session-hbm+prefetch", 30.0)
    assert residency_heuristic("lru+prefetch") == ("lru+prefetch", None)
    assert residency_heuristic("session-hbm:x") is None and residency_heuristic("fifo+prefetch") is None
    table = evaluate(["lru", "lru+prefetch", "session-hbm:30"], TIERS, 1, 1, tmp_path, window_s=40.0,
                     env_id="kvsched/Residency-v0")
    assert set(table["agent"]) == {"lru", "lru+prefetch", "session-hbm:30"}
    env = ResidencyEnv(hbm_actions=True, **TIERS_SMALL)
    obs, _ = env.reset(options={"workload_seed": 0, "window_index": 1})
    agent = HeuristicAgent("session-hbm", env, params={"keep_s": 60.0})
    assert env.decision_of(int(agent.predict(obs)[0])).label == "keep 60s +hbm"


def test_with_both_options_it_passes_the_env_checker():
    from gymnasium.utils.env_checker import check_env

    check_env(ResidencyEnv(hbm_actions=True, prefetch=True, scenario=TIERS, window_s=60.0, max_requests=40),
              skip_render_check=True)
