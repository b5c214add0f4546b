"""Collects what a run produces: per-request records, pooled inter-token latencies per length
class, and KV occupancy samples. Memory grows with requests (records) and scheduling events
(occupancy samples), never with tokens: ITL goes into fixed-size log histograms.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .metrics import LENGTH_CLASSES, RECORD_COLUMNS, LogHistogram, MetricsConfig
from .request import FINISHED, RequestState

class Recorder:
    """Sink for the simulator's measurements.

    Args:
        metrics: the metrics configuration (length-class threshold).
        occupancy_every: keep one occupancy sample in ``occupancy_every`` scheduling events per
            instance (1 keeps all); the first and last are always kept.
    """

    def __init__(self, metrics: MetricsConfig, occupancy_every: int = 1) -> None:
        self.metrics = metrics
        self._itl = {name: LogHistogram() for name in LENGTH_CLASSES}
        self._itl_by_index = [self._itl[name] for name in LENGTH_CLASSES]
        # ITL samples are buffered and binned in batches: one histogram call per ~64k samples
        self._buf_vals: list[list[np.ndarray]] = [[] for _ in LENGTH_CLASSES]
        self._buf_wts: list[list[np.ndarray]] = [[] for _ in LENGTH_CLASSES]
        self._buffered = 0
        self.rows: list[tuple] = []
        self.occupancy: list[tuple] = []
        self.occupancy_every = max(1, int(occupancy_every))
        self._occ_counter: dict[int, int] = {}

    def length_class(self, prompt_tokens: int) -> int:
        """0 for short, 1 for long (``prompt_tokens >= long_prompt_tokens``)."""
        return 1 if prompt_tokens >= self.metrics.long_prompt_tokens else 0

    def record(self, st: RequestState) -> None:
        """Append the final record of a finished or rejected request."""
        self.rows.append((
            st.rid, st.instance_id, st.arrival_s, st.prompt_tokens, st.output_tokens,
            st.req.slo_class, "finished" if st.status == FINISHED else "rejected",
            st.reject_reason, st.first_scheduled_s, st.first_token_s, st.finish_s, st.generated,
            st.preemptions, st.recomputed_tokens, st.prefix_hit_tokens, st.max_itl_s,
            st.bytes_hbm_to_dram, st.bytes_dram_to_hbm, st.bytes_hbm_to_nvme,
            st.bytes_nvme_to_hbm,
        ))

    def add_itl(self, first_gaps: np.ndarray, classes: np.ndarray, shared_gaps: np.ndarray | None) -> None:
        """Add inter-token gaps (s).

        Args:
            first_gaps: one gap per request, shape ``(n,)``.
            classes: length class index of each of those requests, shape ``(n,)``.
            shared_gaps: gaps every one of the ``n`` requests saw (a fast-forwarded stretch),
                shape ``(k,)``; each is counted once per request.
        """
        n_long = int(classes.sum())  # classes are 0 (short) or 1 (long)
        n_short = len(classes) - n_long
        for c, cnt in ((0, n_short), (1, n_long)):
            if not cnt:
                continue
            vals = first_gaps if cnt == len(classes) else first_gaps[classes == c]
            self._buf_vals[c].append(vals)
            self._buf_wts[c].append(np.ones(len(vals), dtype=np.int64))
            self._buffered += len(vals)
            if shared_gaps is not None and len(shared_gaps):
                self._buf_vals[c].append(shared_gaps)
                self._buf_wts[c].append(np.full(len(shared_gaps), cnt, dtype=np.int64))
                self._buffered += len(shared_gaps)
        if self._buffered >= 65536:
            self._flush_itl()

    def _flush_itl(self) -> None:
        for c, hist in enumerate(self._itl_by_index):
            if self._buf_vals[c]:
                hist.add(np.concatenate(self._buf_vals[c]), np.concatenate(self._buf_wts[c]))
                self._buf_vals[c].clear()
                self._buf_wts[c].clear()
        self._buffered = 0

    @property
    def itl(self) -> dict[str, LogHistogram]:
        """Pooled inter-token-latency histogram per length class ("short", "long")."""
        self._flush_itl()
        return self._itl

    def sample_occupancy(self, now: float, inst) -> None:
        """Record the blocks in use per tier of ``inst`` at ``now`` (s)."""
        k = self._occ_counter.get(inst.instance_id, 0)
        self._occ_counter[inst.instance_id] = k + 1
        if k % self.occupancy_every:
            return
        self.occupancy.append((now, inst.instance_id, inst.hbm.used_blocks, inst.hbm.capacity_blocks,
                               inst.dram.used_blocks, inst.dram.capacity_blocks,
                               inst.nvme.used_blocks, inst.nvme.capacity_blocks))

    def records_frame(self) -> pd.DataFrame:
        """Per-request records sorted by request id (columns :data:`RECORD_COLUMNS`)."""
        df = pd.DataFrame.from_records(self.rows, columns=list(RECORD_COLUMNS))
        return df.sort_values("request_id", kind="stable").reset_index(drop=True)

    def occupancy_frame(self) -> pd.DataFrame:
        """Occupancy summed over instances: columns time_s, used_blocks_<tier>, capacity_blocks_<tier>."""
        cols = ["time_s", "instance_id", "used_blocks_hbm", "capacity_blocks_hbm", "used_blocks_dram",
                "capacity_blocks_dram", "used_blocks_nvme", "capacity_blocks_nvme"]
        df = pd.DataFrame.from_records(self.occupancy, columns=cols)
        if df.empty or df["instance_id"].nunique() == 1:
            return df.drop(columns="instance_id")
        # piecewise-constant per instance: forward-fill each instance's last sample, then sum
        parts = []
        for col in cols[2:]:
            wide = df.pivot_table(index="time_s", columns="instance_id", values=col, aggfunc="last")
            parts.append(wide.ffill().fillna(0).sum(axis=1).rename(col))
        return pd.concat(parts, axis=1).reset_index()
