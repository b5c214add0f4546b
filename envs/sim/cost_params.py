"""Cost parameters: the efficiencies and overheads of the roofline step-time model.

The model itself is :mod:`kvsched.envs.sim.cost_model`; a GPU's default parameters come from its
calibration file where kvsched ships one (:func:`kvsched.envs.sim.calibration.default_cost_params`).
Sources: REFERENCE ``shared/design/REFERENCE.md`` §5.2-5.3 and the ground truth, cited per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .allreduce import ALLREDUCE_ALGORITHMS
from .errors import require
from .spec_validation import non_negative, real_in


TAIL_FIELDS: tuple[str, ...] = ("step_time_sigma", "hiccup_probability", "hiccup_mean_s",
                                 "front_end_hiccup_probability", "front_end_hiccup_mean_s")
"""The :class:`CostParams` fields of the stochastic latency tail (:mod:`~.step_noise`); all 0 by
default, which draws nothing."""

FRONT_END_FIELDS: tuple[str, ...] = ("request_overhead_s", "prompt_token_overhead_s", "output_token_overhead_s",
                                     "first_chunk_delay_tokens", "front_end_hiccup_probability",
                                     "front_end_hiccup_mean_s")
"""The :class:`CostParams` fields of the API front end, which every instance of one cluster shares
(:class:`~.cluster.Cluster` refuses instances that disagree on them)."""


@dataclass(frozen=True)
class CostParams:
    """Efficiency parameters of the roofline step-time model (REFERENCE §5.2, §5.3) and the
    front-end overheads a client measures on top of the engine's steps.

    The defaults below are the literature values;
    :func:`~kvsched.envs.sim.calibration.default_cost_params` replaces them by a
    calibration file where one exists for the GPU (``envs/sim/calibration/``, written by
    ``kvsched calibrate``), else takes the host-side fields of the H100's
    (:data:`~kvsched.envs.sim.calibration.HOST_FIELDS`).

    Attributes:
        mfu_max: asymptotic model-FLOPs utilisation, 0 < mfu_max <= 1 (§5.2: ≈ 0.6).
        mfu_half_tokens: tokens in a step at which MFU reaches half of mfu_max, >= 0; the model is
            ``MFU(n) = mfu_max · n / (n + mfu_half_tokens)`` (§5.2: c_half ≈ 64). 0 = constant MFU.
        mbu: memory-bandwidth utilisation, 0 < mbu <= 1 (§5.2: 0.75 for decode).
        step_overhead_s: fixed CPU/launch cost per step, >= 0 (§5.2: 0.5-2 ms with CUDA graphs).
        allreduce_latency_s: fixed latency of one all-reduce under TP, >= 0 (§5.3: ~10 µs).
        allreduce_bw_efficiency: achieved share of ``GPUSpec.nvlink_bytes_per_s`` in the TP
            all-reduces of a step, 0 < η <= 1. Default 1.0 (REFERENCE §5.3 uses the link rate
            as is); NCCL ring all-reduces of the 0.1-10 MB activations of a serving step reach
            well below the link's peak, which a calibration measures.
        request_overhead_s: per-request front-end delay before the engine sees a request, s, >= 0:
            HTTP handling, request validation and hand-off from the API-server process to the
            engine core (vLLM V1 ``AsyncLLM`` -> ZMQ -> ``EngineCore``). Default 10 ms: the
            "10-15 ms of API/queueing per request" of the groundtruth README (replaying, step 4),
            close to the α0 fitted by the inference-sim/training repo (9.3 ms, ``pre_queueing``)
            and BLIS's blackbox α0 for Llama-3.1-8B/H100/vLLM 0.11 (10.3 ms).
        prompt_token_overhead_s: per prompt token of the same delay (tokenisation), s, >= 0.
            Default 4.2 µs: median of the α1 (queueing time per input token) of BLIS's 99 H100
            blackbox coefficient sets (groundtruth ``blis/defaults_blackbox_coeffs_at_90522ded_
            parent.yaml``; inter-quartile range 1.7-8.1 µs).
        output_token_overhead_s: delay between the end of the step that produced a token and
            the client receiving it (engine-core output -> API server detokenisation -> streamed
            chunk), s, >= 0. It shifts the first and last token times (TTFT, E2E), not the gaps
            between tokens: the API server processes outputs while the engine runs the next step.
            Default 45.9 µs: BLIS trained-physics α2 (groundtruth README §3).
        first_chunk_delay_tokens: how many inter-token gaps after its first token a streaming
            client sees its first text, >= 0 (the recorder adds this many of the request's mean
            gaps, ``(finish − first token)/(tokens − 1)``, to its first-token time; E2E is
            unchanged). Default 0 (the client sees the first token at once). The real H100 runs
            need about one gap: their TTFT exceeds front-end delay + wait + prefill by about one
            decode step for every model and TP degree. Streaming detokenisation explains such a
            delay (vLLM's incremental detokeniser sends no text for a token that ends inside a
            multi-byte character, and the runs generate random-token text); a calibration measures it.
        step_time_sigma: σ of the mean-one lognormal factor ``exp(σ·z − σ²/2)``, z ~ N(0, 1), that
            multiplies every step's time, 0 <= σ <= 1 (:mod:`~.step_noise`; step-to-step variation
            of kernel and CPU time). Default 0: deterministic step times.
        hiccup_probability: probability that a step also stalls for an extra exponential delay
            (a host hiccup: engine-core GC pause, detokenisation burst), 0 <= p < 1. Default 0.
        hiccup_mean_s: mean of that extra delay, s, >= 0. Default 0 (no hiccup).
        front_end_hiccup_probability: probability that a request's hand-off to the engine is
            delayed by an extra exponential delay (API-server stall seen by that request only:
            a GC pause or a burst of streaming work while it is tokenised / queued), 0 <= p < 1.
            Default 0.
        front_end_hiccup_mean_s: mean of that extra delay, s, >= 0. Default 0.

    The step fields are drawn per step from a generator seeded by the simulation seed and the
    instance index, the front-end ones per request from one seeded by the simulation seed
    (:mod:`~.step_noise`); with their defaults nothing is drawn and the times are those of the
    roofline and the fixed front end, byte for byte.

        seq_overhead_s: host (CPU) time per scheduled sequence per step, s, >= 0: vLLM V1's engine
            core runs scheduling, input preparation and output processing of every request in the
            batch on the step's critical path (``vllm/v1/core/sched/scheduler.py`` ``schedule`` and
            ``update_from_output`` loop over the scheduled requests; ``vllm/v1/engine/core.py``
            ``step`` runs schedule -> execute_model -> update_from_output in series). Default 0
            (the fixed ``step_overhead_s`` only); the issue #22 residuals put it at ~15-20 µs.
        step_token_overhead_s: host time per token scheduled in a step, s, >= 0 (input-id and
            position preparation, sampling metadata; ``vllm/v1/worker/gpu_model_runner.py``
            ``_prepare_inputs``). Default 0.
        allreduce_hop_latency_s: latency of one step of a ring all-reduce, s, >= 0. A ring over
            ``tp`` GPUs takes ``2(tp−1)`` steps (reduce-scatter then all-gather), so one
            all-reduce costs ``allreduce_latency_s + 2(tp−1)·allreduce_hop_latency_s +
            2(tp−1)/tp · bytes / (nvlink·η)`` (the α-β model of Thakur, Rabenseifner & Gropp,
            "Optimization of collective communication operations in MPICH", IJHPCA 2005).
            Default 0: the latency is the same at every TP degree, as before. Under
            ``allreduce_algorithm = "vllm"`` it is the latency of one sequential stage of any
            all-reduce kernel (a one-shot custom all-reduce has 1, a two-shot 2, a ring 2(tp−1)).
        allreduce_algorithm: how the TP all-reduces are priced, one of ``"ring"`` (default: every
            all-reduce is the ring above, as in calibration versions 1-2) or ``"vllm"``: the kernel
            vLLM picks per message size, one-shot or two-shot custom all-reduce below 8 MiB, NCCL
            (the ring) above (:mod:`~kvsched.envs.sim.allreduce`, which cites vLLM's source).
        moe_efficiency: achieved share of the dense roofline rates (``mfu_max`` x peak FLOP/s and
            ``mbu`` x HBM bandwidth) in the routed-expert kernels of a mixture-of-experts model,
            0 < x <= 1: expert FLOPs and expert weight bytes are divided by it
            (:mod:`~kvsched.envs.sim.cost_model`). Default 1.0 (neutral: the experts run as
            efficiently as a dense MLP); a calibration on MoE runs measures it. Dense models never
            read it.

    The front-end overheads are latencies, not GPU time: the engine is not busy during them
    (:class:`~kvsched.envs.sim.cluster.Cluster` delays arrivals, the recorder shifts token times).

    Raises:
        ConfigError: a value outside the ranges above.
    """

    mfu_max: float = 0.6
    mfu_half_tokens: float = 64.0
    mbu: float = 0.75
    step_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    allreduce_bw_efficiency: float = 1.0
    request_overhead_s: float = 10e-3
    prompt_token_overhead_s: float = 4.2e-6
    output_token_overhead_s: float = 45.9e-6
    first_chunk_delay_tokens: float = 0.0
    seq_overhead_s: float = 0.0
    step_token_overhead_s: float = 0.0
    allreduce_hop_latency_s: float = 0.0
    moe_efficiency: float = 1.0
    allreduce_algorithm: str = "ring"
    step_time_sigma: float = 0.0
    hiccup_probability: float = 0.0
    hiccup_mean_s: float = 0.0
    front_end_hiccup_probability: float = 0.0
    front_end_hiccup_mean_s: float = 0.0

    def __post_init__(self) -> None:
        real_in("CostParams", "mfu_max", self.mfu_max, lambda x: 0 < x <= 1, "a number in (0, 1]")
        non_negative("CostParams", "mfu_half_tokens", self.mfu_half_tokens)
        real_in("CostParams", "mbu", self.mbu, lambda x: 0 < x <= 1, "a number in (0, 1]")
        non_negative("CostParams", "step_overhead_s", self.step_overhead_s)
        non_negative("CostParams", "allreduce_latency_s", self.allreduce_latency_s)
        real_in("CostParams", "allreduce_bw_efficiency", self.allreduce_bw_efficiency, lambda x: 0 < x <= 1,
              "a number in (0, 1]")
        non_negative("CostParams", "request_overhead_s", self.request_overhead_s)
        non_negative("CostParams", "prompt_token_overhead_s", self.prompt_token_overhead_s)
        non_negative("CostParams", "output_token_overhead_s", self.output_token_overhead_s)
        non_negative("CostParams", "first_chunk_delay_tokens", self.first_chunk_delay_tokens)
        non_negative("CostParams", "seq_overhead_s", self.seq_overhead_s)
        non_negative("CostParams", "step_token_overhead_s", self.step_token_overhead_s)
        non_negative("CostParams", "allreduce_hop_latency_s", self.allreduce_hop_latency_s)
        real_in("CostParams", "moe_efficiency", self.moe_efficiency, lambda x: 0 < x <= 1, "a number in (0, 1]")
        require(isinstance(self.allreduce_algorithm, str) and self.allreduce_algorithm in ALLREDUCE_ALGORITHMS,
                "CostParams.allreduce_algorithm", self.allreduce_algorithm, "one of " + ", ".join(ALLREDUCE_ALGORITHMS))
        real_in("CostParams", "step_time_sigma", self.step_time_sigma, lambda x: 0 <= x <= 1, "a number in [0, 1]")
        real_in("CostParams", "hiccup_probability", self.hiccup_probability, lambda x: 0 <= x < 1,
                "a number in [0, 1)")
        non_negative("CostParams", "hiccup_mean_s", self.hiccup_mean_s)
        real_in("CostParams", "front_end_hiccup_probability", self.front_end_hiccup_probability,
                lambda x: 0 <= x < 1, "a number in [0, 1)")
        non_negative("CostParams", "front_end_hiccup_mean_s", self.front_end_hiccup_mean_s)

    @property
    def step_noise_on(self) -> bool:
        """True when the step times are noisy: ``step_time_sigma > 0`` or a hiccup of positive
        probability and mean (:mod:`~.step_noise`)."""
        return self.step_time_sigma > 0 or (self.hiccup_probability > 0 and self.hiccup_mean_s > 0)

    @property
    def front_end_noise_on(self) -> bool:
        """True when requests draw front-end hiccups: ``front_end_hiccup_probability`` and
        ``front_end_hiccup_mean_s`` both > 0 (:func:`~.step_noise.front_end_hiccups_s`)."""
        return self.front_end_hiccup_probability > 0 and self.front_end_hiccup_mean_s > 0

    def server_delay_s(self, prompt_tokens: Any) -> Any:
        """Front-end delay (s) from the client's send to the engine seeing the request:
        ``request_overhead_s + prompt_token_overhead_s · prompt_tokens`` (scalar or array)."""
        return self.request_overhead_s + self.prompt_token_overhead_s * np.asarray(prompt_tokens, dtype=np.float64)
