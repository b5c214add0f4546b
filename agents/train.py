"""``kvsched train``: train an SB3 / sb3-contrib agent on a kvsched environment.

Writes into ``--out``:

- ``train.json``: the command, environment arguments and ``status`` "running", written before
  training starts (so a checkpoint of a killed run can be evaluated); at the end, the steps, CPU
  and wall time, env steps/s, the last evaluation's metrics and ``status`` "finished" or
  "stopped: cpu budget | wall budget | signal SIGINT | signal SIGTERM";
- ``checkpoints/<algo>_<steps>_steps.zip`` every ``--checkpoint-every`` steps (SB3
  ``CheckpointCallback``), ``final.zip`` at the end, also when a budget or a signal stopped it;
- ``tb/`` TensorBoard logs (``tensorboard --logdir OUT/tb``): SB3's training scalars and, at each
  evaluation, ``eval/slo_attainment``, ``eval/goodput_rps``, ``eval/ttft_p99_s/<class>`` and
  ``eval/tpot_p99_s/<class>``, and on Scheduling-v0 ``eval/reference_slo_attainment`` and
  ``eval/slo_attainment_vs_reference`` (the reference on the same windows;
  :mod:`kvsched.agents.callbacks`);
- ``eval/evaluations.npz`` and ``eval/best_model.zip``: mean return on held-out windows (train
  windows with ``--task``) every ``--eval-every`` steps (SB3 ``EvalCallback``;
  ``MaskableEvalCallback`` for MaskablePPO).

Algorithms and the action spaces they need: ``ppo`` and ``maskable_ppo`` (Discrete or
MultiDiscrete; MaskablePPO uses ``action_masks()``), ``dqn`` (Discrete: on Scheduling-v0 the
``action_mode="slot"`` variant is used), ``sac`` (Box: Knobs-v0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from kvsched import atomic_files

ALGOS = ("ppo", "maskable_ppo", "dqn", "sac")
POLICY_NETS = ("mlp", "candidate-set")


def _policy(algo: str, policy_net: str):
    """The SB3 policy (name or class) of ``policy_net`` for ``algo``."""
    if policy_net == "mlp":
        if algo == "maskable_ppo":  # sb3-contrib's MlpPolicy, rollouts sampled in one batched pass
            from kvsched.agents.fast_sampling import FastMaskablePolicy

            return FastMaskablePolicy
        return "MlpPolicy"
    from kvsched.agents.encoder import CandidateSetMaskablePolicy, CandidateSetPolicy

    return CandidateSetMaskablePolicy if algo == "maskable_ppo" else CandidateSetPolicy


def _algo_class(name: str):
    if name == "ppo":
        from stable_baselines3 import PPO
        return PPO
    if name == "maskable_ppo":
        from sb3_contrib import MaskablePPO
        return MaskablePPO
    if name == "dqn":
        from stable_baselines3 import DQN
        return DQN
    if name == "sac":
        from stable_baselines3 import SAC
        return SAC
    raise ConfigError(f"--algo {bounded_repr(name)} is not allowed: expected one of {ALGOS}")


def env_kwargs_for(env_id: str, algo: str, scenario: str | None, window_s: float | None,
                   extra: dict[str, Any] | None) -> dict[str, Any]:
    """Environment keyword arguments for ``algo`` (DQN on Scheduling-v0: slot-only actions).

    Raises:
        ConfigError: an algorithm that cannot act in that environment's action space.
    """
    kw: dict[str, Any] = dict(extra or {})
    if scenario is not None:
        kw["scenario"] = str(scenario)
    if window_s is not None:
        kw["window_s"] = float(window_s)
    if algo == "dqn" and env_id in SCHEDULING_IDS:
        if kw.get("action_mode", "slot") != "slot":
            raise ConfigError("--algo dqn needs a Discrete action space: use action_mode='slot' on Scheduling-v0")
        kw["action_mode"] = "slot"
    if algo == "sac" and env_id != "kvsched/Knobs-v0":
        raise ConfigError(f"--algo sac needs a Box action space; {env_id} has a discrete one (use kvsched/Knobs-v0)")
    if algo in ("ppo", "maskable_ppo", "dqn") and env_id == "kvsched/Knobs-v0" and algo == "dqn":
        raise ConfigError("--algo dqn needs a Discrete action space; kvsched/Knobs-v0 has a Box one")
    if algo == "maskable_ppo" and env_id == "kvsched/Knobs-v0":
        raise ConfigError("--algo maskable_ppo needs a discrete action space; use ppo or sac on kvsched/Knobs-v0")
    return kw


def _check_names(given: dict[str, Any], allowed: list[str], flag: str, what: str) -> None:
    """Refuse names in ``given`` that are not in ``allowed`` (they reached the environment's or
    the algorithm's constructor as a TypeError traceback)."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"{flag}: {bounded_repr(unknown)} not allowed: expected {what} ({', '.join(allowed)})")


#: Widest hidden layer ``--hyperparameters`` may ask for in ``policy_kwargs.net_arch`` (kvsched's
#: networks use 64-256; a width of 10**8 made torch allocate 40 GB and end in an OOM kill).
MAX_NET_WIDTH = 65_536
#: Deepest ``net_arch`` (hidden layers per network).
MAX_NET_DEPTH = 64
#: Hyper-parameters that are fractions in [0, 1] (SB3 accepts any float; ``gamma`` = inf gave NaN tensors).
_UNIT_INTERVAL = ("gamma", "gae_lambda", "tau")
#: Hyper-parameters that count steps or samples: positive integers, and the buffer they size must fit in memory.
_BUFFER_COUNTS = ("n_steps", "batch_size", "buffer_size")


def _physical_memory_bytes() -> int:
    """This machine's RAM (Linux ``sysconf``), or 1 TiB where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 1 << 40


def check_hyperparameters(given: Mapping[str, Any], n_envs: int, observation_floats: int) -> None:
    """Refuse ``--hyperparameters`` values Stable-Baselines3 accepts but fails on later.

    SB3 checks few of its arguments: ``gamma`` = Infinity trains on NaN tensors, ``n_steps`` =
    10**11 asks NumPy for a 56 TiB rollout buffer, ``net_arch`` = [10**8] exhausts memory. Bounds:
    ``gamma``, ``gae_lambda``, ``tau`` in [0, 1]; ``learning_rate`` a finite number > 0 (or a schedule
    given from Python); ``n_epochs`` an integer >= 1; ``n_steps``, ``batch_size``, ``buffer_size``
    integers >= 1 whose buffer
    (``rows x observation_floats x 4 bytes x 2``, rows = ``n_steps x n_envs`` or ``buffer_size``) fits in this
    machine's RAM; every ``policy_kwargs.net_arch`` width an integer in [1, :data:`MAX_NET_WIDTH`], at
    most :data:`MAX_NET_DEPTH` layers, and its weights (x 16 bytes: weights, gradients, Adam's moments) in RAM.

    Args:
        given: the ``--hyperparameters`` object. n_envs: parallel environments.
        observation_floats: numbers in one observation (its flattened size).

    Raises:
        ConfigError: one line naming ``--hyperparameters``, the key, the value (bounded) and the bound.
    """
    import math

    def bad(key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"--hyperparameters: {key}={bounded_repr(value)} is not allowed: expected {allowed}")

    def is_real(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key in _UNIT_INTERVAL:
        if key in given and not (is_real(given[key]) and 0 <= given[key] <= 1):
            raise bad(key, given[key], "a number in [0, 1]")
    if "learning_rate" in given and not callable(given["learning_rate"]):
        lr = given["learning_rate"]
        if not (is_real(lr) and math.isfinite(lr) and lr > 0):
            raise bad("learning_rate", lr, "a finite number > 0")
    if "n_epochs" in given and (isinstance(given["n_epochs"], bool) or not isinstance(given["n_epochs"], int)
                                or given["n_epochs"] < 1):
        raise bad("n_epochs", given["n_epochs"], "an integer >= 1")
    memory = _physical_memory_bytes()
    row_bytes = 2 * 4 * max(1, observation_floats) + 64  # observation (and next observation), action, reward...
    for key in _BUFFER_COUNTS:
        if key not in given:
            continue
        v = given[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(key, v, "an integer >= 1")
        rows = v * n_envs if key == "n_steps" else v
        most = max(1, memory // row_bytes // (n_envs if key == "n_steps" else 1))
        if rows * row_bytes > memory:
            raise bad(key, v, f"an integer in [1, {most:,}] (a larger buffer of {observation_floats:,}-number "
                              f"observations does not fit in this machine's {memory / 2**30:.0f} GiB of RAM)")
    kwargs = given.get("policy_kwargs")
    if isinstance(kwargs, Mapping) and "net_arch" in kwargs:
        arch = kwargs["net_arch"]
        nets = list(arch.values()) if isinstance(arch, Mapping) else [arch]
        for net in nets:
            layers = net if isinstance(net, list) else [net]
            if len(layers) > MAX_NET_DEPTH:
                raise bad("policy_kwargs.net_arch", arch, f"at most {MAX_NET_DEPTH} layers per network")
            for width in layers:
                if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_NET_WIDTH:
                    raise bad("policy_kwargs.net_arch", arch,
                              f"layer widths that are integers in [1, {MAX_NET_WIDTH:,}] (a list, or a mapping "
                              "such as {\"pi\": [64, 64], \"vf\": [64, 64]})")
            widths = [max(1, observation_floats), *layers]
            weights = sum(a * b for a, b in zip(widths, widths[1:]))
            if 16 * weights > memory:  # float32 weights, gradients and Adam's two moments
                raise bad("policy_kwargs.net_arch", arch, f"a network whose {weights:,} weights (x 16 bytes with "
                                                          f"gradients and optimizer state) fit in this machine's "
                                                          f"{memory / 2**30:.0f} GiB of RAM")


def _env_parameters(env_id: str) -> list[str]:
    """The keyword arguments of ``env_id``'s constructor that ``--env-kwargs`` may set (not
    ``split``, which train sets itself: train and held-out, nor what the id fixes:
    ``observation_version`` of Scheduling-v1, which another value would silently contradict)."""
    import importlib
    import inspect

    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)

    ep = gym.spec(env_id).entry_point
    if isinstance(ep, str):
        module, name = ep.split(":")
        ep = getattr(importlib.import_module(module), name)
    from kvsched.envs import ID_KWARGS

    fixed = ID_KWARGS.get(env_id, {})  # what the id itself sets (Scheduling-v1: observation_version=1)
    return [p for p in inspect.signature(ep).parameters if p != "split" and p not in fixed]


def _algo_parameters(cls) -> list[str]:
    """The constructor arguments of an SB3 algorithm that ``--hyperparameters`` may set (not
    those train sets itself)."""
    import inspect

    own = {"self", "policy", "env", "tensorboard_log", "verbose", "seed", "device", "_init_setup_model"}
    return [p for p in inspect.signature(cls.__init__).parameters if p not in own]


def default_interval(timesteps: int) -> int:
    """Steps between checkpoints and between evaluations unless given: 10,000, or a fifth of a
    shorter run (at least 1), so that a short run still writes checkpoints and evaluates."""
    return max(1, min(10_000, int(timesteps) // 5))


def planned_timesteps(model, timesteps: int) -> int:
    """The environment steps ``model.learn(timesteps)`` takes: on-policy algorithms (PPO,
    MaskablePPO) collect whole rollouts of ``n_steps`` x environments, so the next multiple of
    that; others exactly ``timesteps``."""
    from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm

    if isinstance(model, OnPolicyAlgorithm):
        rollout = int(model.n_steps) * int(model.n_envs)
        return -(-int(timesteps) // rollout) * rollout
    return int(timesteps)


def _shaping(reward: Any) -> float:
    """The shaping weight of an environment's ``reward`` argument (a RewardConfig, a mapping or None)."""
    if isinstance(reward, Mapping):
        return reward.get("shaping") or 0.0
    return getattr(reward, "shaping", 0.0) or 0.0


def _check_resumed_reward(resume: Path, reward: Any) -> None:
    """A resumed run trains on the reward its checkpoint was trained on: the ``train.json`` of the
    run that wrote ``resume`` (in its folder or the one above, as ``kvsched train`` lays them out)
    must name the same ``reward`` as ``--env-kwargs`` now (SB3 checkpoints do not store it).

    Raises:
        ConfigError: the rewards differ (both are named).
    """
    from kvsched.envs.reward import reward_config

    for folder in (resume.parent, resume.parent.parent):
        meta_path = folder / "train.json"
        if meta_path.is_file():
            try:
                before = json.loads(meta_path.read_text()).get("env_kwargs", {}).get("reward")
            except (OSError, ValueError, AttributeError, RecursionError):
                return  # unreadable metadata: nothing to compare against (evaluate reports it)
            if before is not None and not isinstance(before, Mapping):
                return  # a RewardConfig given from Python, recorded as its text: not comparable
            same = reward_config(before or {}) == reward_config(reward or {})
            if not same:
                raise ConfigError(f"--resume: the checkpoint was trained with reward {bounded_repr(before)} "
                                  f"({bounded_repr(str(meta_path), MAX_PATH_CHARS)}"
                                  f") and --env-kwargs now gives {bounded_repr(reward)}; pass the "
                                  "same reward (a different one changes the objective mid-run)")
            return


def _learn(model, algo: str, timesteps: int, out: Path, eval_env, *, reset: bool, n_envs: int, reference_env,
           bench_headroom: float | None, checkpoint_every: int, eval_every: int, eval_episodes: int, progress_bar: bool,
           max_cpu_s: float | None, max_wall_s: float | None, progress=None) -> dict[str, Any]:
    """Run ``model.learn`` with the checkpoint, evaluation, budget and signal callbacks, save
    ``final.zip`` (also when stopped early), and return what ``train.json`` adds at the end."""
    from stable_baselines3.common.callbacks import CallbackList

    from . import trust
    from .callbacks import RecordedCheckpointCallback, SignalStop, budget_callback, progress_callback, slo_eval_callback
    from .semi_mdp import ElapsedCallback

    budget = budget_callback(max_cpu_s, max_wall_s)
    evaluation = slo_eval_callback(algo == "maskable_ppo", eval_env, reference_env=reference_env,
                                   bench_headroom=bench_headroom,
                                   n_eval_episodes=eval_episodes,
                                   eval_freq=max(1, eval_every // n_envs), log_path=str(out / "eval"),
                                   best_model_save_path=str(out / "eval"), deterministic=True)
    start_steps = model.num_timesteps
    t0, c0 = time.time(), time.process_time()
    with SignalStop() as signals:
        callbacks = CallbackList([ElapsedCallback(), budget, signals.callback(), evaluation, RecordedCheckpointCallback(
            save_freq=max(1, checkpoint_every // n_envs), save_path=str(out / "checkpoints"), name_prefix=algo)]
            + ([progress_callback(progress, timesteps)] if progress is not None else []))
        model.learn(total_timesteps=timesteps, callback=callbacks, progress_bar=progress_bar,
                    reset_num_timesteps=reset, tb_log_name=algo)
    wall, cpu = time.time() - t0, time.process_time() - c0
    with atomic_files.replacing(out / "final.zip") as tmp:
        model.save(str(tmp))
    trust.record(out / "final.zip")  # kvsched wrote it: evaluate and --resume load it without --trust-checkpoint
    steps = model.num_timesteps - start_steps
    stopped = budget.stopped_by or (signals.received and f"signal {signals.received}")
    return {"status": f"stopped: {stopped}" if stopped else "finished", "timesteps": steps,
            "total_timesteps": model.num_timesteps, "wall_s": wall, "cpu_s": cpu,
            "env_steps_per_s": steps / wall if wall > 0 else None,
            "stopped_by_cpu_budget": budget.stopped_by == "cpu budget", "last_eval": evaluation.last_metrics}


def default_n_envs(algo: str) -> int:
    """Environments ``kvsched train`` steps together unless ``--n-envs`` says otherwise: 8 for the
    on-policy algorithms (one policy call serves all; on Scheduling-v0 this took MaskablePPO
    from ~600 to ~1,100 steps per CPU second, docs/training.md), 1 for DQN and SAC (their
    update per step does not batch over environments)."""
    return 8 if algo in ("ppo", "maskable_ppo") else 1


def default_hyperparameters(algo: str, n_envs: int) -> dict[str, Any]:
    """Hyper-parameters used unless overridden (small rollouts: an env step is a simulated
    scheduler decision, ~1-10 ms of CPU)."""
    if algo in ("ppo", "maskable_ppo"):
        return {"n_steps": max(64, 1024 // n_envs), "batch_size": 256, "n_epochs": 5, "learning_rate": 3e-4,
                "gamma": 0.99, "gae_lambda": 0.95, "ent_coef": 0.01}
    if algo == "dqn":
        return {"learning_starts": 1000, "buffer_size": 100_000, "train_freq": 4, "target_update_interval": 2000}
    return {"learning_starts": 200, "buffer_size": 100_000}


def train(env_id: str, algo: str, timesteps: int, out: str | Path, scenario: str | None = None,
          window_s: float | None = None, env_kwargs: dict | None = None, seed: int = 0, n_envs: int = 1,
          subprocess: bool = False, checkpoint_every: int | None = None, eval_every: int | None = None,
          eval_episodes: int = 4, resume: str | Path | None = None, threads: int = 1, progress_bar: bool = True,
          hyperparameters: dict | None = None, verbose: int = 0,
          max_cpu_s: float | None = None, eval_split: str = "heldout",
          max_wall_s: float | None = None, policy_net: str = "mlp",
          reference_bias: float = 0.0, bc_dataset: str | None = None, bc_dataset_id: str | None = None,
          bc_epochs: int = 5, discount_time_s: float | None = None,
          bench_headroom: float | None = None, trust_checkpoint: bool = False, progress=None) -> dict[str, Any]:
    """Train and save; returns the ``train.json`` content (see the module docstring).

    ``resume`` loads a checkpoint, which unpickles it: it must be one kvsched wrote or shipped
    (:func:`kvsched.agents.trust.check`) unless ``trust_checkpoint`` (``--trust-checkpoint``).
    ``progress`` (optional) is called as ``progress(done_steps, total_steps)`` after every
    environment step (:func:`kvsched.agents.callbacks.progress_callback`; ``kvsched train``'s
    progress lines off a terminal).

    ``checkpoint_every`` / ``eval_every`` default to :func:`default_interval` (10,000 steps, or a
    fifth of a shorter run, so a short run still checkpoints and evaluates). ``max_cpu_s`` /
    ``max_wall_s`` stop training early (CPU seconds of this process / wall seconds); so does
    SIGINT or SIGTERM (the run then saves ``final.zip`` and says so in ``train.json``, whose
    ``status`` is "running" from the start, so any checkpoint of an interrupted run can be
    evaluated, then "finished" or "stopped: <reason>").

    ``policy_net`` is the network: "mlp" (SB3's ``MlpPolicy`` over the flat observation) or
    "candidate-set" (:mod:`kvsched.agents.encoder`: one network per candidate row; PPO and
    MaskablePPO on Scheduling-v0).

    ``reference_bias`` > 0 starts a new model near the environment's reference (Scheduling-v0:
    action 0) instead of uniform (:func:`kvsched.agents.warm_start.reference_bias`).

    ``bc_dataset`` warm-starts a new model by behaviour cloning on Minari demonstrations before
    RL (:func:`kvsched.agents.warm_start.load_demonstrations`: a dataset id, or a folder and
    ``bc_dataset_id``), ``bc_epochs`` epochs.

    ``discount_time_s`` (PPO, MaskablePPO) discounts by simulated time instead of per decision:
    ``gamma`` per ``discount_time_s`` seconds (:mod:`kvsched.agents.semi_mdp`); kept by a resumed
    checkpoint. Refused with potential-based reward shaping, whose invariance needs the
    per-decision discount.

    ``bench_headroom`` (``kvsched train --task``: the task's hard-stratum headroom) adds
    ``eval/bench_score_estimate`` to the evaluations (:func:`kvsched.agents.callbacks.slo_eval_callback`).

    ``eval_split`` is the split of the periodic evaluations (and of ``eval/best_model.zip``, the
    checkpoint they select): "heldout" by default; "train" (other seeds than training's) when the
    held-out windows are a benchmark's and must not select a model (``kvsched train --task``).

    Raises:
        ConfigError: unknown algorithm, incompatible action space, bad counts, an unknown
            ``eval_split``; a ``resume`` checkpoint kvsched did not write (without
            ``trust_checkpoint``) or one that cannot be loaded (e.g. half-written).
    """
    import torch

    from kvsched.agents.factory import make_vec_env

    if algo not in ALGOS:
        raise ConfigError(f"--algo {bounded_repr(algo)} is not allowed: expected one of {ALGOS}")
    given = [(n, v) for n, v in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)) if v is not None]
    for name, v in (("timesteps", timesteps), ("n_envs", n_envs), *given, ("eval_episodes", eval_episodes),
                    ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={bounded_repr(v)} is not allowed: expected an integer >= 1")
    if policy_net not in POLICY_NETS:
        raise ConfigError(f"--policy-net {bounded_repr(policy_net)} is not allowed: expected one of {POLICY_NETS}")
    if policy_net == "candidate-set" and (algo not in ("ppo", "maskable_ppo") or env_id not in SCHEDULING_IDS):
        raise ConfigError(f"--policy-net candidate-set is for --algo ppo or maskable_ppo on kvsched/Scheduling-v0; "
                          f"got --algo {algo} on {env_id}")
    if reference_bias and (env_id not in SCHEDULING_IDS or algo not in ("ppo", "maskable_ppo")):
        raise ConfigError(f"--reference-bias is for --algo ppo or maskable_ppo on kvsched/Scheduling-v0, "
                          f"whose action 0 is the reference policy; got --algo {algo} on {env_id}")
    if discount_time_s is not None:
        from .semi_mdp import check_discount_time_s

        discount_time_s = check_discount_time_s(discount_time_s)
        if algo not in ("ppo", "maskable_ppo"):
            raise ConfigError(f"--discount-time-s is for --algo ppo or maskable_ppo (GAE over a rollout); got --algo "
                              f"{algo}")
    if eval_split not in ("train", "heldout"):
        raise ConfigError(f"eval_split={bounded_repr(eval_split)} is not allowed: expected 'train' or 'heldout'")
    cpus = os.cpu_count() or 1
    if threads > cpus:  # torch.set_num_threads(100_000) crashed the process (segmentation fault)
        raise ConfigError(f"--threads={bounded_repr(threads)} is not allowed: expected an integer in [1, {cpus}] "
                          "(this machine's CPUs)")
    if resume is not None and not (Path(resume).is_file() or Path(f"{resume}.zip").is_file()):
        what = ("is a folder" if Path(resume).is_dir() else "is not a regular file" if Path(resume).exists()
                or Path(f"{resume}.zip").exists() else "does not exist")
        raise ConfigError(f"--resume {bounded_repr(str(resume), MAX_PATH_CHARS)} {what} (expected a checkpoint .zip)")
    cls = _algo_class(algo)
    bc_info = None
    if bc_dataset is not None and (resume is not None or algo not in ("ppo", "maskable_ppo")):
        raise ConfigError("--bc-dataset warm-starts a new ppo or maskable_ppo model; not with --resume or "
                          f"--algo {algo}")
    demos = None
    if bc_dataset is not None:  # before any environment process starts: a missing dataset fails fast
        from .warm_start import load_demonstrations

        demos = load_demonstrations(bc_dataset, bc_dataset_id)
    _check_names(env_kwargs or {}, _env_parameters(env_id), "--env-kwargs", f"arguments of {env_id}")
    _check_names(hyperparameters or {}, _algo_parameters(cls), "--hyperparameters", f"arguments of {cls.__name__}")
    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kw = env_kwargs_for(env_id, algo, scenario, window_s, env_kwargs)
    venv = make_vec_env(env_id, {**kw, "split": "train"}, n_envs=n_envs, seed=seed, subprocess=subprocess)
    eval_env = make_vec_env(env_id, {**kw, "split": eval_split}, n_envs=1, seed=seed + 10_000)
    from gymnasium.spaces import flatdim

    check_hyperparameters(hyperparameters or {}, n_envs, flatdim(venv.observation_space))
    hp = default_hyperparameters(algo, n_envs)
    hp.update(hyperparameters or {})
    time_discount: dict[str, Any] = {}
    if discount_time_s is not None:
        from .semi_mdp import time_discount_buffer_class

        time_discount = {"rollout_buffer_class": time_discount_buffer_class(algo == "maskable_ppo"),
                         "rollout_buffer_kwargs": {"discount_time_s": discount_time_s}}
        hp.update(time_discount)
    if resume is not None:
        import pickle
        import zipfile
        import zlib

        from . import trust

        hp = {**(hyperparameters or {}), **time_discount}  # the rest comes from the checkpoint
        # hyper-parameters given now override the saved ones (e.g. n_steps for another n_envs)
        trust.check(resume if Path(resume).is_file() else Path(f"{resume}.zip"), trust_checkpoint)
        try:
            model = cls.load(str(resume), env=venv, tensorboard_log=str(out / "tb"), device="cpu", **hp)
        except (ValueError, KeyError, TypeError, AssertionError, EOFError, OSError, RuntimeError, zipfile.BadZipFile,
                pickle.UnpicklingError, zlib.error) as e:  # not a zip or cut short (SB3: ValueError, AssertionError),
            # another env's spaces, another algorithm's checkpoint
            why = str(e).splitlines()[0] if str(e) else repr(e)
            raise ConfigError(f"--resume {bounded_repr(str(resume), MAX_PATH_CHARS)} is not a {cls.__name__} "
                              f"checkpoint of {env_id} "
                              f"with these --env-kwargs, or it is damaged ({type(e).__name__}: "
                              f"{bounded_repr(why)})") from None
        _check_resumed_reward(Path(resume), (env_kwargs or {}).get("reward"))
        reset = False
    else:
        if policy_net == "candidate-set":  # the row and instance widths of the environment's observation version
            from kvsched.envs.observation_layout import layout

            row, inst = layout(venv.get_attr("observation_version")[0])
            hp["policy_kwargs"] = {"row_features": row, "instance_features": inst, **hp.get("policy_kwargs", {})}
        try:
            model = cls(_policy(algo, policy_net), venv, seed=seed, tensorboard_log=str(out / "tb"),
                        verbose=verbose,
                        device="cpu", **hp)
        except (AssertionError, TypeError, ValueError, MemoryError, RuntimeError, OverflowError) as e:
            # Stable-Baselines3 checks its arguments so; torch fails allocating (RuntimeError, MemoryError)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"--hyperparameters {bounded_repr(hyperparameters or {})}: {cls.__name__} refused "
                              f"them: {bounded_repr(why)[1:-1]}") from None
        if reference_bias:
            from .warm_start import reference_bias as bias_towards_reference

            bias_towards_reference(model.policy, reference_bias)
        if demos is not None:
            from .warm_start import warm_start_from_demonstrations

            bc_loss = warm_start_from_demonstrations(model.policy, demos, bc_epochs, seed, algo == "maskable_ppo")
            bc_info = {"dataset": demos.spec.dataset_id, "episodes": demos.total_episodes, "epochs": bc_epochs,
                       "last_loss": bc_loss}
        reset = True
    if getattr(getattr(model, "rollout_buffer", None), "discount_time_s", None) is not None \
            and _shaping(kw.get("reward")):  # given now, or kept by a resumed checkpoint
        raise ConfigError("--discount-time-s (given or kept by the resumed checkpoint) with reward shaping: the "
                          "shaping term is policy-invariant only under the per-decision discount shaping_gamma; "
                          "use one or the other")
    # defaults from the steps the run will take (a PPO run of --timesteps 500 takes a whole rollout,
    # 1,024 steps: a fifth of 500 evaluated it ten times, each evaluation costing more than the training)
    planned = planned_timesteps(model, timesteps)
    checkpoint_every = default_interval(planned) if checkpoint_every is None else checkpoint_every
    eval_every = default_interval(planned) if eval_every is None else eval_every
    meta = {
        "command": " ".join(["kvsched", *sys.argv[1:]]) if sys.argv and "kvsched" in sys.argv[0] else None,
        "status": "running", "env_id": env_id, "algo": algo, "env_kwargs": kw, "seed": seed, "n_envs": n_envs,
        "hyperparameters": hp, "resumed_from": None if resume is None else str(resume), "torch_threads": threads,
        "pid": os.getpid(), "max_cpu_s": max_cpu_s, "max_wall_s": max_wall_s, "eval_split": eval_split,
        "reference_bias": reference_bias, "behaviour_cloning": bc_info,
        "policy_net": "candidate-set" if type(model.policy).__name__.startswith("CandidateSet") else "mlp",
        "checkpoint_every": checkpoint_every, "eval_every": eval_every, "bench_headroom": bench_headroom,
        "discount_time_s": getattr(getattr(model, "rollout_buffer", None), "discount_time_s", None),
    }
    # written now: a checkpoint of a run that is killed can still be evaluated
    atomic_files.write_text(out / "train.json", json.dumps(meta, indent=2, default=str))
    reference_env = None
    if env_id in SCHEDULING_IDS:  # action 0 is the reference: its score on the same windows
        import gymnasium as gym

        reference_env = gym.make(env_id, **{**kw, "split": eval_split})
    meta.update(_learn(model, algo, timesteps, out, eval_env, reset=reset, n_envs=n_envs,
                       reference_env=reference_env, bench_headroom=bench_headroom,
                       checkpoint_every=checkpoint_every, eval_every=eval_every, eval_episodes=eval_episodes,
                       progress_bar=progress_bar, max_cpu_s=max_cpu_s, max_wall_s=max_wall_s, progress=progress))
    atomic_files.write_text(out / "train.json", json.dumps(meta, indent=2, default=str))
    venv.close()
    eval_env.close()
    if reference_env is not None:
        reference_env.close()
    return meta
