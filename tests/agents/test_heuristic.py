"""Heuristics act faithfully as agents in every environment: an episode a HeuristicAgent plays
equals the heuristic's direct run in the simulator on the same requests, or the agent refuses and
says how to make the environment."""

from __future__ import annotations

import json

import pytest

gym = pytest.importorskip("gymnasium")

import kvsched.envs  # noqa: E402,F401  (registers the ids)
from kvsched.agents.heuristic import HeuristicAgent  # noqa: E402
from kvsched.envs.common import build_cluster, reference  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.envs.sim.metrics import summary_to_json  # noqa: E402
from kvsched.policies.routing import make_router  # noqa: E402

KW = dict(window_s=10.0, max_requests=40, horizon_s=float("inf"), split="heldout")
OPTIONS = {"workload_seed": 1 << 20, "window_index": 50}


def _episode(env, agent) -> dict:
    obs, info = env.reset(seed=0, options=OPTIONS)
    while True:
        obs, _, term, trunc, info = env.step(agent.predict(obs)[0])
        if term or trunc:
            return info["summary"]


def _same(a: dict, b: dict) -> bool:
    return json.loads(summary_to_json(a)) == json.loads(summary_to_json(b))


@pytest.mark.parametrize("env_id", ["kvsched/Scheduling-v0", "kvsched/Scheduling-v1"])
def test_scheduling_heuristic_as_the_reference_equals_its_direct_run(env_id):
    env = gym.make(env_id, reference_policy="lars", **KW)
    got = _episode(env, HeuristicAgent("lars", env))
    src = env.unwrapped.source
    direct = build_cluster(src, lambda i: reference("lars", None, src)).run(src.workload(**OPTIONS))
    assert _same(got, direct.summary)


def test_scheduling_refuses_a_heuristic_other_than_the_reference_and_says_how():
    env = gym.make("kvsched/Scheduling-v0", **KW)
    with pytest.raises(ConfigError, match="reference_policy='lars'"):
        HeuristicAgent("lars", env)
    with pytest.raises(ConfigError, match="reference_policy='lars'"):
        env.unwrapped.heuristic_action("lars")


def test_routing_heuristic_router_equals_its_direct_run_with_a_stale_view(tmp_path):
    sc = tmp_path / "routed.yaml"
    sc.write_text("name: routed\nsynthetic: {rate_per_s: 12.0, duration_s: 600, arrival: bursty, burstiness_cv: 3.0}\n"
                  "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\nn_instances: 3\nrouter_delay_s: 1.0\nseed: 0\n")
    for router in ("least-loaded", "round-robin", "llm-d"):
        env = gym.make("kvsched/Routing-v0", scenario=str(sc), **KW)
        got = _episode(env, HeuristicAgent(router, env))
        src = env.unwrapped.source
        cluster = build_cluster(src, lambda i: reference(src.scenario.policy, None, src), n_instances=3)
        cluster.router = make_router(router)  # the direct run with that router instead of the scenario's
        cluster.router.bind(3, src.scenario.seed)
        direct = cluster.run(src.workload(**OPTIONS))
        assert direct.summary["routing"]["router"] == router
        assert got["routing"]["router"] == "caller (apply route_to)"  # the agent placed every request
        got["routing"]["router"] = router
        assert _same(got, direct.summary), router


def test_knobs_heuristic_keeps_its_parameters_and_equals_its_direct_run():
    env = gym.make("kvsched/Knobs-v0", interval_s=2.0, **KW)
    got = _episode(env, HeuristicAgent(None, env))
    src = env.unwrapped.source
    direct = build_cluster(src, lambda i: reference("lars", None, src)).run(src.workload(**OPTIONS))
    assert _same(got, direct.summary)
    assert _same(_episode(env, HeuristicAgent("lars", env)), direct.summary)
    with pytest.raises(ConfigError, match="heuristic='ewsjf'"):
        HeuristicAgent("ewsjf", env)


def test_a_routing_agent_needs_a_known_router():
    env = gym.make("kvsched/Routing-v0", **KW)
    with pytest.raises(ConfigError):
        HeuristicAgent("no-such-router", env)
    with pytest.raises(ConfigError, match="router name"):
        HeuristicAgent(None, env)


def test_a_heuristic_named_in_another_case_is_the_registered_one():
    env = gym.make("kvsched/Scheduling-v0", reference_policy="lars", **KW)
    agent = HeuristicAgent("LARS", env)
    assert agent.policy == "lars"
    env.close()


def test_an_environment_made_without_gymnasium_make_is_checked_the_same_way():
    from kvsched.envs.knob_env import KnobEnv
    from kvsched.envs.routing_env import RoutingEnv
    from kvsched.envs.scheduling_env import SchedulingEnv

    with pytest.raises(ConfigError, match="reference_policy='lars'"):
        HeuristicAgent("lars", SchedulingEnv(**KW))  # no spec, no id: the class decides
    with pytest.raises(ConfigError, match="heuristic='ewsjf'"):
        HeuristicAgent("ewsjf", KnobEnv(**KW))
    with pytest.raises(ConfigError, match="router name"):
        HeuristicAgent(None, RoutingEnv(**KW))
    wrapped = gym.wrappers.TimeLimit(SchedulingEnv(reference_policy="lars", **KW), max_episode_steps=10**6)
    assert HeuristicAgent("lars", wrapped).policy == "lars"


def test_an_environment_that_is_not_a_kvsched_one_is_refused():
    env = gym.make("CartPole-v1")
    with pytest.raises(ConfigError, match="kvsched environment"):
        HeuristicAgent("lars", env)


def test_routing_refuses_a_scheduling_policy_and_says_where_it_goes():
    env = gym.make("kvsched/Routing-v0", **KW)
    with pytest.raises(ConfigError, match="policy='lars'") as e:
        HeuristicAgent("LARS", env)
    assert "least-loaded" in str(e.value)  # the routers it could name


@pytest.mark.parametrize("made_with, asked", [("LARS", "lars"), ("lars", "LARS"), ("Lars", "lArS")])
def test_a_reference_named_in_another_case_on_either_side_is_the_same_policy(made_with, asked):
    env = gym.make("kvsched/Scheduling-v0", reference_policy=made_with, **KW)
    agent = HeuristicAgent(asked, env)
    assert agent.policy == "lars"
    obs, _ = env.reset(seed=0, options=OPTIONS)
    env.step(agent.predict(obs)[0])  # the environment plays it too
    env.close()


def test_a_vector_env_whose_sub_envs_disagree_on_the_reference_is_refused():
    from stable_baselines3.common.vec_env import DummyVecEnv

    vec = DummyVecEnv([lambda: gym.make("kvsched/Scheduling-v0", reference_policy="lars", **KW),
                       lambda: gym.make("kvsched/Scheduling-v0", reference_policy="fcfs", **KW)])
    with pytest.raises(ConfigError, match="sub-environments that agree on reference_policy"):
        HeuristicAgent("lars", vec)
    with pytest.raises(ConfigError, match="sub-environments that agree"):
        HeuristicAgent(None, vec)
    same = DummyVecEnv([lambda: gym.make("kvsched/Scheduling-v0", reference_policy="lars", **KW)] * 2)
    assert HeuristicAgent("LARS", same).policy == "lars"


@pytest.mark.parametrize("name, keep", [("LRU", None), ("lru", None), ("Session:30", 30.0), ("session:30", 30.0)])
def test_residency_takes_evaluates_names_in_any_case_and_the_session_keep_form(name, keep):
    from kvsched.envs.residency_env import ResidencyEnv

    from pathlib import Path

    scenario = Path(__file__).resolve().parents[2] / "experiments" / "scenarios" / "residency-mooncake.yaml"
    env = ResidencyEnv(scenario=str(scenario), eviction="lru", window_s=60.0,
                       max_requests=60)
    agent = HeuristicAgent(name, env)
    assert agent._args == (name.lower().split(":")[0], keep)
    with pytest.raises(ConfigError, match="params"):
        HeuristicAgent("session:30", env, params={"keep_s": 30.0})
