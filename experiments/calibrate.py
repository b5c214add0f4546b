"""``kvsched calibrate``: fit the H100 cost parameters to real vLLM runs and write the calibration file.

The fit (:func:`kvsched.envs.sim.calibration.fit_cost_params`) minimises, over the training
experiments only, the residuals ``log(predicted / measured)`` of every stage and metric of
:data:`FIT_METRICS` with a soft-L1 loss. Predictions come from replaying the experiments
(:func:`kvsched.experiments.replay.replay`) with each stage cut to a few tens of seconds after an
unscored warm-up (coarse fit on 30-s stages from the literature defaults, then a short fine fit on
60-s stages; the runs are open-loop, so a stage reaches its steady state within a few request
lifetimes); ``kvsched validate`` then replays every run in full. About 4 minutes on 2 cores.

One parameter set per GPU, shared by every model and TP degree: the published runs hold 14
replayable experiments on 6 architectures, too few to fit per model family without fitting
some families on a single run. Replays run in parallel over ``jobs`` processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing as mp
import time
from collections import Counter
from typing import Callable, Mapping, Sequence

import numpy as np

import kvsched
from kvsched.envs.sim.calibration import (DEFAULT_FIT_BASE, DEFAULT_FIT_PARAMS, CalibrationFile, FitParam, FitResult,
                                          fit_cost_params)
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from kvsched.envs.sim.allreduce import ALLREDUCE_ALGORITHMS
from kvsched.envs.sim.cost_params import TAIL_FIELDS
from kvsched.envs.sim.specs import CostParams

from .groundtruth import METRICS, Experiment, load_experiments
from .replay import CALIBRATED_GPU, replay

__all__ = ["DEFAULT_TRAIN", "FIT_METRICS", "TAIL_FIELDS", "TAIL_FIT_QUANTILES", "TAIL_FIT_STAGES", "TAIL_GRID",
           "Objective", "ReplayError", "TailFit", "calibrate", "fit_tail", "log_residuals", "tail_quantiles",
           "tail_residuals"]

DEFAULT_TRAIN: tuple[str, ...] = (
    "20260217-162547-llama-2-7b-tp1-roleplay",
    "20260217-202857-llama-2-70b-tp4-general",
    "20260217-203421-llama-2-70b-hf-tp4-codegen",
    "20260217-231439-llama-2-7b-tp1-general",
    "20260218-084319-llama-2-70b-tp4-roleplay",
    "20260218-120914-mixtral-8x7b-v0-1-tp2-codegen",
    "20260218-130541-mixtral-8x7b-v0-1-tp2-general",
    "20260218-141024-mixtral-8x7b-v0-1-tp2-roleplay",
)
"""Training runs: the replayable runs of inference-sim/training that the sim-to-real table does
not score (Llama-2-7B TP1, Llama-2-70B TP4 and, since mixture of experts is modelled (calibration
version 2), Mixtral-8x7B TP2; 13 load stages; Mixtral reasoning is overloaded and not replayed).
Everything the peers are scored on (Llama-2-7B codegen and reasoning-lite, Llama-3.1-70B,
Mistral-Nemo, Qwen2.5-7B, Yi-34B, Llama-4-Scout FP8) is held out, so the held-out error also
measures transfer to unseen architectures, a second MoE family, FP8 and batching limits."""

FIT_METRICS: tuple[str, ...] = ("ttft_mean", "ttft_p90", "itl_mean", "e2e_mean", "e2e_p90")
"""Metrics in the fit residuals: means and p90s. The p99s are left out because in these runs they
are set by events outside the steady state that a cut replay leaves out by design: the first
round of prompts on a cold prefix cache and the server's warm-up in the first stage (the 70B
runs' E2E jumps from p95 to p99 by 30 % in stage 0 and by 2 % in stage 1), and queueing bursts
near saturation. ``kvsched validate`` scores all seven metrics on full replays."""



TAIL_FIT_STAGES: tuple[tuple[str, int], ...] = (
    ("20260217-203421-llama-2-70b-hf-tp4-codegen", 1),
    ("20260218-120914-mixtral-8x7b-v0-1-tp2-codegen", 1),
)
"""Training load stages the tail is fitted on: those of :data:`DEFAULT_TRAIN` whose upper TTFT
quantiles measure the steady state of the engine and its front end. A stage is left out when

- its top percent is the first, cold round of the 100 prompts: every stage 0 (2 % of its
  requests; a 70B prefill of ~600 tokens adds 40-50 ms there, and vLLM runs those prefills
  without CUDA graphs), so p99 and p99.9 measure the cold prefills, which the replay models;
- it queues: Llama-2-70B general stage 1 (measured p90 250 ms against a 68 ms median);
- its client counted fewer than 95 % of the tokens vLLM generated (``successes.output_len``
  against ``output_len`` with ``ignore_eos``): every Llama-2-7B stage (76-85 %, against 99 % for
  every other model). There the first text reaches the client steps after the first token for a
  run-specific share of requests (leading tokens that decode to no text; fidelity.md, "TTFT p99:
  what was examined"), a tail of the model's streamed text, not of the engine or the front end.
  A first fit that kept the Llama-2-7B stages (0 and general 1) chose σ 0.15 and 4 % of requests
  delayed by 7 ms on average: it carried that tail to every model (held-out TTFT p99 MAPE 13.9 ->
  13.7 %, Mistral-Nemo and Yi-34B stage 1 over-predicted by 15-25 %).

Two stages remain: Llama-2-70B codegen stage 1 (1,200 s x 10 req/s; measured p95 / p99 / p99.9
65.5 / 67.7 / 82.2 ms) and, since Mixtral joined the training runs, Mixtral-8x7B codegen stage 1
(p90 / p99 / p99.9 64.5 / 68.1 / 73.1 ms; its client counted 98.6 % of the tokens; Mixtral general
stage 1 queues: p90 98.8 ms against a 63.7 ms median). The fit is thin; what it can say is that
the steady tail of an unqueued vLLM is small (about 1 % of requests, a few ms), not what sets
the held-out p99 errors."""

TAIL_FIT_QUANTILES: tuple[str, ...] = ("p95", "p99", "p99.9")
"""TTFT quantiles (stage-JSON keys) in the tail residuals."""

TAIL_GRID: dict[str, tuple[float, ...]] = {
    "step_time_sigma": (0.0, 0.05, 0.1),
    "front_end_hiccup_probability": (0.003, 0.01, 0.03),
    "front_end_hiccup_mean_s": (0.004, 0.007, 0.015),
}
"""Grid the tail fit searches (27 points): σ of the per-step lognormal factor (0-10 % step-to-step
variation; 0 is its natural bound), the share of requests whose hand-off to the engine is delayed
(0.3-3 %) and the mean of that delay (4-15 ms). The engine hiccup fields (``hiccup_probability``,
``hiccup_mean_s``) stay at the base's values (0): an engine-wide stall delays every streaming
request's next chunk, and the measured chunk gaps' p99.9 sits only 3-13 ms above their p99 in the
steady training stages, which bounds such stalls to about one step in 1,000 (on the first,
Llama-2-7B-inclusive stage set a grid over engine hiccups alone reached a TTFT rms of 0.049 at one
step in 125 with 12-ms stalls, which would put the chunk gaps' p99.9 ~25 ms above p99). A grid, not a
gradient fit: with a few seeds the replayed upper quantiles are step-like in these parameters."""


def tail_residuals(exps: Sequence[Experiment], results_by_seed: Sequence[Sequence],
                   stages: Sequence[tuple[str, int]] = TAIL_FIT_STAGES,
                   quantiles: Sequence[str] = TAIL_FIT_QUANTILES) -> np.ndarray:
    """``log(predicted / measured)`` of the TTFT ``quantiles`` of every stage of ``stages``,
    the prediction being the mean over seeds (``results_by_seed[k][i]``: seed k, experiment i).
    A stage's residuals are those of the quantiles both its stage JSON and the replay give
    (:func:`tail_quantiles`); a stage with none of them adds none.

    Raises:
        ConfigError: no stage publishes any of ``quantiles``.
    """
    idx = {e.exp_id: i for i, e in enumerate(exps)}
    scored = tail_quantiles(exps, stages, quantiles)
    out = []
    for exp_id, k in stages:
        i = idx[exp_id]
        meas = next(s for s in exps[i].stages if s.stage == k).ttft_quantiles_ms or {}
        for q in scored[(exp_id, k)]:
            pred = float(np.mean([res[i].ttft_quantiles_ms[k][q] for res in results_by_seed]))
            out.append(math.log(pred / meas[q]) if pred > 0 else float("nan"))
    return np.asarray(out, dtype=np.float64)


def tail_quantiles(exps: Sequence[Experiment], stages: Sequence[tuple[str, int]] = TAIL_FIT_STAGES,
                   quantiles: Sequence[str] = TAIL_FIT_QUANTILES) -> dict[tuple[str, int], tuple[str, ...]]:
    """Per (exp_id, stage) of ``stages``: the TTFT quantiles of ``quantiles`` that its stage JSON
    publishes and a replay reports (:data:`~kvsched.experiments.replay.TTFT_QUANTILES`), in
    ``quantiles`` order; empty for a stage that publishes none of them.

    Raises:
        ConfigError: no stage publishes any of them (nothing to fit), or a stage index the
            experiment does not have.
    """
    from .replay import TTFT_QUANTILES

    replayed = {key for key, _ in TTFT_QUANTILES}
    by_id = {e.exp_id: e for e in exps}
    out: dict[tuple[str, int], tuple[str, ...]] = {}
    for exp_id, k in stages:
        by_stage = {s.stage: s for s in by_id[exp_id].stages}
        if k not in by_stage:
            raise ConfigError(f"tail fit: {bounded_repr(exp_id)} has no stage {bounded_repr(k)}; "
                              f"expected one of {sorted(by_stage)}")
        meas = by_stage[k].ttft_quantiles_ms or {}
        out[(exp_id, k)] = tuple(q for q in quantiles if q in meas and q in replayed)
    if not any(out.values()):
        raise ConfigError(f"tail fit: no stage of {bounded_repr([f'{e} stage {k}' for e, k in stages], 300)} "
                          f"publishes any of the TTFT quantiles {', '.join(quantiles)} (no TTFT quantiles to fit); "
                          "expected stage JSONs with successes.latency.time_to_first_token quantiles")
    return out


@dataclasses.dataclass(frozen=True)
class TailFit:
    """Outcome of :func:`fit_tail`.

    Attributes:
        cost: ``base`` with the best grid point's tail fields.
        rms: root mean square of the best point's residuals (log ratio).
        before_rms: the same for ``base`` as given (its own tail fields, e.g. none).
        grid: one row per grid point: its values (in ``fields`` order) and rms.
        seeds, stage_cap_s: the replays' seeds (0..seeds-1) and stage cap.
        fields: the fitted fields (the grid's keys).
    """

    cost: CostParams
    rms: float
    before_rms: float
    grid: tuple[tuple[float, ...], ...]
    seeds: int
    stage_cap_s: float | None
    fields: tuple[str, ...] = ()


def fit_tail(exps: Sequence[Experiment], base: CostParams, seeds: int = 2, stage_cap_s: float | None = 120.0,
             jobs: int = 2, grid: Mapping[str, Sequence[float]] = TAIL_GRID,
             stages: Sequence[tuple[str, int]] = TAIL_FIT_STAGES,
             progress: Callable[[int, float], None] | None = None) -> TailFit:
    """Fit the tail fields named in ``grid`` (some of :data:`TAIL_FIELDS`) of ``base`` by grid
    search on ``stages``.

    Every grid point is replayed with seeds 0..seeds-1 and the client's measured send jitter;
    the residuals are :func:`tail_residuals` (TTFT p95, p99, p99.9 against the stage JSONs'
    quantiles) and the point of least root-mean-square wins (ties: the first in grid order).
    The other fields of ``base`` are kept.

    Raises:
        ConfigError: a stage's experiment is missing or not replayable, ``seeds`` < 1, or a grid
            field that is not a tail field.
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"fit_tail: seeds={bounded_repr(seeds)}; expected an integer >= 1")
    bad = [k for k in grid if k not in TAIL_FIELDS]
    if bad:
        raise ConfigError(f"fit_tail: grid field {bounded_repr(bad[0])} is not one of {list(TAIL_FIELDS)}")
    by_id = {e.exp_id: e for e in exps}
    ids = list(dict.fromkeys(eid for eid, _ in stages))
    missing = [i for i in ids if i not in by_id or by_id[i].skip_reason]
    if missing:
        raise ConfigError(f"fit_tail: tail-fit experiment {bounded_repr(missing[0])} is missing or not replayable")
    chosen = [by_id[i] for i in ids]
    tail_quantiles(chosen, stages)  # a stage of no TTFT quantiles is refused before any replay
    names = list(grid)
    points = [dict(zip(names, vals)) for vals in itertools.product(*(grid[n] for n in names))]
    rows: list[tuple[float, float, float, float]] = []
    with Objective(chosen, FIT_METRICS, stage_cap_s, jobs, client_jitter=True) as obj:
        def rms_of(cost: CostParams) -> float:
            r = tail_residuals(chosen, [obj.results(cost, seed=k) for k in range(seeds)], stages)
            r = np.where(np.isfinite(r), r, 10.0)
            return float(np.sqrt((r * r).mean()))

        before = rms_of(base)
        best, best_rms = base, math.inf
        for n, pt in enumerate(points, 1):
            cost = dataclasses.replace(base, **pt)
            v = rms_of(cost)
            rows.append((*(float(x) for x in pt.values()), v))
            if progress is not None:
                progress(n, v)
            if v < best_rms:
                best, best_rms = cost, v
    return TailFit(best, best_rms, before, tuple(rows), seeds, stage_cap_s, tuple(names))


def log_residuals(exps: Sequence[Experiment], results: Sequence, metrics: Sequence[str] = FIT_METRICS
                  ) -> np.ndarray:
    """``log(predicted / measured)`` for every experiment, stage and metric, in that order."""
    out = []
    for e, r in zip(exps, results):
        for s in e.stages:
            p = r.stages_ms[s.stage]
            for m in metrics:
                pred, meas = p[m], s.values_ms[m]
                out.append(math.log(pred / meas) if pred > 0 and math.isfinite(pred) else float("nan"))
    return np.asarray(out, dtype=np.float64)


# worker state of the process pool (set once per process by the initializer)
_WORKER: dict = {}


def _init_worker(exps: Sequence[Experiment]) -> None:
    _WORKER["exps"] = list(exps)


class ReplayError(RuntimeError):
    """A replay of :class:`Objective` failed (e.g. requests its configuration cannot serve):
    ``exp_id`` names the experiment, ``reason`` says why (the replay's error, without the id).
    A RuntimeError, so callers that catch those (``kvsched validate``) keep working."""

    def __init__(self, exp_id: str, reason: str) -> None:
        super().__init__(exp_id, reason)  # both in args: the error crosses the worker pool by pickling
        self.exp_id, self.reason = exp_id, reason

    def __str__(self) -> str:
        return f"{self.exp_id}: {self.reason}"


def _replay_named(exp: Experiment, cost: CostParams, **kw) -> object:
    """:func:`replay` of ``exp``, its failure (RuntimeError, KvschedError) as a :class:`ReplayError`."""
    from kvsched.envs.sim.errors import KvschedError

    try:
        return replay(exp, cost, **kw)
    except (RuntimeError, KvschedError) as err:
        text = str(err)
        raise ReplayError(exp.exp_id, text.removeprefix(f"{exp.exp_id}: ")) from None


def _replay_one(args: tuple) -> object:
    idx, cost_fields, stage_cap_s, seed, client_jitter, cost_gpu = args
    return _replay_named(_WORKER["exps"][idx], CostParams(**cost_fields), stage_cap_s=stage_cap_s, seed=seed,
                         client_jitter=client_jitter, cost_gpu=cost_gpu)


class Objective:
    """Residuals of a CostParams candidate over a set of experiments (callable, deterministic).

    Args:
        exps: replayable experiments.
        metrics: metrics in the residuals.
        stage_cap_s: cut every stage to this many seconds (None: full length).
        jobs: worker processes (1: replay in this process).
        client_jitter: replay with the client's measured send lateness
            (:func:`~kvsched.experiments.replay.replay`).
        cost_gpu: the GPU preset the candidates are for (the runs on it, or on a GPU that takes
            its calibration, are priced with them: :func:`~kvsched.experiments.replay.replay`).
    """

    def __init__(self, exps: Sequence[Experiment], metrics: Sequence[str] = FIT_METRICS,
                 stage_cap_s: float | None = 120.0, jobs: int = 1,
                 client_jitter: bool = False, cost_gpu: str = CALIBRATED_GPU) -> None:
        self.client_jitter = bool(client_jitter)
        self.cost_gpu = cost_gpu
        self.exps = list(exps)
        self.metrics = tuple(metrics)
        self.stage_cap_s = stage_cap_s
        self.jobs = max(1, int(jobs))
        self.calls = 0
        self._pool = None
        if self.jobs > 1 and len(self.exps) > 1:
            ctx = mp.get_context("spawn")
            self._pool = ctx.Pool(min(self.jobs, len(self.exps)), initializer=_init_worker,
                                  initargs=(self.exps,))  # the experiments as read (models included)

    def results(self, cost: CostParams, seed: int = 0) -> list:
        """The replay results of every experiment for ``cost`` with replay seed ``seed``.

        Raises:
            ReplayError: a replay failed, naming its experiment.
        """
        self.calls += 1
        fields = dataclasses.asdict(cost)
        if self._pool is None:
            return [_replay_named(e, cost, stage_cap_s=self.stage_cap_s, seed=seed, client_jitter=self.client_jitter,
                                  cost_gpu=self.cost_gpu) for e in self.exps]
        # longest first: better packing on few workers
        order = sorted(range(len(self.exps)), key=lambda i: -self.exps[i].workload.num_requests)
        args = [(i, fields, self.stage_cap_s, seed, self.client_jitter, self.cost_gpu) for i in order]
        res = self._pool.map(_replay_one, args, chunksize=1)
        out: list = [None] * len(self.exps)
        for i, r in zip(order, res):
            out[i] = r
        return out

    def __call__(self, cost: CostParams) -> np.ndarray:
        return log_residuals(self.exps, self.results(cost), self.metrics)

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "Objective":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def calibrate(exps: Sequence[Experiment], train: Sequence[str], gpu: str = "H100-SXM",
              base: CostParams | None = None, params: Sequence[FitParam] = DEFAULT_FIT_PARAMS,
              stage_cap_s: float | None = 120.0, max_nfev: int = 12, jobs: int = 2,
              version: int = 1,
              progress: Callable[[int, float], None] | None = None,
              x0: Mapping[str, float] | None = None,
              diff_step: float = 0.02) -> tuple[CalibrationFile, FitResult]:
    """Fit ``params`` on the ``train`` experiments and return the calibration file content.

    Args:
        exps: all experiments (only those named in ``train`` are used).
        train: experiment ids to fit on.
        gpu: the GPU preset being calibrated; every training run must be on it.
        base: starting / fixed CostParams (default: :data:`DEFAULT_FIT_BASE`, the literature
            defaults with the ring's latency in its per-step term).
        params: fields to fit.
        stage_cap_s: stage length cap of the replays in the fit.
        max_nfev: scipy's evaluation cap (see :func:`fit_cost_params`).
        jobs: worker processes.
        version: calibration version to write.
        progress: called after every objective evaluation with (evaluation number, loss).
        x0: starting values of some fitted fields (default: ``base``'s values).
        diff_step: relative finite-difference step in log space (see :func:`fit_cost_params`;
            default 0.02). Stages of few requests make the objective step-like in the
            parameters; a larger step (e.g. 0.05) sees through those steps at the price of a
            coarser gradient.

    Raises:
        ConfigError: an unknown or non-replayable training id, or a run on another GPU.
    """
    from kvsched.envs.sim.specs import get_gpu

    from kvsched.envs.sim.errors import UnknownPresetError

    from .replay import gpu_preset_of, instance_spec_for

    def ran_on(e: Experiment) -> str:
        try:
            return gpu_preset_of(e.hardware)
        except UnknownPresetError:
            return e.hardware

    gpu = get_gpu(gpu).name  # an alias names the preset the runs are on and the file calibrates
    by_id = {e.exp_id: e for e in exps}
    twice = [t for t, n in Counter(train).items() if n > 1]
    if twice:
        raise ConfigError(f"calibrate: training experiment {bounded_repr(twice[0])} is given more than once; "
                          "expected each --train id once (a repeated run would weigh twice in the fit)")
    missing = [t for t in train if t not in by_id]
    if missing:
        raise ConfigError(f"calibrate: unknown training experiment(s) {bounded_repr(missing, 300)}; "
                          f"known: {bounded_repr(sorted(by_id), 300)}")
    chosen = [by_id[t] for t in train]
    bad = [e.exp_id for e in chosen if e.skip_reason]
    if bad:
        reasons = "; ".join(str(by_id[b].skip_reason) for b in bad[:3])
        raise ConfigError(f"calibrate: training experiment(s) {bounded_repr(bad, 300)} cannot be replayed: "
                          + bounded_repr(reasons, 600)[1:-1])
    other = [e.exp_id for e in chosen if ran_on(e) != gpu]
    if other:
        raise ConfigError(f"calibrate: experiment(s) {bounded_repr(other, 300)} did not run on {bounded_repr(gpu)}: "
                          f"expected training runs on {gpu} (--train), or --operator-profiles DIR to fit a GPU "
                          "without vLLM runs from its measured operator times "
                          "(docs/fidelity.md#gpus-other-than-the-h100)")
    if isinstance(diff_step, bool) or not (isinstance(diff_step, (int, float)) and 0.0 < diff_step < 1.0):
        raise ConfigError(f"calibrate: diff_step={bounded_repr(diff_step)}; expected a number in (0, 1)")
    base = base or DEFAULT_FIT_BASE
    for e in chosen:  # a served system that cannot be built fails here, naming its run (as validate skips it)
        try:
            instance_spec_for(e, base, cost_gpu=gpu)
        except (ConfigError, UnknownPresetError) as err:
            raise ConfigError(f"calibrate: training experiment {bounded_repr(e.exp_id)} cannot be replayed: its "
                              f"served system cannot be built: {bounded_repr(str(err), 300)[1:-1]}; expected "
                              "replayable runs (--train; kvsched validate lists the skipped ones)") from None
    params, unconstrained = _constrained(params, chosen)
    t0 = time.perf_counter()
    try:
        with Objective(chosen, FIT_METRICS, stage_cap_s, jobs, cost_gpu=gpu) as obj:
            def fn(cost: CostParams) -> np.ndarray:
                r = obj(cost)
                if progress is not None:
                    rr = np.where(np.isfinite(r), r, 10.0)
                    progress(obj.calls, 0.5 * float(rr @ rr))
                return r

            fit = fit_cost_params(fn, base, params, max_nfev=max_nfev, x0=x0, diff_step=diff_step)
    except ReplayError as err:
        raise ConfigError(f"calibrate: training experiment {bounded_repr(err.exp_id)} cannot be replayed: "
                          f"{bounded_repr(err.reason, 300)[1:-1]}; expected runs every request of which the "
                          "replayed configuration serves (--train; kvsched validate lists the skipped ones)") from None
    wall = time.perf_counter() - t0
    cal = CalibrationFile(
        gpu=gpu, version=version, cost=fit.cost, fitted=tuple(p.name for p in params), train=tuple(train),
        objective=(f"soft-L1 (f_scale 0.1) least squares on log(predicted/measured) of {', '.join(FIT_METRICS)} "
                   f"per load stage; stages cut to {stage_cap_s} s"),
        loss=fit.loss, n_residuals=int(fit.residuals.size), n_evaluations=fit.n_evaluations,
        wall_s=round(wall, 1), kvsched_version=kvsched.__version__,
        notes=(f"scipy.optimize.least_squares: {fit.message}",
               "bounds: " + ", ".join(f"{p.name} [{p.lo:g}, {p.hi:g}]" for p in params),
               f"allreduce_algorithm: {base.allreduce_algorithm}",
               *([f"{_NOT_FITTED_NOTE}: {', '.join(unconstrained)} (no training run has TP > 1, so no residual "
                  "depends on them); kept at the base values"] if unconstrained else []),
               "fixed at literature defaults: " + ", ".join(
                   f.name for f in dataclasses.fields(CostParams)
                   if f.name not in {p.name for p in params} and f.name != "allreduce_algorithm"))
        + _config_model_notes(chosen))
    return cal, fit


ALLREDUCE_FIT_FIELDS: tuple[str, ...] = ("allreduce_bw_efficiency", "allreduce_hop_latency_s", "allreduce_latency_s")
"""CostParams fields that price the TP all-reduce: only runs with TP > 1 constrain them."""

_NOT_FITTED_NOTE = "not fitted"


def _constrained(params: Sequence[FitParam], chosen: Sequence[Experiment]
                 ) -> tuple[list[FitParam], tuple[str, ...]]:
    """``params`` without the all-reduce fields when no training run has TP > 1 (no residual
    depends on them: the fit would leave them at their start and call them fitted), and the names
    left out.

    Raises:
        ConfigError: every field of ``params`` is left out (nothing to fit).
    """
    if any(e.tp > 1 for e in chosen):
        return list(params), ()
    kept = [p for p in params if p.name not in ALLREDUCE_FIT_FIELDS]
    dropped = tuple(p.name for p in params if p.name in ALLREDUCE_FIT_FIELDS)
    if not kept:
        raise ConfigError(f"calibrate: the fitted fields {bounded_repr([p.name for p in params], 300)} all price the "
                          "TP all-reduce and no training run has TP > 1; expected a training run with TP > 1")
    return kept, dropped


def _config_model_notes(chosen: Sequence[Experiment]) -> tuple[str, ...]:
    """A note naming the model and the config.json (``--model-configs``) of every training run
    whose model is no preset, so the fit can be reproduced; none when every model is a preset."""
    from kvsched.envs.sim.hf_config import HF_CONFIG_SOURCE

    read = [f"{e.exp_id}: {e.model.name} ({e.model.source})" for e in chosen
            if e.model is not None and e.model.source.startswith(HF_CONFIG_SOURCE)]
    return (f"models read from a Hugging Face config.json (--model-configs): {'; '.join(read)}",) if read else ()


# ------------------------------------------------------------------------------------------------
# command line


def add_arguments(p) -> None:
    """Arguments of ``kvsched calibrate`` (an argparse sub-parser)."""
    from pathlib import Path

    from .cli_types import count, integer, number

    p.add_argument("--groundtruth", help="ground-truth directory (default: $KVSCHED_GROUNDTRUTH or "
                                         "../shared/groundtruth)")
    p.add_argument("--model-configs", type=Path, metavar="DIR",
                   help="Hugging Face config.json of models that are no preset, as DIR/<model>/config.json (the "
                        "layout of inference-sim's model_configs/; <model> is the id's repo name, as given or "
                        "lower-cased) (default: the ground truth's model_configs/ when it has one)")
    p.add_argument("--gpu", default="H100-SXM", help="GPU preset to calibrate (default H100-SXM)")
    p.add_argument("--train", nargs="+", metavar="EXP_ID", help="training experiment ids, each once (default: the "
                   "replayable inference-sim/training runs the sim-to-real table does not score)")
    p.add_argument("--coarse-cap-s", type=number(0, True), default=COARSE_CAP_S,
                   help=f"stage length of the coarse fit, s (default {COARSE_CAP_S:g})")
    p.add_argument("--coarse-nfev", type=count, default=COARSE_NFEV,
                   help=f"scipy max_nfev of the coarse fit (default {COARSE_NFEV})")
    p.add_argument("--fine-cap-s", type=number(0, True), default=FINE_CAP_S,
                   help=f"stage length of the fine fit, s (default {FINE_CAP_S:g})")
    p.add_argument("--fine-nfev", type=integer(0), default=FINE_NFEV,
                   help=f"scipy max_nfev of the fine fit, 0 = skip (default {FINE_NFEV})")
    p.add_argument("--diff-step", type=number(0, True), default=0.02,
                   help="relative finite-difference step of the fit in log space (default 0.02; larger "
                        "sees through the step-like objective of short stages)")
    p.add_argument("--jobs", type=count, default=2, help="worker processes (default 2)")
    p.add_argument("--allreduce-algorithm", choices=ALLREDUCE_ALGORITHMS, default="ring",
                   help="TP all-reduce price to fit under (CostParams.allreduce_algorithm): ring (every "
                        "all-reduce an α-β ring) or vllm (vLLM's one-shot/two-shot custom all-reduce below 8 MiB, "
                        "NCCL above) (default ring)")
    p.add_argument("--version", type=count, default=1, help="calibration version to write (default 1)")
    p.add_argument("--out", type=Path, help="output file (default: the shipped calibration of the GPU, "
                                            "envs/sim/calibration/<GPU>.json)")
    p.add_argument("--tail-only", action="store_true",
                   help="fit only the stochastic tail (step_time_sigma, front_end_hiccup_probability, "
                        "front_end_hiccup_mean_s) on top of the existing calibration file --out and store it in the "
                        "file's tail_params (kvsched validate --tail applies it; a full calibration keeps it)")
    p.add_argument("--operator-profiles", type=Path, metavar="DIR",
                   help="fit the GPU's kernel-side parameters (mfu_max, mfu_half_tokens, mbu) to measured operator "
                        "times in Vidur's layout (compute/<device>/<org>/<model>/mlp.csv, attention.csv, "
                        "network/<node>/all_reduce.csv) instead of replaying vLLM runs; every other field comes "
                        "from --host-from's calibration")
    p.add_argument("--host-from", default="H100-SXM", metavar="GPU",
                   help="with --operator-profiles: the GPU whose shipped calibration lends the host-side, "
                        "front-end and all-reduce fields (default H100-SXM)")
    p.add_argument("--tail-seeds", type=count, default=2, help="replay seeds per tail grid point (default 2)")
    p.add_argument("--tail-cap-s", type=number(0, True), default=TAIL_CAP_S,
                   help=f"stage length of the tail fit's replays, s (default {TAIL_CAP_S:g})")


FIT_START = {"allreduce_bw_efficiency": 0.5, "first_chunk_delay_tokens": 1.0, "allreduce_hop_latency_s": 2.5e-6,
             "seq_overhead_s": 5e-6}
"""Starting values of the coarse fit where the literature default sits on a bound (1.0 and 0.0):
the middle of the link-efficiency range, the one token gap the runs' TTFT suggests, a ring step
of 2.5 µs (a TP4 all-reduce of ~15 µs, NCCL's small-message order on NVLink) and 5 µs of host
time per sequence."""

TAIL_CAP_S = 120.0
"""Stage length of the tail fit's replays: ~1,000 requests per 8-req/s stage, so the replayed
p99.9 rests on about one request per seed (2 seeds per grid point by default)."""

COARSE_CAP_S, COARSE_NFEV = 30.0, 8
FINE_CAP_S, FINE_NFEV = 60.0, 2
"""Coarse-to-fine schedule: a coarse fit on 30-s stages (~2 s per objective evaluation on 2
cores) from the literature defaults, then a short fine fit on 60-s stages from its result."""


def cmd_calibrate(a, console) -> int:
    """Run ``kvsched calibrate`` (see the module docstring); returns the exit code."""
    from pathlib import Path

    from kvsched.envs.sim.calibration import calibration_path

    from .groundtruth import find_groundtruth
    from .outputs import file_name

    # the default output is named after --gpu: a name with a path in it must not write elsewhere
    from kvsched.envs.sim.calibration import load_calibration
    from kvsched.envs.sim.specs import get_gpu

    # an alias (a100, h100) calibrates its preset, in the file default_cost_params reads
    a.gpu = get_gpu(file_name(a.gpu, "--gpu")).name
    out = Path(a.out) if a.out else calibration_path(a.gpu)
    if a.operator_profiles is not None:
        if a.tail_only:
            raise ConfigError("--tail-only with --operator-profiles is not allowed: the tail is fitted on vLLM runs; "
                              "give one of them")
        return _cmd_operator_profiles(a, console, out)
    existing = None
    if out.is_file():
        try:
            existing = load_calibration(out)
        except ConfigError as e:
            if a.tail_only:
                raise
            console.print(f"note: the calibration being replaced does not load ({e}); no fitted tail is kept",
                          highlight=False, markup=False)
    if a.tail_only:
        if existing is None:
            raise ConfigError(f"--tail-only: no calibration file {bounded_repr(str(out), MAX_PATH_CHARS)} to fit "
                              "the tail on; run a full calibration first")
        if existing.gpu != CALIBRATED_GPU:
            raise ConfigError(f"--tail-only on {bounded_repr(str(out), MAX_PATH_CHARS)} is not allowed: it calibrates "
                              f"{bounded_repr(existing.gpu)}, and the tail is fitted on vLLM runs on {CALIBRATED_GPU}; "
                              f"expected a {CALIBRATED_GPU} calibration file (--gpu {CALIBRATED_GPU} or --out)")
    gt = str(find_groundtruth(a.groundtruth))
    exps = load_experiments(gt, a.model_configs)
    if a.tail_only:
        assert existing is not None  # checked above
        return _cmd_tail_only(a, console, existing, exps, gt, out)
    base = CostParams()
    train = tuple(a.train) if a.train else DEFAULT_TRAIN
    console.print(f"calibrating {a.gpu} on {len(train)} experiments from {gt}: " + ", ".join(train),
                  highlight=False, markup=False)
    t0 = time.perf_counter()

    def progress(i: int, loss: float) -> None:
        console.print(f"  evaluation {i:3d}: 0.5·Σ r² = {loss:.4f}  ({time.perf_counter() - t0:.0f} s)",
                      highlight=False, markup=False)

    console.print(f"coarse fit: stages cut to {a.coarse_cap_s:g} s, max_nfev {a.coarse_nfev}",
                  highlight=False, markup=False)
    fit_base = dataclasses.replace(DEFAULT_FIT_BASE, allreduce_algorithm=a.allreduce_algorithm)
    console.print(f"all-reduce algorithm: {a.allreduce_algorithm}", highlight=False, markup=False)
    cal, fit = calibrate(exps, train, a.gpu, fit_base, DEFAULT_FIT_PARAMS, a.coarse_cap_s, a.coarse_nfev,
                         a.jobs, a.version, progress, x0=FIT_START, diff_step=a.diff_step)
    n_eval = fit.n_evaluations
    if a.fine_nfev > 0:
        console.print(f"fine fit: stages cut to {a.fine_cap_s:g} s, max_nfev {a.fine_nfev}",
                      highlight=False, markup=False)
        cal, fit = calibrate(exps, train, a.gpu, cal.cost, DEFAULT_FIT_PARAMS, a.fine_cap_s, a.fine_nfev,
                             a.jobs, a.version, progress, diff_step=a.diff_step)
        n_eval += fit.n_evaluations
    wall = time.perf_counter() - t0
    for line in cal.notes:
        if line.startswith(_NOT_FITTED_NOTE):
            console.print(f"note: {line}", highlight=False, markup=False)
    if existing is not None and existing.tail_params:  # the fitted tail stays (refit it with --tail-only)
        cal = dataclasses.replace(cal, tail_params=existing.tail_params,
                                  notes=cal.notes + tuple(n for n in existing.notes if n.startswith(_TAIL_NOTE)))
    cal = dataclasses.replace(
        cal, n_evaluations=n_eval, wall_s=round(wall, 1),
        objective=cal.objective.replace(f"stages cut to {a.fine_cap_s if a.fine_nfev > 0 else a.coarse_cap_s} s",
                                        f"coarse fit on stages cut to {a.coarse_cap_s:g} s (max_nfev "
                                        f"{a.coarse_nfev}), then fine fit on {a.fine_cap_s:g} s (max_nfev "
                                        f"{a.fine_nfev})"))
    _save_and_show(console, cal, out, f"calibrated CostParams for {a.gpu} (version {cal.version})",
                   lambda name, value: "fitted" if name in cal.fitted else (
                       "--allreduce-algorithm" if isinstance(value, str) else "literature default"))
    console.print(f"{n_eval} objective evaluations, loss {cal.loss:.4f}, {wall:.0f} s wall; wrote {out}",
                  highlight=False, markup=False)
    return 0


_TAIL_NOTE = "tail fit"


def _save_and_show(console, cal: CalibrationFile, out, title: str, how: Callable[[str, object], str]) -> None:
    """Write ``cal`` to ``out`` (its folder made if missing) and print its CostParams as a table
    with a "how" column ``how(field name, value)``."""
    from rich.table import Table

    from kvsched.envs.sim.calibration import save_calibration

    out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(cal, out)
    table = Table(title=title)
    table.add_column("parameter")
    table.add_column("value", justify="right")
    table.add_column("how")
    for f in dataclasses.fields(CostParams):
        value = getattr(cal.cost, f.name)
        table.add_row(f.name, value if isinstance(value, str) else f"{value:.6g}", how(f.name, value))
    console.print(table)


def _cmd_operator_profiles(a, console, out) -> int:
    """``kvsched calibrate --operator-profiles DIR``: :func:`~.operator_profiles.fit_operator_profiles`
    on the GPU ``--gpu`` with the other fields of ``--host-from``'s shipped calibration; writes ``out``."""
    import os

    from kvsched.envs.sim.calibration import calibrated_cost_params
    from kvsched.envs.sim.specs import get_gpu

    from .operator_profiles import KERNEL_FIT_PARAMS, check_device, fit_operator_profiles, load_operator_profiles

    gpu = get_gpu(a.gpu)
    profiles = load_operator_profiles(a.operator_profiles)
    check_device(profiles, gpu)  # before --host-from's checks: the default --gpu is the H100-SXM
    host_gpu = get_gpu(a.host_from).name
    host = calibrated_cost_params(host_gpu)
    if host is None:
        raise ConfigError(f"--host-from {bounded_repr(a.host_from)} is not allowed: kvsched ships no calibration for "
                          f"{host_gpu}; expected a GPU with a calibration file (H100-SXM)")
    if host_gpu == gpu.name:
        raise ConfigError(f"--host-from {bounded_repr(a.host_from)} is not allowed: it is the GPU being calibrated "
                          f"({gpu.name}); expected another GPU whose calibration was fitted on vLLM runs")
    host = dataclasses.replace(host, **{f: getattr(CostParams(), f) for f in TAIL_FIELDS})
    t0 = time.perf_counter()
    console.print(f"calibrating {gpu.name} on operator profiles of {profiles.model.name} ({profiles.device}): "
                  + ", ".join(os.path.relpath(s, a.operator_profiles) for s in profiles.sources),
                  highlight=False, markup=False)
    fit = fit_operator_profiles(profiles, gpu, host,
                                progress=lambda line: console.print("  " + line, highlight=False, markup=False))
    wall = time.perf_counter() - t0
    kernel_names = tuple(p.name for p in KERNEL_FIT_PARAMS)
    notes = [f"kernel fields fitted to {profiles.model.name} operator times measured on {profiles.device} "
             f"(Vidur profiles); MAPE % per group: "
             + ", ".join(f"{k} {v:.1f}" for k, v in fit.group_mape.items() if not k.startswith("all-reduce")),
             f"every other field from the shipped {host_gpu} calibration (host side, front end, TP all-reduce; "
             "no tail)"]
    if fit.allreduce is not None:
        notes.append("NCCL ring fit of the network profile, not applied (vLLM runs its custom all-reduce below "
                     "8 MiB): " + ", ".join(f"{k} {v:.4g}" for k, v in fit.allreduce.values.items()) + "; MAPE % "
                     + ", ".join(f"{k} {v:.1f}" for k, v in fit.group_mape.items() if k.startswith("all-reduce")))
    notes += [f"skipped {line}"[:300] for line in fit.skipped]
    cal = CalibrationFile(
        gpu=gpu.name, version=a.version, cost=fit.cost, fitted=kernel_names,
        train=tuple(os.path.relpath(s, a.operator_profiles) for s in profiles.sources),
        objective="least squares on log(predicted/measured) kernel time of steps composed from operator profiles "
                  "(embedding + layers x operators, + attention), each group weighted 1/sqrt(rows)",
        loss=fit.kernel.loss, n_residuals=int(fit.kernel.residuals.size), n_evaluations=fit.kernel.n_evaluations,
        wall_s=round(wall, 1), kvsched_version=kvsched.__version__, notes=tuple(notes))
    _save_and_show(console, cal, out, f"CostParams for {gpu.name} (version {cal.version}) from operator profiles",
                   lambda name, value: "fitted" if name in kernel_names else f"{host_gpu} calibration")
    for k, v in fit.group_mape.items():
        console.print(f"  {k}: MAPE {v:.1f} %" + (" (of the NCCL ring fit, not applied: the all-reduce fields above "
                                                  f"are {host_gpu}'s)" if k.startswith("all-reduce") else ""),
                      highlight=False, markup=False)
    for line in fit.skipped:
        console.print(f"  skipped {line}"[:300], highlight=False, markup=False)
    console.print(f"loss {cal.loss:.4g}, {wall:.0f} s wall; wrote {out}", highlight=False, markup=False)
    return 0


def _cmd_tail_only(a, console, existing: CalibrationFile, exps: Sequence[Experiment], gt: str, out) -> int:
    """``kvsched calibrate --tail-only``: :func:`fit_tail` on ``existing`` and rewrite ``out``."""
    from kvsched.envs.sim.calibration import save_calibration

    if a.tail_cap_s is not None and not (math.isfinite(a.tail_cap_s) and a.tail_cap_s > 0):
        raise ConfigError(f"--tail-cap-s={bounded_repr(a.tail_cap_s)}; expected a number > 0")
    t0 = time.perf_counter()
    console.print(f"tail fit on {len(TAIL_FIT_STAGES)} training stages, {a.tail_seeds} seeds, stages cut to "
                  f"{a.tail_cap_s:g} s, {int(np.prod([len(v) for v in TAIL_GRID.values()]))} grid points",
                  highlight=False, markup=False)

    def progress(i: int, rms: float) -> None:
        console.print(f"  grid point {i:3d}: rms log error {rms:.4f}  ({time.perf_counter() - t0:.0f} s)",
                      highlight=False, markup=False)

    by_id = {e.exp_id: e for e in exps}
    usable = [by_id[i] for i in dict.fromkeys(i for i, _ in TAIL_FIT_STAGES) if i in by_id]
    scored = tail_quantiles(usable, [st for st in TAIL_FIT_STAGES if st[0] in by_id]) if usable else {}
    partial = {st: qs for st, qs in scored.items() if qs != TAIL_FIT_QUANTILES}
    for (e, k), qs in partial.items():
        console.print(f"note: {e} stage {k} publishes " + (f"only the TTFT quantiles {', '.join(qs)} of "
                      if qs else "none of the TTFT quantiles ") + f"{', '.join(TAIL_FIT_QUANTILES)}; "
                      + ("only those are scored" if qs else "the stage is left out of the tail fit"),
                      highlight=False, markup=False)
    try:
        tf = fit_tail(exps, existing.cost, a.tail_seeds, a.tail_cap_s, a.jobs, progress=progress)  # tail off
    except ReplayError as err:
        raise ConfigError(f"--tail-only: tail-fit experiment {bounded_repr(err.exp_id)} cannot be replayed: "
                          f"{bounded_repr(err.reason, 300)[1:-1]}") from None
    note = (f"{_TAIL_NOTE}: grid search over {', '.join(f'{k} {list(v)}' for k, v in TAIL_GRID.items())}; "
            f"rms of log(pred/meas) of TTFT {', '.join(TAIL_FIT_QUANTILES)} on "
            + ", ".join(f"{e} stage {k}" + (f" ({', '.join(partial[(e, k)]) or 'none published: left out'})"
                                            if (e, k) in partial else "") for e, k in TAIL_FIT_STAGES)
            + f"; {tf.seeds} seeds, stages cut to {tf.stage_cap_s:g} s, client send jitter replayed; "
            f"rms {tf.before_rms:.4f} -> {tf.rms:.4f}")
    notes = tuple(n for n in existing.notes if not n.startswith(_TAIL_NOTE))
    cal = dataclasses.replace(existing, tail_params={f: getattr(tf.cost, f) for f in tf.fields}, notes=notes + (note,))
    save_calibration(cal, out)
    console.print(" ".join(f"{f} = {getattr(tf.cost, f):.6g}" for f in tf.fields)
                  + f"; rms log error {tf.before_rms:.4f} -> {tf.rms:.4f}; "
                  f"{time.perf_counter() - t0:.0f} s wall; wrote {out}", highlight=False, markup=False)
    return 0
