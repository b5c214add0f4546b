"""Metrics: per-request records and streamed inter-token latencies -> a JSON-ready summary.

The simulator produces two things while it runs:

* one **record** per request (a :class:`pandas.DataFrame` with the columns in
  :data:`RECORD_COLUMNS`), written when the request finishes or is rejected;
* **inter-token-latency (ITL) samples**, streamed into one :class:`LogHistogram` per length
  class, so memory stays O(bins) however many tokens are decoded.

:func:`summarize` turns them, plus an optional KV-occupancy time series, into a nested dict of
plain Python values (TTFT, TPOT, ITL, E2E, queueing delay, SLO attainment, goodput,
throughput, preemptions, prefix hits, bytes per link, starvation, KV utilisation), for all
requests and per length class ("short" / "long"). :func:`summary_to_json` serialises it
deterministically and :func:`format_summary_rows` flattens it into table rows.

This module holds the summary itself; its parts live next to it and are re-exported here
(``from kvsched.envs.sim.metrics import X`` keeps working for every name in ``__all__``):
:mod:`.histogram` (:class:`LogHistogram`), :mod:`.metrics_config` (:class:`SLO`,
:class:`SLOTable`, :class:`MetricsConfig`, :data:`LENGTH_CLASSES`), :mod:`.records` (the records
frame: :data:`RECORD_COLUMNS`, :data:`BYTE_COLUMNS`, :data:`STATUSES`, :func:`length_class`),
:mod:`.metrics_stats` (the statistics blocks) and :mod:`.metrics_format` (table rows).

Definitions follow docs REFERENCE.md §6 (Metrics), which follows the vLLM benchmark:

* TTFT = first_token_s - arrival_s;
* TPOT = (finish_s - first_token_s) / (generated_tokens - 1), defined only when
  generated_tokens > 1 (vLLM ``benchmark_serving`` skips single-token requests too);
* ITL = every gap between two consecutive tokens of a request, pooled over requests;
* E2E = finish_s - arrival_s;
* queueing delay = first_scheduled_s - arrival_s;
* SLO attainment = fraction of *arrived* requests meeting TTFT and TPOT (and E2E if set);
  rejected requests count as misses (REFERENCE §6: ignoring them biases the tail);
* goodput = requests meeting their SLO / duration, the ``vllm bench serve --goodput``
  variant (requests/s), not DistServe's "maximum sustainable rate" (that needs a rate sweep);
* starvation: a request is starved when its queueing delay exceeds
  ``starvation_factor`` x its class TTFT SLO (REFERENCE §6: "e.g. 10x their SLO").

Summary layout (one block C per class: "all", and "short" / "long" when they have a request)::

    counts: {arrived, finished, rejected, rejected_by_reason: {reason: n}}
    ttft_s, tpot_s, e2e_s, queueing_delay_s: {count, mean, max, p50, p90, p99}
        (over finished requests; tpot_s only over those with generated_tokens > 1)
    itl_s: {count, mean, max, p50, ...}  (from the class's LogHistogram)
    max_itl_s                             (max of the records' max_itl_s)
    slo: {met, attainment}                (attainment = met / arrived)
    goodput_rps                           (met / duration_s)
    throughput: {requests_per_s, output_tokens_per_s, total_tokens_per_s}
        (finished requests; output = generated_tokens, total = prompt + generated)
    preemptions: {total, requests_preempted, recomputed_tokens}
    prefix: {hit_tokens, prompt_tokens, hit_rate}  (finished requests)
    bytes_moved: {<from>_to_<to>: bytes for every bytes_<from>_to_<to> column of the records
        (frame order: hbm_to_dram, dram_to_hbm, hbm_to_nvme, nvme_to_hbm, hbm_to_pnm, then
        those of user-defined tiers), total}
    starvation: {max_queueing_delay_s, starved, threshold_factor}

A request meets its SLO when it finished, TTFT <= ttft_s, TPOT <= tpot_s (a single-token
request meets TPOT by definition) and, if set, E2E <= e2e_s. Rejected requests count as arrived
and as misses. Starvation looks at every request that was scheduled at least once (finished or
not). All numbers are plain int/float; NaN -> None.

All times are in seconds, token counts are integers, bytes are bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from .errors import require
from .histogram import LogHistogram
from .metrics_config import LENGTH_CLASSES, SLO, MetricsConfig, SLOTable, is_positive_finite
from .metrics_format import SUMMARY_ROW_HEADERS, format_summary_rows
from .metrics_format import format_number as _fmt  # noqa: F401  (its former name here)
from .metrics_stats import itl_stats, json_scalar, occupancy_summary, rate, sample_stats
from .records import (BYTE_COLUMN_PREFIX, BYTE_COLUMNS, RECORD_COLUMNS, STATUSES, byte_columns,
                      check_records, length_class)

__all__ = [
    "LogHistogram",
    "SLO",
    "SLOTable",
    "MetricsConfig",
    "RECORD_COLUMNS",
    "BYTE_COLUMNS",
    "STATUSES",
    "LENGTH_CLASSES",
    "SUMMARY_ROW_HEADERS",
    "length_class",
    "summarize",
    "summary_to_json",
    "format_summary_rows",
]


@dataclass(frozen=True)
class _Requests:
    """Per-request arrays of one records frame, each of shape ``(n,)`` in row order.

    Times and latencies are float64 seconds (NaN where the event did not happen), token and
    byte counts int64, flags bool.
    """

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    generated: np.ndarray  # generated tokens
    prompt: np.ndarray  # prompt tokens
    reject_reason: np.ndarray  # str, "" if none
    finished: np.ndarray
    rejected: np.ndarray
    max_itl_s: np.ndarray
    preemptions: np.ndarray
    recomputed: np.ndarray  # recomputed tokens
    prefix_hits: np.ndarray  # prefix-cache hit tokens
    link_bytes: dict[str, np.ndarray]  # "<from>_to_<to>" -> bytes, frame column order
    length_class: np.ndarray  # "short" / "long"
    ttft_s: np.ndarray
    tpot_s: np.ndarray  # NaN unless `multi`
    e2e_s: np.ndarray
    queueing_s: np.ndarray
    multi: np.ndarray  # finished with more than one generated token (has a TPOT)
    scheduled: np.ndarray  # scheduled at least once
    met: np.ndarray  # met its SLO
    starved: np.ndarray


def _request_arrays(records: pd.DataFrame, cfg: MetricsConfig) -> _Requests:
    """Read, derive and judge the per-request arrays of a checked records frame."""
    a = records["arrival_s"].to_numpy(dtype=np.float64)
    s = records["first_scheduled_s"].to_numpy(dtype=np.float64)
    f = records["first_token_s"].to_numpy(dtype=np.float64)
    e = records["finish_s"].to_numpy(dtype=np.float64)
    g = records["generated_tokens"].to_numpy(dtype=np.int64)
    prompt = records["prompt_tokens"].to_numpy(dtype=np.int64)
    status = records["status"].astype(str).to_numpy()
    fin = status == "finished"
    lcls = length_class(prompt, cfg)
    slo_ttft, slo_tpot, slo_e2e = _slo_bounds(records, lcls, cfg)
    with np.errstate(invalid="ignore", divide="ignore"):
        ttft, e2e, qdelay = f - a, e - a, s - a
        multi = fin & (g > 1)
        tpot = np.full(len(records), np.nan)
        tpot[multi] = (e[multi] - f[multi]) / (g[multi] - 1)
        met = fin & (ttft <= slo_ttft) & (~multi | (tpot <= slo_tpot)) & (e2e <= slo_e2e)
        scheduled = np.isfinite(s)
        starved = scheduled & (qdelay > cfg.starvation_factor * slo_ttft)
    return _Requests(
        arrival_s=a, first_token_s=f, finish_s=e, generated=g, prompt=prompt,
        reject_reason=records["reject_reason"].fillna("").astype(str).to_numpy(),
        finished=fin, rejected=status == "rejected",
        max_itl_s=records["max_itl_s"].to_numpy(dtype=np.float64),
        preemptions=records["preemptions"].to_numpy(dtype=np.int64),
        recomputed=records["recomputed_tokens"].to_numpy(dtype=np.int64),
        prefix_hits=records["prefix_hit_tokens"].to_numpy(dtype=np.int64),
        link_bytes={c[len(BYTE_COLUMN_PREFIX):]: records[c].to_numpy(dtype=np.int64)
                    for c in byte_columns(records)},
        length_class=lcls, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, queueing_s=qdelay, multi=multi,
        scheduled=scheduled, met=met, starved=starved)


def _slo_bounds(records: pd.DataFrame, lcls: np.ndarray,
                cfg: MetricsConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The TTFT, TPOT and E2E bound (s, float64, shape ``(n,)``) each request is judged by.

    A request goes by ``cfg.slos[slo_class]`` when its ``slo_class`` tag is a key there, else by
    its length class ``lcls``; an unset E2E bound is ``inf``.
    """
    slo_cls = records["slo_class"].astype(str).to_numpy()
    # an untagged request (None / NaN) goes by its length class whatever str() makes of the
    # missing value (pandas 2: "None", pandas 3: NaN), even with a class named "None"
    tagged = records["slo_class"].notna().to_numpy()
    judged = np.where(tagged & np.isin(slo_cls, list(cfg.slos.keys())), slo_cls, lcls)
    slo_ttft = np.array([cfg.slos[c].ttft_s for c in judged], dtype=np.float64)
    slo_tpot = np.array([cfg.slos[c].tpot_s for c in judged], dtype=np.float64)
    slo_e2e = np.array([np.inf if cfg.slos[c].e2e_s is None else cfg.slos[c].e2e_s
                        for c in judged], dtype=np.float64)
    return slo_ttft, slo_tpot, slo_e2e


def _default_duration(req: _Requests) -> float | None:
    """Last finish minus first arrival (s); ``None`` when nothing finished or it is not > 0."""
    if not req.finished.any():
        return None
    span = float(np.max(req.finish_s[req.finished]) - np.min(req.arrival_s))
    return span if span > 0 else None


def _itl_histograms(itl: Mapping[str, LogHistogram] | None) -> dict[str, LogHistogram]:
    """A copy of ``itl`` with an "all" entry (the merge of every class, by sorted name, when
    absent; the given histograms are not modified).

    Raises:
        ConfigError: an entry is not a :class:`LogHistogram`.
    """
    hists = dict(itl or {})
    for k, h in hists.items():
        require(isinstance(h, LogHistogram), f"itl[{k!r}]", type(h).__name__, "a LogHistogram")
    if "all" not in hists:
        merged = LogHistogram()
        for k in sorted(hists):
            merged.merge(hists[k])
        hists["all"] = merged
    return hists


def _counts_block(req: _Requests, mask: np.ndarray) -> dict[str, Any]:
    """``counts``: arrived, finished, rejected and rejections by reason among ``mask``."""
    m_rej = mask & req.rejected
    reasons, rcounts = np.unique(req.reject_reason[m_rej], return_counts=True)
    return {
        "arrived": int(np.count_nonzero(mask)),
        "finished": int(np.count_nonzero(mask & req.finished)),
        "rejected": int(np.count_nonzero(m_rej)),
        "rejected_by_reason": {str(r): int(c) for r, c in zip(reasons, rcounts)},
    }


def _latency_blocks(req: _Requests, mask: np.ndarray, hist: LogHistogram | None,
                    ps: tuple[float, ...]) -> dict[str, Any]:
    """``ttft_s``, ``tpot_s``, ``e2e_s``, ``queueing_delay_s``, ``itl_s`` and ``max_itl_s``."""
    m_fin = mask & req.finished
    m_multi = mask & req.multi
    mi = req.max_itl_s[mask]
    mi = mi[np.isfinite(mi)]
    decode_span_s = req.finish_s[m_multi] - req.first_token_s[m_multi]
    return {
        "ttft_s": sample_stats(req.ttft_s[m_fin], ps),
        "tpot_s": sample_stats(req.tpot_s[m_multi], ps),
        "e2e_s": sample_stats(req.e2e_s[m_fin], ps),
        "queueing_delay_s": sample_stats(req.queueing_s[m_fin], ps),
        "itl_s": itl_stats(hist, ps, decode_span_s, req.generated[m_multi]),
        "max_itl_s": json_scalar(np.max(mi)) if mi.size else None,
    }


def _slo_blocks(req: _Requests, mask: np.ndarray, duration_s: float | None) -> dict[str, Any]:
    """``slo`` (met, attainment over arrived) and ``goodput_rps`` (met per second)."""
    n_met = int(np.count_nonzero(mask & req.met))
    arrived = int(np.count_nonzero(mask))
    return {
        "slo": {"met": n_met, "attainment": json_scalar(n_met / arrived) if arrived else None},
        "goodput_rps": rate(n_met, duration_s),
    }


def _throughput_block(req: _Requests, mask: np.ndarray,
                      duration_s: float | None) -> dict[str, Any]:
    """``throughput``: finished requests, output tokens and prompt + output tokens per second."""
    m_fin = mask & req.finished
    out_tokens = int(req.generated[m_fin].sum())
    return {
        "requests_per_s": rate(np.count_nonzero(m_fin), duration_s),
        "output_tokens_per_s": rate(out_tokens, duration_s),
        "total_tokens_per_s": rate(out_tokens + int(req.prompt[m_fin].sum()), duration_s),
    }


def _preemption_block(req: _Requests, mask: np.ndarray) -> dict[str, Any]:
    """``preemptions``: total, requests preempted at least once, recomputed tokens."""
    return {
        "total": int(req.preemptions[mask].sum()),
        "requests_preempted": int(np.count_nonzero(mask & (req.preemptions > 0))),
        "recomputed_tokens": int(req.recomputed[mask].sum()),
    }


def _prefix_block(req: _Requests, mask: np.ndarray) -> dict[str, Any]:
    """``prefix``: prefix-cache hit tokens over prompt tokens of the finished requests."""
    m_fin = mask & req.finished
    prompt_fin = int(req.prompt[m_fin].sum())
    hit_fin = int(req.prefix_hits[m_fin].sum())
    return {
        "hit_tokens": hit_fin,
        "prompt_tokens": prompt_fin,
        "hit_rate": json_scalar(hit_fin / prompt_fin) if prompt_fin else None,
    }


def _bytes_block(req: _Requests, mask: np.ndarray) -> dict[str, int]:
    """``bytes_moved``: bytes per link (every ``bytes_*`` column, frame order) and ``total``."""
    moved = {k: int(v[mask].sum()) for k, v in req.link_bytes.items()}
    moved["total"] = int(sum(moved.values()))
    return moved


def _starvation_block(req: _Requests, mask: np.ndarray, cfg: MetricsConfig) -> dict[str, Any]:
    """``starvation``: longest queueing delay of a scheduled request (s), starved requests."""
    q_sched = req.queueing_s[mask & req.scheduled]
    return {
        "max_queueing_delay_s": json_scalar(np.max(q_sched)) if q_sched.size else None,
        "starved": int(np.count_nonzero(mask & req.starved)),
        "threshold_factor": float(cfg.starvation_factor),
    }


def _class_block(req: _Requests, mask: np.ndarray, hist: LogHistogram | None,
                 cfg: MetricsConfig, duration_s: float | None) -> dict[str, Any]:
    """The summary block C of the requests selected by ``mask`` (bool, shape ``(n,)``), see the
    module docstring; ``hist`` is the class's ITL histogram."""
    return {
        "counts": _counts_block(req, mask),
        **_latency_blocks(req, mask, hist, cfg.percentiles),
        **_slo_blocks(req, mask, duration_s),
        "throughput": _throughput_block(req, mask, duration_s),
        "preemptions": _preemption_block(req, mask),
        "prefix": _prefix_block(req, mask),
        "bytes_moved": _bytes_block(req, mask),
        "starvation": _starvation_block(req, mask, cfg),
    }


def summarize(
    records: pd.DataFrame,
    itl: Mapping[str, LogHistogram] | None,
    occupancy: pd.DataFrame | None,
    cfg: MetricsConfig,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """Summarise one simulation run into a JSON-ready nested dict.

    Args:
        records: per-request records with (at least) the columns of :data:`RECORD_COLUMNS`,
            one row per arrived request; extra ``bytes_<from>_to_<to>`` columns are reported.
        itl: length class name ("short"/"long") -> :class:`LogHistogram` of that class's
            inter-token gaps (s). An "all" entry is used for the "all" class if present;
            otherwise "all" is the merge of every entry. ``None`` or missing classes give
            empty ITL stats.
        occupancy: optional KV occupancy samples: ``time_s`` (non-decreasing) plus
            ``used_blocks_<tier>`` and ``capacity_blocks_<tier>`` columns (every tier is
            reported). Values hold until the next sample (piecewise constant); the window is
            first to last sample. An empty frame gives ``{"time_span_s": None, "samples": 0,
            "tiers": {}}``.
        cfg: classes, SLOs, percentiles and starvation factor.
        duration_s: the denominator of every rate (s). Default: last finish_s minus first
            arrival_s; ``None`` (rates reported as None) when no request finished or that span
            is not positive.

    Returns:
        ``{"duration_s", "config", "classes": {"all": C, "short": C, "long": C},
        "kv_occupancy": {"time_span_s", "samples", "tiers": {tier: {"mean_utilization",
        "max_utilization", "max_capacity_blocks", "max_used_blocks"}}} | None}``, where only
        classes with at least one arrived request appear besides "all"; the block C and the
        SLO rules are in the module docstring ("Summary layout").

    Raises:
        ConfigError: missing columns, a malformed byte column name, an unknown status,
            inconsistent timestamps of a finished request, a non-positive ``duration_s``, an
            ``itl`` entry that is not a LogHistogram, or malformed ``occupancy``.
    """
    require(isinstance(cfg, MetricsConfig), "cfg", type(cfg).__name__, "a MetricsConfig")
    check_records(records)
    if duration_s is not None:
        require(is_positive_finite(duration_s), "duration_s", duration_s,
                "None or a finite number > 0 (s)")
        duration_s = float(duration_s)
    req = _request_arrays(records, cfg)
    if duration_s is None:
        duration_s = _default_duration(req)
    hists = _itl_histograms(itl)
    classes: dict[str, Any] = {
        "all": _class_block(req, np.ones(len(records), dtype=bool), hists.get("all"), cfg, duration_s)}
    for c in LENGTH_CLASSES:
        mask = req.length_class == c
        if mask.any():
            classes[c] = _class_block(req, mask, hists.get(c), cfg, duration_s)
    return {
        "duration_s": json_scalar(duration_s),
        "config": cfg.to_dict(),
        "classes": classes,
        "kv_occupancy": None if occupancy is None else occupancy_summary(occupancy),
    }


def summary_to_json(summary: Mapping[str, Any]) -> str:
    """Deterministic JSON text of a :func:`summarize` result (sorted keys, indent 2).

    Raises:
        ValueError: the summary holds NaN/inf (``allow_nan=False``); :func:`summarize` never
            produces them.
    """
    return json.dumps(summary, sort_keys=True, indent=2, allow_nan=False)
