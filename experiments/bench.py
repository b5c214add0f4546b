"""``kvsched bench``: how fast the simulator serves requests, case by case.

Each case builds a workload and an instance spec, then times :func:`~kvsched.runner.simulate.simulate`
in a **fresh Python subprocess** (``python -m kvsched.experiments.bench CASE``), so that peak
memory is the case's own. Measured per case:

* ``sim_wall_s``: wall seconds of the ``simulate()`` call alone (event loop, records frame,
  summary), :func:`time.perf_counter`. ``requests_per_s`` and ``events_per_s`` divide by it.
* ``load_wall_s``: building or loading the workload; ``process_wall_s``: the whole subprocess
  as the parent sees it (interpreter start, imports, load, simulate, output), and
  ``process_cpu_s`` its CPU seconds (user + system, ``resource.getrusage(RUSAGE_CHILDREN)``
  before and after it).
* ``sim_cpu_s``: CPU seconds of the same call (:func:`time.process_time`) and
  ``requests_per_cpu_s``: less sensitive than wall time to other processes sharing the machine;
  ``load_average_1min`` (:func:`os.getloadavg`) at the end of the case says how busy it was.
* ``events``, ``steps``, ``fast_forward_steps``, ``fast_forward_stretches``, ``folded_steps``, ``preemptions``:
  :attr:`SimulationResult.stats <kvsched.envs.sim.cluster.SimulationResult.stats>`.
* ``peak_rss_mib``: peak resident set size of the case's process, ``resource.getrusage(
  RUSAGE_SELF).ru_maxrss`` (KiB on Linux) / 1024, read after the run. It includes the
  interpreter and imported libraries; ``baseline_rss_mib`` is the same figure read after the
  imports and before the workload is built, so ``peak - baseline`` is what the case added. We
  chose ``ru_maxrss`` over :mod:`tracemalloc` because tracemalloc slows Python allocation
  several-fold (it would distort the timings measured in the same run) and misses memory that
  NumPy and pandas allocate outside the Python allocator's tracing.
* ``result_sha256``: SHA-256 of the run's ``summary.json`` bytes (simulated results only, no
  timings): the same case gives the same hash in every run and process.

Cases (``kvsched bench --list``):

* ``blis-1k``, ``blis-10k``, ``blis-100k``: the BLIS reference workload (fixed 800 prompt +
  400 output tokens, Poisson 10 req/s, Llama-3.1-8B on one H100-SXM) with 1,000 / 10,000 /
  100,000 requests. The figure to beat: BLIS takes about 23 s for 10,000 requests of it on
  these 2-core machines (about 435 req/s; :data:`BLIS_REFERENCE_WALL_S`, quoted, not re-run
  here); the goal is >= 10x that.
* ``azure-conv``: the bundled Azure 2023 conversation trace (19,366 requests) on one H100.
* ``mooncake-1i``, ``mooncake-4i``, ``mooncake-16i``: the bundled Mooncake conversation trace
  (12,031 requests, prefix hashes) on 1, 4 and 16 H100s (round-robin). One H100 is overloaded
  by it (the queue grows over the hour), which makes that case the slowest per request.
* ``long-context-swap``: ``experiments/scenarios/long-context-swap-dram.yaml`` (synthetic
  short traffic + 3 % 16k-120k-token requests on a small KV cache with swap to 64 GiB DRAM):
  preemptions and PCIe tier transfers.
* ``azure-1m-64i`` (opt-in, not in the default set): 1,000,000 requests on 64 H100s. The
  Azure trace is *tiled*: 52 copies, copy ``k`` circularly shifted in time by ``k/52`` of the
  trace's period (so copies do not arrive in lock-step and the hour's rate profile is kept),
  merged by arrival and rate-scaled by 64/52 so that each of the 64 instances sees, under
  round-robin, the mean request rate one H100 sees in the default ``azure-conv`` job
  (~5.4 req/s); then the first 1,000,000 requests are kept (52 x 19,366 = 1,007,032).
* Quick set (``--quick``, CI-sized): ``blis-1k``, ``azure-1k`` (first 1,000 Azure requests),
  ``mooncake-4i-500`` (first 500 Mooncake requests on 4 instances), ``swap-60s`` (the first
  60 s of ``long-context-swap``).
* ``vidur-n<N>-qps<Q>``: Vidur's only runnable offline configuration in kvsched (see
  :func:`vidur_instance_spec`); used by ``--peer vidur``.

``kvsched bench --peer vidur`` runs Microsoft Vidur 0.0.26 (``run.sh`` of the peer folder,
default ``../shared/peers/vidur`` next to the repository (:data:`DEFAULT_VIDUR_DIR`), which
installs Vidur into its own venv) and kvsched on the
same configuration and reports the wall-time and CPU-time ratios (the CPU seconds of each
simulator's processes, ``resource.getrusage(RUSAGE_CHILDREN)`` before and after it) and both
simulators' TTFT / TBT / E2E p50 / p99.

``kvsched bench --envs`` also measures the Gymnasium environments (in one subprocess,
:mod:`kvsched.agents.throughput`): env steps per wall and CPU second with a random agent (and
fcfs / lars heuristic agents in ``Scheduling-v0``), the simulator's CPU microseconds per step
and the environment's own overhead per step (``env.step`` minus the simulator); they go to the
JSON's ``envs`` list. Without ``--envs`` the output says they were not measured.
"""

from __future__ import annotations

from kvsched.envs.sim.errors import bounded_repr, MAX_PATH_CHARS

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from kvsched import atomic_files
from kvsched.experiments import progress as progress_lines

#: Wall seconds BLIS takes for 10,000 requests of the BLIS reference workload on these 2-core
#: machines (figure quoted in issue #8; not re-measured by this module).
BLIS_REFERENCE_WALL_S = 23.0
#: Requests of that BLIS figure.
BLIS_REFERENCE_REQUESTS = 10_000
#: BLIS throughput on its reference workload, requests per wall second (~435).
BLIS_REFERENCE_REQ_PER_S = BLIS_REFERENCE_REQUESTS / BLIS_REFERENCE_WALL_S
#: What the cases table's BLIS column is (printed under it): a ratio to a figure quoted, not run here.
BLIS_COLUMN_NOTE = (f"x quoted BLIS: this run's req/s (per wall and per CPU second of simulate()) over BLIS's "
                    f"{BLIS_REFERENCE_REQUESTS / BLIS_REFERENCE_WALL_S:,.0f} req/s quoted in issue #8 "
                    f"({BLIS_REFERENCE_REQUESTS:,} requests in {BLIS_REFERENCE_WALL_S:g} s wall), not measured in "
                    "this run")
#: Speed-up over BLIS that issue #8 asks for.
GOAL_SPEEDUP = 10.0

#: Default folder of the Vidur peer scripts (``run.sh``, ``summarize.py``): ``shared/peers/vidur``
#: beside the repository checkout (``<repo>/../shared/peers/vidur``); override with
#: ``--peer-dir`` or the ``KVSCHED_VIDUR_DIR`` environment variable.
DEFAULT_VIDUR_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "peers" / "vidur"
#: Vidur release the peer scripts install (PyPI ``vidur``).
VIDUR_VERSION = "0.0.26"

GYM_NOTE = "Gymnasium environment steps/s: not measured in this run (kvsched bench --envs measures them)"
MEMORY_METHOD = ("peak RSS of a fresh subprocess per case: resource.getrusage(RUSAGE_SELF).ru_maxrss "
                 "(includes the interpreter and imports; baseline_rss_mib is the same figure before "
                 "the workload is built)")

#: Keys of every case entry in the JSON output (``cases[i]``), documented in the README.
CASE_KEYS = (
    "case", "description", "group", "requests", "instances", "model", "gpu", "tp", "finished",
    "rejected", "simulated_s", "sim_wall_s", "sim_cpu_s", "load_wall_s", "process_wall_s", "process_cpu_s",
    "requests_per_s", "requests_per_cpu_s", "load_average_1min",
    "events", "events_per_s", "steps", "fast_forward_steps", "fast_forward_stretches", "folded_steps",
    "fast_forward_share", "preemptions", "peak_rss_mib", "baseline_rss_mib", "latency_s",
    "result_sha256", "profiled",
)
#: Top-level keys of the JSON output.
TOP_KEYS = ("kvsched_version", "python", "platform", "cpu_count", "memory_method", "reference",
            "cases", "envs", "not_measured")


# =============================================================================================
# Workloads
# =============================================================================================
def fixed_length_poisson(n: int, rate_per_s: float, prompt_tokens: int, output_tokens: int,
                         seed: int, name: str):
    """``n`` requests with fixed lengths and Poisson arrivals (a columnar ``Workload``).

    Arrivals are the cumulative sum of ``n`` exponential gaps of mean ``1 / rate_per_s``
    seconds drawn from ``numpy.random.default_rng(seed)``; no sessions, no prefix hashes, SLO
    class ``"default"``. (Built here rather than with
    :func:`kvsched.envs.workload.synthetic.generate`, which cannot produce a fixed length:
    ``prompt_sigma=0`` with ``prompt_min_tokens == prompt_max_tokens == median`` is rejected
    because ``exp(log(800)) < 800`` in floating point.)

    Args:
        n: number of requests (>= 1).
        rate_per_s: mean arrival rate, requests per second (> 0).
        prompt_tokens, output_tokens: tokens of every request (>= 1).
        seed: seed of the generator.
        name: workload name (provenance).
    """
    from kvsched.envs.sim.errors import ConfigError
    from kvsched.envs.sim.request import Workload

    for field, v in (("n", n), ("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"fixed_length_poisson {field}={bounded_repr(v)} is not allowed: "
                              "expected an integer >= 1")
    if not (isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ConfigError(f"fixed_length_poisson rate_per_s={bounded_repr(rate_per_s)} is not allowed: expected a "
                          "finite number > 0 (requests per second)")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    desc = (f"fixed prompt {prompt_tokens} + output {output_tokens} tokens, Poisson {rate_per_s:g} req/s, "
            f"{n} requests, seed {seed} (numpy default_rng exponential gaps)")
    return Workload(
        name=name, request_id=np.arange(n, dtype=np.int64), arrival_s=arrival,
        prompt_tokens=np.full(n, prompt_tokens, dtype=np.int64),
        output_tokens=np.full(n, output_tokens, dtype=np.int64),
        session_id=np.full(n, -1, dtype=np.int64), slo_class=np.zeros(n, dtype=np.int16),
        hash_offsets=np.zeros(n + 1, dtype=np.int64), hashes=np.zeros(0, dtype=np.int64),
        source_sha256=hashlib.sha256(desc.encode()).hexdigest(), notes=(desc,))


def tile_workload(w, copies: int):
    """``copies`` time-shifted copies of a trace merged into one workload (for scale tests).

    Copy ``k`` (0-based) has arrivals ``(a - a0 + k * P / copies) mod P`` with ``a0`` the first
    arrival and period ``P = span * n / (n - 1)`` (the span plus one mean gap, so the seam where
    a copy wraps around looks like any other gap). The copies are merged by arrival (stable),
    request ids renumbered ``0..N-1``; session ids of copy ``k`` are offset so copies never
    share a session. The request rate is ``copies`` times the trace's; rate-scale afterwards to
    set the load per instance.

    Raises:
        ConfigError: ``copies`` < 1, fewer than two requests, or a trace with prefix hashes
            (copies would share prefixes that no real client sent).
    """
    from kvsched.envs.sim.errors import ConfigError
    from kvsched.envs.sim.request import Workload

    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ConfigError(f"tile_workload copies={bounded_repr(copies)} is not allowed: expected an integer >= 1")
    n = len(w)
    if n < 2:
        raise ConfigError(f"tile_workload: workload {bounded_repr(w.name)} has {n} requests; expected >= 2")
    if len(w.hashes):
        raise ConfigError(f"tile_workload: workload {bounded_repr(w.name)} has prefix hashes; tiling would make copies "
                          "share prefixes (allowed: traces without hashes, e.g. azure-conv-2023)")
    base = w.arrival_s - w.arrival_s[0]
    span = float(base[-1])
    period = span * n / (n - 1)
    arr = np.concatenate([np.mod(base + k * period / copies, period) for k in range(copies)])
    order = np.argsort(arr, kind="stable")
    sess = w.session_id
    sess_span = int(sess.max()) + 1 if len(sess) and sess.max() >= 0 else 0
    sessions = np.concatenate([np.where(sess >= 0, sess + k * sess_span, -1) for k in range(copies)])
    total = n * copies
    note = (f"tiled x{copies}: copy k shifted by k/{copies} of the period {period:.3f} s (circular), "
            f"merged by arrival: {total:,} requests at {copies}x the trace's rate")
    return Workload(
        name=f"{w.name} x{copies}", request_id=np.arange(total, dtype=np.int64), arrival_s=arr[order],
        prompt_tokens=np.tile(w.prompt_tokens, copies)[order],
        output_tokens=np.tile(w.output_tokens, copies)[order],
        session_id=sessions[order], slo_class=np.tile(w.slo_class, copies)[order],
        hash_offsets=np.zeros(total + 1, dtype=np.int64), hashes=np.zeros(0, dtype=np.int64),
        hash_block_tokens=0, slo_class_names=w.slo_class_names, source_sha256=w.source_sha256,
        notes=w.notes + (note,), priority=np.tile(w.priority, copies)[order], n=np.tile(w.n, copies)[order])


# =============================================================================================
# Cases
# =============================================================================================
@dataclass(frozen=True)
class Prepared:
    """Everything :func:`simulate` needs for one case."""

    workload: Any
    spec: Any
    n_instances: int = 1
    policy: str = "fcfs"
    metrics: Any = None
    oracle_lengths: bool = False
    policy_params: dict | None = None


@dataclass(frozen=True)
class BenchCase:
    """One benchmark case.

    Attributes:
        name: the case name (``--cases``).
        description: one line for the table and JSON.
        group: ``blis``, ``trace``, ``mooncake``, ``long-context``, ``scale`` or ``peer``
            (plot series).
        build: returns the :class:`Prepared` inputs (runs inside the case's subprocess).
        default: part of the default set (``kvsched bench`` without ``--cases``).
        quick: part of ``--quick``.
    """

    name: str
    description: str
    group: str
    build: Callable[[], Prepared]
    default: bool = True
    quick: bool = False


def _h100_8b(**kw):
    from kvsched.envs.sim.specs import instance_spec_from_dict

    return instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "tp": 1, **kw},
                                   source="bench")


def _blis(n: int) -> Callable[[], Prepared]:
    def build() -> Prepared:
        w = fixed_length_poisson(n, 10.0, 800, 400, seed=0, name=f"blis-reference-{n}")
        return Prepared(w, _h100_8b())
    return build


def _trace(name: str, n_instances: int, max_requests: int | None = None) -> Callable[[], Prepared]:
    def build() -> Prepared:
        from kvsched.envs.workload import traces

        w = traces.load_trace(name)
        if max_requests is not None:
            w = traces.head(w, max_requests)
        return Prepared(w, _h100_8b(), n_instances)
    return build


def _scenario_file(stem: str, window_s: tuple[float, float] | None = None) -> Callable[[], Prepared]:
    def build() -> Prepared:
        from kvsched.runner.scenario import load_scenario

        sc = load_scenario(Path(__file__).parent / "scenarios" / f"{stem}.yaml")
        if window_s is not None:
            sc = sc.with_overrides(window_s=window_s)
        return Prepared(sc.workload(), sc.instance_spec(), sc.n_instances, sc.policy, sc.metrics_config(),
                        sc.oracle_lengths, dict(sc.policy_params) or None)
    return build


#: Requests, copies and instances of the scale case.
SCALE_REQUESTS, SCALE_COPIES, SCALE_INSTANCES = 1_000_000, 52, 64


def _azure_scale() -> Prepared:
    from kvsched.envs.workload import traces

    w = tile_workload(traces.load_trace("azure-conv-2023"), SCALE_COPIES)
    w = traces.scale_rate(w, SCALE_INSTANCES / SCALE_COPIES)
    w = traces.head(w, SCALE_REQUESTS)
    return Prepared(w, _h100_8b(), SCALE_INSTANCES)


CASES: dict[str, BenchCase] = {c.name: c for c in (
    BenchCase("blis-1k", "BLIS reference: 800+400 tokens, Poisson 10/s, 1,000 req, 1x H100 8B", "blis",
              _blis(1_000), quick=True),
    BenchCase("blis-10k", "BLIS reference, 10,000 requests", "blis", _blis(10_000)),
    BenchCase("blis-100k", "BLIS reference, 100,000 requests", "blis", _blis(100_000)),
    BenchCase("azure-conv", "Azure 2023 conversation trace (19,366 req), 1x H100 8B", "trace",
              _trace("azure-conv-2023", 1)),
    BenchCase("mooncake-1i", "Mooncake conversation trace (12,031 req), 1x H100 8B (overloaded)", "mooncake",
              _trace("mooncake-conversation", 1)),
    BenchCase("mooncake-4i", "Mooncake conversation trace, 4x H100 8B round-robin", "mooncake",
              _trace("mooncake-conversation", 4)),
    BenchCase("mooncake-16i", "Mooncake conversation trace, 16x H100 8B round-robin", "mooncake",
              _trace("mooncake-conversation", 16)),
    BenchCase("long-context-swap", "long-context-swap-dram.yaml: 3% 16k-120k req, swap to DRAM", "long-context",
              _scenario_file("long-context-swap-dram")),
    BenchCase("azure-1m-64i", "Azure trace tiled x52, rate x64/52, first 1,000,000 req, 64x H100 8B", "scale",
              _azure_scale, default=False),
    BenchCase("azure-1k", "Azure trace, first 1,000 requests, 1x H100 8B", "trace",
              _trace("azure-conv-2023", 1, 1_000), default=False, quick=True),
    BenchCase("mooncake-4i-500", "Mooncake trace, first 500 requests, 4x H100 8B", "mooncake",
              _trace("mooncake-conversation", 4, 500), default=False, quick=True),
    BenchCase("swap-60s", "long-context-swap-dram.yaml, first 60 s", "long-context",
              _scenario_file("long-context-swap-dram", (0.0, 60.0)), default=False, quick=True),
)}

_VIDUR_CASE = re.compile(r"^vidur-n(\d+)-qps(\d+(?:\.\d+)?)$")


# ---------------------------------------------------------------------------------------------
# Vidur's configuration in kvsched
# ---------------------------------------------------------------------------------------------
def vidur_kv_blocks(max_tokens_per_request: int = 4096, block_size: int = 16) -> int:
    """KV blocks Vidur 0.0.26 gives Llama-2-70B on one A100 (80 GB) replica with TP 2.

    Vidur's ``MemoryPlanner.get_max_kv_cache_size_in_tokens`` (vidur/utils/memory_planner.py):
    ``80 GiB * (1 - memory_margin_fraction=0.1)`` minus 2 bytes per *layer* parameter per
    device (``ParamCounter``: attention and gated MLP weights of 80 layers, sharded by TP 2; no
    embeddings or LM head), divided by 2 bytes x K and V x 128 head dims x 4 KV heads per
    device x 80 layers per token. ``BaseReplicaScheduler`` then rounds down to whole requests of
    ``request_generator max_tokens`` (4096): ``num_blocks = (4096 // 16) * (tokens // 4096)``.
    Vidur does not read ``ReplicaConfig.gpu_memory_utilization`` (0.8) anywhere in 0.0.26.

    Returns:
        The block count (3,328 for the defaults).
    """
    d, heads, kv_heads, head_dim, layers, ffn, tp = 8192, 64, 8, 128, 80, 28672, 2
    per_layer = (d * head_dim * (heads // tp + 2 * (kv_heads // tp))   # Wq, Wk, Wv
                 + d * head_dim * (heads // tp)                          # Wo
                 + 3 * d * ffn // tp)                                   # gated MLP
    params = per_layer * layers
    available = 80 * 1024 ** 3 * (1 - 0.1)
    kv_per_token = 2 * 2 * head_dim * (kv_heads // tp) * layers
    tokens = int((available - 2 * params) // kv_per_token)
    return (max_tokens_per_request // block_size) * (tokens // max_tokens_per_request)


def vidur_instance_spec():
    """kvsched's spec for Vidur's configuration (see ``README.md`` in :data:`DEFAULT_VIDUR_DIR`).

    Llama-2-70B on 2x A100-80GB (TP 2), 16-token blocks, Sarathi chunk 512 -> a token budget
    (``max_num_batched_tokens``) of 512 with chunked prefill, batch cap 128 -> ``max_num_seqs``
    128, recompute preemption, prefix caching off (Vidur does not model it; the workload has no
    prefix hashes anyway). KV capacity: Vidur's own block count (:func:`vidur_kv_blocks`) via
    ``hbm_kv_blocks``, and ``gpu_memory_utilization=0.9`` (= Vidur's ``1 -
    memory_margin_fraction``): at the issue's 0.8 kvsched refuses the run, because Llama-2-70B's
    bf16 weights (68.98 GB per GPU with embeddings and LM head) exceed 0.8 x 85.9 GB; Vidur
    runs it because it ignores that setting.
    """
    from kvsched.envs.sim.specs import instance_spec_from_dict

    return instance_spec_from_dict({
        "model": "Llama-2-70B", "gpu": "A100-80GB", "tp": 2, "block_size_tokens": 16,
        "gpu_memory_utilization": 0.9, "hbm_kv_blocks": vidur_kv_blocks(),
        "max_num_batched_tokens": 512, "max_num_seqs": 128, "enable_chunked_prefill": True,
        "enable_prefix_caching": False, "preemption_mode": "recompute"}, source="bench: vidur configuration")


def vidur_case_name(n: int, qps: float) -> str:
    """Case name of kvsched on Vidur's configuration with ``n`` requests at ``qps`` req/s."""
    return f"vidur-n{int(n)}-qps{qps:g}"


def get_case(name: str) -> BenchCase:
    """The case called ``name`` (a registered case or ``vidur-n<N>-qps<Q>``).

    Raises:
        ConfigError: unknown name (the message lists the allowed names).
    """
    from kvsched.envs.sim.errors import ConfigError

    if name in CASES:
        return CASES[name]
    m = _VIDUR_CASE.match(name)
    if m:
        n, qps = int(m.group(1)), float(m.group(2))
        if n < 1 or qps <= 0:
            raise ConfigError(f"bench case {bounded_repr(name)}: N={n} must be >= 1 and QPS={qps:g} > 0")

        def build() -> Prepared:
            w = fixed_length_poisson(n, qps, 1024, 128, seed=42, name=f"vidur-synthetic-{n}-qps{qps:g}")
            return Prepared(w, vidur_instance_spec())
        return BenchCase(name, f"Vidur config: Llama-2-70B 2x A100 TP2, 1024+128 tokens, Poisson {qps:g}/s, "
                               f"{n:,} req", "peer", build, default=False)
    raise ConfigError(f"unknown bench case {bounded_repr(name)}; allowed: {', '.join(CASES)}, or vidur-n<N>-qps<Q> "
                      "(e.g. vidur-n10000-qps1)")


def default_cases() -> list[str]:
    """Names of the default set (``kvsched bench``)."""
    return [n for n, c in CASES.items() if c.default]


def quick_cases() -> list[str]:
    """Names of the quick set (``kvsched bench --quick``)."""
    return [n for n, c in CASES.items() if c.quick]


# =============================================================================================
# Running one case (inside its own process)
# =============================================================================================
def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _quantiles(s) -> dict[str, float | None]:
    s = s.dropna()
    if not len(s):
        return {"p50": None, "p99": None}
    return {"p50": float(s.quantile(0.5)), "p99": float(s.quantile(0.99))}


def latency_quantiles(records) -> dict[str, dict[str, float | None]]:
    """TTFT, TPOT and E2E p50 / p99 in seconds over finished requests (pandas linear quantiles).

    TTFT = first token - arrival, TPOT = (finish - first token) / (generated tokens - 1) (the
    request's mean time between tokens, for requests with >= 2 tokens), E2E = finish - arrival.
    """
    fin = records[records["status"] == "finished"]
    multi = fin[fin["generated_tokens"] > 1]
    return {
        "ttft": _quantiles(fin["first_token_s"] - fin["arrival_s"]),
        "tpot": _quantiles((multi["finish_s"] - multi["first_token_s"]) / (multi["generated_tokens"] - 1)),
        "e2e": _quantiles(fin["finish_s"] - fin["arrival_s"]),
    }


def run_case(name: str, profile_dir: Path | None = None) -> dict:
    """Build and simulate case ``name`` in this process; returns its JSON entry (without
    ``process_wall_s``, which only the parent can measure). Prefer :func:`run_case_subprocess`
    for timings and memory that belong to the case alone."""
    import kvsched  # noqa: F401  (imports counted in the baseline)
    from kvsched.runner.simulate import simulate
    from kvsched.envs.sim.instance import InstanceOptions
    from kvsched.envs.sim.metrics import MetricsConfig, summary_to_json

    case = get_case(name)
    baseline = _rss_mib()
    t0 = time.perf_counter()
    prep = case.build()
    load_s = time.perf_counter() - t0
    options = InstanceOptions(oracle_lengths=prep.oracle_lengths)
    metrics = prep.metrics or MetricsConfig()
    profiler = None
    if profile_dir is not None:
        try:
            from pyinstrument import Profiler
        except ImportError as e:
            from kvsched.envs.sim.errors import KvschedError
            raise KvschedError(f"--profile needs pyinstrument ({e}); pip install -e '.[profile]' in the kvsched "
                               "checkout") from None
        profiler = Profiler(interval=0.001)
        profiler.start()
    n = len(prep.workload)
    t1, c1 = time.perf_counter(), time.process_time()
    step = max(1_000, n // 10)
    marks = {"next": step}

    def progress(done: int) -> None:  # a line per ~10 % on stderr (the parent passes it through)
        if done >= marks["next"] and done < n:
            marks["next"] = (done // step + 1) * step
            sys.stderr.write(f"  {name}: {done:,}/{n:,} requests done, {time.perf_counter() - t1:,.0f} s\n")
            sys.stderr.flush()

    result = simulate(prep.workload, prep.spec, prep.policy, metrics, options, prep.n_instances,
                      progress=progress if n >= 50_000 else None, policy_params=prep.policy_params)
    sim_s, cpu_s = time.perf_counter() - t1, time.process_time() - c1
    if profiler is not None:
        profiler.stop()
        profile_dir.mkdir(parents=True, exist_ok=True)
        atomic_files.write_text(profile_dir / f"{name}.html", profiler.output_html())
        atomic_files.write_text(profile_dir / f"{name}.txt", profiler.output_text(unicode=False, color=False))
    st = result.stats
    summary = result.summary
    counts = summary["classes"]["all"]["counts"]
    return {
        "case": name, "description": case.description, "group": case.group,
        "requests": n, "instances": prep.n_instances,
        "model": prep.spec.model.name, "gpu": prep.spec.gpu.name, "tp": prep.spec.tp,
        "finished": int(counts["finished"]), "rejected": int(counts["rejected"]),
        "simulated_s": float(summary["duration_s"] or 0.0),
        "sim_wall_s": sim_s, "sim_cpu_s": cpu_s, "load_wall_s": load_s, "process_wall_s": None,
        "requests_per_s": n / max(sim_s, 1e-9), "requests_per_cpu_s": n / max(cpu_s, 1e-9),
        "load_average_1min": os.getloadavg()[0],
        "events": int(st["events"]), "events_per_s": st["events"] / max(sim_s, 1e-9),
        "steps": int(st["steps"]), "fast_forward_steps": int(st["fast_forward_steps"]),
        "fast_forward_stretches": int(st["fast_forward_stretches"]),
        "folded_steps": int(st["folded_steps"]),
        "fast_forward_share": st["fast_forward_steps"] / max(1, st["steps"]),
        "preemptions": int(st["preemptions"]),
        "peak_rss_mib": _rss_mib(), "baseline_rss_mib": baseline,
        "latency_s": latency_quantiles(result.records),
        "result_sha256": hashlib.sha256(summary_to_json(summary).encode()).hexdigest(),
        "profiled": profiler is not None,
    }


def run_case_subprocess(name: str, profile_dir: Path | None = None) -> dict:
    """Run case ``name`` in a fresh ``python -m kvsched.experiments.bench`` process.

    The subprocess's error output (progress lines of long cases, errors) goes to this
    process's stderr.

    Raises:
        KvschedError: the subprocess failed.
    """
    from kvsched.envs.sim.errors import KvschedError

    get_case(name)  # unknown names fail here, with the list of allowed names
    cmd = [sys.executable, "-m", "kvsched.experiments.bench", name]
    if profile_dir is not None:
        cmd += ["--profile", str(profile_dir)]
    t0, c0 = time.perf_counter(), children_cpu_s()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - c0
    if proc.returncode != 0:
        raise KvschedError(f"bench case {bounded_repr(name)} failed (exit {proc.returncode}); "
                           "its error output is above")
    entry = json.loads(proc.stdout.strip().splitlines()[-1])
    entry["process_wall_s"] = wall
    entry["process_cpu_s"] = cpu
    return entry


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's terminated and waited-for children and
    their descendants so far (``resource.getrusage(RUSAGE_CHILDREN)``): the difference around a
    :func:`subprocess.run` is that run's CPU time (nothing else may reap children meanwhile)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# =============================================================================================
# Vidur
# =============================================================================================
def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvsched-peers"


def _time_v(log: str) -> tuple[float | None, float | None]:
    """(wall s, max RSS MiB) from ``/usr/bin/time -v`` output."""
    wall = rss = None
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log)
    if m:
        parts = [float(p) for p in m.group(1).split(":")]
        wall = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    if m:
        rss = int(m.group(1)) / 1024.0
    return wall, rss


_VIDUR_LOG_TIME = re.compile(r"^\w+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) simulator\.py:\d+\] (.*)$", re.M)


def _vidur_event_loop_s(log: str) -> float | None:
    """Seconds between Vidur's "Starting simulation" and "Writing output" log lines (its event
    loop alone; the log has 1 s resolution, so +-1 s)."""
    stamps = {}
    for m in _VIDUR_LOG_TIME.finditer(log):
        secs = int(m.group(3)) * 3600 + int(m.group(4)) * 60 + int(m.group(5))
        for key in ("Starting simulation", "Writing output"):
            if m.group(6).startswith(key):
                stamps[key] = secs
    if len(stamps) < 2:
        return None
    return float((stamps["Writing output"] - stamps["Starting simulation"]) % 86400)


def _vidur_num_blocks() -> int | None:
    """KV blocks of the run as Vidur's own ``MemoryPlanner`` computes them (in Vidur's venv), or
    ``None`` if that venv is not usable. Cross-checks :func:`vidur_kv_blocks`."""
    venv = Path(os.environ.get("VIDUR_VENV") or _cache_root() / "vidur-venv")
    code = ("from vidur.config import ReplicaConfig, CacheConfig\n"
            "from vidur.utils.memory_planner import MemoryPlanner\n"
            "rc = ReplicaConfig(model_name='meta-llama/Llama-2-70b-hf', device='a100', network_device='a100_dgx', "
            "tensor_parallel_size=2, num_pipeline_stages=1)\n"
            "t = MemoryPlanner(rc, CacheConfig()).get_max_kv_cache_size_in_tokens()\n"
            "print(int((4096 // 16) * (t // 4096)))\n")
    try:
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        return int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, ValueError, IndexError):
        return None


def run_vidur(n: int, qps: float, peer_dir: Path) -> dict:
    """Run Vidur 0.0.26 (the peer folder's ``run.sh N sarathi QPS``) and read its results.

    ``run.sh`` creates its venv and predictor cache under ``$XDG_CACHE_HOME/kvsched-peers`` on
    first use (about 1 min of pip install and 5 min of random-forest training), then runs
    ``python -m vidur.main`` under ``/usr/bin/time -v``. Reported: the wall time of ``run.sh``
    as measured here (``wall_s``) with its CPU seconds, its children's included (``cpu_s``:
    :func:`children_cpu_s` around it), and as ``time -v`` saw ``vidur.main`` (``vidur_main_wall_s``:
    about 36 s of it rebuild prediction tables before simulating), its event loop alone from the
    log's time stamps (``event_loop_s``, 1 s resolution), peak RSS, the KV blocks Vidur's
    ``MemoryPlanner`` gives the replica (``num_blocks``), and from
    ``request_metrics.csv`` TTFT = ``prefill_e2e_time``, TBT =
    ``decode_time_execution_plus_preemption_normalized`` (the request's mean time between
    tokens), E2E = ``request_e2e_time``, p50 / p99 in seconds (pandas linear quantiles).

    Raises:
        KvschedError: ``run.sh`` is missing or fails (with the tail of its output).
    """
    import pandas as pd

    from kvsched.envs.sim.errors import KvschedError

    run_sh = peer_dir / "run.sh"
    if not run_sh.is_file():
        raise KvschedError(f"--peer vidur: {run_sh} does not exist; give the Vidur peer folder with --peer-dir "
                           "or KVSCHED_VIDUR_DIR")
    out = _cache_root() / "runs" / f"bench_sarathi_{n}_qps{qps:g}"
    env = {**os.environ, "VIDUR_OUT": str(out)}
    t0, c0 = time.perf_counter(), children_cpu_s()
    proc = subprocess.run(["bash", str(run_sh), str(n), "sarathi", f"{qps:g}"], capture_output=True,
                          text=True, env=env)
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - c0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise KvschedError(f"Vidur run (N={n}, QPS={qps:g}) failed (exit {proc.returncode}):\n{tail}")
    log_path = Path(f"{out}.log")
    main_wall, rss = _time_v(log_path.read_text(errors="replace") if log_path.exists() else "")
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    if not runs:
        raise KvschedError(f"Vidur run (N={n}, QPS={qps:g}) wrote no run folder under "
                           f"{bounded_repr(str(out), MAX_PATH_CHARS)}")
    d = pd.read_csv(runs[-1] / "request_metrics.csv")
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    return {
        "version": VIDUR_VERSION, "scheduler": "sarathi", "requests": n, "qps": qps,
        "completed": int(len(d)), "wall_s": wall, "cpu_s": cpu, "vidur_main_wall_s": main_wall,
        "event_loop_s": _vidur_event_loop_s(log), "peak_rss_mib": rss,
        "num_blocks": _vidur_num_blocks(), "run_dir": str(runs[-1]),
        "restarts": int(d["request_num_restarts"].sum()) if "request_num_restarts" in d else None,
        "latency_s": {
            "ttft": _quantiles(d["prefill_e2e_time"]),
            "tpot": _quantiles(d["decode_time_execution_plus_preemption_normalized"]),
            "e2e": _quantiles(d["request_e2e_time"]),
        },
    }


def peer_vidur(n: int, qps_list: Sequence[float], peer_dir: Path, console) -> list[dict]:
    """Vidur and kvsched on the same configuration, one entry per QPS (Vidur first)."""
    rows = []
    for qps in qps_list:
        console.print(f"[dim]Vidur {VIDUR_VERSION}: N={n:,}, QPS={qps:g} (first use installs Vidur and trains "
                      "its predictor: several minutes) ...[/]", highlight=False)
        vid = run_vidur(n, qps, peer_dir)
        console.print("[dim]kvsched on the same configuration ...[/]", highlight=False)
        kv = run_case_subprocess(vidur_case_name(n, qps))
        rows.append({"requests": n, "qps": qps, "vidur": vid, "kvsched": kv,
                     "wall_ratio_vidur_over_kvsched_process": vid["wall_s"] / kv["process_wall_s"],
                     "wall_ratio_vidur_over_kvsched_sim": (vid["event_loop_s"] / kv["sim_wall_s"]
                                                           if vid["event_loop_s"] is not None else None),
                     "cpu_ratio_vidur_over_kvsched_process": (vid["cpu_s"] / kv["process_cpu_s"]
                                                              if kv["process_cpu_s"] > 0 else None),
                     "kvsched_kv_blocks": vidur_kv_blocks()})
    return rows


# =============================================================================================
# Output: table, JSON, plot
# =============================================================================================
def _fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.2f}" if x >= 1 else f"{x:.3f}")


def cases_table(entries: Sequence[dict]):
    """A rich table of case entries."""
    from rich.table import Table

    t = Table(title="kvsched bench (wall = simulate() call; peak RSS of the case's own process)",
              caption=BLIS_COLUMN_NOTE)
    for col in ("case", "requests", "inst", "sim wall s", "cpu s", "req/s wall", "req/s CPU", "events", "events/s",
                "steps", "ff steps", "folded", "preempt", "peak RSS MiB", "x quoted BLIS (wall, CPU)"):
        t.add_column(col, justify="left" if col == "case" else "right", no_wrap=(col == "case"))
    for e in entries:
        blis = (f"{e['requests_per_s'] / BLIS_REFERENCE_REQ_PER_S:,.1f}x, "
                f"{e['requests_per_cpu_s'] / BLIS_REFERENCE_REQ_PER_S:,.1f}x" if e["group"] == "blis" else "")
        t.add_row(e["case"] + (" (profiled)" if e.get("profiled") else ""), f"{e['requests']:,}",
                  str(e["instances"]), _fmt_s(e["sim_wall_s"]), _fmt_s(e["sim_cpu_s"]),
                  f"{e['requests_per_s']:,.0f}", f"{e['requests_per_cpu_s']:,.0f}",
                  f"{e['events']:,}", f"{e['events_per_s']:,.0f}", f"{e['steps']:,}",
                  f"{e['fast_forward_steps']:,} ({100 * e['fast_forward_share']:.0f}%)",
                  f"{e['folded_steps']:,}", f"{e['preemptions']:,}", f"{e['peak_rss_mib']:,.0f}", blis)
    return t


def peer_table(row: dict):
    """A rich table comparing Vidur and kvsched for one QPS."""
    from rich.table import Table

    vid, kv = row["vidur"], row["kvsched"]
    t = Table(title=f"Vidur {vid['version']} vs kvsched: Llama-2-70B, 2x A100 TP2, 1024+128 tokens, "
                    f"Poisson {row['qps']:g}/s, {row['requests']:,} requests")
    for col in ("", "Vidur", "kvsched", "Vidur / kvsched"):
        t.add_column(col, justify="left" if not col else "right")

    def ratio(a, b):
        return f"{a / b:,.1f}" if a is not None and b not in (None, 0) else "-"

    t.add_row("wall s (whole process)", _fmt_s(vid["wall_s"]), _fmt_s(kv["process_wall_s"]),
              ratio(vid["wall_s"], kv["process_wall_s"]))
    t.add_row("CPU s (whole process, its children included)", _fmt_s(vid.get("cpu_s")),
              _fmt_s(kv.get("process_cpu_s")), ratio(vid.get("cpu_s"), kv.get("process_cpu_s")))
    t.add_row("wall s (simulation only: Vidur event loop / kvsched simulate())", _fmt_s(vid["event_loop_s"]),
              _fmt_s(kv["sim_wall_s"]), ratio(vid["event_loop_s"], kv["sim_wall_s"]))
    t.add_row("CPU s (simulation only: not measured for Vidur / kvsched simulate())", "-", _fmt_s(kv["sim_cpu_s"]), "-")
    t.add_row("peak RSS MiB", f"{vid['peak_rss_mib']:,.0f}" if vid["peak_rss_mib"] else "-",
              f"{kv['peak_rss_mib']:,.0f}", ratio(vid["peak_rss_mib"], kv["peak_rss_mib"]))
    t.add_row("requests completed", f"{vid['completed']:,}", f"{kv['finished']:,}", "")
    t.add_row("KV blocks", str(vid.get("num_blocks") or "-"), f"{row['kvsched_kv_blocks']:,}", "")
    for metric, label in (("ttft", "TTFT"), ("tpot", "TBT (per-request mean)"), ("e2e", "E2E")):
        for q in ("p50", "p99"):
            a, b = vid["latency_s"][metric][q], kv["latency_s"][metric][q]
            t.add_row(f"{label} {q} s", _fmt_s(a), _fmt_s(b), ratio(a, b))
    return t


def write_plot(entries: Sequence[dict], path: Path) -> None:
    """Write :func:`plot_figure` of ``entries`` to ``path`` (PNG, 120 dpi)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def plot_figure(entries: Sequence[dict]):
    """Log-log plot of bench entries: wall time of ``simulate()`` against requests (left: every
    case, the BLIS cases joined, BLIS's quoted time and a slope-1 line) and against instances
    (right: the Mooncake cases and the scale case; a run without them says so on the panel).
    Returns the matplotlib Figure (the caller closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    markers = {"blis": "o", "trace": "s", "mooncake": "^", "long-context": "D", "scale": "*", "peer": "v"}
    blis = sorted((e for e in entries if e["group"] == "blis"), key=lambda e: e["requests"])
    if blis:
        ax1.plot([e["requests"] for e in blis], [e["sim_wall_s"] for e in blis], "-o", label="BLIS workload")
    for e in entries:
        if e["group"] != "blis":
            ax1.plot(e["requests"], e["sim_wall_s"], markers.get(e["group"], "x"), label=e["case"])
    ax1.plot(BLIS_REFERENCE_REQUESTS, BLIS_REFERENCE_WALL_S, "kx", markersize=10, label="BLIS itself (quoted)")
    if blis:  # what linear growth from the smallest BLIS case would give (slope 1 on log-log axes)
        n0, t0 = blis[0]["requests"], blis[0]["sim_wall_s"]
        xs = [min(e["requests"] for e in entries), max(e["requests"] for e in entries)]
        ax1.plot(xs, [t0 * x / n0 for x in xs], "k--", linewidth=0.8, alpha=0.6, label="linear in requests")
    ax1.set(xscale="log", yscale="log", xlabel="requests", ylabel="wall time of simulate() (s)",
            title="wall time vs requests")
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)
    moon = sorted((e for e in entries if e["group"] == "mooncake" and e["requests"] > 10_000),
                  key=lambda e: e["instances"])
    if moon:
        ax2.plot([e["instances"] for e in moon], [e["sim_wall_s"] for e in moon], "-^",
                 label="Mooncake trace (12,031 req)")
    for e in entries:
        if e["group"] == "scale":
            ax2.plot(e["instances"], e["sim_wall_s"], "*", markersize=12, label=f"{e['case']} ({e['requests']:,} req)")
    for e in entries:
        if e["group"] == "mooncake" and e["requests"] <= 10_000:
            ax2.plot(e["instances"], e["sim_wall_s"], "^", label=f"{e['case']} ({e['requests']:,} req)")
    if moon:  # the same requests on more instances: flat means cost follows requests, not instances
        ax2.axhline(moon[0]["sim_wall_s"], color="k", linestyle="--", linewidth=0.8, alpha=0.6,
                    label="same as on 1 instance")
    ax2.set(xscale="log", yscale="log", xlabel="instances", ylabel="wall time of simulate() (s)",
            title="wall time vs instances")
    ys = [ln.get_ydata() for ln in ax2.get_lines()]
    flat = [float(y) for arr in ys for y in np.atleast_1d(arr)]
    if flat:  # at least a decade, so that a flat line looks flat
        lo, hi = min(flat), max(flat)
        mid = (lo * hi) ** 0.5
        ax2.set_ylim(min(lo / 1.5, mid / 3.2), max(hi * 1.5, mid * 3.2))
    for ax in (ax1, ax2):  # seconds as plain numbers at 1, 2, 5 x 10^k
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=7)
    else:  # not an empty grid that looks like a failed plot
        ax2.text(0.5, 0.5, "no multi-instance case in this run\n(mooncake-1i / -4i / -16i, azure-1m-64i)",
                 transform=ax2.transAxes, ha="center", va="center", fontsize=9, color="0.4")
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def bench_report(entries: Sequence[dict], peer: list[dict] | None = None, envs: list[dict] | None = None,
                 training: list[dict] | None = None) -> dict:
    """The JSON document of one bench run (keys: :data:`TOP_KEYS`, plus ``peer`` with ``--peer``
    and ``training`` with ``--train``: the :func:`kvsched.agents.throughput.measure_training`
    rows; ``envs``: the :func:`kvsched.agents.throughput.measure` rows with ``--envs``, else
    ``None``)."""
    import kvsched

    doc: dict[str, Any] = {
        "kvsched_version": kvsched.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_method": MEMORY_METHOD,
        "reference": {"blis_wall_s": BLIS_REFERENCE_WALL_S, "blis_requests": BLIS_REFERENCE_REQUESTS,
                      "blis_requests_per_s": BLIS_REFERENCE_REQ_PER_S, "goal_speedup": GOAL_SPEEDUP,
                      "note": "BLIS figure quoted in issue #8, not re-measured in this run"},
        "cases": list(entries),
        "envs": envs,
        "not_measured": [] if envs is not None else [GYM_NOTE],
    }
    for e in entries:
        if e["group"] == "blis":
            e["speedup_vs_blis_quoted"] = e["requests_per_s"] / BLIS_REFERENCE_REQ_PER_S
            e["speedup_vs_blis_quoted_cpu"] = e["requests_per_cpu_s"] / BLIS_REFERENCE_REQ_PER_S
    if peer is not None:
        doc["peer"] = {"name": "vidur", "version": VIDUR_VERSION, "runs": peer}
    if training is not None:
        doc["training"] = list(training)
    return doc


def run_envs_subprocess(steps: int) -> list[dict]:
    """:func:`kvsched.agents.throughput.measure_all` in a fresh subprocess (its JSON rows).

    Raises:
        KvschedError: the subprocess failed.
    """
    from kvsched.envs.sim.errors import KvschedError

    proc = subprocess.run([sys.executable, "-m", "kvsched.agents.throughput", "--json", "--steps", str(steps)],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise KvschedError(f"environment throughput subprocess failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_training_subprocess(steps: int, n_envs: int) -> list[dict]:
    """:func:`kvsched.agents.throughput.measure_training_all` in a fresh subprocess (its JSON rows).

    Raises:
        KvschedError: the subprocess failed.
    """
    from kvsched.envs.sim.errors import KvschedError

    proc = subprocess.run([sys.executable, "-m", "kvsched.agents.throughput", "--train", "--json", "--steps",
                           str(steps), "--n-envs", str(n_envs)], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise KvschedError(f"training throughput subprocess failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def training_table(rows: Sequence[dict]):
    """Rich table of the training rows: steps per CPU and wall second, training and environment
    alone, and each environment's ratio to the last one (CartPole-v1, the reference point)."""
    from rich.table import Table

    ref = {r["part"]: r for r in rows if r["env"] == rows[-1]["env"]}
    t = Table(title="Training throughput (MaskablePPO as kvsched train runs it; CPU = this process, all threads)")
    for col in ("env", "part", "n_envs", "steps", "steps/s CPU", "steps/s wall", f"CPU rate vs {rows[-1]['env']}"):
        t.add_column(col, justify="left" if col in ("env", "part") else "right")
    for r in rows:
        base = ref.get(r["part"], {}).get("steps_per_cpu_s")
        t.add_row(r["env"], r["part"], str(r["n_envs"]), f"{r['steps']:,}", f"{r['steps_per_cpu_s']:,.0f}",
                  f"{r['steps_per_wall_s']:,.0f}", f"{r['steps_per_cpu_s'] / base:.3f}" if base else "")
    return t


def envs_table(rows: Sequence[dict]):
    """Rich table of the environment rows (steps/s, simulator and overhead us per step)."""
    from rich.table import Table

    t = Table(title="Gymnasium environments (env.step calls; overhead = env.step minus simulator, CPU)")
    for col in ("env", "agent", "steps", "steps/s wall", "steps/s CPU", "simulator us/step", "overhead us/step"):
        t.add_column(col, justify="left" if col in ("env", "agent") else "right")
    for r in rows:
        t.add_row(r["env"], r["agent"], f"{r['steps']:,}", f"{r['steps_per_wall_s']:,.0f}",
                  f"{r['steps_per_cpu_s']:,.0f}", f"{r['sim_us_per_step']:,.0f}", f"{r['overhead_us_per_step']:,.0f}")
    return t


# =============================================================================================
# Command line
# =============================================================================================
def add_arguments(b: argparse.ArgumentParser) -> None:
    """The ``kvsched bench`` options (wired into :mod:`kvsched.experiments.cli`)."""
    b.add_argument("--cases", nargs="+", metavar="CASE",
                   help=f"cases to run, space- or comma-separated, each once (default: {' '.join(default_cases())}); "
                        "see --list")
    b.add_argument("--quick", action="store_true", help=f"the small CI-sized set: {' '.join(quick_cases())}")
    b.add_argument("--list", action="store_true", help="list the cases and exit")
    b.add_argument("--out", type=Path, help="write the results as JSON here (and the plot next to it as .png)")
    b.add_argument("--plot", type=Path, help="write the log-log plot here, in the format of its suffix (.png, .pdf, "
                                             ".svg, ...: one matplotlib writes; checked before the cases run) "
                                             "(default: --out with .png)")
    b.add_argument("--peer", choices=("vidur",),
                   help="compare with a peer simulator on its configuration (runs it; minutes)")
    b.add_argument("--peer-requests", type=int, help="requests of the peer comparison (10000; with --peer)")
    b.add_argument("--qps", type=float, nargs="+", help="request rates of the peer comparison (1; with --peer)")
    b.add_argument("--peer-dir", type=Path, default=None,
                   help=f"Vidur peer folder with run.sh (default $KVSCHED_VIDUR_DIR or {DEFAULT_VIDUR_DIR})")
    b.add_argument("--envs", action="store_true",
                   help="also measure the Gymnasium environments' steps/s and overhead per step (subprocess)")
    b.add_argument("--env-steps", type=int, help="steps per environment and agent with --envs (2000)")
    b.add_argument("--train", action="store_true",
                   help="also measure training: MaskablePPO steps per CPU second end to end and the environment "
                        "alone, on kvsched/Scheduling-v0 and on CartPole-v1 under the same settings "
                        "(subprocess); alone "
                        "(without --cases or --quick) it runs no simulator case; columns explained in "
                        "docs/performance.md")
    b.add_argument("--train-steps", type=int, help="environment steps per measurement with --train (8192)")
    b.add_argument("--train-envs", type=int, help="environments per training process with --train (8)")
    b.add_argument("--profile", type=Path, metavar="DIR",
                   help="profile each case with pyinstrument, writing DIR/<case>.html and .txt "
                        "(timings of profiled runs are inflated)")


def case_names(args: Sequence[str] | None) -> list[str]:
    """The case names of ``--cases`` values, space- or comma-separated (``a b`` or ``a,b``, as
    the other commands' lists), each once, in the order given.

    Raises:
        ConfigError: an empty item (``a,,b``, ``a,``)."""
    from .cli_types import comma_list

    return list(dict.fromkeys(n for arg in args or () for n in comma_list(arg, "--cases")))


def cmd_bench(a: argparse.Namespace, console) -> int:
    """``kvsched bench``: run the selected cases (and the peer comparison) and report."""
    from kvsched.envs.sim.errors import KvschedError

    from .consoles import stderr_console
    from .outputs import prepare_out_file
    from .plot_files import check_plot_suffix

    if a.list:
        from rich.table import Table

        t = Table(title="bench cases")
        for col in ("case", "default", "quick", "description"):
            t.add_column(col)
        for c in CASES.values():
            t.add_row(c.name, "yes" if c.default else "", "yes" if c.quick else "", c.description)
        t.add_row("vidur-n<N>-qps<Q>", "", "", "Vidur's configuration in kvsched (used by --peer vidur)")
        console.print(t)
        return 0
    # options of a part that does not run are refused, not silently ignored
    unused = [f for f, v in (("--peer-requests", a.peer_requests), ("--qps", a.qps), ("--peer-dir", a.peer_dir))
              if v is not None and a.peer is None] \
        + (["--env-steps"] if a.env_steps is not None and not a.envs else []) \
        + [f for f, v in (("--train-steps", a.train_steps), ("--train-envs", a.train_envs))
           if v is not None and not a.train]
    if unused:
        raise KvschedError(f"{', '.join(unused)}: not allowed here: --peer-requests, --qps and --peer-dir are "
                           "options of --peer vidur, --env-steps of --envs, --train-steps and --train-envs of --train")
    a.train_steps = 8192 if a.train_steps is None else a.train_steps
    a.train_envs = 8 if a.train_envs is None else a.train_envs
    for flag, v in (("--train-steps", a.train_steps), ("--train-envs", a.train_envs)):
        if v < 1:
            raise KvschedError(f"{flag} {v} is not allowed: expected an integer >= 1")
    a.peer_requests = 10_000 if a.peer_requests is None else a.peer_requests
    a.qps = [1.0] if a.qps is None else a.qps
    a.env_steps = 2000 if a.env_steps is None else a.env_steps
    if a.peer_requests < 1:
        raise KvschedError(f"--peer-requests {a.peer_requests} is not allowed: expected an integer >= 1")
    for q in a.qps:
        if not (math.isfinite(q) and q > 0):
            raise KvschedError(f"--qps {q:g} is not allowed: expected finite request rates > 0")
    if a.cases and a.quick:
        raise KvschedError("give either --cases or --quick, not both")
    if a.env_steps < 1:
        raise KvschedError(f"--env-steps {a.env_steps} is not allowed: expected an integer >= 1")
    given = case_names(a.cases)
    if a.cases is not None and not given:  # `--cases ,` or `--cases ""`: not the default set
        raise KvschedError(f"--cases {bounded_repr(' '.join(a.cases))} names no case; see --list")
    names = given or (quick_cases() if a.quick else ([] if a.peer or a.train else default_cases()))
    for n in names:
        get_case(n)  # unknown names fail before anything runs
    if a.profile is not None and importlib.util.find_spec("pyinstrument") is None:
        raise KvschedError("--profile needs pyinstrument, which is not installed: "
                           "pip install -e '.[profile]' in the kvsched checkout")
    for flag, path in (("--out", a.out), ("--plot", a.plot)):
        prepare_out_file(path, flag)  # before the cases run (minutes), not when their results are written
    if a.out is not None and (a.plot or a.out.with_suffix(".png")).resolve() == a.out.resolve():
        # the plot would be written over the JSON results
        raise KvschedError(f"--out {bounded_repr(str(a.out), MAX_PATH_CHARS)} is not allowed: "
                           "the plot goes to the same file "
                           f"({'--plot' if a.plot else '--out with .png'}); give another --plot or an --out "
                           "ending in .json")
    check_plot_suffix(a.plot, "--plot")  # a suffix matplotlib cannot write, before the cases run
    err = stderr_console()
    entries = []
    for i, name in enumerate(names, 1):
        err.print(f"[dim]case {i}/{len(names)}: {name} ...[/]", highlight=False)
        progress_lines.note(f"case {i}/{len(names)} {name}")  # off a terminal, in the progress lines
        entries.append(run_case_subprocess(name, a.profile))
    peer = None
    if a.peer == "vidur":
        peer_dir = a.peer_dir or Path(os.environ.get("KVSCHED_VIDUR_DIR", DEFAULT_VIDUR_DIR))
        peer = peer_vidur(a.peer_requests, a.qps, peer_dir, err)
    envs = None
    if a.envs:
        err.print("[dim]environments (kvsched.agents.throughput) ...[/]", highlight=False)
        progress_lines.note("environments")
        envs = run_envs_subprocess(a.env_steps)
    training = None
    if a.train:
        err.print("[dim]training throughput (kvsched.agents.throughput --train) ...[/]", highlight=False)
        progress_lines.note("training throughput")
        training = run_training_subprocess(a.train_steps, a.train_envs)
    doc = bench_report(entries, peer, envs, training)
    if entries:
        console.print(cases_table(entries))
        blis10 = next((e for e in entries if e["case"] == "blis-10k"), None)
        if blis10:
            console.print(f"blis-10k: {blis10['requests_per_s']:,.0f} req/s wall "
                          f"({blis10['requests_per_cpu_s']:,.0f} per CPU s) = "
                          f"{blis10['requests_per_s'] / BLIS_REFERENCE_REQ_PER_S:,.1f}x "
                          f"({blis10['requests_per_cpu_s'] / BLIS_REFERENCE_REQ_PER_S:,.1f}x by CPU time) the quoted "
                          f"BLIS figure, not measured in this run ({BLIS_REFERENCE_REQ_PER_S:,.0f} req/s: "
                          f"{BLIS_REFERENCE_REQUESTS:,} requests in {BLIS_REFERENCE_WALL_S:g} s wall; goal "
                          f"{GOAL_SPEEDUP:g}x)", highlight=False)
    for row in peer or []:
        console.print(peer_table(row))
    if training:
        console.print(training_table(training))
    if envs:
        console.print(envs_table(envs))
    elif entries:
        console.print(f"[dim]{GYM_NOTE}.[/]", highlight=False)
    if entries:  # the memory column is the cases' (bench --train alone runs none)
        console.print(f"[dim]Memory: {MEMORY_METHOD}.[/]", highlight=False)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_files.write_text(a.out, json.dumps(doc, indent=2, sort_keys=False) + "\n")
        console.print(f"wrote {a.out}", highlight=False, markup=False)
    plot = a.plot or (a.out.with_suffix(".png") if a.out else None)
    if plot and entries:
        write_plot(entries, plot)
        console.print(f"wrote {plot}", highlight=False, markup=False)
    return 0


def _worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a case's subprocess: prints the case's JSON entry as the last line."""
    p = argparse.ArgumentParser(prog="python -m kvsched.experiments.bench",
                                description="run one bench case in this process (used by `kvsched bench`)")
    p.add_argument("case")
    p.add_argument("--profile", type=Path)
    a = p.parse_args(argv)
    from kvsched.envs.sim.errors import KvschedError

    try:
        entry = run_case(a.case, a.profile)
    except KvschedError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(json.dumps(entry) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
