"""The layers hold: the simulator core imports no policy, learner, CLI, Gymnasium, torch, Optuna
or rich; each layer imports only the layers below it.

Layers, bottom up: the core (``kvsched.envs.sim``, ``kvsched.envs.workload``) -> policies ->
the runner (scenarios, simulate by name, sweeps) -> the Gymnasium environments -> agents -> the
CLI (``kvsched.experiments``). Each check imports modules in a fresh interpreter and reads
``sys.modules`` after each import, so the message names the first module that pulled a package in.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvsched.envs.sim
import kvsched.envs.workload

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("gymnasium", "torch", "optuna", "rich", "ray", "stable_baselines3", "sb3_contrib", "tensorboard")
ABOVE_CORE = ("kvsched.policies", "kvsched.agents", "kvsched.experiments", "kvsched.runner")


def core_modules() -> list[str]:
    mods = []
    for pkg in (kvsched.envs.sim, kvsched.envs.workload):
        mods.append(pkg.__name__)
        mods += [f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    return sorted(mods)


def loaded_after_each(modules: list[str]) -> dict[str, list[str]]:
    """Import ``modules`` in order in a fresh interpreter; for each, the top-level packages and
    kvsched subpackages that were loaded after its import (cumulative)."""
    code = (
        "import importlib, json, sys\n"
        f"mods = {modules!r}\n"
        "out = {}\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "    names = set(k.split('.')[0] for k in sys.modules)\n"
        "    names |= set('.'.join(k.split('.')[:2]) for k in sys.modules if k.startswith('kvsched.'))\n"
        "    out[m] = sorted(names)\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def first_offender(loaded: dict[str, list[str]], forbidden: tuple[str, ...]) -> tuple[str, str] | None:
    for mod, names in loaded.items():
        bad = [n for n in names if n in forbidden]
        if bad:
            return mod, bad[0]
    return None


def test_core_modules_import_no_policy_learner_cli_or_heavy_library():
    mods = core_modules()
    assert len(mods) >= 30  # every file of envs/sim and envs/workload
    loaded = loaded_after_each(mods)
    assert first_offender(loaded, HEAVY + ABOVE_CORE + ("kvsched.envs.registration",)) is None, \
        first_offender(loaded, HEAVY + ABOVE_CORE)


def test_importing_kvsched_envs_does_not_import_gymnasium():
    loaded = loaded_after_each(["kvsched.envs", "kvsched.envs.sim.specs"])
    assert first_offender(loaded, HEAVY + ABOVE_CORE) is None


def test_policies_sit_on_the_core_only():
    loaded = loaded_after_each(["kvsched.policies"])
    assert first_offender(loaded, ("gymnasium", "torch", "rich", "ray", "kvsched.agents", "kvsched.experiments",
                                   "kvsched.runner")) is None


def test_the_runner_sits_on_core_and_policies_only():
    loaded = loaded_after_each(["kvsched.runner.scenario", "kvsched.runner.simulate", "kvsched.runner.sweep",
                                "kvsched.runner.ray_connect"])
    assert first_offender(loaded, ("gymnasium", "torch", "ray", "kvsched.agents", "kvsched.experiments")) is None


def test_environments_do_not_import_agents_or_the_cli():
    pytest.importorskip("gymnasium")
    loaded = loaded_after_each(["kvsched.envs.scheduling_env", "kvsched.envs.routing_env", "kvsched.envs.knob_env"])
    assert first_offender(loaded, ("torch", "kvsched.agents", "kvsched.experiments")) is None


def test_gymnasium_ids_register_in_either_import_order_and_by_module_id():
    pytest.importorskip("gymnasium")
    code = ("import {a}; import {b}; import gymnasium as gym\n"
            "print(all(i in gym.registry for i in "
            "('kvsched/Scheduling-v0', 'kvsched/Routing-v0', 'kvsched/Knobs-v0')))")
    for a, b in (("kvsched.envs", "gymnasium"), ("gymnasium", "kvsched.envs")):
        out = subprocess.run([sys.executable, "-c", code.format(a=a, b=b)], capture_output=True, text=True, cwd=ROOT)
        assert out.stdout.strip() == "True", out.stderr[-1000:]
    out = subprocess.run([sys.executable, "-c", "import kvsched.envs.registration; import gymnasium as gym; "
                          "print('kvsched/Knobs-v0' in gym.registry)"], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr[-1000:]  # importing the registration module alone registers
    out = subprocess.run([sys.executable, "-c", "import gymnasium as gym; "
                          "print(type(gym.make('kvsched.envs.registration:kvsched/Routing-v0').unwrapped).__name__)"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "RoutingEnv", out.stderr[-1000:]
