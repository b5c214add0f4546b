"""Gymnasium environments and the cluster's stepping API (issue #6). Small windows: seconds each."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

import kvsched.envs  # noqa: E402  (registers the ids)
from kvsched.envs.action import AgentPolicy  # noqa: E402
from kvsched.envs.common import build_cluster, default_scenario_path, reference  # noqa: E402
from kvsched.envs.episodes import EpisodeConfig, EpisodeSource  # noqa: E402
from kvsched.envs.knob_env import KnobEnv  # noqa: E402
from kvsched.envs.routing_env import RoutingEnv  # noqa: E402
from kvsched.envs.scheduling_env import SchedulingEnv  # noqa: E402
from kvsched.envs.sim.cluster import Cluster, DecisionWatch
from kvsched.runner.simulate import simulate  # noqa: E402
from kvsched.envs.sim.errors import ConfigError  # noqa: E402
from kvsched.envs.sim.metrics import summary_to_json  # noqa: E402
from kvsched.envs.sim.request import Request, Workload  # noqa: E402
from kvsched.policies.base import make_policy  # noqa: E402
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model  # noqa: E402

SMALL = dict(window_s=10.0, max_requests=25)
#: Residency-v0 needs a scenario whose instances cache prefixes below HBM
RESIDENCY_SMALL = dict(scenario=str(Path(__file__).resolve().parents[2] / "experiments" / "scenarios"
                                    / "residency-mooncake.yaml"), window_s=40.0, max_requests=40)


def small(env_id: str) -> dict:
    """Small episodes of ``env_id`` (its own scenario where the default cannot serve it)."""
    return RESIDENCY_SMALL if env_id == "kvsched/Residency-v0" else SMALL

PREEMPT_YAML = """
name: tiny-hbm-swap
synthetic: {rate_per_s: 10.0, duration_s: 12, prompt_median_tokens: 400, output_median_tokens: 120,
            output_max_tokens: 300}
instance: {model: Llama-3.1-8B, gpu: H100-SXM, hbm_kv_blocks: 160, dram_kv_bytes: 2.0e8,
           max_num_batched_tokens: 2048, max_num_seqs: 64, preemption_mode: MODE}
policy: fcfs
seed: 3
"""


@pytest.fixture(scope="module")
def preempt_scenarios(tmp_path_factory):
    d = tmp_path_factory.mktemp("scen")
    out = {}
    for mode in ("swap", "recompute"):
        p = d / f"tiny-{mode}.yaml"
        p.write_text(PREEMPT_YAML.replace("MODE", mode))
        out[mode] = str(p)
    return out


def _canon(summary: dict) -> dict:
    return json.loads(summary_to_json(summary))


def _play(env, policy=None, seed=0, options=None, actions=None):
    """Run one episode with the heuristic (or a fixed action list, cycled); returns
    (observations, rewards, last info)."""
    obs, info = env.reset(seed=seed, options=options)
    out_obs, rewards = [obs], []
    i = 0
    while True:
        a = env.heuristic_action(policy) if actions is None else actions[i % len(actions)]
        obs, r, term, trunc, info = env.step(a)
        out_obs.append(obs)
        rewards.append(r)
        i += 1
        if term or trunc:
            return out_obs, rewards, info


# ------------------------------------------------------------------------------ stepping API
def _workload_and_spec(path=None, window=(0.0, 20.0)):
    src = EpisodeSource(EpisodeConfig(path or default_scenario_path(), window_s=window[1] - window[0], split="all"))
    return src, src.workload(src.scenario.seed, 0)


def test_stepping_api_reproduces_run_exactly():
    """start + run_until_decision/apply, stopping at every arrival and every scheduling point,
    serves the workload exactly as run()."""
    src, w = _workload_and_spec()
    direct = build_cluster(src, lambda i: reference("fcfs", None, src), n_instances=2).run(w)
    c = build_cluster(src, lambda i: reference("fcfs", None, src), n_instances=2)
    c.start(w, DecisionWatch(route=True, schedule_instance=1))
    kinds = {"route": 0, "schedule": 0}
    while (p := c.run_until_decision()) is not None:
        kinds[p.kind] += 1
        c.apply()
    stepped = c.result()
    assert kinds["route"] == len(w) and kinds["schedule"] > 0
    assert summary_to_json(stepped.summary) == summary_to_json(direct.summary)
    assert stepped.records.equals(direct.records)


def test_stepping_api_time_points_and_errors():
    src, w = _workload_and_spec()
    c = build_cluster(src, lambda i: reference("fcfs", None, src))
    with pytest.raises(RuntimeError, match="start"):
        c.run_until_decision()
    c.start(w, DecisionWatch(route=True))
    with pytest.raises(RuntimeError, match="no decision is pending"):
        c.apply()
    p = c.run_until_decision(until_s=0.0)  # the first arrival is later than t = 0
    assert p.kind == "time" and p.time_s == 0.0 and c.arrived == 0
    p = c.run_until_decision()
    assert p.kind == "route" and p.request.rid == int(w.request_id[0])
    with pytest.raises(RuntimeError, match="pending"):
        c.run_until_decision()
    with pytest.raises(ValueError, match="route_to"):
        c.apply(route_to=5)
    c.apply(route_to=0)
    with pytest.raises(RuntimeError, match="already served"):
        c.start(w)


def test_route_to_places_requests():
    src, w = _workload_and_spec()
    c = build_cluster(src, lambda i: reference("fcfs", None, src), n_instances=3)
    c.start(w, DecisionWatch(route=True))
    while c.run_until_decision() is not None:
        c.apply(route_to=2)
    rec = c.result().records
    assert set(rec["instance_id"]) == {2}


# ----------------------------------------------------------------------- heuristic identity
@pytest.mark.parametrize("policy", ["fcfs", "lars", "sarathi", "priority", "ewsjf", "nonpreemptive"])
def test_heuristic_through_env_equals_direct_run(policy):
    env = SchedulingEnv(window_s=30.0, reference_policy=policy, horizon_s=math.inf)
    _, _, info = _play(env, seed=4)
    direct = simulate(env.workload, env.source.scenario.instance_spec(), policy, env.metrics)
    assert info["decisions"] > 10
    assert _canon(info["summary"]) == _canon(direct.summary)


@pytest.mark.parametrize("policy,mode", [("fcfs", "swap"), ("priority", "swap"), ("lars", "recompute"),
                                         ("sarathi", "recompute"), ("lars", "swap"), ("sarathi", "swap")])
def test_heuristic_identity_under_preemption(preempt_scenarios, policy, mode):
    env = SchedulingEnv(scenario=preempt_scenarios[mode], window_s=10.0, max_requests=40, split="all",
                        reference_policy=policy, horizon_s=math.inf)
    _, _, info = _play(env, seed=0, options={"workload_seed": 3, "window_index": 0})
    direct = simulate(env.workload, env.source.scenario.instance_spec(), policy, env.metrics)
    assert direct.stats["preemptions"] > 0  # the case exercises preemption decisions
    assert _canon(info["summary"]) == _canon(direct.summary)


def test_agent_decisions_change_the_schedule():
    """A chunk cap of 512 tokens (bin 3) changes the FCFS schedule, and the slot picks who is
    admitted first."""
    env = SchedulingEnv(window_s=60.0, split="heldout", horizon_s=math.inf)
    opts = {"workload_seed": 1 << 20, "window_index": env.source.heldout_windows[0]}
    _, _, ref = _play(env, options=opts)
    _, _, capped = _play(env, options=opts, actions=[np.array([0, 3, 0, 0])])
    assert _canon(ref["summary"]) != _canon(capped["summary"])
    # slot choice: find a decision with >= 2 candidates and room; pick the last shown one
    env.reset(seed=0, options=opts)
    for _ in range(5000):
        inst = env.inst
        n = len(env._shown_ids)
        if n >= 2 and inst.hbm.available_blocks > 2000 and not inst.policy.stall_free:
            chosen = int(env._shown_ids[n - 1])
            env.step(np.array([n - 1, 0, 0, 0]))
            assert chosen in {st.rid for st in inst.running}
            break
        _, _, term, trunc, _ = env.step(np.zeros(4, dtype=np.int64))
        assert not (term or trunc)
    else:
        pytest.fail("no decision with two candidates")


@pytest.mark.parametrize("early", [True, False])
def test_reward_counts_match_summary(early):
    """The episode's reward sums to met - missed as the summary counts them, whether certain
    misses are charged early (default) or at their records."""
    from kvsched.envs.reward import RewardConfig

    env = SchedulingEnv(window_s=60.0, split="heldout", horizon_s=math.inf, reward=RewardConfig(early_miss=early))
    _, rewards, info = _play(env, options={"workload_seed": (1 << 20) + 2, "window_index": 8})
    s = info["summary"]["classes"]["all"]
    met, arrived = s["slo"]["met"], s["counts"]["arrived"]
    assert env.slo_reward.met == met and arrived - met > 0  # the window has misses
    assert env.slo_reward.met + env.slo_reward.missed == arrived
    assert sum(rewards) == pytest.approx(met - (arrived - met))
    assert (len(env.slo_reward.charged) > 0) == early


# ------------------------------------------------------------------------------- masks/actions
def test_preemption_actions_take_effect(preempt_scenarios):
    """Victim 'most_blocks' with recompute instead of the reference's newest victim + swap."""
    env = SchedulingEnv(scenario=preempt_scenarios["swap"], window_s=10.0, max_requests=40, split="all",
                        horizon_s=math.inf)
    opts = {"workload_seed": 3, "window_index": 0}
    _, _, ref = _play(env, options=opts)
    _, _, other = _play(env, options=opts, actions=[np.array([0, 0, 3, 1])])
    a, b = ref["summary"]["classes"]["all"], other["summary"]["classes"]["all"]
    assert a["bytes_moved"]["hbm_to_dram"] > 0 and b["bytes_moved"]["hbm_to_dram"] < a["bytes_moved"]["hbm_to_dram"]
    assert b["preemptions"]["recomputed_tokens"] > a["preemptions"]["recomputed_tokens"]


def test_masks_padding_and_modes(preempt_scenarios):
    env = SchedulingEnv(k=8, **SMALL)
    obs, info = env.reset(seed=0)
    m = env.action_masks()
    assert m.shape == (8 + 7 + 5 + 4,) and np.array_equal(m, info["action_mask"])
    n = len(env._shown_ids)
    assert m[:8].sum() == max(1, n) and np.array_equal(m[-4:], [True, True, False, False])  # no DRAM/NVMe
    assert obs[:8 * 9].reshape(8, 9)[:, 0].sum() == n
    env2 = SchedulingEnv(scenario=preempt_scenarios["swap"], window_s=10.0, max_requests=40, split="all")
    env2.reset(seed=0)
    assert np.array_equal(env2.action_masks()[-4:], [True, True, True, False])  # DRAM yes, NVMe no


def test_masked_action_falls_back_and_is_flagged():
    env = SchedulingEnv(k=16, **SMALL)
    env.reset(seed=0)
    n = len(env._shown_ids)
    assert n < 16
    _, _, _, _, info = env.step(np.array([15, 0, 0, 2]))  # padding slot, swap without DRAM
    assert info["invalid_action"] is True
    with pytest.raises(ConfigError, match="action"):
        env.step(np.array([16, 0, 0, 0]))


def test_actions_that_are_not_whole_numbers_are_refused_not_truncated():
    """A fractional Scheduling-v0 / Routing-v0 action used to be cast to int (0.7 -> 0, 1.9 -> 1,
    [0, 1] -> 0), and text raised a bare ValueError; both now name the action and what is allowed.
    Whole numbers in any numeric form still decode as before."""
    env = SchedulingEnv(k=16, **SMALL)
    env.reset(seed=0)
    ref = env.decode(np.array([0, 1, 0, 0]))[0]
    for same in ([0, 1, 0, 0], np.array([0.0, 1.0, 0.0, 0.0]), np.array([[0, 1, 0, 0]], dtype=np.int32)):
        d = env.decode(same)[0]
        assert (d.first_request_id, d.chunk_tokens, d.victim_rule, d.mode) == \
            (ref.first_request_id, ref.chunk_tokens, ref.victim_rule, ref.mode) == (None, 128, "reference", "reference")
    for bad in (np.array([0.7, 1.9, 0.0, 0.0]), [0, 1, 0, float("nan")], "ab", [0, 1], None):
        with pytest.raises(ConfigError, match=r"action=.* is not allowed: expected 4 integers below \[16, 7, 5, 4\]"):
            env.decode(bad)
    renv = RoutingEnv(n_instances=3, **SMALL)
    renv.reset(seed=0)
    for bad in (1.7, np.array([0, 1]), "x", -1, 3):
        with pytest.raises(ConfigError, match=r"action=.* is not allowed: expected an instance index in \[0, 3\)"):
            renv.step(bad)
    renv.step(np.float64(2.0))
    renv.step(np.array([2]))
    insts = renv.cluster.instances
    assert renv.decisions == 2 and all(len(i.waiting) + len(i.running) == 0 for i in insts[:2])
    assert len(insts[2].waiting) + len(insts[2].running) >= 1
    kenv = KnobEnv(**SMALL)
    kenv.reset(seed=0)
    for bad in ("abc", [[0.0, 0.0], [0.0]], None):
        with pytest.raises(ConfigError, match=r"action=.* is not allowed: expected 4 numbers in \[-1, 1\]"):
            kenv.values(bad)


def test_slot_action_mode_is_discrete():
    env = SchedulingEnv(action_mode="slot", k=4, **SMALL)
    assert isinstance(env.action_space, gym.spaces.Discrete) and env.action_space.n == 4
    env.reset(seed=0)
    assert env.action_masks().shape == (4,)
    env.step(0)


# ----------------------------------------------------------------------------- API compliance
@pytest.mark.parametrize("env_id", kvsched.envs.ENV_IDS)
def test_gymnasium_and_sb3_check_env(env_id):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    a, b = gym.make(env_id, **small(env_id)).unwrapped, gym.make(env_id, **small(env_id)).unwrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning is a failure
        check_env(a)
        sb3_check_env(b, warn=True)


def _shared_objects(a, b, path="") -> list[str]:
    """Where ``a`` and ``b`` (observations or infos) share a mutable object: the same dict or
    list, or NumPy arrays over the same memory (what Gymnasium >= 1.4's ``check_env`` refuses,
    checked here over whole episodes and without depending on the installed Gymnasium)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return [path or "obs"] if np.shares_memory(a, b) else []
    if isinstance(a, (dict, list)) and a is b:
        return [path or "info"]
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in a.keys() & b.keys() for p in _shared_objects(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _shared_objects(x, y, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("env_id", kvsched.envs.ENV_IDS)
def test_every_step_returns_new_observation_and_info_data(env_id):
    env = gym.make(env_id, **small(env_id)).unwrapped
    env.action_space.seed(0)
    returned = [env.reset(seed=0)]
    while True:
        obs, _, term, trunc, info = env.step(env.action_space.sample())
        returned.append((obs, info))
        if term or trunc:
            break
    returned.append(env.reset(seed=1))
    for i in range(len(returned)):
        for j in range(i + 1, len(returned)):
            shared = _shared_objects(returned[i], returned[j])
            assert not shared, f"{env_id}: calls {i} and {j} return the same object at {shared}"


def _rollout(env, seed, n=40):
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    traj = [obs.copy()]
    for _ in range(n):
        obs, r, term, trunc, _ = env.step(env.action_space.sample())
        traj.append(np.append(obs, r))
        if term or trunc:
            obs, _ = env.reset()
    return np.concatenate([np.ravel(t) for t in traj])


@pytest.mark.parametrize("env_id", kvsched.envs.ENV_IDS)
def test_same_seed_same_trajectory_and_pickling(env_id):
    n = 8 if env_id == "kvsched/Knobs-v0" else 40  # a knob step simulates 5 s
    a = _rollout(gym.make(env_id, **small(env_id)), 7, n)
    b = _rollout(gym.make(env_id, **small(env_id)), 7, n)
    c = _rollout(gym.make(env_id, **small(env_id)), 8, n)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # a pickled env mid-episode continues exactly like the original
    env = gym.make(env_id, **small(env_id)).unwrapped
    env.reset(seed=3)
    env.action_space.seed(3)
    env.step(env.action_space.sample())
    clone = pickle.loads(pickle.dumps(env))
    for _ in range(4 if env_id == "kvsched/Knobs-v0" else 10):
        act = env.action_space.sample()
        o1, r1, t1, u1, _ = env.step(act)
        o2, r2, t2, u2, _ = clone.step(act)
        assert np.array_equal(o1, o2) and r1 == r2 and (t1, u1) == (t2, u2)
        if t1 or u1:
            break


def test_same_trajectory_in_another_process():
    code = ("import numpy as np, gymnasium as gym, kvsched.envs, hashlib\n"
            "from tests.envs.test_envs import _rollout\n"
            "print(hashlib.sha256(_rollout(gym.make('kvsched/Scheduling-v0', window_s=10.0, max_requests=25), 7)"
            ".tobytes()).hexdigest())\n")
    import hashlib
    import os
    here = hashlib.sha256(_rollout(gym.make("kvsched/Scheduling-v0", **SMALL), 7).tobytes()).hexdigest()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONHASHSEED": "123"}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_gymnasium_vector_envs_sync_and_async_agree():
    from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

    fns = [lambda: gym.make("kvsched/Scheduling-v0", **SMALL) for _ in range(2)]
    results = []
    for cls in (SyncVectorEnv, AsyncVectorEnv):
        venv = cls(fns)
        obs, info = venv.reset(seed=[1, 2])
        assert obs.shape == (2,) + venv.single_observation_space.shape
        assert info["action_mask"].shape[0] == 2
        seq = [obs]
        for _ in range(15):
            acts = np.zeros((2, 4), dtype=np.int64)
            obs, r, term, trunc, info = venv.step(acts)
            seq.append(obs)
        venv.close()
        results.append(np.stack(seq))
    assert np.array_equal(results[0], results[1])


def test_sb3_dummy_and_subproc_vec_envs_with_heuristic_agent():
    from kvsched.agents.factory import make_vec_env
    from kvsched.agents.heuristic import HeuristicAgent

    runs = []
    for sub in (False, True):
        venv = make_vec_env("kvsched/Scheduling-v0", dict(SMALL, reference_policy="lars"), n_envs=2, seed=5,
                            subprocess=sub)
        agent = HeuristicAgent("lars", venv)
        obs = venv.reset()
        seq = [obs]
        for _ in range(15):
            actions, _ = agent.predict(obs, None, None, True)
            assert actions.shape == (2, 4)
            obs, r, done, info = venv.step(actions)
            seq.append(obs)
        masks = np.stack(venv.env_method("action_masks"))
        assert masks.shape == (2, 16 + 7 + 5 + 4)
        venv.close()
        runs.append(np.stack(seq))
    assert np.array_equal(runs[0], runs[1])


# ----------------------------------------------------------------------------- routing, knobs
def test_routing_env_actions_choose_the_instance():
    env = RoutingEnv(n_instances=3, horizon_s=math.inf, **SMALL)
    env.reset(seed=0)
    done = False
    while not done:
        _, _, term, trunc, info = env.step(1)
        done = term or trunc
    rec = env.cluster.result().records
    assert set(rec["instance_id"]) == {1} and info["summary"]["classes"]["all"]["counts"]["arrived"] == 25


def test_knob_env_maps_and_applies_parameters():
    env = KnobEnv(**SMALL)
    env.reset(seed=0)
    v = env.values(np.array([-1.0, 1.0, 0.0, 1.0]))
    assert v == {"kappa": 1.0, "ttft_floor_s": 1.0, "tbt_target_s": pytest.approx(0.105), "max_chunk_tokens": 8192}
    with pytest.raises(ConfigError, match="action"):
        env.values(np.array([2.0, 0, 0, 0]))
    _, _, _, _, info = env.step(np.array([-1.0, 1.0, 0.0, -1.0], dtype=np.float32))
    p = env.cluster.instances[0].policy
    assert p.params.kappa == 1.0 and p.params.max_chunk_tokens == 256 and p._candidates[-1] == 256
    assert info["time_s"] == 5.0


def test_knob_env_values_fast_path_equals_the_checked_conversion():
    """values() maps a 1-D float array through tolist() (exact); every other action goes through
    float64 conversion. Both give the same numbers (and types), and every bad action raises
    ConfigError naming it, whichever path it takes. The action mask is all True, a new array each call."""
    env = KnobEnv(**SMALL)
    rng = np.random.default_rng(3)
    edge = [np.array([-1.0, 1.0, 0.0, 1.0]), np.array([1.0, -1.0, -1.0, -1.0], dtype=np.float32)]
    randoms = [rng.uniform(-1, 1, 4).astype(dt) for dt in (np.float32, np.float64, np.float16) for _ in range(20)]
    for a in edge + randoms:
        fast, checked = env.values(a), env.values(env._real_entries(a))  # the conversion path
        assert fast == checked and [type(v) for v in fast.values()] == [float, float, float, int]
        assert env.values(a.tolist()) == fast and env.values(a.reshape(1, 4)) == fast  # checked path
    assert env.values(np.array([1, -1, 0, 1])) == env.values(np.array([1.0, -1.0, 0.0, 1.0]))
    assert env.values(np.array([True, False, True, True])) == env.values(np.array([1.0, 0.0, 1.0, 1.0]))
    for bad in (np.array([0.0, 0.0, np.nan, 0.0]), np.array([0.0, 1.5, 0.0, 0.0], dtype=np.float32),
                np.array([0.0, 0.0, 0.0, -np.inf]), np.array([2, 0, 0, 0]), np.zeros(3), np.zeros(5),
                np.float32(0.5), np.zeros((2, 4)), [0.0, 0.0, 0.0, 1.0000001]):
        with pytest.raises(ConfigError, match="action"):
            env.values(bad)
    m = env.action_masks()
    assert m.tolist() == [True] * 4
    m[0] = False  # the caller's copy: the next mask is unchanged
    assert env.action_masks().tolist() == [True] * 4


def test_knob_env_observation_and_chunk_candidates_follow_each_step():
    """After each step the observation's instance features are the instance's own state over
    its fixed scales, its knob entries map the step's values back to [-1, 1], and the LARS
    chunk candidates equal a fresh np.arange up to the new max_chunk_tokens."""
    from kvsched.envs.common import queued_prefill_tokens

    env = KnobEnv(**SMALL)
    env.reset(seed=0)
    rng = np.random.default_rng(1)
    for _ in range(3):
        a = rng.uniform(-1, 1, 4).astype(np.float32)
        obs, _, term, trunc, info = env.step(a)
        inst = env.cluster.instances[0]
        cap, q, nw, ns = inst.hbm.capacity_blocks, queued_prefill_tokens(inst), len(inst.waiting), len(inst.swapped)
        expected = [inst.hbm.used_blocks / cap, inst.hbm.available_blocks / cap, nw / (nw + 16.0),
                    len(inst.running) / inst.spec.max_seqs, ns / (ns + 1.0),
                    q / (q + inst.spec.model_len_limit)]
        v = env.values(a)
        assert info["knobs"] == v
        expected_knobs = [2.0 * (v[n] - lo) / (hi - lo) - 1.0 for n, lo, hi, _ in env.knobs]
        assert np.array_equal(obs[:6], np.array(expected, dtype=np.float32))
        assert np.array_equal(obs[10:], np.array(expected_knobs, dtype=np.float32))
        p = inst.policy
        assert p.params.max_chunk_tokens == v["max_chunk_tokens"]
        assert np.array_equal(p._candidates, np.arange(32, v["max_chunk_tokens"] + 1, 16, dtype=np.float64))
        if term or trunc:
            break


def test_knob_env_validates_every_new_value():
    """Each step's parameters go through the parameter class's validation: a bad value raises
    ConfigError naming the field, and the policy keeps its previous parameters. The builder runs
    only LARS's own checks for LARS's own fields, the full validation otherwise (an inherited
    field among the replaced ones, or a subclass), and equals dataclasses.replace."""
    import dataclasses

    from kvsched.envs.knob_env import ParamsBuilder
    from kvsched.policies.lars import LARSParams

    env = KnobEnv(**SMALL)
    env.reset(seed=0)
    pol, build = env._builders[0]
    before = pol.params
    for field, bad in (("kappa", -1.0), ("ttft_floor_s", 0.0), ("tbt_target_s", float("nan")),
                       ("max_chunk_tokens", 16), ("max_chunk_tokens", 256.0)):
        with pytest.raises(ConfigError, match=field if field != "max_chunk_tokens" or bad != 16
                           else "min_chunk_tokens"):
            env._set({"kappa": 2.0, "ttft_floor_s": 0.5, "tbt_target_s": 0.05, field: bad})
        assert pol.params is before
    assert build.validate == LARSParams._validate_own
    ok = build({"kappa": 2.0})
    assert ok == dataclasses.replace(before, kappa=2.0) and type(ok) is LARSParams
    # an inherited field among the replaced ones: the full validation runs
    full = ParamsBuilder(before, ["kappa", "prefetch"])
    assert full.validate == LARSParams.__post_init__
    with pytest.raises(ConfigError, match="PolicyParams.prefetch"):
        full({"kappa": 2.0, "prefetch": "yes"})
    with pytest.raises(ConfigError, match="LARSParams.eps_s"):
        ParamsBuilder(before, ["eps_s"])({"eps_s": 0})

    @dataclasses.dataclass(frozen=True)
    class Stricter(LARSParams):  # a subclass may check more: it gets its full validation
        def __post_init__(self) -> None:
            super().__post_init__()
            if self.kappa > 4:
                raise ConfigError(f"Stricter.kappa={self.kappa} must be <= 4")

    sub = ParamsBuilder(Stricter(), ["kappa"])
    assert sub({"kappa": 3.0}) == Stricter(kappa=3.0)
    with pytest.raises(ConfigError, match="Stricter.kappa"):
        sub({"kappa": 5.0})

    @dataclasses.dataclass(frozen=True)
    class WithDerived(LARSParams):  # an init=False field: not a plain class, dataclasses.replace
        ratio: float = dataclasses.field(default=0.0, init=False)

        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, "ratio", self.kappa / self.ttft_floor_s)

    iv = ParamsBuilder(WithDerived(), ["kappa"])
    assert iv.validate is None and iv({"kappa": 3.0}).ratio == 3.0 / 0.25
    with pytest.raises(ConfigError, match="LARSParams.kappa"):
        iv({"kappa": -3.0})


def test_episode_source_sees_an_edited_scenario_file(tmp_path):
    """Scenarios and workloads are cached per process by path *and* content: a scenario file
    edited between two environments (a notebook) is read again, not served stale."""
    sc = tmp_path / "s.yaml"
    text = open(default_scenario_path()).read()
    sc.write_text(text)
    a = EpisodeSource(EpisodeConfig(str(sc), window_s=60.0))
    sc.write_text(text.replace("rate_per_s: 4.0", "rate_per_s: 2.0").replace("policy: fcfs", "policy: lars"))
    b = EpisodeSource(EpisodeConfig(str(sc), window_s=60.0))
    assert (a.scenario.policy, b.scenario.policy) == ("fcfs", "lars")
    wa, _ = a.choose(np.random.default_rng(0), {"window_index": 0, "workload_seed": 0})
    wb, _ = b.choose(np.random.default_rng(0), {"window_index": 0, "workload_seed": 0})
    assert len(wb) < 0.75 * len(wa)  # half the rate: about half the requests in the same window
    sc.write_text(text)
    assert EpisodeSource(EpisodeConfig(str(sc), window_s=60.0)).scenario == a.scenario


def test_episode_source_sees_a_rewritten_trace_file(tmp_path):
    """A scenario's trace *file* is part of the workload cache's key (path, size, mtime): a trace
    rewritten between two environments of one process is read again, while an unchanged one is
    served from the cache (the same Workload object)."""
    import os

    def write_trace(output_tokens: int, mtime_ns: int) -> None:
        rows = "".join(f"2023-11-16 18:00:{s:010.7f},100,{output_tokens}\n" for s in np.arange(0.0, 50.0, 0.5))
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
        os.utime(trace, ns=(mtime_ns, mtime_ns))

    trace = tmp_path / "t.csv"
    write_trace(7, 1_000_000_000)
    sc = tmp_path / "s.yaml"
    sc.write_text(f"name: t\ntrace: {trace}\ninstance: {{model: Llama-3.1-8B, gpu: H100-SXM}}\n")
    opts = {"window_index": 0, "workload_seed": 0}
    a = EpisodeSource(EpisodeConfig(str(sc), window_s=10.0))
    wa, _ = a.choose(np.random.default_rng(0), opts)
    assert set(wa.output_tokens.tolist()) == {7}
    assert EpisodeSource(EpisodeConfig(str(sc), window_s=10.0))._ref == a._ref  # unchanged file: cached
    write_trace(9, 2_000_000_000)
    b = EpisodeSource(EpisodeConfig(str(sc), window_s=10.0))
    assert b._ref != a._ref
    wb, _ = b.choose(np.random.default_rng(0), opts)
    assert set(wb.output_tokens.tolist()) == {9}


@pytest.mark.parametrize("how", ["in place", "symlink re-pointed"])
def test_episode_source_sees_a_trace_replaced_with_the_same_size_and_mtime(tmp_path, how):
    """A trace replaced by one of the same size whose modification time is carried over (``cp
    -p``, ``rsync -t``, ``tar x``, ``touch -r``), in place or by re-pointing a symlink, is read
    again: the key has the file's inode and status-change time too (the kernel sets ctime; no
    tool copies it). It was served stale from the cache."""
    import os

    def rows(output_tokens: int) -> str:
        return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"2023-11-16 18:00:{s:010.7f},100,{output_tokens}\n" for s in np.arange(0.0, 50.0, 0.5))

    trace = tmp_path / "t.csv"
    if how == "in place":
        trace.write_text(rows(7))
    else:
        (tmp_path / "v1.csv").write_text(rows(7))
        trace.symlink_to(tmp_path / "v1.csv")
    mtime_ns = os.stat(trace).st_mtime_ns
    sc = tmp_path / "s.yaml"
    sc.write_text(f"name: t\ntrace: {trace}\ninstance: {{model: Llama-3.1-8B, gpu: H100-SXM}}\n")
    cfg = EpisodeConfig(str(sc), window_s=10.0)
    assert set(EpisodeSource(cfg).workload(0, 0).output_tokens.tolist()) == {7}
    if how == "in place":
        trace.write_text(rows(9))
    else:
        (tmp_path / "v2.csv").write_text(rows(9))
        os.utime(tmp_path / "v2.csv", ns=(mtime_ns, mtime_ns))
        trace.unlink()
        trace.symlink_to(tmp_path / "v2.csv")
    os.utime(trace, ns=(mtime_ns, mtime_ns))
    assert os.stat(trace).st_mtime_ns == mtime_ns and os.stat(trace).st_size == len(rows(9))
    assert set(EpisodeSource(cfg).workload(0, 0).output_tokens.tolist()) == {9}


def test_episode_source_keeps_its_trace_after_a_cwd_change_and_cache_eviction(tmp_path, monkeypatch):
    """A scenario naming its trace by a relative path, two folders each with a trace of that
    name. The source made in folder A keeps serving A's trace after the process moves to B and
    other environments' workloads evict it from the workload cache: it was reloaded relative to
    the new working folder (B's requests under A's cache key), and a new source made back in A
    was then served B's trace from the cache."""
    def write_trace(folder, output_tokens: int) -> None:
        folder.mkdir()
        rows = "".join(f"2023-11-16 18:00:{s:010.7f},100,{output_tokens}\n" for s in np.arange(0.0, 50.0, 0.5))
        (folder / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)

    write_trace(tmp_path / "a", 7)
    write_trace(tmp_path / "b", 9)
    sc = tmp_path / "s.yaml"
    sc.write_text("name: t\ntrace: t.csv\ninstance: {model: Llama-3.1-8B, gpu: H100-SXM}\n")
    cfg = EpisodeConfig(str(sc), window_s=10.0)
    monkeypatch.chdir(tmp_path / "a")
    a = EpisodeSource(cfg)
    monkeypatch.chdir(tmp_path / "b")
    synthetic = EpisodeSource(EpisodeConfig(default_scenario_path(), window_s=60.0))
    for seed in range(8):  # the workload cache holds 8: A's whole trace is evicted
        synthetic.workload(seed, 0)
    assert set(a.workload(0, 0).output_tokens.tolist()) == {7}
    assert set(EpisodeSource(cfg).workload(0, 0).output_tokens.tolist()) == {9}
    monkeypatch.chdir(tmp_path / "a")
    assert set(EpisodeSource(cfg).workload(0, 0).output_tokens.tolist()) == {7}


def test_a_tiny_episode_window_is_a_clean_error_not_a_memory_error():
    """``--window-s 1e-9`` passes the flag's check (> 0) and makes ~6e11 windows of the bundled
    scenario: the source keeps them as ranges (a tuple of them was a MemoryError traceback
    when the environment was made); an episode's empty window is an empty workload (an empty
    episode, see test_a_window_without_requests_is_an_empty_episode_in_every_environment)."""
    src = EpisodeSource(EpisodeConfig(default_scenario_path(), window_s=1e-9, split="all"))
    assert src.n_windows > 10**11 and len(src.windows) == src.n_windows
    assert len(src.train_windows) + len(src.heldout_windows) == src.n_windows
    assert (src.heldout_windows[0] == len(src.train_windows)
            and 0 <= src.draw(np.random.default_rng(0))[1] < src.n_windows)
    assert len(src.workload(0, 0)) == 0


def test_episode_split_is_disjoint_and_errors_name_fields():
    src = EpisodeSource(EpisodeConfig(default_scenario_path(), window_s=60.0))
    assert set(src.train_windows).isdisjoint(src.heldout_windows)
    assert len(src.train_windows) + len(src.heldout_windows) == src.n_windows == 9
    rng = np.random.default_rng(0)
    assert all(src.draw(rng)[1] in src.train_windows for _ in range(50))
    with pytest.raises(ConfigError, match="window_s"):
        EpisodeConfig(default_scenario_path(), window_s=-1)
    with pytest.raises(ConfigError, match="longer than"):
        EpisodeSource(EpisodeConfig(default_scenario_path(), window_s=10_000))
    with pytest.raises(ConfigError, match="k"):
        SchedulingEnv(k=0)


def test_agent_policy_without_decision_is_the_reference():
    src, w = _workload_and_spec()
    direct = build_cluster(src, lambda i: reference("lars", None, src)).run(w)
    proxied = build_cluster(src, lambda i: AgentPolicy(reference("lars", None, src))).run(w)
    assert summary_to_json(proxied.summary) == summary_to_json(direct.summary)


def test_reward_judges_records_as_summarize_does():
    """SLOReward (per-step lookup tables, rows judged in one pass) counts exactly the requests
    ``summarize`` counts as meeting their SLO: named SLO classes with and without an E2E bound,
    unknown classes judged by length class, TTFT / TPOT / E2E misses, one-token requests (no
    TPOT), rejections; and it charges a certain miss only past the request's own TTFT SLO."""
    import pandas as pd

    from kvsched.envs.reward import RewardConfig, SLOReward
    from kvsched.envs.sim.metrics import RECORD_COLUMNS, SLO, MetricsConfig, summarize

    m = MetricsConfig(long_prompt_tokens=1000, slos={"short": SLO(1.0, 0.1), "long": SLO(5.0, 0.2),
                                                     "gold": SLO(0.5, 0.05, e2e_s=3.0)})
    base = dict.fromkeys(RECORD_COLUMNS, 0)
    cases = [  # slo_class, prompt, status, first - arrival, finish - first, generated
        ("gold", 100, "finished", 0.4, 1.0, 21),   # met (TPOT 0.05, E2E 1.4)
        ("gold", 100, "finished", 0.6, 1.0, 21),   # TTFT 0.6 > 0.5
        ("gold", 100, "finished", 0.4, 1.2, 21),   # TPOT 0.06 > 0.05
        ("gold", 100, "finished", 0.4, 2.9, 200),  # E2E 3.3 > 3.0 (TPOT ok)
        ("x", 100, "finished", 0.9, 1.0, 11),      # unknown class: short, met
        ("x", 2000, "finished", 0.9, 1.0, 11),     # unknown class: long, met
        ("x", 100, "finished", 1.1, 0.0, 1),       # short TTFT miss, one token
        ("x", 2000, "finished", 4.0, 0.0, 1),      # long, one token: no TPOT, met
        ("x", 2000, "finished", 4.0, 3.0, 11),     # long TPOT 0.3 > 0.2
        ("short", 100, "rejected", math.nan, math.nan, 0),
        (None, 2000, "finished", 4.0, 1.0, 11),    # untagged: long, met
        (None, 100, "finished", 1.1, 1.0, 11),     # untagged: short TTFT miss
    ]
    rows = []
    for i, (cls, prompt, status, ttft, rest, gen) in enumerate(cases):
        r = dict(base, request_id=i, arrival_s=10.0 + i, prompt_tokens=prompt, output_tokens=max(gen, 1),
                 slo_class=cls, length_class="long" if prompt >= 1000 else "short", status=status,
                 first_scheduled_s=10.0 + i + ttft / 2, first_token_s=10.0 + i + ttft, finish_s=10.0 + i + ttft + rest,
                 generated_tokens=gen)
        rows.append(tuple(r[c] for c in RECORD_COLUMNS))
    expected = summarize(pd.DataFrame(rows, columns=list(RECORD_COLUMNS)), None, None, m)["classes"]["all"]
    rw = SLOReward(RewardConfig(met=2.0, missed=3.0), m)
    rw.charged.add(1)  # request 1 was charged as a certain miss earlier
    comps = rw.collect(rows[:4])  # one met, three missed of which one already charged
    comps2 = rw.collect(rows)  # the eight new rows: four met, four missed
    assert rw.met == expected["slo"]["met"] == 5 and rw.missed == len(rows) - 5
    assert comps == {"slo_met": 2.0, "slo_missed": -3.0 * 2} and comps2 == {"slo_met": 2.0 * 4, "slo_missed": -3.0 * 4}
    assert [rw.is_met(r) for r in rows] == [True, False, False, False, True, True, False, True, False, False,
                                            True, False]
    assert rw.collect(rows) == {"slo_met": 0.0, "slo_missed": -0.0}  # nothing new

    class St:  # the RequestState fields certain_misses reads
        def __init__(self, rid, arrival_s, prompt_tokens, slo_class, generated=0):
            self.rid, self.arrival_s, self.prompt_tokens, self.generated = rid, arrival_s, prompt_tokens, generated
            self.first_token_s, self.output_tokens = 0.1, 1000  # a timely first token, a TPOT still possible
            self.req = type("Req", (), {"slo_class": slo_class})()

    states = [St(20, 0.0, 100, "gold"), St(21, 0.0, 100, "x"), St(22, 0.0, 2000, "x"), St(23, 0.0, 100, "gold", 1)]
    assert rw.certain_misses(states, 0.5) == -0.0  # waited 0.5 s: no TTFT SLO exceeded yet
    assert rw.certain_misses(states, 0.75) == -3.0 and rw.charged >= {20}  # gold (0.5 s) only
    assert rw.certain_misses(states, 1.5) == -3.0 and 21 in rw.charged  # short (1 s); 20 not again
    assert rw.certain_misses(states, 2.9) == -0.0 and 23 not in rw.charged  # a timely first token
    # long (5 s) misses its TTFT; gold 23 has its first token but is past gold's E2E bound (3 s)
    assert rw.certain_misses(states, 6.0) == -6.0 and {22, 23} <= rw.charged


def test_knob_env_parameters_equal_dataclasses_replace_and_are_validated(tmp_path):
    """The parameters KnobEnv builds each step equal dataclasses.replace of the previous ones,
    and go through the parameter class's validation (a knob range that would break it raises)."""
    import dataclasses

    env = KnobEnv(**SMALL)
    env.reset(seed=0)
    before = env.cluster.instances[0].policy.params
    a = np.array([0.25, -0.5, 0.75, -0.1], dtype=np.float32)
    env.step(a)
    assert env.cluster.instances[0].policy.params == dataclasses.replace(before, **env.values(a))
    sc = tmp_path / "big-min-chunk.yaml"
    sc.write_text(open(default_scenario_path()).read().replace("policy: fcfs", "policy: lars\npolicy_params:\n"
                                                                               "  min_chunk_tokens: 512"))
    # the scenario's min_chunk_tokens 512 is above the max_chunk_tokens knob's low end 256: an
    # error at construction (naming both), not at the first action that reaches it mid-episode
    with pytest.raises(ConfigError, match=r"knob ranges at .*'max_chunk_tokens': 256.*min_chunk_tokens=512"):
        KnobEnv(scenario=str(sc), window_s=10.0, max_requests=20, split="all")
    sc.write_text(sc.read_text().replace("min_chunk_tokens: 512", "min_chunk_tokens: 256"))
    env = KnobEnv(scenario=str(sc), window_s=10.0, max_requests=20, split="all")  # 256 <= 256: every corner valid
    env.reset(seed=0)
    env.step(np.array([1.0, -1.0, 1.0, -1.0], dtype=np.float32))
    assert env.cluster.instances[0].policy.params.max_chunk_tokens == 256


def literature_spec(**kw) -> InstanceSpec:
    """Llama-3.1-8B on one H100 with the literature cost parameters (as tests/policies/test_policies.py)."""
    kw.setdefault("cost", CostParams())
    return InstanceSpec(model=get_model("Llama-3.1-8B"), gpu=get_gpu("H100-SXM"), **kw)


def _burst(long_prompt=100_000, long_out=300, n_short=20, at_s=8.0) -> Workload:
    """tests/policies/test_policies.py's burst: one long request decoding in a nearly full HBM, then shorts."""
    rng = np.random.default_rng(5)
    reqs = [Request(0, 0.0, long_prompt, long_out)] + [
        Request(1 + i, at_s + 0.05 * i, int(rng.integers(200, 600)), int(rng.integers(50, 150)))
        for i in range(n_short)]
    return Workload.from_requests(reqs, name="burst")


def test_agent_policy_without_a_decision_matches_a_reference_using_admission_preemption():
    """Scheduling-v0 wraps the reference policy in ``AgentPolicy``, which mirrors its ``params``
    (so the instance turns admission preemption on) but never had ``output_history``: the first
    finished request raised ``AttributeError: 'AgentPolicy' object has no attribute
    'output_history'`` (``SchedulingEnv(reference_params={"admission_preemption": "cost-gated"})``
    crashed in ``reset``/``step``). Without a pending decision the agent must behave exactly as
    its reference, admission preemptions included."""
    from kvsched.envs.action import AgentPolicy

    w = _burst()
    sp = literature_spec(hbm_kv_blocks=6_400, dram_kv_bytes=64 * 2**30, preemption_mode="swap")
    params = {"admission_preemption": "cost-gated"}
    ref = Cluster([sp], lambda: make_policy("fcfs", params)).run(w)
    agent = Cluster([sp], lambda: AgentPolicy(make_policy("fcfs", params))).run(w)
    assert ref.stats["admission_preemptions"] == 1  # the gate fires in this workload
    assert agent.stats["admission_preemptions"] == 1
    assert agent.summary == ref.summary


def test_scheduling_env_episode_runs_with_an_admission_preemption_reference():
    """The user-facing form of the defect above: an episode of Scheduling-v0 whose reference
    policy uses admission preemption runs to its end."""
    import pytest

    pytest.importorskip("gymnasium")
    from kvsched.envs.scheduling_env import SchedulingEnv

    env = SchedulingEnv(window_s=10.0, max_requests=25,
                        reference_params={"admission_preemption": "cost-gated"})
    env.reset(seed=0)
    done, steps = False, 0
    while not done and steps < 2_000:
        _, _, term, trunc, info = env.step(env.heuristic_action())
        done, steps = term or trunc, steps + 1
    assert done
    assert env.agent_policy.output_history.__len__() > 0  # finished requests were recorded


def test_knob_action_that_is_not_real_numbers_is_a_config_error():
    """Every bad action raises ConfigError naming ``action``. Before: a complex array was
    accepted with its imaginary part dropped (a ComplexWarning only), a masked array with its
    masked entries' hidden values used, strings parsed as numbers, a structured array read as
    its field; a complex list, a dict or ragged nesting raised TypeError / ValueError."""
    import warnings

    from kvsched.envs.knob_env import KnobEnv

    env = KnobEnv(max_requests=50)
    good = [0.5, -0.5, 0.0, 1.0]
    ok = env.values(np.array(good))
    bad = [np.array(good) + 0.5j, np.array(good, dtype=np.complex64) + 0.5j, [complex(x, 1) for x in good],
           np.ma.array(good, mask=[0, 1, 0, 0]), ["0.5", "-0.5", "0", "1"], np.array(["0.5", "-0.5", "0", "1"]),
           np.zeros(4, dtype=[("a", "f8")]), {"kappa": 0.5}, [0.5, [0.1], 0.0, 1.0],
           np.array([0.5, None, 0.0, 1.0], dtype=object), np.array([0, 0, 0, 1], dtype="m8[s]")]
    for a in bad:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no ComplexWarning on the way to the error either
            with pytest.raises(ConfigError, match="action"):
                env.values(a)
    # real numbers in any form keep their values
    for a in (np.ma.array(good, mask=[0, 0, 0, 0]), np.array(good, dtype=object), good, tuple(good),
              np.array(good, dtype=np.complex128).real, np.array([good])):
        assert env.values(a) == ok
    assert env.values(np.array([1, -1, 0, 1], dtype=object)) == env.values(np.array([1.0, -1.0, 0.0, 1.0]))


def test_a_window_without_requests_is_an_empty_episode_in_every_environment(tmp_path):
    """A held-out window that holds no request (a sparse trace, or a quiet stretch of a synthetic
    workload) is served as an empty episode: it terminates at the first step with a summary whose
    SLO attainment is None (evaluations skip it); it was a ConfigError."""
    sc = tmp_path / "sparse.yaml"
    sc.write_text("name: sparse\nsynthetic: {rate_per_s: 0.05, duration_s: 600}\n"
                  "instance: {model: Llama-3.1-8B, gpu: H100-SXM}\nseed: 0\n")
    for env_id in ("kvsched/Scheduling-v0", "kvsched/Routing-v0", "kvsched/Knobs-v0"):
        env = gym.make(env_id, scenario=str(sc), window_s=10.0, split="heldout")
        src = env.unwrapped.source
        seed = src.scenario.seed
        empty = [w for w in src.heldout_windows if len(src.workload(seed, w)) == 0]
        assert empty, "the scenario must have an empty held-out window"
        env.reset(seed=0, options={"window_index": empty[0], "workload_seed": seed})
        _, _, terminated, truncated, info = env.step(env.action_space.sample())
        assert terminated and not truncated, env_id
        assert info["summary"]["classes"]["all"]["counts"]["arrived"] == 0
        assert info["summary"]["classes"]["all"]["slo"]["attainment"] is None
