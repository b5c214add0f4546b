"""Shared helpers of the tests (not a test module): a small served system, workloads from rows,
runs with the invariants checked, byte-identity of two results, a hand-made instance to drive a
mechanism directly, and a hand-computed records frame.

Importable from every test folder: ``tests/`` is on ``sys.path`` because ``tests/conftest.py``
lives there (pytest's default ``prepend`` import mode).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import strategies as hst

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.fast_forward import StretchPlanner
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.metrics import RECORD_COLUMNS, summary_to_json
from kvsched.envs.sim.request import RUNNING, Request, RequestState, Workload
from kvsched.envs.sim.routing import INSTANCE_COLUMNS
from kvsched.envs.sim.specs import CostParams, InstanceSpec, PNMSpec, get_gpu, get_model, get_pnm
from kvsched.policies.base import make_policy
from kvsched.policies.routing import Router, make_router
from kvsched.runner.simulate import simulate

MODEL = get_model("Llama-3.1-8B")
GPU = get_gpu("H100-SXM")
BLOCK_BYTES = 131072 * 16  # Llama-3.1-8B bf16 KV bytes per 16-token block
NO_FRONT_END = CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0, output_token_overhead_s=0.0)
NAN = float("nan")


# ------------------------------------------------------------------------------ served system
def make_spec(**kw) -> InstanceSpec:
    """Llama-3.1-8B on one H100: 4,096 HBM blocks, a 512-token budget, 64 seats (override any)."""
    base = dict(model=MODEL, gpu=GPU, hbm_kv_blocks=4096, max_num_batched_tokens=512, max_num_seqs=64)
    base.update(kw)
    return InstanceSpec(**base)


def literature_spec(**kw) -> InstanceSpec:
    """Llama-3.1-8B on one H100 with the literature cost parameters (``CostParams()``), as the
    policy scenarios were sized with (the calibrated H100 default changes their regimes)."""
    kw.setdefault("cost", CostParams())
    return InstanceSpec(model=MODEL, gpu=GPU, **kw)


# --------------------------------------------------------------------------------- workloads
def build_workload(rows, seg_tokens: int = 32) -> Workload:
    """rows: ``(arrival_s, prompt, output, prefix group)``; a group > 0 shares leading segments
    (hashes ``1000 * group + k``) of ``seg_tokens`` tokens."""
    reqs = []
    for i, (arr, p, o, g) in enumerate(rows):
        hashes = tuple(1000 * g + k for k in range(p // seg_tokens)) if g else ()
        reqs.append(Request(i, arr, p, o, prefix_hashes=hashes, hash_block_tokens=seg_tokens if hashes else 0))
    return Workload.from_requests(reqs)


def growing_sessions(seed: int, n: int = 40, seg_tokens: int = 32) -> Workload:
    """Conversations (groups 1-5) whose turns extend their history by 2-11 segments, arriving in
    a burst (exponential gaps of 0.15 s): prefix reuse under KV pressure."""
    rng = np.random.default_rng(seed)
    rows, hist = [], {}
    t = 0.0
    for _ in range(n):
        s = int(rng.integers(1, 6))
        hist[s] = hist.get(s, 0) + int(rng.integers(2, 12)) * seg_tokens
        t += float(rng.exponential(0.15))
        rows.append((t, hist[s] + 16, int(rng.integers(4, 60)), s))
    return build_workload(rows, seg_tokens=seg_tokens)


def short_only(rate=4.0, dur=120.0, seed=1) -> Workload:
    """Synthetic short chat: prompts of ~400 tokens, outputs of ~100."""
    from kvsched.envs.workload.synthetic import SyntheticConfig, generate

    cfg = SyntheticConfig(rate_per_s=rate, duration_s=dur, prompt_median_tokens=400, prompt_sigma=0.6,
                          prompt_min_tokens=16, prompt_max_tokens=4000, output_median_tokens=100,
                          output_sigma=0.5, output_min_tokens=8, output_max_tokens=400)
    return generate(cfg, seed=seed)


def with_longs(w: Workload, times, tokens, out=64) -> Workload:
    """``w`` plus long requests of ``tokens`` prompt tokens arriving at ``times``."""
    base = int(w.request_id.max()) + 1
    longs = [Request(base + i, float(t), int(p), out) for i, (t, p) in enumerate(zip(times, tokens))]
    return Workload.from_requests(list(w) + longs, name="mixed")


# -------------------------------------------------------------------------------------- runs
def run(workload, spec, fast_forward=True, check=True, policy="fcfs", n_instances=1, oracle=False):
    """One simulation; ``check`` verifies block conservation and holdings after every step."""
    return simulate(workload, spec, policy, n_instances=n_instances,
                    options=InstanceOptions(fast_forward=fast_forward, check_invariants=check,
                                            oracle_lengths=oracle))


def assert_identical(a, b) -> None:
    """Two results are byte-identical: records, summary JSON and occupancy frame."""
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=True)
    assert summary_to_json(a.summary) == summary_to_json(b.summary)
    pd.testing.assert_frame_equal(a.occupancy, b.occupancy, check_exact=True)


class Stuck(Exception):
    """The run did not end within :data:`STUCK_AFTER_S` simulated seconds (a preemption livelock)."""


STUCK_AFTER_S = 60.0  # the small generated workloads end within a few simulated seconds


def run_cluster(w, specs, policy="fcfs", params=None, ff=True, fold=True, check=False, oracle=False):
    """One run on a cluster of ``specs`` (round-robin), stopped at :data:`STUCK_AFTER_S`
    (raises :class:`Stuck`); ``fold=False`` disables folding a prompt-completing step into the
    stretch after it. Returns ``(result, ITL histograms as (count, bin counts bytes, min, max))``."""
    orig = StretchPlanner.fold
    if not fold:
        StretchPlanner.fold = lambda self, start, end1, *a: end1
    try:
        pp = make_policy(policy, params).params
        c = Cluster(specs, lambda: make_policy(policy, pp),
                    options=InstanceOptions(fast_forward=ff, check_invariants=check, oracle_lengths=oracle))
        c.start(w)
        if c.run_until_decision(until_s=STUCK_AFTER_S) is not None:
            raise Stuck  # a preemption livelock
        res = c.result()
        itl = {k: (h.count, h._counts.tobytes(), h.min, h.max) for k, h in c.recorder.itl.items()}
        return res, itl
    finally:
        StretchPlanner.fold = orig


def assert_same(a, b) -> None:
    """Two :func:`run_cluster` results are byte-identical, ITL histogram bins included."""
    (ra, ia), (rb, ib) = a, b
    pd.testing.assert_frame_equal(ra.records, rb.records, check_exact=True)
    assert summary_to_json(ra.summary) == summary_to_json(rb.summary)
    pd.testing.assert_frame_equal(ra.occupancy, rb.occupancy, check_exact=True)
    assert ia == ib


def three_way(w, specs, **kw) -> int:
    """Fold on (invariants checked every step) == fold off == one by one; returns folded steps."""
    on = run_cluster(w, specs, fold=True, check=True, **kw)
    assert_same(on, run_cluster(w, specs, fold=False, **kw))
    assert_same(on, run_cluster(w, specs, ff=False, **kw))
    return on[0].stats["folded_steps"]


# ------------------------------------------------------------- one instance, driven by hand
def make_instance(spec=None, policy="fcfs", params=None, check=False):
    """A fresh instance of a one-instance cluster (its recorder attached), nothing queued."""
    c = Cluster([spec or make_spec()], lambda: make_policy(policy, params),
                options=InstanceOptions(check_invariants=check))
    return c.instances[0]


def state(rid, prompt, output=10, arrival=0.0, hashes=(), seg=0, bs=16) -> RequestState:
    """A request's simulator state (waiting, nothing computed)."""
    return RequestState(Request(rid, arrival, prompt, output, prefix_hashes=tuple(hashes), hash_block_tokens=seg),
                        bs, 0)


def place_running(inst, st, computed, generated=0):
    """Make ``st`` a running HBM resident of ``inst`` with ``computed`` KV tokens (private blocks
    allocated), as if admitted earlier."""
    need = inst.kv.blocks_for(computed)
    assert inst.kv.allocate(need)
    st.private_blocks = need
    st.computed = computed
    st.generated = generated
    st.status = RUNNING
    st.admissions += 1
    inst.running.append(st)
    return st


# -------------------------------------------------------------------------- a records frame
def record(**kw) -> dict:
    """One records row (a finished request with nothing measured yet; override any column)."""
    base = dict(
        request_id=0, instance_id=0, arrival_s=0.0, prompt_tokens=100, output_tokens=10,
        slo_class="default", status="finished", reject_reason="", first_scheduled_s=NAN,
        first_token_s=NAN, finish_s=NAN, generated_tokens=0, preemptions=0,
        recomputed_tokens=0, prefix_hit_tokens=0, max_itl_s=NAN, bytes_hbm_to_dram=0,
        bytes_dram_to_hbm=0, bytes_hbm_to_nvme=0, bytes_nvme_to_hbm=0, bytes_hbm_to_pnm=0,
    )
    base.update(kw)
    return base


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(RECORD_COLUMNS))


# Hand-computed fixture (default config: short SLO TTFT 1 s / TPOT 0.1 s, long 10 s / 0.2 s,
# long when prompt >= 8192):
#   r0 short: arr 0,   sched 0.1,  first 0.5, fin 2.0,  gen 21 -> TTFT 0.5, TPOT 1.5/20=0.075,
#             E2E 2.0, queue 0.1                                      -> meets
#   r1 short: arr 1.0, sched 1.5,  first 3.0, fin 3.5,  gen 11 -> TTFT 2.0, TPOT 0.5/10=0.05,
#             E2E 2.5, queue 0.5                                      -> misses (TTFT)
#   r2 long (prompt == 8192): arr 2, sched 2, first 7, fin 12, gen 51 -> TTFT 5, TPOT 0.1,
#             E2E 10, queue 0                                         -> meets
#   r3 short: arr 3.0, sched 3.25, first 3.5, fin 3.5, gen 1   -> TTFT 0.5, no TPOT,
#             E2E 0.5, queue 0.25                                     -> meets
#   duration = last finish 12 - first arrival 0 = 12 s
def four_requests() -> pd.DataFrame:
    return frame([
        record(request_id=0, arrival_s=0.0, prompt_tokens=100, first_scheduled_s=0.1,
               first_token_s=0.5, finish_s=2.0, generated_tokens=21, preemptions=1,
               recomputed_tokens=100, prefix_hit_tokens=64, max_itl_s=0.2,
               bytes_hbm_to_dram=1000, bytes_dram_to_hbm=1000),
        record(request_id=1, arrival_s=1.0, prompt_tokens=200, first_scheduled_s=1.5,
               first_token_s=3.0, finish_s=3.5, generated_tokens=11, max_itl_s=0.1),
        record(request_id=2, instance_id=1, arrival_s=2.0, prompt_tokens=8192,
               first_scheduled_s=2.0, first_token_s=7.0, finish_s=12.0, generated_tokens=51,
               preemptions=2, recomputed_tokens=4096, prefix_hit_tokens=4096, max_itl_s=0.5,
               bytes_hbm_to_nvme=7, bytes_nvme_to_hbm=5),
        record(request_id=3, arrival_s=3.0, prompt_tokens=50, first_scheduled_s=3.25,
               first_token_s=3.5, finish_s=3.5, generated_tokens=1),
    ])


def approx(x):
    import pytest

    return pytest.approx(x, rel=1e-12, abs=1e-15)



# ------------------------------------------------------------ clusters with a router
MODEL_BLOCK_BYTES = InstanceSpec(MODEL, GPU).kv_bytes_per_block


def routing_spec(**kw) -> InstanceSpec:
    """Llama-3.1-8B on one H100 with no front-end delay, otherwise the spec's defaults."""
    base = dict(model=MODEL, gpu=GPU, cost=NO_FRONT_END)
    base.update(kw)
    return InstanceSpec(**base)


def cluster(n, router="round-robin", spec=None, check=True, fast_forward=True, **kw) -> Cluster:
    """``n`` FCFS instances of ``spec`` (8,192 HBM blocks, 2,048-token budget) behind ``router``."""
    spec = spec or routing_spec(hbm_kv_blocks=8192, max_num_batched_tokens=2048)
    return Cluster([spec] * n, lambda: make_policy("fcfs"),
                   router=make_router(router) if isinstance(router, str) else router,
                   options=InstanceOptions(check_invariants=check, fast_forward=fast_forward), **kw)


class Recording(Router):
    """Routes as ``inner`` and keeps copies of the columns it saw (``seen``)."""

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[dict] = []

    def bind(self, n_instances, seed=0):
        super().bind(n_instances, seed)
        self.inner.bind(n_instances, seed)

    def route(self, table):
        row = {c: np.array(getattr(table, c)) for c in INSTANCE_COLUMNS}
        row.update(overlap=table.prefix_overlap_segments.copy(), overlap_blocks=table.prefix_overlap_blocks.copy(),
                   rid=table.request_id, snapshot_s=table.snapshot_s,
                   now_s=table.now_s, prompt=table.prompt_tokens)
        self.seen.append(row)
        return self.inner.route(table)


def mixed_prefix_workload(seed=0, n=120, seg=64):
    """Five prompt families (1-11 shared 64-token segments each, plus a private tail), Poisson
    arrivals at 50/s, outputs of 1-199 tokens: prefixes are reused across instances and the
    100-block HBM of each instance forces preemptions."""
    rng = np.random.default_rng(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.exponential(0.02)
        fam, nseg = int(rng.integers(0, 5)), int(rng.integers(1, 12))
        hashes = tuple(fam * 1000 + j for j in range(nseg)) + (100_000 + i,)
        reqs.append(Request(i, t, nseg * seg + int(rng.integers(1, seg)), int(rng.integers(1, 200)),
                            prefix_hashes=hashes, hash_block_tokens=seg))
    return Workload.from_requests(reqs)


# ------------------------------------------------------------------ a policy by name
def run_policy(w, sp, policy, params, ff=True, check=True):
    """One instance of ``sp`` under ``policy`` with ``params``."""
    return Cluster([sp], lambda: make_policy(policy, params),
                   options=InstanceOptions(fast_forward=ff, check_invariants=check)).run(w)


def pnm_tier(blocks: int | None = None, preset: str = "cxl-pnm-ocp2025"):
    """The PNM preset, or one device of it holding ``blocks`` Llama-3.1-8B KV blocks."""
    p = get_pnm(preset)
    if blocks is None:
        return p
    return PNMSpec(p.name, blocks * BLOCK_BYTES, p.mem_bytes_per_s, p.attn_flops_per_s, p.link, 1)


def tiny_hbm_scenario(mode: str):
    """A 160-block HBM under ~80 synthetic requests in 8 s (``mode``: swap, offload, recompute)."""
    from kvsched.runner.scenario import Scenario

    inst = {"model": "Llama-3.1-8B", "gpu": "H100-SXM", "hbm_kv_blocks": 160, "dram_kv_bytes": 2.0e8,
            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "preemption_mode": mode}
    if mode == "offload":
        inst["nvme_kv_bytes"] = 1e9
    return Scenario(name="tiny-hbm", trace=None, instance=inst, seed=3,
                    synthetic={"rate_per_s": 10.0, "duration_s": 8, "prompt_median_tokens": 400,
                               "output_median_tokens": 120, "output_max_tokens": 300})


#: Hypothesis strategy of small workloads: (arrival s, prompt tokens, output tokens, prefix group
#: 0-3, 0 = none) rows, for :func:`build_workload`
request_lists = hst.lists(
    hst.tuples(
        hst.floats(0, 5.0, allow_nan=False),     # arrival
        hst.integers(1, 1500),                   # prompt
        hst.integers(1, 200),                    # output
        hst.integers(0, 3),                      # prefix group (0: none)
    ),
    min_size=1, max_size=25,
)
