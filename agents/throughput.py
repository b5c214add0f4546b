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
        raise ValueError(f"steps={steps!r} is not allowed: expected an integer >= 1")
    if agent != "random" and env_id.endswith("Scheduling-v0"):
        env_kwargs = {**env_kwargs, "reference_policy": agent}
    env = gym.make(env_id, **env_kwargs).unwrapped
    if agent != "random" and not hasattr(env, "heuristic_action"):
        raise ValueError(f"agent={agent!r} is not allowed for {env_id}: expected 'random' "
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
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps} is not allowed: expected an integer >= 1")
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
