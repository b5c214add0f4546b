"""Collects what a run produces: per-request records, pooled inter-token latencies per length
class, and KV occupancy samples. Memory grows with requests (records) and scheduling events
(occupancy samples), never with tokens: ITL goes into fixed-size log histograms.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .metrics import BYTE_COLUMNS, LENGTH_CLASSES, RECORD_COLUMNS, LogHistogram, MetricsConfig
from .occupancy import OccupancyTracker
from .request import FINISHED, RequestState
from .tiers import STANDARD_TIERS

_STANDARD_BYTES = tuple(c[len("bytes_"):] for c in BYTE_COLUMNS)

class Recorder:
    """Sink for the simulator's measurements.

    Args:
        metrics: the metrics configuration (length-class threshold).
        occupancy_interval_s: simulated seconds between kept occupancy samples (statistics
            are exact regardless; see :mod:`kvsched.envs.sim.occupancy`).
        output_overhead_s: seconds between a step producing a token and the client receiving
            it (:attr:`~kvsched.envs.sim.specs.CostParams.output_token_overhead_s`); added to the
            recorded first-token and finish times. Gaps between tokens are unchanged (every token
            is delayed alike).
        first_chunk_delay_tokens: mean inter-token gaps between a request's first token and the
            client's first text (:attr:`~kvsched.envs.sim.specs.CostParams.first_chunk_delay_tokens`);
            added to the recorded first-token time of requests with more than one token, capped
            at the finish time (the last chunk flushes all text).
    """

    def __init__(self, metrics: MetricsConfig, occupancy_interval_s: float = 1.0,
                 output_overhead_s: float = 0.0, first_chunk_delay_tokens: float = 0.0) -> None:
        self.metrics = metrics
        self.output_overhead_s = float(output_overhead_s)
        self.first_chunk_delay_tokens = float(first_chunk_delay_tokens)
        self._itl = {name: LogHistogram() for name in LENGTH_CLASSES}
        self._itl_by_index = [self._itl[name] for name in LENGTH_CLASSES]
        # ITL samples are buffered and binned in batches: one histogram call per ~64k samples
        self._buf_vals: list[list[np.ndarray | list[float]]] = [[] for _ in LENGTH_CLASSES]  # kept, not copied
        self._buf_wts: list[list[int]] = [[] for _ in LENGTH_CLASSES]  # one weight per array
        self._buffered = 0
        self.rows: list[tuple] = []
        self.occupancy = OccupancyTracker(occupancy_interval_s)
        #: byte counters of the records beyond the standard ones (extra tiers' ``hbm_to_<tier>``
        #: and ``<tier>_to_hbm``), in the order their tiers were registered
        self.extra_bytes: list[str] = []
        #: parallel sampling (set to a list by the cluster when some request has ``n > 1``): per
        #: record, the id of the user request it belongs to (the parent's for a child sequence, its
        #: own otherwise), written as the records' ``parent_id`` column; ``None``: no such column
        self.parent_ids: list[int] | None = None

    def register_instance(self, instance_id: int, tier_names: list[str], capacity_blocks: tuple[int, ...]) -> None:
        """Declare an instance's tiers (HBM first) and their capacity in blocks: its occupancy is
        tracked per tier, and an extra tier's bytes get record columns. Call before any record."""
        self.occupancy.register(instance_id, tier_names, capacity_blocks)
        for name in tier_names:
            if name not in STANDARD_TIERS:
                for key in (f"hbm_to_{name}", f"{name}_to_hbm"):
                    if key not in self.extra_bytes:
                        self.extra_bytes.append(key)

    def length_class(self, prompt_tokens: int) -> int:
        """0 for short, 1 for long (``prompt_tokens >= long_prompt_tokens``)."""
        return 1 if prompt_tokens >= self.metrics.long_prompt_tokens else 0

    def record(self, st: RequestState) -> None:
        """Append the final record of a finished or rejected request (first-token and finish
        times as the client sees them: + ``output_overhead_s``, and the first token also
        + ``first_chunk_delay_tokens`` mean gaps; NaN stays NaN)."""
        d = self.output_overhead_s
        first = st.first_token_s
        if self.first_chunk_delay_tokens and st.generated > 1:
            # never after the last token: the final chunk flushes all pending text
            first = min(first + self.first_chunk_delay_tokens * (st.finish_s - st.first_token_s)
                        / (st.generated - 1), st.finish_s)
        tb = st.tier_bytes
        if tb is None:
            moved = (0,) * (len(_STANDARD_BYTES) + len(self.extra_bytes))
        else:
            moved = tuple(tb.get(k, 0) for k in _STANDARD_BYTES) + tuple(tb.get(k, 0) for k in self.extra_bytes)
        if self.parent_ids is not None:
            pid = st.req.parent_id
            self.parent_ids.append(st.rid if pid < 0 else pid)
        self.rows.append((
            st.rid, st.instance_id, st.arrival_s, st.prompt_tokens, st.output_tokens,
            st.req.slo_class, LENGTH_CLASSES[st.length_class],
            "finished" if st.status == FINISHED else "rejected",
            st.reject_reason, st.first_scheduled_s, first + d, st.finish_s + d, st.generated,
            st.preemptions, st.recomputed_tokens, st.prefix_hit_tokens, st.max_itl_s,
        ) + moved)

    def add_itl(self, first_gaps: np.ndarray, classes: np.ndarray, shared_gaps: np.ndarray | None) -> None:
        """Add inter-token gaps (s).

        Args:
            first_gaps: one gap per request, shape ``(n,)``.
            classes: length class index of each of those requests, shape ``(n,)``.
            shared_gaps: gaps every one of the ``n`` requests saw (a fast-forwarded stretch),
                shape ``(k,)``; each is counted once per request.
        """
        first_gaps = np.asarray(first_gaps, dtype=np.float64)
        classes = np.asarray(classes)
        self.add_itl_by_class(tuple(first_gaps[classes == c].tolist() for c in range(len(LENGTH_CLASSES))),
                              shared_gaps)

    def add_itl_by_class(self, first_gaps: tuple[list[float], ...], shared_gaps: np.ndarray | None) -> None:
        """:meth:`add_itl` with the per-request gaps already split by length class.

        Args:
            first_gaps: one list of gaps (s) per length class (index 0 short, 1 long).
            shared_gaps: as in :meth:`add_itl`, counted once per request of every class.

        Samples are buffered as (values, one integer weight) and binned ~64k at a time, with the
        same concatenated arrays as before (the weights are expanded once per flush).
        """
        for c, vals in enumerate(first_gaps):
            cnt = len(vals)
            if not cnt:
                continue
            self._buf_vals[c].append(vals)  # a list of floats: np.concatenate converts it at the flush
            self._buf_wts[c].append(1)
            self._buffered += cnt
            if shared_gaps is not None and len(shared_gaps):
                self._buf_vals[c].append(shared_gaps)
                self._buf_wts[c].append(cnt)
                self._buffered += len(shared_gaps)
        if self._buffered >= 65536:
            self._flush_itl()

    def _flush_itl(self) -> None:
        for c, hist in enumerate(self._itl_by_index):
            if self._buf_vals[c]:
                vals = self._buf_vals[c]
                w = np.repeat(np.array(self._buf_wts[c], dtype=np.int64), [len(v) for v in vals])
                hist.add(np.concatenate(vals), w)
                vals.clear()
                self._buf_wts[c].clear()
        self._buffered = 0

    @property
    def itl(self) -> dict[str, LogHistogram]:
        """Pooled inter-token-latency histogram per length class ("short", "long")."""
        self._flush_itl()
        return self._itl

    def occupancy_change(self, inst, t: float, used: tuple[int, ...] | None = None) -> None:
        """Blocks in use per tier of ``inst`` from time ``t`` (s) on (``used``: per tier, in the
        instance's tier order; default what its pools hold now -- a fast-forwarded stretch passes
        its own, since blocks reserved ahead for later steps are not in use yet)."""
        self.occupancy.change(inst.instance_id, t, inst.kv.used_blocks() if used is None else used)

    def records_frame(self) -> pd.DataFrame:
        """Per-request records sorted by request id (columns :data:`RECORD_COLUMNS`, then
        ``bytes_<key>`` for each of :attr:`extra_bytes`, then ``parent_id`` with parallel
        sampling: one record per child sequence, see :attr:`parent_ids`)."""
        cols = list(RECORD_COLUMNS) + [f"bytes_{k}" for k in self.extra_bytes]
        df = pd.DataFrame.from_records(self.rows, columns=cols)
        if self.parent_ids is not None:
            df["parent_id"] = np.asarray(self.parent_ids, dtype=np.int64)
        return df.sort_values("request_id", kind="stable").reset_index(drop=True)

    def occupancy_frame(self) -> pd.DataFrame:
        """Sampled occupancy: time_s, instance_id, used_blocks_<tier>, capacity_blocks_<tier>."""
        return self.occupancy.frame()
