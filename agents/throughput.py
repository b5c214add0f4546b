"""Environment steps per second, and the environments' own cost per step, of the three
``kvsched`` Gymnasium environments.

``python -m kvsched.agents.throughput [--steps N] [--envs IDS] [--agents NAMES] [--json]`` runs
each environment for ``N`` steps (resetting with seeds 0, 1, ... when an episode ends; reset time
is not counted) and prints, per environment and agent:

* steps per wall second and per CPU second of the ``env.step`` calls (``time.perf_counter`` /
  ``time.thread_time``; on a shared machine the CPU figure is the meaningful one);
* ``sim_us_per_step``: CPU microseconds per step spent in the simulator (the cluster's
  ``run_until_decision``, ``apply`` and ``result`` calls made inside ``env.step``);
* ``overhead_us_per_step``: the rest of ``env.step``, i.e. what the environment adds on top of
  the simulation (decoding the action, building the observation, mask, reward and info). It
  includes the cost of the timing calls themselves (about 2 us each, 6 per step on these
  machines).

Agents: ``random`` (uniform over the masked actions; ``action_space.sample()`` for the Box
actions of ``Knobs-v0``, seeded) for every environment; a policy name (e.g. ``fcfs``, ``lars``)
acts through :class:`~kvsched.agents.heuristic.HeuristicAgent` and exists only for
``Scheduling-v0``. Each environment uses its ``gymnasium.make`` defaults (the bundled mixed
long/short scenario, training windows), as training does.
"""

from __future__ import annotations

from kvsched.envs.sim.errors import bounded_repr

import argparse
import json
import time

import numpy as np

ENV_IDS = ("kvsched/Scheduling-v0", "kvsched/Knobs-v0", "kvsched/Routing-v0")


class _SimClock:
    """Accumulates this thread's CPU seconds inside one cluster's stepping calls."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def attach(self, cluster) -> None:
        for name in ("run_until_decision", "apply", "result"):
            fn = getattr(cluster, name)

            def timed(*a, _fn=fn, **k):
                t = time.thread_time()
                try:
                    return _fn(*a, **k)
                finally:
                    self.cpu_s += time.thread_time() - t

            setattr(cluster, name, timed)  # shadows the bound method on this cluster object only


def _random_action(env, info: dict, rng: np.random.Generator):
    import gymnasium as gym

    space = env.action_space
    if isinstance(space, gym.spaces.Box):
        return space.sample()
    mask = info["action_mask"]
    if isinstance(space, gym.spaces.MultiDiscrete):
        parts, i = [], 0
        for n in space.nvec.tolist():
            parts.append(rng.choice(np.flatnonzero(mask[i:i + n])))
            i += n
        return np.array(parts)
    return int(rng.choice(np.flatnonzero(mask)))


def measure(env_id: str = "kvsched/Scheduling-v0", agent: str = "random", steps: int = 2000,
            seed: int = 0, **env_kwargs) -> dict:
    """Run ``env_id`` for ``steps`` steps with ``agent`` and time the ``env.step`` calls.

    Args:
        env_id: a registered ``kvsched/...`` environment id.
        agent: ``"random"``, or a policy name (``Scheduling-v0`` only: the environment is made
            with it as the reference policy and :class:`HeuristicAgent` plays its decisions).
        steps: steps to time (>= 1).
        seed: seeds the first reset (later resets use ``seed + episode``) and the random agent.
        env_kwargs: passed to ``gymnasium.make``.

    Returns:
        dict with ``env``, ``agent``, ``steps``, ``episodes_ended``, ``wall_s``, ``cpu_s``,
        ``steps_per_wall_s``, ``steps_per_cpu_s``, ``sim_us_per_step``, ``overhead_us_per_step``.

    Raises:
        ValueError: ``steps < 1``, or a policy agent for an environment other than
            ``Scheduling-v0``.
    """
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    from kvsched.agents.heuristic import HeuristicAgent

    if steps < 1:
        raise ValueError(f"steps={bounded_repr(steps)} is not allowed: expected an integer >= 1")
    if agent != "random" and env_id.endswith("Scheduling-v0"):
        env_kwargs = {**env_kwargs, "reference_policy": agent}
    env = gym.make(env_id, **env_kwargs).unwrapped
    if agent != "random" and not hasattr(env, "heuristic_action"):
        raise ValueError(f"agent={bounded_repr(agent)} is not allowed for {env_id}: expected 'random' "
                         "(policy agents act only in kvsched/Scheduling-v0)")
    env.action_space.seed(seed)
    rng = np.random.default_rng(seed)
    heur = None if agent == "random" else HeuristicAgent(agent, env)
    clock = _SimClock()
    obs, info = env.reset(seed=seed)
    clock.attach(env.cluster)
    wall = cpu = 0.0
    episodes = 0
    for _ in range(steps):
        action = _random_action(env, info, rng) if heur is None else heur.predict(obs)[0]
        w0, c0 = time.perf_counter(), time.thread_time()
        obs, _, terminated, truncated, info = env.step(action)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - w0
        if terminated or truncated:
            episodes += 1
            obs, info = env.reset(seed=seed + episodes)
            clock.attach(env.cluster)
    env.close()
    return {"env": env_id, "agent": agent, "steps": steps, "episodes_ended": episodes, "wall_s": wall,
            "cpu_s": cpu, "steps_per_wall_s": steps / wall if wall > 0 else None,
            "steps_per_cpu_s": steps / cpu if cpu > 0 else None,
            "sim_us_per_step": 1e6 * clock.cpu_s / steps, "overhead_us_per_step": 1e6 * (cpu - clock.cpu_s) / steps}


def measure_all(steps: int = 2000, env_ids=ENV_IDS, agents=("random", "fcfs", "lars")) -> list[dict]:
    """:func:`measure` for every environment with the random agent, and for ``Scheduling-v0``
    also with each policy agent of ``agents``."""
    out = []
    for env_id in env_ids:
        for a in agents:
            if a == "random" or env_id == "kvsched/Scheduling-v0":
                out.append(measure(env_id, a, steps))
    return out


def _random_masked_actor(env, seed: int):
    rng = np.random.default_rng(seed)
    return lambda info: _random_action(env, info, rng)


def _env_alone(env_id: str, steps: int, seed: int, env_kwargs: dict) -> tuple[float, float]:
    """(CPU s, wall s) of ``steps`` ``env.step`` calls of ``env_id`` under a random (masked) agent,
    resets included (as in training), agent excluded."""
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)

    env = gym.make(env_id, **env_kwargs)
    env.action_space.seed(seed)
    base = env.unwrapped
    masked = hasattr(base, "action_masks")
    act = _random_masked_actor(base, seed) if masked else (lambda info: env.action_space.sample())
    obs, info = env.reset(seed=seed)
    cpu = wall = 0.0
    episodes = 0
    for _ in range(steps):
        action = act(info)
        c0, w0 = time.process_time(), time.perf_counter()
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            episodes += 1
            obs, info = env.reset(seed=seed + episodes)
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
    env.close()
    return cpu, wall


def measure_training(env_id: str = "kvsched/Scheduling-v0", steps: int = 8192, n_envs: int = 8, seed: int = 0,
                     **env_kwargs) -> list[dict]:
    """Steps per CPU second of training and of the environment alone, in this process.

    Training is what ``kvsched train --algo maskable_ppo`` runs: sb3-contrib's MaskablePPO with
    :func:`kvsched.agents.train.default_hyperparameters`, its default network
    (:class:`kvsched.agents.fast_sampling.FastMaskablePolicy`), ``n_envs`` environments in one
    ``DummyVecEnv``, one torch thread, ``steps`` environment steps (rollouts and gradient steps;
    model construction excluded). An environment without action masks (``CartPole-v1``, the
    reference point) trains with the same class, network and settings, masking off. The
    environment alone is ``steps`` ``env.step`` calls under a random (masked) agent, resets
    included.

    CPU time is ``time.process_time`` (this process, all threads), beside wall time.

    Returns:
        two rows: ``{"env", "part": "training" | "environment", "n_envs", "steps", "cpu_s",
        "wall_s", "steps_per_cpu_s", "steps_per_wall_s"}``.

    Raises:
        ValueError: ``steps`` or ``n_envs`` < 1.
    """
    import torch
    from sb3_contrib import MaskablePPO

    from kvsched.agents.factory import make_vec_env
    from kvsched.agents.fast_sampling import FastMaskablePolicy
    from kvsched.agents.train import default_hyperparameters

    for name, v in (("steps", steps), ("n_envs", n_envs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={bounded_repr(v)} is not allowed: expected an integer >= 1")
    torch.set_num_threads(1)
    kw = {**env_kwargs, "split": "train"} if env_id.startswith("kvsched/") else dict(env_kwargs)
    venv = make_vec_env(env_id, kw, n_envs=n_envs, seed=seed)
    masked = bool(venv.has_attr("action_masks"))
    model = MaskablePPO(FastMaskablePolicy, venv, seed=seed, device="cpu", **default_hyperparameters("maskable_ppo",
                                                                                                        n_envs))
    c0, w0 = time.process_time(), time.perf_counter()
    model.learn(steps, use_masking=masked)
    train_cpu, train_wall = time.process_time() - c0, time.perf_counter() - w0
    venv.close()
    env_cpu, env_wall = _env_alone(env_id, steps, seed, kw)

    def row(part: str, n: int, cpu: float, wall: float) -> dict:
        return {"env": env_id, "part": part, "n_envs": n, "steps": steps, "cpu_s": cpu, "wall_s": wall,
                "steps_per_cpu_s": steps / cpu if cpu > 0 else None,
                "steps_per_wall_s": steps / wall if wall > 0 else None}

    return [row("training", n_envs, train_cpu, train_wall), row("environment", 1, env_cpu, env_wall)]


def measure_training_all(steps: int = 8192, n_envs: int = 8,
                         env_ids: tuple[str, ...] = ("kvsched/Scheduling-v0", "CartPole-v1")) -> list[dict]:
    """:func:`measure_training` for each of ``env_ids`` in turn (CartPole-v1 under the same
    settings, as the reference point), in one run."""
    return [r for e in env_ids for r in measure_training(e, steps, n_envs)]


def main(argv=None) -> None:
    """Command line; bad flags exit with status 2 naming the flag, the value and what is allowed
    (an agent/environment pair that :func:`measure_all` skips is said so on stderr)."""
    import sys

    from kvsched.envs.sim.errors import KvschedError

    p = argparse.ArgumentParser(prog="python -m kvsched.agents.throughput",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--steps", type=int, default=2000, help="env.step calls per environment and agent (default 2000)")
    p.add_argument("--envs", default=",".join(ENV_IDS), help=f"comma-separated ids (default {','.join(ENV_IDS)})")
    p.add_argument("--agents", default=None,
                   help="comma-separated: random and/or policy names; policies act only in kvsched/Scheduling-v0 "
                        "(default random,fcfs,lars)")
    p.add_argument("--json", action="store_true", help="print one JSON list as the last line")
    p.add_argument("--train", action="store_true",
                   help="measure training (MaskablePPO, --n-envs environments) and the environment alone on "
                        "kvsched/Scheduling-v0 and CartPole-v1 instead (measure_training)")
    p.add_argument("--n-envs", type=int, default=8, help="environments per training process with --train (default 8)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps} is not allowed: expected an integer >= 1")
    if args.n_envs < 1:
        p.error(f"--n-envs {args.n_envs} is not allowed: expected an integer >= 1")
    if args.train:
        rows = measure_training_all(args.steps, args.n_envs)
        if args.json:
            print(json.dumps(rows))
            return
        for r in rows:
            print(f"{r['env']:22s} {r['part']:11s} n_envs {r['n_envs']:2d}  {r['steps']:6d} steps  "
                  f"{r['steps_per_cpu_s']:8.1f} steps/CPU-s  {r['steps_per_wall_s']:8.1f} steps/s wall")
        return
    env_ids = args.envs.split(",")
    agents = (args.agents or "random,fcfs,lars").split(",")
    unknown = [e for e in env_ids if e not in ENV_IDS]
    if unknown:
        p.error(f"--envs: unknown environment(s) {unknown}; allowed: {', '.join(ENV_IDS)}")
    if "kvsched/Scheduling-v0" in env_ids:
        from kvsched.policies.base import policy_names

        bad = [a for a in agents if a != "random" and a not in policy_names()]
        if bad:
            p.error(f"--agents: unknown agent(s) {bad}; allowed: random, {', '.join(policy_names())}")
    skipped = [f"{a} on {e}" for e in env_ids for a in agents if a != "random" and e != "kvsched/Scheduling-v0"]
    if skipped and args.agents is not None:  # the default agents are meant for Scheduling-v0 only
        print(f"note: not measured (policy agents act only in kvsched/Scheduling-v0): {', '.join(skipped)}",
              file=sys.stderr)
    try:
        rows = measure_all(args.steps, env_ids, agents)
    except KvschedError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['env']:22s} {r['agent']:7s} {r['steps']:6d} steps  {r['steps_per_wall_s']:8.1f} steps/s wall  "
              f"{r['steps_per_cpu_s']:8.1f} steps/CPU-s  simulator {r['sim_us_per_step']:8.1f} us/step  "
              f"env overhead {r['overhead_us_per_step']:6.1f} us/step")


if __name__ == "__main__":
    main()
