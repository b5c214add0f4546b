"""kvsched/PDRouting-v0: the decode instance and the prefill placement of each arrival, with
prefill/decode roles (kvsched.envs.routing_env.PDRoutingEnv)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import kvsched.envs  # noqa: F401  (registers the ids)
from kvsched.envs.common import build_cluster, reference
from kvsched.envs.episodes import EpisodeConfig, EpisodeSource
from kvsched.envs.routing_env import PDRoutingEnv
from kvsched.envs.sim.cluster import LOCAL_PREFILL
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import summary_to_json
from kvsched.policies.routing import make_router
from kvsched.runner.scenario import bundled_scenario_dir

PD = str(bundled_scenario_dir() / "mixed-long-short-pd.yaml")


def test_heuristic_play_equals_the_direct_run_with_that_router():
    """Playing the decode router (least-loaded) and the cluster's own prefill decision through the
    environment serves the window exactly as the cluster run with that router."""
    env = PDRoutingEnv(window_s=10.0, max_requests=30, split="all")
    env.reset(seed=0)
    while True:
        _, _, term, trunc, _ = env.step(env.heuristic_action("least-loaded"))
        if term or trunc:
            break
    played = env.cluster.result()
    src = EpisodeSource(EpisodeConfig(PD, window_s=10.0, split="all", max_requests=30))
    direct = build_cluster(src, lambda i: reference(src.scenario.policy, None, src)).run(env.workload)
    assert played.summary["routing"].pop("router") == "caller (apply route_to)"
    assert direct.summary["routing"].pop("router") == "least-loaded"
    assert summary_to_json(played.summary) == summary_to_json(direct.summary)
    assert direct.summary["disaggregation"]["remote_prefills"] > 0


def test_action_encoding_masks_and_bad_actions():
    env = PDRoutingEnv(window_s=10.0, max_requests=10)
    env.reset(seed=0)
    assert env.action_space.n == 2 * 3  # 2 decode instances x (local + 2 prefill instances)
    assert env.decode_action(0) == (2, LOCAL_PREFILL) and env.decode_action(5) == (3, 1)
    assert env.action_masks().all()  # decode-only targets take any prefill choice
    with pytest.raises(ConfigError, match="action"):
        env.step(6)
    assert env.observation_space.shape == (3 + 9 * 4,)


def test_scenario_without_prefill_instances_is_refused():
    with pytest.raises(ConfigError, match="cluster: section"):
        gym.make("kvsched/PDRouting-v0", scenario=str(bundled_scenario_dir() / "mixed-long-short.yaml"))
    with pytest.raises(ConfigError, match="n_instances"):
        PDRoutingEnv(n_instances=2)


def test_routers_of_the_heuristic_are_registered():
    make_router("least-loaded")


def test_routing_v0_with_roles_picks_the_decode_instance_only():
    """Routing-v0 on a scenario with roles: prefill instances are masked; its router heuristic
    equals the direct run with that router."""
    env = gym.make("kvsched/Routing-v0", scenario=PD, window_s=10.0, max_requests=20, split="all").unwrapped
    env.reset(seed=0)
    assert env.action_masks().tolist() == [False, False, True, True]
    env.reset(seed=0)
    while True:
        _, _, term, trunc, _ = env.step(env.heuristic_action("least-loaded"))
        if term or trunc:
            break
    played = env.cluster.result()
    src = EpisodeSource(EpisodeConfig(PD, window_s=10.0, split="all", max_requests=20))
    direct = build_cluster(src, lambda i: reference(src.scenario.policy, None, src)).run(env.workload)
    played.summary["routing"].pop("router")
    direct.summary["routing"].pop("router")
    assert summary_to_json(played.summary) == summary_to_json(direct.summary)


MIXED = """name: pd-mixed
synthetic: {rate_per_s: 6.0, duration_s: 20, long_fraction: 0.1, long_min_tokens: 4000, long_max_tokens: 8000}
instance: {model: Llama-3.1-8B, gpu: H100-SXM}
policy: fcfs
router: least-loaded
cluster: {prefill: {count: 1}, decode: {count: 1}, mixed: {count: 1}}
seed: 0
"""


def test_a_masked_routing_action_falls_back_to_the_cluster_router_not_an_error():
    """Routing-v0 with roles: choosing a prefill instance (masked) lets the scenario's router place
    the request, flagged in info["invalid_action"]; an episode of masked actions only is the direct
    run (Gymnasium's checker samples any action of the space, masked ones included)."""
    env = gym.make("kvsched/Routing-v0", scenario=PD, window_s=10.0, max_requests=20, split="all").unwrapped
    env.reset(seed=0)
    while True:
        _, _, term, trunc, info = env.step(0)
        assert info["invalid_action"] is True
        if term or trunc:
            break
    src = EpisodeSource(EpisodeConfig(PD, window_s=10.0, split="all", max_requests=20))
    direct = build_cluster(src, lambda i: reference(src.scenario.policy, None, src)).run(env.workload)
    assert summary_to_json(env.cluster.result().summary) == summary_to_json(direct.summary)


def test_a_masked_pd_action_prefills_locally_on_the_mixed_target_and_passes_the_env_checker(tmp_path):
    from gymnasium.utils.env_checker import check_env

    p = tmp_path / "pd-mixed.yaml"
    p.write_text(MIXED)
    env = PDRoutingEnv(scenario=str(p), window_s=10.0, max_requests=20, split="all")
    env.reset(seed=0)
    masked = [a for a, ok in enumerate(env.action_masks()) if not ok]
    assert masked and all(env.decode_action(a)[0] == 2 for a in masked)  # the mixed instance's remote prefills
    _, _, _, _, info = env.step(masked[0])
    assert info["invalid_action"] is True
    assert env.cluster.disagg.counters.remote_prefills == 0  # prefilled locally on the mixed instance
    _, _, _, _, info = env.step(1)  # decode instance 1, remote prefill on instance 0: allowed
    assert info["invalid_action"] is False
    for seed in range(3):  # the checker's sampled actions include masked ones (seeds 0 and 2 sample one)
        fresh = PDRoutingEnv(scenario=str(p), window_s=10.0, max_requests=20)
        fresh.action_space.seed(seed)
        check_env(fresh, skip_render_check=True)
