"""Replay a measured vLLM experiment in kvsched and score it against the measurement.

:func:`instance_spec_for` turns an :class:`~kvsched.experiments.groundtruth.Experiment` into the
served system (groundtruth README "Replaying", step 1): the model preset, H100-SXM, TP,
``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len`` when logged, 16-token blocks,
chunked prefill and prefix caching on, vLLM V1's prefix-cache eviction order
(``cache_decode_blocks``: a finished request's output blocks stay cached and age in one LRU free
queue with the prompts, so long outputs evict round-robin prompts from a small cache), and the
vLLM-logged ``total_kv_blocks`` as the HBM KV capacity when known, else derived from memory as
vLLM does (``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``: requested memory =
``gpu_memory_utilization`` x device memory, minus weights, peak activations and non-torch memory,
divided by the per-rank block bytes in ``vllm/v1/core/kv_cache_utils.py``; kvsched's
:meth:`~kvsched.envs.sim.instance_spec.InstanceSpec.num_hbm_blocks` with the run's
``gpu_memory_utilization``), so utilisation 0.95 holds more blocks than 0.9 and preempts less.

**CPU KV offload** (``cpu_offload``; vLLM ``--kv-offloading-size`` -> ``OffloadingConnector``,
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``): a host-DRAM tier of
``kv_offloading_size`` GiB when the run logs it (the engine's whole buffer, split over its TP ranks
as vLLM does: ``vllm/config/cache.py``, ``vllm/v1/kv_offload/cpu/spec.py``), else ``cpu_kv_blocks``
blocks (when logged; else :data:`~kvsched.experiments.groundtruth.DEFAULT_CPU_OFFLOAD_GIB_PER_RANK`
per rank) caching
prefixes (:class:`~kvsched.envs.sim.prefix_offload.PrefixOffloadSpec`): every full prompt block a
request computes or hits in HBM that the CPU store lacks is stored to CPU over PCIe asynchronously
(``offload_prompt_only``, vLLM's default; ``write_hbm_hits``: the connector's ``prepare_store``),
and a request whose prefix is found in CPU beyond its HBM hit always loads it (the connector's
``get_num_new_matched_tokens`` reports every CPU hit, ``load_policy="always"``) and waits for the
load before its prefill, instead of recomputing; and a step whose allocations reuse HBM blocks
whose store has not landed waits for it (``fence_pending_writes``: the connector's
``jobs_to_flush``, waited for by the worker before the forward pass). **Data parallelism** (``dp`` > 1):
``dp`` copies of the instance behind vLLM's DP load balancer, which sends each request to the engine with the
fewest waiting + running requests (``vllm/v1/engine/core_client.py``, kvsched's ``least-loaded``
router with the KV term off). **GPU**: :data:`GPU_OF_HARDWARE`; ``cost`` applies to runs on
``cost_gpu`` (the calibrated GPU), runs on other GPUs use that GPU's default cost parameters
(:func:`~kvsched.envs.sim.calibration.default_cost_params`: literature defaults where kvsched ships
no calibration, :func:`cost_source` says which).

:func:`replay` generates the inference-perf workload (step 2), simulates it and returns the
per-stage metrics in ms (step 3) with the measurement's definitions: TTFT and E2E from the
client's send time (``arrival_s``) -- kvsched adds the front-end overheads of
:class:`~kvsched.envs.sim.specs.CostParams` -- mean, p90 and p99 (``numpy.percentile``,
linear interpolation), and ``itl_mean = (E2E_mean − TTFT_mean) / (n − 1)`` with ``n`` the
measurement's client-counted mean output length (see :mod:`kvsched.experiments.groundtruth`).

**Seeds and the client's jitter.** ``seed`` seeds the workload generator and the simulation
(the step-time noise of :mod:`kvsched.envs.sim.step_noise`, when the cost parameters turn it
on). With ``client_jitter`` every request is sent late by a draw from inference-perf's measured
``schedule_delay`` distribution of its stage (:func:`send_delays_s`), so arrivals are no longer
exactly periodic; TTFT and E2E are still timed from the actual send, as the client times them.

``stage_cap_s`` shortens every stage to its first ``stage_cap_s`` seconds after an unscored
warm-up (calibration uses this to stay fast; the steady state of these open-loop runs is
reached within a few request lifetimes once the prefix cache holds every prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from kvsched.runner.simulate import simulate
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig, generate, stage_of

from .groundtruth import METRICS, QUANTILE_KEYS, Experiment

__all__ = ["CALIBRATED_GPU", "GPU_OF_HARDWARE", "POOLED_SCHEDULE_DELAY_MS", "TTFT_QUANTILES", "ReplayResult",
           "ape", "cost_source", "gpu_preset_of", "instance_spec_for", "replay", "send_delays_s",
           "workload_config"]

TTFT_QUANTILES: tuple[tuple[str, float], ...] = (
    ("p1", 1.0), ("p10", 10.0), ("median", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p99.9", 99.9))
"""TTFT quantiles a replay reports per stage (stage-JSON key, percent), for the tail fit."""

QUANTILE_LEVELS: tuple[float, ...] = (0.0, 0.001, 0.01, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 0.999, 1.0)
"""Cumulative probability of each of :data:`~kvsched.experiments.groundtruth.QUANTILE_KEYS`."""

POOLED_SCHEDULE_DELAY_MS: dict[str, float] = {
    "min": -1.203, "p0.1": -1.03, "p1": -0.771, "p5": -0.448, "p10": -0.259, "p25": 0.062, "median": 0.44,
    "p75": 0.82, "p90": 1.153, "p95": 1.346, "p99": 1.714, "p99.9": 2.805, "max": 6.862}
"""inference-perf's send lateness (ms) where a run does not publish its own: the median, per
quantile, of ``load_summary.schedule_delay`` over the 18 published stage JSONs of
``training_default_args`` (negative: sent up to ~1 ms early). Every stage's distribution is close
to it (p99 1.6-1.9 ms, max 2.9-21 ms)."""

GPU_OF_HARDWARE = {"H100": "H100-SXM", "A100-80GB": "A100-80GB", "A100-80": "A100-80GB", "A100-SXM": "A100-80GB",
                   "L40S": "L40S"}
"""GT ``hardware`` -> kvsched GPU preset. The sim-to-real csv names H100 | A100-80GB | L40S (groundtruth
README §2); BLIS's ``hardware_config.json`` names A100-SXM / A100-80 (one 80 GB SXM part) and L40S.
Other names go to :func:`~kvsched.envs.sim.specs.get_gpu` as they are (its aliases)."""

CALIBRATED_GPU = "H100-SXM"
"""The GPU whose cost parameters ``kvsched calibrate`` fits (every published run is on it)."""


def gpu_preset_of(hardware: str) -> str:
    """The kvsched GPU preset name of a ground-truth ``hardware`` value.

    Raises:
        UnknownPresetError: no preset of that name or alias.
    """
    return get_gpu(GPU_OF_HARDWARE.get(hardware, hardware)).name


def cost_source(exp: Experiment, cost_gpu: str = CALIBRATED_GPU) -> str:
    """Which cost parameters a replay of ``exp`` uses: ``"given"`` (its GPU is ``cost_gpu`` or has
    no calibration of its own and shares ``cost_gpu``'s chip,
    :data:`~kvsched.envs.sim.calibration.SAME_CHIP`), ``"calibration"`` (kvsched ships a
    calibration for its GPU), ``"same-chip calibration"`` (that of the GPU it shares a chip with) or
    ``"host terms transferred"`` (literature defaults for the GPU-side fields, the host-side ones of
    the reference GPU's calibration: :func:`~kvsched.envs.sim.calibration.default_cost_params`).

    Raises:
        UnknownPresetError: the run's hardware has no GPU preset.
    """
    from kvsched.envs.sim.calibration import default_cost_origin

    gpu = gpu_preset_of(exp.hardware)
    if _takes_given_cost(gpu, cost_gpu):
        return "given"
    kind, _ = default_cost_origin(gpu)
    return {"calibration": "calibration", "same chip": "same-chip calibration"}.get(kind, "host terms transferred")


def _takes_given_cost(gpu: str, cost_gpu: str) -> bool:
    """A cost given for ``cost_gpu`` applies to runs on ``gpu`` (the same preset, or one without a
    calibration of its own that shares its chip)."""
    from kvsched.envs.sim.calibration import SAME_CHIP, calibrated_cost_params

    target = get_gpu(cost_gpu).name
    return gpu == target or (SAME_CHIP.get(gpu) == target and calibrated_cost_params(gpu) is None)


@dataclass(frozen=True)
class ReplayResult:
    """Predicted metrics of one replay.

    Attributes:
        exp_id: the experiment.
        stages_ms: stage index -> metric (:data:`METRICS`) -> predicted ms.
        n_requests: stage index -> requests scored.
        per_token_itl_ms: stage index -> kvsched's own (E2E−TTFT)/(output_len−1) mean, ms.
        ttft_quantiles_ms: stage index -> :data:`TTFT_QUANTILES` key -> predicted TTFT ms.
    """

    exp_id: str
    stages_ms: Mapping[int, Mapping[str, float]]
    n_requests: Mapping[int, int]
    per_token_itl_ms: Mapping[int, float]
    ttft_quantiles_ms: Mapping[int, Mapping[str, float]] = field(default_factory=dict)


def instance_spec_for(exp: Experiment, cost: CostParams | None = None,
                      cost_gpu: str = CALIBRATED_GPU) -> InstanceSpec:
    """The :class:`InstanceSpec` of one of ``exp``'s ``dp`` replicas (see the module docstring).

    Args:
        exp: a replayable experiment (``skip_reason is None``).
        cost: cost parameters for runs on ``cost_gpu``; None, or a run on another GPU = that
            GPU's default (its calibration file when kvsched ships one, else literature defaults).
        cost_gpu: the GPU ``cost`` was calibrated for.

    Raises:
        ConfigError: the experiment cannot be replayed (its skip reason) or an invalid spec
            (e.g. weights that do not fit in ``gpu_memory_utilization`` of the GPU).
        UnknownPresetError: the run's hardware has no GPU preset.
    """
    from kvsched.envs.sim.errors import ConfigError
    from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
    from kvsched.envs.sim.hardware import GiB

    from .groundtruth import DEFAULT_CPU_OFFLOAD_GIB_PER_RANK

    if exp.skip_reason:
        raise ConfigError(f"experiment {exp.exp_id} cannot be replayed: {exp.skip_reason}")
    gpu = get_gpu(gpu_preset_of(exp.hardware))
    kw: dict = dict(model=exp.model if exp.model is not None else get_model(exp.preset), gpu=gpu, tp=exp.tp,
                    max_num_batched_tokens=exp.max_num_batched_tokens, max_num_seqs=exp.max_num_seqs,
                    max_model_len=exp.max_model_len, hbm_kv_blocks=exp.total_kv_blocks,
                    gpu_memory_utilization=exp.gpu_memory_utilization,
                    enable_chunked_prefill=exp.enable_chunked_prefill,
                    enable_prefix_caching=exp.enable_prefix_caching, cache_decode_blocks=True,
                    block_size_tokens=exp.block_size, kv_dtype=exp.kv_cache_dtype, weight_dtype=exp.weight_dtype)
    if cost is not None and _takes_given_cost(gpu.name, cost_gpu):
        kw["cost"] = cost
    spec = InstanceSpec(**kw)
    if exp.cpu_offload:
        if exp.kv_offloading_gib is not None:
            # vLLM: --kv-offloading-size is the whole engine's buffer (cpu_bytes_to_use = size x 2**30,
            # vllm/config/vllm.py _post_init_kv_transfer_config; "the total buffer size summed across all TP
            # ranks", vllm/config/cache.py), and one CPU block holds every rank's share of a GPU block
            # (worker_kv_bytes_per_block x world_size, vllm/v1/kv_offload/cpu/spec.py; vLLM 0.32 wheel).
            # Its page alignment (4 KiB) is below a block's bytes and ignored.
            block_bytes = spec.kv_bytes_per_block_per_gpu * exp.tp
            cpu_blocks = int(exp.kv_offloading_gib * GiB // block_bytes)
            if cpu_blocks < 1:
                raise ConfigError(f"experiment {exp.exp_id}: kv_offloading_size={exp.kv_offloading_gib:g} GiB holds "
                                  f"no KV block of {block_bytes:.0f} bytes (all {exp.tp} TP ranks); expected at "
                                  f"least {block_bytes / GiB:.4g} GiB")
        else:
            cpu_blocks = (exp.cpu_kv_blocks if exp.cpu_kv_blocks
                               else int(DEFAULT_CPU_OFFLOAD_GIB_PER_RANK * GiB // spec.kv_bytes_per_block_per_gpu))
        spec = spec.with_overrides(dram_kv_bytes=cpu_blocks * spec.kv_bytes_per_block,
                                   prefix_offload=PrefixOffloadSpec(tiers=("dram",), write_policy="write_through",
                                                                    offload_prompt_only=True, load_policy="always",
                                                                    fence_pending_writes=True, write_hbm_hits=True))
    return spec


def workload_config(exp: Experiment, stage_cap_s: float | None = None) -> tuple[SharedPrefixConfig, int]:
    """The experiment's workload and the number of leading warm-up stages not to score.

    With ``stage_cap_s`` every stage is cut to that many seconds and a warm-up stage at the first
    stage's rate is prepended, long enough to send every distinct prompt once plus 2 s: in a
    full run the prefix cache is cold for the first round of prompts only (about 2 % of the
    first stage), in a cut stage it would be most of it.
    """
    cfg = exp.workload
    if stage_cap_s is None:
        return cfg, 0
    first = cfg.stages[0]
    warm = LoadStage(first.rate_per_s, cfg.num_users / first.rate_per_s + 2.0)
    stages = (warm,) + tuple(LoadStage(s.rate_per_s, min(s.duration_s, float(stage_cap_s))) for s in cfg.stages)
    return replace(cfg, stages=stages), 1


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def send_delays_s(exp: Experiment, stage: np.ndarray, seed: int) -> np.ndarray:
    """Per-request send lateness (s) drawn from the measured ``schedule_delay`` of its stage.

    The inverse CDF is the piecewise-linear interpolation of the published quantiles
    (:data:`~kvsched.experiments.groundtruth.QUANTILE_KEYS` at :data:`QUANTILE_LEVELS`); a stage
    without them (csv-only runs) uses :data:`POOLED_SCHEDULE_DELAY_MS`, a warm-up stage (index -1)
    its first stage's. Uniforms come from ``numpy.random.default_rng([seed, 0x5E4D])``.

    Args:
        exp: the experiment.
        stage: measured-stage index of every request (-1: an unscored warm-up stage).
        seed: the replay seed.
    """
    u = np.random.default_rng([int(seed), 0x5E4D]).random(len(stage))
    out = np.empty(len(stage), dtype=np.float64)
    by_stage = {s.stage: s.schedule_delay_ms for s in exp.stages}
    levels = np.asarray(QUANTILE_LEVELS)
    for k in np.unique(stage):
        q = by_stage.get(max(int(k), 0)) or POOLED_SCHEDULE_DELAY_MS
        values = np.asarray([q[key] for key in QUANTILE_KEYS]) * 1e-3
        m = stage == k
        out[m] = np.interp(u[m], levels, values)
    return out


def replay(exp: Experiment, cost: CostParams | None = None, stage_cap_s: float | None = None,
           seed: int = 0, client_jitter: bool = False, cost_gpu: str = CALIBRATED_GPU) -> ReplayResult:
    """Simulate ``exp`` and compute its per-stage metrics (ms).

    Args:
        exp: a replayable experiment.
        cost: cost parameters for runs on ``cost_gpu`` (None, or a run on another GPU: that GPU's
            default, :func:`instance_spec_for`).
        stage_cap_s: cut every stage to this many seconds (None: full length).
        seed: workload seed (group permutation, re-tokenisation noise, hashes) and simulation
            seed (step-time noise when ``cost`` turns it on).
        client_jitter: send each request late by a draw from its stage's measured
            ``schedule_delay`` (:func:`send_delays_s`); arrivals stay in send order (a request
            is never sent before the one scheduled ahead of it) and at or after 0.
        cost_gpu: the GPU preset (or alias) ``cost`` is for; ``kvsched calibrate --gpu`` fits it.

    Raises:
        ConfigError: the experiment cannot be replayed.
        RuntimeError: requests were rejected (a replay must serve every request).
    """
    spec = instance_spec_for(exp, cost, cost_gpu=cost_gpu)
    cfg, skip = workload_config(exp, stage_cap_s)
    wl = generate(cfg, seed=seed)
    scheduled = wl.arrival_s
    if client_jitter:
        late = wl.arrival_s + send_delays_s(exp, stage_of(cfg, wl.arrival_s) - skip, seed)
        wl = wl.with_arrivals(np.maximum.accumulate(np.maximum(late, 0.0)),
                              "client send lateness from the measured schedule_delay (kvsched.experiments.replay)")
    if exp.dp > 1:  # vLLM's DP load balancer: fewest waiting + running requests
        res = simulate(wl, spec, "fcfs", MetricsConfig(), InstanceOptions(), n_instances=exp.dp,
                       router="least-loaded", router_params={"queue_weight": 1.0, "kv_weight": 0.0}, seed=seed)
    else:
        res = simulate(wl, spec, "fcfs", MetricsConfig(), InstanceOptions(), seed=seed)
    rec = res.records
    if (rec["status"] != "finished").any():
        bad = rec[rec["status"] != "finished"]
        raise RuntimeError(f"{exp.exp_id}: {len(bad)} requests were not served "
                           f"({bad['reject_reason'].value_counts().to_dict()})")
    arrival = rec["arrival_s"].to_numpy()
    ttft = (rec["first_token_s"].to_numpy() - arrival) * 1e3
    e2e = (rec["finish_s"].to_numpy() - arrival) * 1e3
    out_tokens = rec["output_tokens"].to_numpy()
    # a request belongs to the stage it was scheduled in (request ids are 0..n-1 in schedule order)
    stage = stage_of(cfg, scheduled[rec["request_id"].to_numpy()]) - skip
    stages, counts, per_tok, quant = {}, {}, {}, {}
    meas = {s.stage: s for s in exp.stages}
    for k in range(len(cfg.stages) - skip):
        m = stage == k
        t, e = ttft[m], e2e[m]
        vals = {"ttft_mean": float(t.mean()), "ttft_p90": _pct(t, 90), "ttft_p99": _pct(t, 99),
                "e2e_mean": float(e.mean()), "e2e_p90": _pct(e, 90), "e2e_p99": _pct(e, 99)}
        n_meas = meas[k].output_len_mean if k in meas else float(cfg.output_len)
        vals["itl_mean"] = (vals["e2e_mean"] - vals["ttft_mean"]) / (n_meas - 1.0)
        stages[k] = {name: vals[name] for name in METRICS}
        counts[k] = int(m.sum())
        per_tok[k] = float(((e - t) / np.maximum(out_tokens[m] - 1, 1)).mean())
        quant[k] = {key: _pct(t, q) for key, q in TTFT_QUANTILES}
    return ReplayResult(exp.exp_id, stages, counts, per_tok, quant)


def ape(pred: float, actual: float) -> float:
    """Absolute percentage error ``100·|pred − actual| / actual``."""
    return 100.0 * abs(pred - actual) / actual
