"""Evolution strategies with paired episodes: a linear scheduler trained on whole-episode SLO
attainment, starting exactly at the reference policy.

Why this learner (issue #20's evidence): on kvsched's tasks a decision's consequence (a TPOT
miss, a preemption cascade) lands seconds and dozens of decisions later, and episodes differ
more by their arrivals than by the policy; per-decision policy gradients from a uniform start
unlearned on the tuned references (PPO with the reference bias: -5 points on kv-burst-tiers
after 160k steps, docs/training.md). Evolution strategies (Salimans et al. 2017, "Evolution
Strategies as a Scalable Alternative to Reinforcement Learning", Algorithm 1 with antithetic
sampling and centred-rank fitness shaping) score a whole parameter vector by the episode's
metric, so credit assignment over time is not needed, and every candidate of a generation plays
the **same** training windows, so the arrival sequence's variance cancels out of the ranking:
the input-dependent baseline of Mao et al. (ICLR'19, "Variance Reduction for Reinforcement
Learning in Input-Driven Environments") in its simplest form.

The policy (:class:`LinearScheduler`, 186 parameters for ``K = 16``) acts deterministically
in ``kvsched/Scheduling-v0``'s ``MultiDiscrete([K, 7, 5, 4])``:

- slot: ``argmax_i (rows[i] . v + u [i = 0])`` over the shown candidates (``rows``: the ``K x 9``
  candidate block of the observation);
- chunk bin, victim rule, preemption mode: ``argmax (b_p + W_p . inst)`` over the allowed
  choices (``inst``: the 10 instance features);

initialised with ``u = 1``, ``b_p[0] = 1`` and everything else 0, so the initial policy is the
reference (action 0 everywhere). Masked choices are never taken.

A checkpoint is a NumPy ``.npz`` archive (a zip file, named ``.zip`` like the other learners')
with the parameters and the observation / action sizes; ``train.json`` beside it names
``algo: "es"`` so ``kvsched evaluate`` and ``kvsched leaderboard --agents`` load it.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvsched import atomic_files
from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.observation_layout import layout
from kvsched.envs.sim.errors import ConfigError, bounded_repr, require, MAX_PATH_CHARS
from kvsched.provenance import git_commit

N_ROW, N_INST = layout(0)  # observation version 0's widths (the default)


class LinearScheduler:
    """The deterministic linear policy of the module docstring.

    Args:
        k: candidate rows of the observation (the action's first part).
        nvec: the action's parts (``[k, 7, 5, 4]`` on Scheduling-v0).
        theta: flat parameters (:meth:`size`), default the reference-reproducing start.
        observation_version: the environment's (0 or 1: :mod:`kvsched.envs.observation_layout`).

    Attributes:
        observation_space, action_space: Gymnasium spaces (what checkpoint checks compare).

    Raises:
        ConfigError: ``nvec[0] != k``, or ``theta`` of another length.
    """

    def __init__(self, k: int, nvec: list[int], theta: np.ndarray | None = None, observation_version: int = 0) -> None:
        from gymnasium import spaces

        require(len(nvec) >= 1 and int(nvec[0]) == k, "nvec", nvec, f"a list whose first entry is k={k}")
        self.k = k
        self.nvec = [int(n) for n in nvec]
        self.observation_version = observation_version
        self.n_row, self.n_inst = layout(observation_version)
        self.observation_space = spaces.Box(-1.0, 1.0, (k * self.n_row + self.n_inst,), np.float32)
        self.action_space = spaces.MultiDiscrete(self.nvec)
        theta = self.initial() if theta is None else np.asarray(theta, dtype=np.float64)
        require(theta.shape == (self.size(),), "theta", f"shape {theta.shape}", f"shape ({self.size()},)")
        self.theta = theta
        self._parts = self._split()  # views of theta, split once (act runs at every decision)

    def size(self) -> int:
        """Number of parameters: ``row features + 1`` (slot) ``+ sum(nvec[1:]) x (instance features + 1)``
        (186 on Scheduling-v0 with K = 16, 316 on Scheduling-v1)."""
        return self.n_row + 1 + sum(self.nvec[1:]) * (self.n_inst + 1)

    def initial(self) -> np.ndarray:
        """The parameters whose policy is action 0 everywhere (the reference)."""
        t = np.zeros(self.size())
        t[self.n_row] = 1.0  # u: slot 0's bonus
        off = self.n_row + 1 + sum(self.nvec[1:]) * self.n_inst  # the biases b, part after part
        for n in self.nvec[1:]:
            t[off] = 1.0
            off += n
        return t

    def _split(self):
        t, nr, ni = self.theta, self.n_row, self.n_inst
        v, u = t[:nr], t[nr]
        m = sum(self.nvec[1:])
        w = t[nr + 1:nr + 1 + m * ni].reshape(m, ni)
        b = t[nr + 1 + m * ni:]
        return v, u, w, b

    def act(self, obs: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The action for one observation ``(K*9 + 10,)`` and its mask ``(sum(nvec),)`` (True =
        allowed; sb3-contrib's concatenated layout)."""
        v, u, w, b = self._parts
        rows = obs[:self.k * self.n_row].reshape(self.k, self.n_row)
        inst = obs[self.k * self.n_row:]
        out = np.zeros(len(self.nvec), dtype=np.int64)
        slot = rows @ v
        slot[0] += u
        out[0] = _masked_argmax(slot, mask[:self.k])
        logits = b + w @ inst
        start, off = self.k, 0
        for p, n in enumerate(self.nvec[1:], 1):
            out[p] = _masked_argmax(logits[off:off + n], mask[start:start + n])
            start += n
            off += n
        return out

    # ---------------------------------------------------- the Stable-Baselines3 shape it mimics
    def predict(self, obs, state=None, episode_start=None, deterministic: bool = True, action_masks=None):
        """``(action, None)`` as SB3's ``predict``; batched observations give batched actions."""
        obs = np.asarray(obs, dtype=np.float32)
        n = sum(self.nvec)
        if obs.ndim == 1:
            mask = np.ones(n, dtype=bool) if action_masks is None else np.asarray(action_masks, dtype=bool)
            return self.act(obs, mask.reshape(-1)), None
        # without masks: everything allowed for each observation of the batch
        masks = np.ones((len(obs), n), dtype=bool) if action_masks is None else \
            np.asarray(action_masks, dtype=bool).reshape(len(obs), -1)
        return np.stack([self.act(o, m) for o, m in zip(obs, masks)]), None

    def save(self, path: str | Path) -> None:
        """Write the checkpoint (whole or not at all)."""
        arrays = {"theta": self.theta, "k": np.int64(self.k), "nvec": np.asarray(self.nvec, dtype=np.int64),
                  "observation_version": np.int64(self.observation_version)}
        buf = io.BytesIO()
        # an .npz archive (what np.load reads) with fixed entry times, so the same parameters give
        # the same bytes (np.savez stamps each entry with the current time)
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, value in arrays.items():
                entry = io.BytesIO()
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)
                z.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), entry.getvalue())
        atomic_files.write_bytes(Path(path), buf.getvalue())
        from . import trust

        trust.record(path)  # kvsched wrote it: loaded without --trust-checkpoint

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> "LinearScheduler":
        """Read a checkpoint written by :meth:`save` (``device`` is accepted for SB3's signature).

        Raises:
            ConfigError: not such a checkpoint.
        """
        try:
            with np.load(str(path), allow_pickle=False) as z:
                version = int(z["observation_version"]) if "observation_version" in z.files else 0
                return cls(int(z["k"]), [int(n) for n in z["nvec"]], np.asarray(z["theta"], dtype=np.float64),
                           version)
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise ConfigError(f"{bounded_repr(str(path), MAX_PATH_CHARS)} is not an es checkpoint "
                              f"({bounded_repr(str(e))})") from None


def _masked_argmax(x: np.ndarray, allowed: np.ndarray) -> int:
    """The first index of the largest allowed entry (index 0 when nothing is allowed)."""
    if not allowed.any():
        return 0
    return int(np.argmax(np.where(allowed, x, -np.inf)))


@dataclass(frozen=True)
class ESConfig:
    """Evolution-strategy settings (defaults: Salimans et al. 2017 scaled to a 186-parameter
    deterministic linear policy whose logits are O(1)).

    Attributes:
        generations: updates (>= 1).
        pairs: antithetic pairs per generation (population ``2 * pairs``; >= 1).
        windows: training windows every candidate of a generation plays (>= 1; the same for all).
        sigma: perturbation scale (> 0); 0.5 flips decisions whose logits differ by about 1.
        learning_rate: Adam step on the mean (> 0).
        validation_windows: train windows (other seeds) the final choice between the last and the
            best generation's mean is made on (>= 0; 0 = keep the last).
        step_cap_factor: a candidate's episode stops after this many times the decisions the
            reference took on the same window (:func:`play`'s ``max_steps``; >= 1).
        paired: every candidate plays the generation's windows (default); False is the ablation
            where each candidate plays windows of its own (capped at the largest paired cap).
    """

    generations: int = 15
    pairs: int = 8
    windows: int = 4
    sigma: float = 0.5
    learning_rate: float = 0.2
    validation_windows: int = 8
    step_cap_factor: float = 4.0
    paired: bool = True

    def __post_init__(self) -> None:
        for name in ("generations", "pairs", "windows"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"es.{name}", v, "an integer >= 1")
        v = self.validation_windows
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "es.validation_windows", v,
                "an integer >= 0")
        require(isinstance(self.paired, bool), "es.paired", self.paired, "true or false")
        v = self.step_cap_factor
        require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 1,
                "es.step_cap_factor", v, "a finite number >= 1")
        for name in ("sigma", "learning_rate"):
            v = getattr(self, name)
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
                    f"es.{name}", v, "a finite number > 0")

    @classmethod
    def from_mapping(cls, m: dict) -> "ESConfig":
        """From ``--hyperparameters`` JSON; unknown keys are refused.

        Raises:
            ConfigError: an unknown key or a bad value.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(m) - known)
        require(not unknown, "--hyperparameters", unknown, f"keys among {sorted(known)} for --algo es")
        return cls(**m)


def centred_ranks(x: np.ndarray) -> np.ndarray:
    """Fitness shaping: ranks mapped linearly onto [-0.5, 0.5] (ties by order of appearance)."""
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r / max(len(x) - 1, 1) - 0.5


def es_gradient(eps: np.ndarray, fitness: np.ndarray, sigma: float) -> np.ndarray:
    """The search gradient of antithetic pairs with centred-rank shaping (Salimans et al. 2017).

    Args:
        eps: ``(pairs, parameters)`` standard-normal directions.
        fitness: ``(2 * pairs,)`` scores of ``mean + sigma * eps[i]`` and ``mean - sigma * eps[i]``,
            interleaved (``+`` first).
        sigma: the perturbation scale.

    Returns:
        ``(parameters,)``: ``sum_i (R(F+_i) - R(F-_i)) eps_i / (2 * pairs * sigma)``.
    """
    ranks = centred_ranks(np.asarray(fitness, dtype=np.float64))
    return (ranks[0::2] - ranks[1::2]) @ eps / (2 * len(eps) * sigma)


def play(env, policy: LinearScheduler, seed: int, max_steps: int | None = None) -> tuple[float | None, int]:
    """``(SLO attainment, environment steps)`` of the episode ``env.reset(seed=seed)`` draws,
    played by ``policy`` (attainment None for an empty window).

    With ``max_steps``, an episode still running after that many decisions stops there and scores
    the requests that met their SLO by then over **all** the window's requests (unserved and not
    yet arrived ones count as misses): a candidate that multiplies the decisions (tiny chunks,
    swap thrashing) cannot stall a generation, and stopping it early never flatters it."""
    obs, info = env.reset(seed=seed)
    steps = 0
    while True:
        obs, _, terminated, truncated, info = env.step(policy.act(obs, info["action_mask"]))
        steps += 1
        if terminated or truncated:
            break
        if max_steps is not None and steps >= max_steps:
            return _met_so_far(env.unwrapped), steps
    summary = info["summary"] if "summary" in info else env.unwrapped.cluster.result().summary
    return summary["classes"]["all"]["slo"]["attainment"], steps


def _met_so_far(base) -> float | None:
    """Requests of the episode that finished within their SLO so far, over all its requests."""
    from kvsched.envs.sim.metrics import summarize

    cluster, total = base.cluster, len(base.workload)
    records = cluster.recorder.records_frame()
    if not total:
        return None
    if not len(records):
        return 0.0
    met = summarize(records, cluster.recorder.itl, None, cluster.metrics)["classes"]["all"]["slo"]["met"]
    return met / total


def paired_fitness(env, policy: LinearScheduler, seeds: list[int], steps: list[int] | None = None,
                   caps: list[int | None] | None = None) -> list[float | None]:
    """:func:`play` on each of ``seeds`` (the same windows for every candidate), each capped at
    ``caps[i]`` decisions when given; the environment steps are added to ``steps[0]`` when given."""
    out = []
    for i, s in enumerate(seeds):
        score, n = play(env, policy, s, None if caps is None else caps[i])
        out.append(score)
        if steps is not None:
            steps[0] += n
    return out


def _mean(scores: list[float | None], keep: list[bool]) -> float:
    vals = [s for s, k in zip(scores, keep) if k]
    return float(np.mean(vals)) if vals else 0.0


def _reference_play(env, ref: LinearScheduler, seeds: list[int], cap_factor: float,
                    steps: list[int] | None) -> tuple[list[float | None], list[int]]:
    """The reference's scores on ``seeds`` and each window's decision cap for the candidates
    (``cap_factor`` x the reference's decisions there)."""
    scores, caps = [], []
    for s in seeds:
        score, n = play(env, ref, s)
        scores.append(score)
        caps.append(max(1, math.ceil(cap_factor * n)))
        if steps is not None:
            steps[0] += n
    return scores, caps


def _population_fitness(env, policy_of: Callable[[np.ndarray], LinearScheduler], mean: np.ndarray, eps: np.ndarray,
                        config: ESConfig, seeds: list[int], caps: list[int], keep: list[bool],
                        rng: np.random.Generator, steps: list[int]) -> list[float]:
    """The fitness of ``mean +- sigma * eps[i]`` (interleaved, ``+`` first): their mean score on
    the generation's windows, or (``config.paired`` False, the ablation) on windows of their own."""
    fit = []
    for e in eps:
        for sign in (1.0, -1.0):
            cand = policy_of(mean + sign * config.sigma * e)
            if config.paired:
                fit.append(_mean(paired_fitness(env, cand, seeds, steps, caps), keep))
            else:  # the ablation: each candidate on its own windows (arrival variance stays in the ranking)
                own = [int(x) for x in rng.integers(0, 2**31 - 1, config.windows)]
                scores = paired_fitness(env, cand, own, steps, [max(caps)] * len(own))
                fit.append(_mean(scores, [x is not None for x in scores]))
    return fit


class _AdamAscent:
    """Adam steps up a gradient (Kingma & Ba 2015; beta 0.9 / 0.999, eps 1e-8)."""

    def __init__(self, n: int, learning_rate: float) -> None:
        self.m, self.v, self.t, self.lr = np.zeros(n), np.zeros(n), 0, learning_rate

    def step(self, grad: np.ndarray) -> np.ndarray:
        """The parameter change for ``grad`` (bias-corrected moments)."""
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * grad
        self.v = 0.999 * self.v + 0.001 * grad * grad
        return self.lr * ((self.m / (1 - 0.9 ** self.t)) / (np.sqrt(self.v / (1 - 0.999 ** self.t)) + 1e-8))


def _stop_reason(c0: float, w0: float, steps: int, max_cpu_s: float | None, max_wall_s: float | None,
                 max_steps: int | None, signal_name: str | None) -> str | None:
    """Why training stops after this generation (None: it goes on)."""
    if max_cpu_s is not None and time.process_time() - c0 >= max_cpu_s:
        return "cpu budget"
    if max_wall_s is not None and time.perf_counter() - w0 >= max_wall_s:
        return "wall budget"  # the word of kvsched train's other learners
    if max_steps is not None and steps >= max_steps:
        return "timesteps reached"
    if signal_name:  # SIGINT / SIGTERM: stop after this generation, final.zip saved
        return f"signal {signal_name}"
    return None


def _validate(env, ref: LinearScheduler, policy_of: Callable[[np.ndarray], LinearScheduler], mean: np.ndarray,
              best: tuple[float, np.ndarray, int], config: ESConfig) -> dict[str, Any]:
    """Scores of the reference, the last mean and the best generation's mean on
    ``config.validation_windows`` train windows of seeds 10,000 on (paired, capped)."""
    vseeds = [10_000 + i for i in range(config.validation_windows)]
    vr, vcaps = _reference_play(env, ref, vseeds, config.step_cap_factor, None)
    vkeep = [s is not None for s in vr]
    return {"windows": vseeds, "reference": _mean(vr, vkeep),
            "last": _mean(paired_fitness(env, policy_of(mean), vseeds, caps=vcaps), vkeep),
            f"best_generation_{best[2]}": _mean(paired_fitness(env, policy_of(best[1]), vseeds, caps=vcaps), vkeep)}


def train_es(env_id: str, env_kwargs: dict[str, Any], out: str | Path, config: ESConfig = ESConfig(), seed: int = 0,
             max_cpu_s: float | None = None, max_wall_s: float | None = None, max_steps: int | None = None,
             progress: Callable[[str], None] | None = None, command: str | None = None) -> dict[str, Any]:
    """Train a :class:`LinearScheduler` by evolution strategies on ``env_id``'s train windows.

    Each generation draws ``config.windows`` window seeds with a generator seeded by ``seed``,
    plays the mean, ``config.pairs`` antithetic pairs ``mean +- sigma * eps`` and the reference
    (the initial parameters) on them, and moves the mean by Adam along
    ``sum_i rank_i eps_i / (n sigma)``. Writes ``out/train.json`` (status ``running`` from the start),
    ``out/checkpoints/es_gen<G>.zip`` each generation, ``out/progress.json`` (per generation: the
    mean's and the reference's scores on the generation's windows, the paired gain) and
    ``out/final.zip``: the last mean or the best generation's, whichever scores higher on
    ``config.validation_windows`` other train windows (never held-out ones). ``max_cpu_s``,
    ``max_wall_s`` and ``max_steps`` (environment steps) stop training after the generation that
    reaches them (``status`` "stopped: cpu budget | wall budget | timesteps reached"); a run that
    ran all ``config.generations`` is "finished". SIGINT / SIGTERM stop it after the current
    generation ("stopped: signal SIGINT"), skipping the validation (``final.zip`` is the last
    mean); a second one kills it.

    Returns:
        the ``train.json`` content.

    Raises:
        ConfigError: an environment other than Scheduling-v0, or bad settings.
    """
    import gymnasium as gym

    import kvsched.envs  # noqa: F401  (registers the ids)
    from kvsched.agents.callbacks import SignalStop
    from kvsched.agents.train import _check_names, _env_parameters

    require(env_id in SCHEDULING_IDS, "--env", env_id, f"one of {SCHEDULING_IDS} for --algo es")
    # as train's: an unknown name reached the environment's constructor as a TypeError traceback
    _check_names(env_kwargs, _env_parameters(env_id), "--env-kwargs", f"arguments of {env_id}")
    require(env_kwargs.get("action_mode", "multi") == "multi", "action_mode", env_kwargs.get("action_mode"),
            '"multi" for --algo es (the linear scheduler acts in the MultiDiscrete action space)')
    out = Path(out)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    kw = {**env_kwargs, "split": "train"}
    env = gym.make(env_id, **kw)
    base = env.unwrapped
    nvec = [int(n) for n in base.action_space.nvec]
    version = int(base.observation_version)

    def policy_of(theta: np.ndarray) -> LinearScheduler:
        return LinearScheduler(base.k, nvec, theta, version)

    ref = LinearScheduler(base.k, nvec, None, version)
    mean = ref.initial()
    meta: dict[str, Any] = {"command": command, "status": "running", "env_id": env_id, "algo": "es",
                            "env_kwargs": {k: v for k, v in kw.items() if k != "split"}, "seed": seed,
                            "hyperparameters": asdict(config), "max_cpu_s": max_cpu_s, "max_wall_s": max_wall_s,
                            "pid": os.getpid(), "parameters": ref.size(), "eval_split": "train",
                            "kvsched_commit": git_commit()}
    atomic_files.write_text(out / "train.json", json.dumps(meta, indent=2, default=str))
    rng = np.random.default_rng(seed)
    adam = _AdamAscent(len(mean), config.learning_rate)
    history: list[dict[str, Any]] = []
    best = (-math.inf, mean.copy(), 0)
    c0, w0 = time.process_time(), time.perf_counter()
    stopped = None
    n_steps = [0]
    signals = SignalStop()
    with signals:
        for gen in range(1, config.generations + 1):
            seeds = [int(s) for s in rng.integers(0, 2**31 - 1, config.windows)]
            eps = rng.standard_normal((config.pairs, len(mean)))
            ref_scores, caps = _reference_play(env, ref, seeds, config.step_cap_factor, n_steps)
            keep = [s is not None for s in ref_scores]
            mean_scores = paired_fitness(env, policy_of(mean), seeds, n_steps, caps)
            fit = _population_fitness(env, policy_of, mean, eps, config, seeds, caps, keep, rng, n_steps)
            gain = _mean(mean_scores, keep) - _mean(ref_scores, keep)
            if gain > best[0]:
                best = (gain, mean.copy(), gen - 1)
            mean = mean + adam.step(es_gradient(eps, np.asarray(fit), config.sigma))
            policy_of(mean).save(out / "checkpoints" / f"es_gen{gen}.zip")
            row = {"generation": gen, "windows": seeds, "reference": _mean(ref_scores, keep),
                   "mean_before_update": _mean(mean_scores, keep), "paired_gain": gain,
                   "population_best": max(fit), "population_mean": float(np.mean(fit)),
                   "env_steps": n_steps[0], "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}
            history.append(row)
            atomic_files.write_text(out / "progress.json", json.dumps(history, indent=2))
            if progress:
                progress(f"generation {gen}/{config.generations}: reference {row['reference']:.3f}, mean "
                         f"{row['mean_before_update']:.3f} (paired gain {gain:+.3f}), population best {max(fit):.3f}")
            if gen == config.generations:  # every generation asked for ran: finished, whatever else was reached
                break
            stopped = _stop_reason(c0, w0, n_steps[0], max_cpu_s, max_wall_s, max_steps, signals.received)
            if stopped:
                break
    final, chosen, validation = mean, "last", None
    if config.validation_windows and not signals.received:  # a signal asks to stop now: keep the last
        validation = _validate(env, ref, policy_of, mean, best, config)
        if validation[f"best_generation_{best[2]}"] > validation["last"]:
            final, chosen = best[1], f"generation {best[2]} (best paired gain during training)"
    policy_of(final).save(out / "final.zip")
    env.close()
    meta.update({"status": "finished" if stopped is None else f"stopped: {stopped}", "generations": len(history),
                 "final": chosen, "validation": validation, "cpu_s": time.process_time() - c0,
                 "wall_s": time.perf_counter() - w0,
                 "episodes": len(history) * config.windows * (2 * config.pairs + 2), "timesteps": n_steps[0]})
    atomic_files.write_text(out / "train.json", json.dumps(meta, indent=2, default=str))
    return meta
