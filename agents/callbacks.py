"""Stable-Baselines3 callbacks of ``kvsched train``: budgets, a graceful stop on signals, and the
serving metrics of each evaluation.

- :func:`budget_callback` stops training after a CPU-time (``--max-cpu-s``, ``time.process_time``
  of the training process; SubprocVecEnv workers are not counted) or wall-clock budget
  (``--max-wall-s``, ``time.monotonic``) and records which one stopped it;
- :class:`SignalStop` turns SIGINT / SIGTERM into a stop at the next environment step, so that
  training ends through SB3's normal path and ``final.zip`` is written (a second signal of the same
  kind gets the previous handler: Ctrl-C twice still kills a stuck run);
- :func:`progress_callback` tells a ``progress(done_steps, total_steps)`` function (``kvsched
  train``'s progress lines off a terminal, :mod:`kvsched.experiments.progress`) the environment
  steps of this run after every step;
- :func:`slo_eval_callback` extends SB3's ``EvalCallback`` (``MaskableEvalCallback`` for
  MaskablePPO) to log, beside the mean return, the serving metrics of the evaluation episodes'
  ``info["summary"]`` to TensorBoard: ``eval/slo_attainment`` (all requests), ``eval/goodput_rps``
  and, per length class, ``eval/ttft_p99_s/<class>`` and ``eval/tpot_p99_s/<class>`` (means over
  the episodes that have the value); on Scheduling-v0 also the reference policy's attainment on
  the same episodes and the agent's paired difference to it;
- checkpoints (periodic, ``eval/best_model.zip``) and ``eval/evaluations.npz`` are written whole or
  not at all (:func:`save_checkpoint`: a temporary name in the same folder, then ``os.replace``),
  where SB3's callbacks write them in place (a full disk left a truncated zip).

These use the wall clock: training is outside the simulator, whose results never depend on it.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Any, Mapping

from kvsched import atomic_files
from kvsched.envs.sim.errors import ConfigError, bounded_repr


def save_checkpoint(model: Any, path: Path) -> None:
    """``model.save`` to ``path`` (``.zip``) whole or not at all (:mod:`kvsched.atomic_files`:
    saved on a temporary name in the same folder, then renamed over ``path``), then its SHA-256
    sidecar (:func:`kvsched.agents.trust.record`): a full disk part-way leaves no partial
    checkpoint and no sidecar.

    Raises:
        OSError: the checkpoint or its sidecar cannot be written (the temporary file is removed).
    """
    from . import trust

    with atomic_files.replacing(path) as tmp:
        model.save(str(tmp))
    trust.record(path)


def _positive_seconds(value: Any, flag: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag}={bounded_repr(value)} is not allowed: expected a finite number of seconds > 0")
    return float(value)


def budget_callback(max_cpu_s: float | None = None, max_wall_s: float | None = None):
    """A callback that stops training once ``max_cpu_s`` CPU seconds of this process or
    ``max_wall_s`` wall seconds have passed since it was made; its ``stopped_by`` is then
    ``"cpu budget"`` or ``"wall budget"`` (``None`` while running).

    Raises:
        ConfigError: a budget that is not a finite number > 0.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    cpu = _positive_seconds(max_cpu_s, "--max-cpu-s")
    wall = _positive_seconds(max_wall_s, "--max-wall-s")

    class _Budget(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.stopped_by: str | None = None
            self.cpu0, self.wall0 = time.process_time(), time.monotonic()

        def _on_step(self) -> bool:
            if cpu is not None and time.process_time() - self.cpu0 >= cpu:
                self.stopped_by = "cpu budget"
            elif wall is not None and time.monotonic() - self.wall0 >= wall:
                self.stopped_by = "wall budget"
            return self.stopped_by is None

    return _Budget()


def progress_callback(progress, total_steps: int):
    """A callback calling ``progress(done, total_steps)`` after every environment step, ``done``
    being the environment steps of this ``learn`` call (a resumed run counts from 0). It never
    stops training."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _Progress(BaseCallback):
        def _on_training_start(self) -> None:
            self.start_steps = self.model.num_timesteps

        def _on_step(self) -> bool:
            progress(self.model.num_timesteps - self.start_steps, total_steps)
            return True

    return _Progress()


class SignalStop:
    """Installs SIGINT / SIGTERM handlers for the duration of a ``with`` block; a signal sets
    :attr:`received` (its name) and :meth:`callback` returns a callback that stops training at the
    next step. The previous handlers are restored on exit, and a second signal while stopping
    is handed to them. Outside the main thread (where Python cannot install handlers) it does
    nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalStop":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == name:  # the second one: the user insists
            previous = self._previous.get(signum)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received = name

    def callback(self):
        """A callback that returns False (stop) once a signal was received."""
        from stable_baselines3.common.callbacks import BaseCallback

        outer = self

        class _Stop(BaseCallback):
            def _on_step(self) -> bool:
                return outer.received is None

        return _Stop()


def summary_metrics(summaries: list[Mapping[str, Any]]) -> dict[str, float]:
    """Means over episode summaries (:func:`kvsched.envs.sim.metrics.summarize`'s dicts) of the
    metrics logged at each evaluation; a metric no episode has (e.g. an empty class) is left out.
    Keys: ``slo_attainment``, ``goodput_rps``, ``ttft_p99_s/<class>``, ``tpot_p99_s/<class>``."""
    values: dict[str, list[float]] = {}

    def add(key: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            values.setdefault(key, []).append(float(v))

    for s in summaries:
        classes = s.get("classes", {})
        every = classes.get("all", {})
        add("slo_attainment", every.get("slo", {}).get("attainment"))
        add("goodput_rps", every.get("goodput_rps"))
        for name, c in classes.items():
            add(f"ttft_p99_s/{name}", c.get("ttft_s", {}).get("p99"))
            add(f"tpot_p99_s/{name}", c.get("tpot_s", {}).get("p99"))
    return {k: sum(v) / len(v) for k, v in sorted(values.items())}


def reference_attainment(env, window: Mapping[str, Any]) -> float | None:
    """SLO attainment of the environment's reference policy (action 0 in every step: Scheduling-v0)
    on the episode ``window`` (``info["window"]``: ``workload_seed``, ``window_index``)."""
    import numpy as np

    options = {"workload_seed": int(window["workload_seed"]), "window_index": int(window["window_index"])}
    env.reset(options=options)
    zero = np.zeros(env.action_space.shape, dtype=np.int64) if env.action_space.shape else 0
    while True:
        _, _, terminated, truncated, info = env.step(zero)
        if terminated or truncated:
            summary = info.get("summary")
            return None if summary is None else summary["classes"]["all"]["slo"]["attainment"]


def slo_eval_callback(masked: bool, eval_env, reference_env=None, bench_headroom: float | None = None, **kwargs):
    """SB3's ``EvalCallback`` (``MaskableEvalCallback`` when ``masked``) that also logs
    :func:`summary_metrics` of the evaluation episodes under ``eval/`` and keeps the latest in
    ``last_metrics``. With ``reference_env`` (a Scheduling-v0 environment of the evaluation's
    split), the reference policy serves the same episodes and ``eval/reference_slo_attainment``
    and ``eval/slo_attainment_vs_reference`` (the paired mean difference; > 0: the agent beats its
    reference on those windows) are logged too; each window's reference score is computed once.
    With ``bench_headroom`` (a bench task's hard-stratum headroom, SLO attainment: ``kvsched
    train --task``) also ``eval/bench_score_estimate`` = that paired difference / the headroom: an
    estimate, on the evaluation's (train) windows, of the normalised bench score the leaderboard
    measures on held-out ones (1: the agent closes the measured headroom). ``kwargs`` go to the
    SB3 class."""
    if masked:
        from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback as base
    else:
        from stable_baselines3.common.callbacks import EvalCallback as base

    class _SloEval(base):  # type: ignore[misc, valid-type]
        last_metrics: dict[str, float] = {}

        _reference_cache: dict = {}

        def _log_success_callback(self, locals_: dict, globals_: dict) -> None:
            super()._log_success_callback(locals_, globals_)
            if locals_.get("done"):
                info = locals_.get("info", {})
                if info.get("summary") is not None:
                    self._summaries.append(info["summary"])
                    self._windows.append(info.get("window"))

        def _on_step(self) -> bool:
            self._summaries: list = []
            self._windows: list = []
            evaluating = self.eval_freq > 0 and self.n_calls % self.eval_freq == 0
            go_on = self._atomic_base_step() if evaluating else super()._on_step()
            if evaluating and self._summaries:
                self.last_metrics = summary_metrics(self._summaries)
                if reference_env is not None:
                    self.last_metrics.update(self._versus_reference())
                for key, v in self.last_metrics.items():
                    self.logger.record(f"eval/{key}", v)
                self.logger.dump(self.num_timesteps)
            return go_on

        def _atomic_base_step(self) -> bool:
            """The base class's evaluation step with its two files written whole or not at all:
            ``evaluations.npz`` (``np.savez`` on a temporary name, then renamed) and, on a new best
            mean return, ``best_model.zip`` (saved here on a temporary name, then its sidecar)."""
            best_dir, log_path, best = self.best_model_save_path, self.log_path, self.best_mean_reward
            self.best_model_save_path = None  # the base class would write best_model.zip in place
            try:
                if log_path is None:
                    go_on = super()._on_step()
                else:
                    with atomic_files.replacing(log_path + ".npz") as tmp:
                        self.log_path = str(tmp)  # ends in .npz: np.savez writes exactly there
                        go_on = super()._on_step()
            finally:
                self.best_model_save_path, self.log_path = best_dir, log_path
            if self.best_mean_reward != best and best_dir is not None:
                save_checkpoint(self.model, Path(best_dir) / "best_model.zip")
            return go_on

        def _versus_reference(self) -> dict[str, float]:
            pairs = []
            for summary, window in zip(self._summaries, self._windows):
                if window is None:
                    continue
                key = (int(window["workload_seed"]), int(window["window_index"]))
                if key not in self._reference_cache:
                    self._reference_cache[key] = reference_attainment(reference_env, window)
                mine, ref = summary["classes"]["all"]["slo"]["attainment"], self._reference_cache[key]
                if mine is not None and ref is not None:
                    pairs.append((mine, ref))
            if not pairs:
                return {}
            gain = sum(m - r for m, r in pairs) / len(pairs)
            out = {"reference_slo_attainment": sum(r for _, r in pairs) / len(pairs),
                   "slo_attainment_vs_reference": gain}
            if bench_headroom:
                out["bench_score_estimate"] = gain / bench_headroom
            return out

    return _SloEval(eval_env, **kwargs)


def RecordedCheckpointCallback(**kwargs: Any):
    """SB3's ``CheckpointCallback`` (``kwargs`` go to it) that also records each checkpoint's
    SHA-256 sidecar (:func:`kvsched.agents.trust.record`), so kvsched loads it without
    ``--trust-checkpoint``. Every file is written whole or not at all (:func:`save_checkpoint`):
    a full disk leaves no partial ``<prefix>_<n>_steps.zip`` and no sidecar without its checkpoint."""
    from stable_baselines3.common.callbacks import CheckpointCallback

    class _Recorded(CheckpointCallback):
        def _on_step(self) -> bool:
            # CheckpointCallback._on_step, each file written whole or not at all
            if self.n_calls % self.save_freq == 0:
                save_checkpoint(self.model, Path(self._checkpoint_path(extension="zip")))
                if self.save_replay_buffer and getattr(self.model, "replay_buffer", None) is not None:
                    dest = Path(self._checkpoint_path("replay_buffer_", extension="pkl"))
                    with atomic_files.replacing(dest) as tmp:
                        self.model.save_replay_buffer(str(tmp))  # type: ignore[attr-defined]
                if self.save_vecnormalize and self.model.get_vec_normalize_env() is not None:
                    dest = Path(self._checkpoint_path("vecnormalize_", extension="pkl"))
                    with atomic_files.replacing(dest) as tmp:
                        self.model.get_vec_normalize_env().save(str(tmp))  # type: ignore[union-attr]
            return True

    return _Recorded(**kwargs)
