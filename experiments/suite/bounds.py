"""Bounds of an episode: the isolation bound and what stratifies the pool.

**Isolation bound.** Each request served alone on one instance of the task's system, with FCFS
(vLLM's default: one request alone is prefilled in token-budget chunks, the fastest it can be)
and nothing else in flight: its TTFT, TPOT and E2E then are the best it can get, and SLO
attainment over those alone-runs (judged by :func:`kvsched.envs.sim.metrics.summarize`,
exactly as an episode is) bounds every schedule from above. It is loose: requests that arrive
together cannot all run alone.

**Load measures** (for the hard stratum, :mod:`.episodes`): from the same alone-runs,

- ``offered_load``: the requests' alone prefill times (first scheduled to first token) summed over
  the window's length and the instances -- the share of the GPU's time the prompts alone ask for
  (above 1 the window cannot keep up even with perfect batching of its decodes);
- ``kv_pressure``: the largest share of the HBM KV capacity (all instances) that the requests
  alive at one moment would hold, each holding ``prompt + output`` tokens from its alone start to
  its alone finish shifted to its arrival.

And from the workload's prefix hashes alone (no run; :func:`reuse_pressure`):

- ``reuse_pressure``: the mean share of the prefix cache (HBM and the lower tiers that cache
  prefixes, all instances) that blocks awaiting their next use would fill over the window, each
  block held from its first use to its last (the live set Belady's order keeps to hit every
  reuse). Below 1 a cache that keeps everything hits every reuse; above 1 it cannot, and which
  blocks stay decides the hits.

The achievable hindsight bound is :mod:`.search`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from kvsched.envs.sim.metrics import MetricsConfig, summarize
from kvsched.envs.sim.request import Request, Workload


@dataclass(frozen=True)
class IsolationStats:
    """What the alone-runs of one episode give.

    Attributes:
        attainment: SLO attainment with every request alone (None for an empty episode).
        offered_load: summed alone prefill time / (window_s x instances).
        kv_pressure: peak share of the HBM KV capacity held by requests alive at once.
        requests: requests in the episode.
        reuse_pressure: mean share of the prefix cache that blocks awaiting reuse would fill
            (:func:`reuse_pressure`; 0 without prefix hashes).
    """

    attainment: float | None
    offered_load: float
    kv_pressure: float
    requests: int
    reuse_pressure: float = 0.0


#: spacing of the alone-runs in their one simulation (s): the first try; doubled while a run is
#: still in flight when the next arrives (:func:`alone_records`)
ALONE_SPACING_S = 600.0


def isolation_stats(workload: Workload, run_alone: Callable[[Workload], pd.DataFrame], metrics: MetricsConfig,
                    window_s: float, instances: int, hbm_capacity_tokens: int,
                    prefix_cache_tokens: int | None = None) -> IsolationStats:
    """The alone-runs of ``workload``'s requests and what they give (see the module docstring).

    Args:
        workload: the episode's requests.
        run_alone: serves a workload on one instance; returns its records frame. It is given the
            alone-runs spaced apart in one workload (:func:`alone_records`).
        metrics: the task's metrics configuration (classes, SLOs).
        window_s: the episode's window (s).
        instances: instances of the task's cluster (the load is per instance).
        hbm_capacity_tokens: HBM KV capacity of one instance, tokens.
        prefix_cache_tokens: what one instance can cache of prefixes, tokens (HBM and the lower
            tiers caching prefixes); default ``hbm_capacity_tokens``.

    Requests with the same prompt length, output length and SLO class are run once.
    """
    n = len(workload)
    if n == 0:
        return IsolationStats(None, 0.0, 0.0, 0)
    reqs = [workload.request(i) for i in range(n)]
    keys = sorted({(r.prompt_tokens, r.output_tokens, r.slo_class) for r in reqs})
    alone = alone_records(keys, run_alone)
    rel = {k: alone.iloc[i] for i, k in enumerate(keys)}
    cols = ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s")
    rows = []
    for req in reqs:
        r = rel[(req.prompt_tokens, req.output_tokens, req.slo_class)].copy()
        for col in cols:
            r[col] = r[col] + req.arrival_s
        r["request_id"] = req.request_id
        rows.append(r)
    records = pd.DataFrame(rows).reset_index(drop=True)
    summary = summarize(records, None, None, metrics)
    att = summary["classes"]["all"]["slo"]["attainment"]
    fin = records["status"] == "finished"
    busy = (records.loc[fin, "first_token_s"] - records.loc[fin, "first_scheduled_s"]).to_numpy(dtype=np.float64)
    load = float(busy.sum() / (window_s * max(1, instances)))
    start = records.loc[fin, "first_scheduled_s"].to_numpy(dtype=np.float64)
    end = records.loc[fin, "finish_s"].to_numpy(dtype=np.float64)
    tokens = (records.loc[fin, "prompt_tokens"] + records.loc[fin, "output_tokens"]).to_numpy(dtype=np.float64)
    cache = hbm_capacity_tokens if prefix_cache_tokens is None else prefix_cache_tokens
    return IsolationStats(att, load, _peak_concurrent(start, end, tokens) / max(1, hbm_capacity_tokens * instances),
                          n, reuse_pressure(workload, cache * max(1, instances), window_s))


def reuse_pressure(workload: Workload, cache_tokens: int, window_s: float) -> float:
    """Mean share of ``cache_tokens`` that the workload's blocks awaiting their next use fill over
    ``window_s`` (see the module docstring): the sum over distinct prefix hashes of (last use -
    first use) x ``hash_block_tokens``, over ``window_s`` and ``cache_tokens``. A use is a request's
    arrival (its prompt reads the block; a turn's prompt holds the previous turn's output, so the
    decoded blocks are counted from the next turn on). 0 for a workload without prefix hashes.

    Raises:
        ValueError: ``cache_tokens`` or ``window_s`` not > 0.
    """
    if cache_tokens <= 0 or not window_s > 0:
        raise ValueError(f"cache_tokens {cache_tokens} and window_s {window_s} must be > 0")
    if not len(workload.hashes):
        return 0.0
    uses = pd.DataFrame({"hash": workload.hashes,
                         "t": np.repeat(workload.arrival_s, np.diff(workload.hash_offsets))})
    span = uses.groupby("hash", sort=False)["t"].agg(["min", "max"])
    live = float((span["max"] - span["min"]).sum()) * workload.hash_block_tokens
    return live / window_s / cache_tokens


def alone_records(keys: list[tuple[int, int, str]], run_alone: Callable[[Workload], pd.DataFrame],
                  spacing_s: float = ALONE_SPACING_S) -> pd.DataFrame:
    """Records of one alone-run per ``(prompt_tokens, output_tokens, slo_class)`` key, in key
    order, with times relative to the request's own arrival (``arrival_s`` = 0).

    The alone-runs share one simulation (one result to build instead of one per request): request
    ``i`` arrives at ``i x spacing_s``, far enough apart that each is served alone. Whether it was
    is checked -- every request finished before the next arrived -- and the spacing doubled until
    it is. The requests carry no prefix hashes, so no run finds another's blocks cached.

    A request rejected on arrival (longer than the model's context) keeps its rejected record.
    """
    while True:
        w = Workload.from_requests([Request(i, i * spacing_s, p, o, slo_class=c) for i, (p, o, c) in enumerate(keys)])
        rec = run_alone(w).sort_values("request_id").reset_index(drop=True)
        ends = rec["finish_s"].to_numpy(dtype=np.float64)
        next_arrival = np.append(rec["arrival_s"].to_numpy(dtype=np.float64)[1:], np.inf)
        unfinished = rec["status"].to_numpy() != "finished"  # rejected alone: no times to overlap
        if np.all(unfinished | (ends < next_arrival)):
            break
        if spacing_s > 1e7:  # pragma: no cover - no request takes 4 months alone
            raise RuntimeError(f"alone-runs still overlap {spacing_s:g} s apart")
        spacing_s *= 2
    for col in ("first_scheduled_s", "first_token_s", "finish_s"):
        rec[col] = rec[col] - rec["arrival_s"]
    rec["arrival_s"] = 0.0
    return rec


def _peak_concurrent(start: np.ndarray, end: np.ndarray, weight: np.ndarray) -> float:
    """Largest sum of ``weight`` over intervals ``[start, end)`` alive at one moment."""
    if not len(start):
        return 0.0
    times = np.concatenate([start, end])
    deltas = np.concatenate([weight, -weight])
    order = np.lexsort((deltas, times))  # at equal times, ends (negative) before starts
    return float(np.max(np.cumsum(deltas[order])))
