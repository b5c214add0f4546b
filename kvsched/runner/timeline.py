"""A schedule you can look at: the run's events as a Chrome / Perfetto trace-event JSON.

:class:`TimelineWriter` is an observer (:class:`kvsched.envs.sim.observer.SimObserver`) given to
the cluster; it writes the Trace Event Format (``{"traceEvents": [...], "displayTimeUnit":
"ms"}``; the format Chrome's ``chrome://tracing`` and https://ui.perfetto.dev open, also gzipped),
as Vidur writes its ``chrome_trace.json`` (one process per replica, a complete event per batch
with its request ids and token counts in ``args``). Layout (docs/timeline.md):

- process ``cluster`` (pid 0; with two or more instances or a cluster KV tier): the ``routing``
  track, an instant event per routing decision (``-> instance k``, args: request, by whom, prompt
  tokens), and one track per link of the cluster KV tier;
- process ``instance k`` (pid k + 1):

  - ``steps``: a complete event (``X``) per engine step named by its batch (``prefill``,
    ``decode``, ``mixed``, or ``recompute`` when only preempted requests re-prefill), args: the
    prefill chunks and recomputed chunks as ``[request, tokens]``, the decoding request ids, batch
    size and tokens; a fast-forwarded stretch of identical decode steps is one ``decode stretch``
    event with its step count (``kvsched simulate --no-fast-forward`` shows every step);
  - ``preemptions``: an instant event per preemption (``preempt (<mode>)``, args: victim, mode,
    cause, the request it made room for, its tokens and blocks);
  - ``link <name>``: a complete event per KV copy on that link (named by its kind: ``swap_out``,
    ``swap_in``, ``prefix_write``, ``prefix_load``, ``prefix_prefetch``, ``pnm_migration``, ``shared_write``,
    ``shared_fetch``, ``kv_transfer`` (prefill/decode disaggregation, on both instances' ports);
    args: request, bytes);
  - ``requests``: instant events at each request's ``arrival``, ``first token`` and ``finish``
    (or ``rejected``), at the client's times of ``records.csv`` (the finish event carries the
    record's latencies).

Timestamps are simulated time in microseconds with nanosecond resolution, written from integer
nanoseconds (exact; so the events of one track never overlap by rounding). The file is written
as the run goes (memory does not grow with the run), gzip-compressed when its name ends in
``.gz``, and only replaces the destination once complete (:mod:`kvsched.atomic_files`). The same
run gives the same bytes (no wall clock; gzip header without name and time).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from kvsched import atomic_files
from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.observer import PreemptionEvent, RetentionEvent, RouteEvent, StepEvent, TransferEvent

#: thread ids of an instance's fixed tracks (links get 10, 11, ... in order of first use)
STEPS_TID, PREEMPTIONS_TID, REQUESTS_TID, RETENTION_TID = 1, 2, 3, 4
ROUTING_TID = 1
FIRST_LINK_TID = 10
CLUSTER_PID = 0

_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode


def _us(ns: int) -> str:
    """Integer nanoseconds as a JSON number of microseconds (exact, three decimals)."""
    return f"{ns // 1000}.{ns % 1000:03d}"


def _ns(t_s: float) -> int:
    return int(round(t_s * 1e9))


def parse_window(text: str, flag: str = "--timeline-window") -> tuple[float, float]:
    """``START:END`` (simulated seconds; END may be empty for the run's end) as ``(start_s, end_s)``.

    Raises:
        ConfigError: not two numbers separated by ``:``, an empty START, a negative or non-finite start, or an end
            not above the start.
    """
    parts = str(text).split(":")
    if len(parts) != 2:
        raise ConfigError(f"{flag}={bounded_repr(text)} is not allowed: expected START:END in simulated seconds "
                          "(e.g. 10:20, or 10: for 10 s to the end)")
    if not parts[0].strip():
        raise ConfigError(f"{flag}={bounded_repr(text)} is not allowed: START is empty; give it (0 for the run's "
                          "start, e.g. 0:20)")
    try:
        start = float(parts[0])
        end = float(parts[1]) if parts[1].strip() else math.inf
    except ValueError:
        raise ConfigError(f"{flag}={bounded_repr(text)} is not allowed: START and END must be numbers of "
                          "simulated seconds (e.g. 10:20)") from None
    if not (math.isfinite(start) and start >= 0.0 and not math.isnan(end) and end > start):
        raise ConfigError(f"{flag}={bounded_repr(text)} is not allowed: expected START:END simulated seconds with "
                          "0 <= START < END (END may be empty for the run's end)")
    return start, end


def check_window(window: Any, field: str = "window_s") -> tuple[float, float]:
    """Validate a ``(start_s, end_s)`` window: ``0 <= start_s < end_s`` (``end_s`` may be ``inf``).

    Raises:
        ConfigError: naming ``field`` and the value.
    """
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in window))
    if ok:
        start, end = float(window[0]), float(window[1])
        ok = math.isfinite(start) and start >= 0.0 and not math.isnan(end) and end > start
    if not ok:
        raise ConfigError(f"{field}={bounded_repr(window)} is not allowed: expected (start_s, end_s) simulated "
                          "seconds with 0 <= start_s < end_s (end_s may be inf)")
    return float(window[0]), float(window[1])


def timeline_path(value: Any, field: str = "--timeline") -> Path:
    """A timeline file name given by a user, checked: a non-empty path ending in ``.json`` or
    ``.json.gz`` (Perfetto and ``chrome://tracing`` recognise the trace by it).

    Raises:
        ConfigError: an empty or non-path value, or another suffix.
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ConfigError(f"{field}={bounded_repr(value)} is not allowed: expected a file name ending in "
                          ".json or .json.gz")
    path = Path(value)
    if not (path.name.endswith(".json") or path.name.endswith(".json.gz")):
        raise ConfigError(f"{field}={bounded_repr(str(value))} is not allowed: the timeline is a trace-event JSON; "
                          "name it *.json or *.json.gz (gzip-compressed)")
    return path


class TimelineWriter:
    """Writes the run's events to ``path`` as a Chrome / Perfetto trace (see the module docstring).

    Use as a context manager around the run, then add the records::

        with TimelineWriter("run.json.gz", ["instance 0"]) as tl:
            result = simulate(workload, spec, observer=tl)
            tl.add_records(result.records)

    The file replaces ``path`` when the ``with`` block ends without an exception; otherwise
    nothing is written (the temporary file is removed).

    Args:
        path: the file (``.json``, or ``.json.gz`` for gzip); its folder is created if missing.
        instance_labels: one process name per instance (its pid is its index + 1).
        window_s: keep only events inside ``[start_s, end_s]`` of simulated time (complete events
            overlapping it are kept whole); ``None`` keeps everything.
        metadata: JSON-ready facts written under ``otherData`` (scenario, policy, seed...).

    Raises:
        ConfigError: a bad path, window or label list.
        OSError: the folder cannot be created or the file written.
    """

    def __init__(self, path: str | os.PathLike[str], instance_labels: Sequence[str],
                 window_s: tuple[float, float] | None = None, metadata: dict | None = None) -> None:
        self.path = timeline_path(path, "path")
        labels = list(instance_labels) if isinstance(instance_labels, (list, tuple)) else None
        if not labels or not all(isinstance(x, str) for x in labels):
            raise ConfigError(f"instance_labels={bounded_repr(instance_labels)} is not allowed: expected one "
                              "process name (text) per instance")
        self.labels = labels
        self.window = None if window_s is None else check_window(window_s)
        self._lo = -1 if self.window is None else _ns(self.window[0])
        self._hi = None if self.window is None or math.isinf(self.window[1]) else _ns(self.window[1])
        self.metadata = dict(metadata or {})
        self.events_written = 0
        self._tids: dict[tuple[int, str], int] = {}
        self._next_link_tid: dict[int, int] = {}
        self._stack: contextlib.ExitStack | None = None
        self._out: io.TextIOWrapper | None = None
        self._first = True
        self._cluster_named = False
        self._retention_tracks: set[int] = set()  # instances whose retention track is named

    # ------------------------------------------------------------------ file
    def __enter__(self) -> TimelineWriter:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def open(self) -> None:
        """Start the file (a temporary beside ``path``) and write the process and track names."""
        if self._stack is not None:
            raise RuntimeError("this TimelineWriter is already open")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        try:
            tmp = stack.enter_context(atomic_files.replacing(self.path))
            raw = stack.enter_context(open(tmp, "wb"))
            binary: Any = raw
            if self.path.name.endswith(".gz"):  # no name, time 0: the same run gives the same bytes
                gz = stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                       compresslevel=6))
                binary = stack.enter_context(io.BufferedWriter(gz, buffer_size=1 << 20))  # few large writes
            self._out = stack.enter_context(io.TextIOWrapper(binary, encoding="utf-8", newline="\n"))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._out.write('{"traceEvents":[\n')
        if len(self.labels) > 1:
            self._cluster_process()
            self._thread(CLUSTER_PID, ROUTING_TID, "routing")
        for i, label in enumerate(self.labels):
            pid = i + 1
            self._process(pid, label, pid)
            for tid, name in ((STEPS_TID, "steps"), (PREEMPTIONS_TID, "preemptions"), (REQUESTS_TID, "requests")):
                self._thread(pid, tid, name)

    def close(self) -> None:
        """Finish the JSON and put the file in place."""
        out, stack = self._require_open()
        meta = {"generator": "kvsched", "time": "simulated seconds (ts and dur in microseconds)",
                "window_s": None if self.window is None else [self.window[0],
                                                              None if math.isinf(self.window[1]) else self.window[1]],
                **self.metadata}
        out.write(f'\n],"displayTimeUnit":"ms","otherData":{_DUMPS(meta)}}}\n')
        self._out = self._stack = None
        stack.close()

    def abort(self) -> None:
        """Drop the file (nothing replaces ``path``)."""
        stack = self._stack
        self._out = self._stack = None
        if stack is not None:
            with contextlib.suppress(RuntimeError):
                stack.__exit__(RuntimeError, RuntimeError("timeline aborted"), None)

    def _require_open(self) -> tuple[io.TextIOWrapper, contextlib.ExitStack]:
        if self._out is None or self._stack is None:
            raise RuntimeError("the TimelineWriter is not open (use it as a context manager or call open())")
        return self._out, self._stack

    # ------------------------------------------------------------------ low level
    def _emit(self, text: str) -> None:
        out = self._out
        if out is None:
            raise RuntimeError("the TimelineWriter is not open (use it as a context manager or call open())")
        if self._first:
            self._first = False
        else:
            out.write(",\n")
        out.write(text)
        self.events_written += 1

    def _process(self, pid: int, name: str, sort_index: int) -> None:
        self._emit(f'{{"name":"process_name","ph":"M","ts":0,"pid":{pid},"tid":0,"args":{_DUMPS({"name": name})}}}')
        self._emit(f'{{"name":"process_sort_index","ph":"M","ts":0,"pid":{pid},"tid":0,'
                   f'"args":{{"sort_index":{sort_index}}}}}')

    def _cluster_process(self) -> None:
        self._cluster_named = True
        self._process(CLUSTER_PID, "cluster", 0)

    def _thread(self, pid: int, tid: int, name: str) -> None:
        self._tids[(pid, name)] = tid
        self._emit(f'{{"name":"thread_name","ph":"M","ts":0,"pid":{pid},"tid":{tid},"args":{_DUMPS({"name": name})}}}')
        self._emit(f'{{"name":"thread_sort_index","ph":"M","ts":0,"pid":{pid},"tid":{tid},'
                   f'"args":{{"sort_index":{tid}}}}}')

    def _link_tid(self, pid: int, link: str) -> int:
        name = f"link {link}"
        tid = self._tids.get((pid, name))
        if tid is None:
            tid = self._next_link_tid.get(pid, FIRST_LINK_TID)
            self._next_link_tid[pid] = tid + 1
            if pid == CLUSTER_PID and not self._cluster_named:  # one instance with a cluster KV tier
                self._cluster_process()
            self._thread(pid, tid, name)
        return tid

    def _inside(self, start_ns: int, end_ns: int) -> bool:
        return end_ns >= self._lo and (self._hi is None or start_ns <= self._hi)

    def _complete(self, name: str, cat: str, start_ns: int, end_ns: int, pid: int, tid: int, args: dict) -> None:
        if self._inside(start_ns, end_ns):
            self._emit(f'{{"name":{_DUMPS(name)},"cat":"{cat}","ph":"X","ts":{_us(start_ns)},'
                       f'"dur":{_us(end_ns - start_ns)},"pid":{pid},"tid":{tid},"args":{_DUMPS(args)}}}')

    def _instant(self, name: str, cat: str, t_ns: int, pid: int, tid: int, args: dict) -> None:
        if self._inside(t_ns, t_ns):
            self._emit(f'{{"name":{_DUMPS(name)},"cat":"{cat}","ph":"i","s":"t","ts":{_us(t_ns)},'
                       f'"pid":{pid},"tid":{tid},"args":{_DUMPS(args)}}}')

    # ------------------------------------------------------------------ observer
    def on_step(self, event: StepEvent) -> None:
        """A step (or stretch): see the module docstring."""
        pid = event.instance_id + 1
        ends = event.ends_s
        start = _ns(event.start_s)
        k = len(ends)
        if k == 1 or event.folded:
            end1 = _ns(float(ends[0]))
            self._complete(*_single_step(event), start, end1, pid, STEPS_TID, _step_args(event))
            if k == 1:
                return
            start = end1
            steps_left = k - 1
            member_steps = None if event.member_steps is None else [s - 1 for s in event.member_steps]
        else:
            steps_left = k
            member_steps = None if event.member_steps is None else list(event.member_steps)
        ids = [b.request_id for b in event.batch]
        if member_steps is not None:
            runs = [[rid, s] for rid, s in zip(ids, member_steps) if s > 0]
            ids = [rid for rid, _ in runs]
            args: dict = {"steps": steps_left, "batch": len(ids), "decode": ids, "decode_steps": runs}
        else:
            args = {"steps": steps_left, "batch": len(ids), "decode": ids}
        self._complete("decode stretch", "step", start, _ns(float(ends[-1])), pid, STEPS_TID, args)

    def on_preemption(self, event: PreemptionEvent) -> None:
        """A preemption: an instant on the instance's ``preemptions`` track."""
        self._instant(f"preempt ({event.mode})", "preemption", _ns(event.time_s), event.instance_id + 1,
                      PREEMPTIONS_TID,
                      {"victim": event.victim_id, "mode": event.mode, "cause": event.cause,
                       "for_request": event.for_request_id, "tokens": event.tokens, "blocks": event.blocks})

    def on_transfer(self, event: TransferEvent) -> None:
        """A KV copy: a complete event on its link's track."""
        pid = CLUSTER_PID if event.instance_id < 0 else event.instance_id + 1
        start, end = _ns(event.start_s), _ns(event.end_s)
        if not self._inside(start, end):
            return
        self._complete(event.kind or "copy", "transfer", start, end, pid, self._link_tid(pid, event.link),
                       {"request": event.request_id, "bytes": event.n_bytes})

    def on_retention(self, event: RetentionEvent) -> None:
        """A retention decision (Residency-v0): an instant on the instance's ``retention`` track
        (named at its first decision: runs without retention decisions have no such track)."""
        pid = event.instance_id + 1
        if pid not in self._retention_tracks:
            self._retention_tracks.add(pid)
            self._thread(pid, RETENTION_TID, "retention")
        self._instant(event.decision, "retention", _ns(event.time_s), event.instance_id + 1, RETENTION_TID,
                      {"request": event.request_id, "tier_blocks_before": list(event.blocks_before),
                       "tier_blocks_after": list(event.blocks_after)})

    def on_route(self, event: RouteEvent) -> None:
        """A routing decision: an instant on the cluster's ``routing`` track."""
        self._instant(f"-> instance {event.instance_id}", "routing", _ns(event.time_s), CLUSTER_PID, ROUTING_TID,
                      {"request": event.request_id, "instance": event.instance_id, "by": event.by,
                       "prompt_tokens": event.prompt_tokens})

    # ------------------------------------------------------------------ requests
    def add_records(self, records) -> None:
        """Instant events of each request's lifetime from the run's records (``arrival``,
        ``first token``, ``finish`` or ``rejected``; client times), per instance in time order.

        Args:
            records: the run's records frame (:data:`kvsched.envs.sim.metrics.RECORD_COLUMNS`).
        """
        if records is None or not len(records):
            return
        cols = {c: records[c].to_numpy() for c in ("request_id", "instance_id", "arrival_s", "first_token_s",
                                                   "finish_s", "status", "reject_reason", "prompt_tokens",
                                                   "output_tokens", "prefix_hit_tokens", "preemptions")}
        events: list[tuple[int, int, int, int, str, dict]] = []
        for j in range(len(records)):
            rid = int(cols["request_id"][j])
            pid = int(cols["instance_id"][j]) + 1
            arr = float(cols["arrival_s"][j])
            if cols["status"][j] != "finished":
                events.append((pid, _ns(arr), rid, 0, "rejected", {"request": rid,
                                                                   "reason": str(cols["reject_reason"][j])}))
                continue
            first = float(cols["first_token_s"][j])
            fin = float(cols["finish_s"][j])
            events.append((pid, _ns(arr), rid, 0, "arrival", {"request": rid}))
            events.append((pid, _ns(first), rid, 1, "first token", {"request": rid, "ttft_s": first - arr}))
            events.append((pid, _ns(fin), rid, 2, "finish", {
                "request": rid, "prompt_tokens": int(cols["prompt_tokens"][j]),
                "output_tokens": int(cols["output_tokens"][j]),
                "prefix_hit_tokens": int(cols["prefix_hit_tokens"][j]),
                "preemptions": int(cols["preemptions"][j]), "ttft_s": first - arr, "e2e_s": fin - arr}))
        events.sort(key=lambda e: e[:4])
        for pid, t, _, _, name, args in events:
            if 1 <= pid <= len(self.labels):
                self._instant(name, "request", t, pid, REQUESTS_TID, args)


def _single_step(event: StepEvent) -> tuple[str, str]:
    """``(name, category)`` of a single step from its batch's phases."""
    phases = {b.phase for b in event.batch}
    if phases == {"decode"}:
        return "decode", "step"
    if "decode" in phases:
        return "mixed", "step"
    if phases == {"recompute"}:
        return "recompute", "step"
    return "prefill", "step"


def _step_args(event: StepEvent) -> dict:
    """A single step's batch as args: prefill and recompute chunks ``[request, tokens]``, decodes."""
    prefill, recompute, decode = [], [], []
    for b in event.batch:
        if b.phase == "decode":
            decode.append(b.request_id)
        elif b.phase == "prefill":
            prefill.append([b.request_id, b.tokens])
        else:
            recompute.append([b.request_id, b.tokens])
    return {"batch": len(event.batch), "tokens": int(sum(b.tokens for b in event.batch)), "prefill": prefill,
            "recompute": recompute, "decode": decode}


def instance_labels(n_instances: int, spec=None) -> list[str]:
    """Process names ``instance k`` (with the model, GPU and TP of ``spec`` when given)."""
    what = "" if spec is None else f" ({spec.model.name} / {spec.gpu.name} TP{spec.tp})"
    return [f"instance {i}{what}" for i in range(n_instances)]
