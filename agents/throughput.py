"""Environment steps per second of ``kvsched/Scheduling-v0`` with a random and a heuristic agent.

``python -m kvsched.agents.throughput [--episodes N] [--window-s S]`` prints steps per wall
second and per CPU second of this process (``time.process_time``; on a shared machine the CPU
figure is the meaningful one). Episodes are held-out windows of the bundled mixed long/short
scenario, run to completion.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np


def measure(agent: str, episodes: int = 3, window_s: float = 60.0, seed: int = 0) -> dict:
    """Steps, wall and CPU seconds of ``episodes`` episodes; ``agent`` is ``"random"`` (uniform
    over the masked actions) or a policy name (through :class:`HeuristicAgent`)."""
    from kvsched.agents.heuristic import HeuristicAgent
    from kvsched.envs.scheduling_env import SchedulingEnv

    env = SchedulingEnv(window_s=window_s, split="heldout", horizon_s=math.inf)
    rng = np.random.default_rng(seed)
    heur = None if agent == "random" else HeuristicAgent(None if agent == env.reference_policy else agent, env)
    steps = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for e in range(episodes):
        obs, info = env.reset(seed=seed + e)
        done = False
        while not done:
            if heur is None:
                m = info["action_mask"]
                parts, a, i = env._nvec, [], 0
                for n in parts:
                    a.append(rng.choice(np.flatnonzero(m[i:i + n])))
                    i += n
                action = np.array(a)
            else:
                action, _ = heur.predict(obs)
            obs, _, term, trunc, info = env.step(action)
            steps += 1
            done = term or trunc
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"agent": agent, "episodes": episodes, "steps": steps, "wall_s": wall, "cpu_s": cpu,
            "steps_per_wall_s": steps / wall, "steps_per_cpu_s": steps / cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--agents", default="random,fcfs,lars")
    args = p.parse_args()
    for a in args.agents.split(","):
        r = measure(a, args.episodes, args.window_s)
        print(f"{a:8s} {r['steps']:6d} steps  {r['steps_per_wall_s']:8.1f} steps/s wall  "
              f"{r['steps_per_cpu_s']:8.1f} steps/CPU-s")


if __name__ == "__main__":
    main()
