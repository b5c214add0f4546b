"""Seeded step-time noise: the engine-side part of the latency tail.

A real vLLM engine does not repeat a step of the same batch in the same time: kernel timings,
the CPU side of the step (scheduling, input preparation, sampling, the output hand-off to the
API server) and the host interfere, and now and then the engine-core process stalls for a few
tens of ms (a Python garbage collection of the generation holding the request objects, a burst of
detokenisation and streaming work in the same process group, a page fault). kvsched's step
times are otherwise a deterministic roofline (:mod:`.cost_model`), so with inference-perf's
fixed send interval its TTFT distribution ends almost where its p95 does, while the measured
ones carry a tail: p99 2-8 ms above p95 and p99.9 15-35 ms above p99 in the steady stages of
the training runs (``shared/groundtruth/training_default_args``, stage JSONs).

Per step, with ``t`` the roofline step time (:class:`~.cost_params.CostParams` fields):

```
t' = t · exp(σ·z − σ²/2) + H          z ~ N(0, 1)                   (σ = step_time_sigma)
H  = hiccup_mean_s · E  with probability hiccup_probability, else 0   E ~ Exp(1)
```

The multiplicative factor is lognormal with mean 1 (the mean step time is unchanged, so the
means of a calibrated model move only through queueing); the hiccup is a rare additive stall of
exponential length. Both are drawn once per step -- never per token -- so cost grows with steps.

**Determinism.** Every draw comes from this module's own ``numpy.random.Generator`` (PCG64)
seeded from ``numpy.random.SeedSequence(seed, spawn_key=(instance_id, STREAM))``: the simulation
seed (``Cluster(seed=...)``, ``simulate(seed=...)``) and the instance index, nothing global and no
wall clock. Draws are consumed in step order, one (z, u, E) triple per timed step; the same seed
gives the same step times byte for byte, and an instance whose noise is off draws nothing.

**Fast-forward.** A fast-forwarded stretch (:mod:`.fast_forward`) times K identical decode steps
with one vectorised call and a cumulative sum, bounds the steps that reach the next arrival by
assuming step times never decrease, and may run through completions or fold the step before
it. Noise breaks that monotonicity and would have to be threaded through every stretch planner
(plain, through completions, folded, PNM) with per-step draws indexed by step number. With noise
on, :class:`~.instance.Instance` therefore steps one by one (``fast_forward`` off): the results
are those fast-forward would give by construction (it is byte-identical to stepping), and for
the open-loop replays of ``kvsched validate`` the speed is about the same (their stretches are
short: an arrival every 50-200 ms ends them).
"""

from __future__ import annotations

import numpy as np

from .cost_params import CostParams

__all__ = ["FRONT_END_STREAM", "STREAM", "StepNoise", "front_end_hiccups_s", "step_noise_for"]

STREAM = 0x7A11
"""Spawn-key tag of the step-noise stream (keeps it apart from any other seeded stream)."""

FRONT_END_STREAM = 0x7A12
"""Spawn-key tag of the front-end hiccup stream."""

_BLOCK = 1024
"""Draws generated at once (three arrays of this length per refill)."""


class StepNoise:
    """Per-step multiplicative noise and rare hiccups of one instance (see the module docstring).

    Args:
        cost: the instance's cost parameters (``step_time_sigma``, ``hiccup_probability``,
            ``hiccup_mean_s``).
        seed: the simulation seed, an integer >= 0.
        instance_id: the instance's index in its cluster, >= 0.

    Attributes:
        steps: timed steps so far (draws consumed).
        hiccups: steps that drew a hiccup.
    """

    def __init__(self, cost: CostParams, seed: int, instance_id: int) -> None:
        self.sigma = float(cost.step_time_sigma)
        self.p = float(cost.hiccup_probability)
        self.mean_s = float(cost.hiccup_mean_s)
        self._rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(instance_id), STREAM)))
        self._mult: list[float] = []
        self._extra: list[float] = []
        self._i = 0
        self.steps = 0
        self.hiccups = 0

    def _refill(self) -> None:
        rng = self._rng
        z = rng.standard_normal(_BLOCK)
        u = rng.random(_BLOCK)
        e = rng.standard_exponential(_BLOCK)
        s = self.sigma
        self._mult = np.exp(s * z - 0.5 * s * s).tolist()
        self._extra = np.where(u < self.p, self.mean_s * e, 0.0).tolist()
        self._i = 0

    def apply(self, dt: float) -> float:
        """The noisy time (s) of a step whose roofline time is ``dt`` s (one draw)."""
        i = self._i
        if i >= len(self._mult):
            self._refill()
            i = 0
        self._i = i + 1
        self.steps += 1
        extra = self._extra[i]
        if extra > 0.0:
            self.hiccups += 1
        return dt * self._mult[i] + extra


def front_end_hiccups_s(cost: CostParams, seed: int, n_requests: int) -> np.ndarray | None:
    """Per-request extra front-end delay (s) of ``n_requests`` requests in workload order, or
    None when ``cost`` draws none (:attr:`CostParams.front_end_noise_on`).

    Request ``i`` is delayed by ``front_end_hiccup_mean_s · E_i`` with probability
    ``front_end_hiccup_probability`` (E_i ~ Exp(1)), else 0: an API-server stall that only the
    request being handled sees. Unlike an engine hiccup (:class:`StepNoise`) it leaves the
    streams of running requests alone, which is what the measured chunk gaps show (their p99.9
    sits 4-13 ms above p99 in the steady stages, while TTFT's sits 15-35 ms above). Drawn at once
    from ``numpy.random.SeedSequence(seed, spawn_key=(FRONT_END_STREAM,))``: uniforms, then
    exponentials, one of each per request.
    """
    if not cost.front_end_noise_on:
        return None
    rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(FRONT_END_STREAM,)))
    u = rng.random(n_requests)
    e = rng.standard_exponential(n_requests)
    return np.where(u < float(cost.front_end_hiccup_probability), float(cost.front_end_hiccup_mean_s) * e, 0.0)


def step_noise_for(cost: CostParams, seed: int, instance_id: int) -> StepNoise | None:
    """A :class:`StepNoise` when ``cost`` turns noise on (:attr:`CostParams.step_noise_on`),
    else None (the deterministic step times of the roofline, drawing nothing)."""
    return StepNoise(cost, seed, instance_id) if cost.step_noise_on else None
