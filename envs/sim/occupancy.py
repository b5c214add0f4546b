"""KV occupancy per tier over time: exact time-weighted statistics plus a sampled series.

Occupancy (blocks in use, i.e. referenced by a request, per tier) is piecewise constant: it
changes only when a step is planned (allocation), a step ends (frees) or a transfer lands.
The tracker integrates ``used_blocks x seconds`` exactly at each change point, keeps the peak,
and keeps one sample per ``interval_s`` of simulated time for plots (the first change point
in each interval). A fast-forwarded stretch reports its per-step values at once; the float
operations are the same, in the same order, as stepping one by one, so results are identical
with and without fast-forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

TIERS: tuple[str, ...] = ("hbm", "dram", "nvme", "pnm")
N_TIERS = len(TIERS)  # OccupancyTracker.change and _stretch_scalar unroll these four


class _InstanceOccupancy:
    __slots__ = ("capacity", "prev_t", "prev_used", "first_t", "integral", "peak", "last_cell")

    def __init__(self, capacity: tuple[int, ...]) -> None:
        self.capacity = capacity
        self.prev_t = float("nan")
        self.prev_used = (0,) * N_TIERS
        self.first_t = float("nan")
        self.integral = [0.0] * N_TIERS
        self.peak = [0] * N_TIERS
        self.last_cell = -1


class OccupancyTracker:
    """Tracks the blocks in use per tier of each instance.

    Args:
        interval_s: spacing (simulated seconds) of the kept samples; > 0.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"occupancy interval_s={interval_s!r} must be > 0")
        self.interval_s = float(interval_s)
        self._inst: dict[int, _InstanceOccupancy] = {}
        self.samples: list[tuple] = []

    def register(self, inst_id: int, capacity: tuple[int, ...]) -> None:
        """Declare an instance and its capacity per tier (counted even if it never runs)."""
        self._state(inst_id, capacity)

    def _state(self, inst_id: int, capacity: tuple[int, ...]) -> _InstanceOccupancy:
        s = self._inst.get(inst_id)
        if s is None:
            s = self._inst[inst_id] = _InstanceOccupancy(capacity)
        return s

    def change(self, inst_id: int, t: float, used: tuple[int, ...],
               capacity: tuple[int, ...]) -> None:
        """Occupancy of ``inst_id`` is ``used`` (blocks per tier) from time ``t`` (s) on."""
        s = self._inst.get(inst_id)
        if s is None:
            s = self._state(inst_id, capacity)
        # the four tiers unrolled (called at every step's planning and end)
        u0, u1, u2, u3 = used
        prev_t = s.prev_t
        if prev_t == prev_t:  # not NaN: integrate the previous value over [prev_t, t)
            dt = t - prev_t
            integral = s.integral
            p0, p1, p2, p3 = s.prev_used
            integral[0] = integral[0] + p0 * dt
            integral[1] = integral[1] + p1 * dt
            integral[2] = integral[2] + p2 * dt
            integral[3] = integral[3] + p3 * dt
        else:
            s.first_t = t
        peak = s.peak
        if u0 > peak[0]:
            peak[0] = u0
        if u1 > peak[1]:
            peak[1] = u1
        if u2 > peak[2]:
            peak[2] = u2
        if u3 > peak[3]:
            peak[3] = u3
        s.prev_t = t
        s.prev_used = used
        cell = int(t // self.interval_s)
        if cell > s.last_cell:
            s.last_cell = cell
            self.samples.append((t, inst_id) + tuple(used) + tuple(capacity))

    def stretch(self, inst_id: int, ends: np.ndarray, hbm_used: np.ndarray,
                pnm_used: np.ndarray | None = None, hbm_end_used: np.ndarray | None = None) -> None:
        """A fast-forwarded stretch: step ``k`` held ``hbm_used[k]`` HBM blocks until ``ends[k]``.

        Equivalent to, for each interior step end ``ends[k]`` (k < K-1): ``change`` with the
        value before the next allocation (``hbm_end_used[k]``: after the frees of requests that
        finished in step ``k``; ``hbm_used[k]`` when not given) then with ``hbm_used[k+1]``. The
        last step's end is reported by the caller with ``change`` (after its frees). DRAM and
        NVMe stay constant inside a stretch; PNM too unless ``pnm_used`` (same form as
        ``hbm_used``) is given (PNM-resident decodes grow there). Shapes: ``(K,)`` each.
        """
        k = len(ends)
        s = self._inst[inst_id]
        if k < 2:
            return
        if k <= self._SCALAR_STEPS and pnm_used is None:
            self._stretch_scalar(s, inst_id, ends.tolist(), hbm_used.tolist(),
                                 None if hbm_end_used is None else hbm_end_used.tolist())
            return
        sampled = hbm_used if hbm_end_used is None else hbm_end_used
        t_int = ends[:-1]
        prev = np.empty(k - 1)
        prev[0] = s.prev_t
        prev[1:] = t_int[:-1]
        dt = t_int - prev
        held = hbm_used[:-1].astype(np.float64)
        acc = np.empty(k)
        acc[0] = s.integral[0]
        acc[1:] = held * dt
        s.integral[0] = float(np.cumsum(acc)[-1])
        if pnm_used is not None:
            acc[0] = s.integral[3]
            acc[1:] = pnm_used[:-1].astype(np.float64) * dt
            s.integral[3] = float(np.cumsum(acc)[-1])
            top_p = int(pnm_used.max())
            if top_p > s.peak[3]:
                s.peak[3] = top_p
        for i in ((1, 2) if pnm_used is not None else (1, 2, 3)):
            if s.prev_used[i]:
                acc[0] = s.integral[i]
                acc[1:] = s.prev_used[i] * dt
                s.integral[i] = float(np.cumsum(acc)[-1])
            # x + 0.0 == x: a zero tier needs no additions
        top = int(hbm_used.max())
        if top > s.peak[0]:
            s.peak[0] = top
        cells = np.floor_divide(t_int, self.interval_s).astype(np.int64)
        new = np.flatnonzero(cells > np.maximum.accumulate(np.concatenate([[s.last_cell], cells[:-1]])))
        for j in new.tolist():
            self.samples.append((float(t_int[j]), inst_id, int(sampled[j]), s.prev_used[1], s.prev_used[2],
                                 s.prev_used[3] if pnm_used is None else int(pnm_used[j])) + tuple(s.capacity))
        if len(new):
            s.last_cell = int(cells[new[-1]])
        s.prev_t = float(t_int[-1])
        s.prev_used = (int(hbm_used[-1]), s.prev_used[1], s.prev_used[2],
                       s.prev_used[3] if pnm_used is None else int(pnm_used[-1]))

    #: Stretches up to this many steps are integrated with Python floats (fewer calls).
    _SCALAR_STEPS = 64

    def _stretch_scalar(self, s: _InstanceOccupancy, inst_id: int, ends: list[float], used: list[int],
                        end_used: list[int] | None = None) -> None:
        """:meth:`stretch` for a short stretch: the same float operations in the same order
        (``x + u * dt`` per step end, as the cumulative sums do), one Python pass."""
        if end_used is None:
            end_used = used
        prev_t = s.prev_t
        i0, i1, i2, i3 = s.integral
        u1, u2, u3 = s.prev_used[1], s.prev_used[2], s.prev_used[3]
        iv = self.interval_s
        last_cell = s.last_cell
        samples = self.samples
        for j in range(len(ends) - 1):
            t = ends[j]
            dt = t - prev_t
            i0 = i0 + float(used[j]) * dt
            if u1:
                i1 = i1 + u1 * dt
            if u2:
                i2 = i2 + u2 * dt
            if u3:  # PNM: constant inside a stretch without PNM-resident decodes
                i3 = i3 + u3 * dt
            cell = int(t // iv)
            if cell > last_cell:
                last_cell = cell
                samples.append((t, inst_id, end_used[j], u1, u2, u3) + tuple(s.capacity))
            prev_t = t
        s.integral[0], s.integral[1], s.integral[2], s.integral[3] = i0, i1, i2, i3
        top = max(used)
        if top > s.peak[0]:
            s.peak[0] = top
        s.last_cell = last_cell
        s.prev_t = prev_t
        s.prev_used = (used[-1], u1, u2, u3)

    def frame(self) -> pd.DataFrame:
        """Samples: time_s, instance_id, used_blocks_<tier>, capacity_blocks_<tier>."""
        cols = ["time_s", "instance_id"] + [f"used_blocks_{t}" for t in TIERS] + [f"capacity_blocks_{t}" for t in TIERS]
        df = pd.DataFrame.from_records(self.samples, columns=cols)
        order = ["time_s", "instance_id"]
        for t in TIERS:
            order += [f"used_blocks_{t}", f"capacity_blocks_{t}"]
        return df[order].sort_values(["time_s", "instance_id"], kind="stable").reset_index(drop=True)

    def summary(self) -> dict[str, Any]:
        """Time-weighted mean and peak utilisation per tier over the run.

        Over a cluster: ``mean_utilization`` = sum of used-block-seconds / (sum of capacities x
        span from the first to the last change anywhere); ``max_utilization`` and
        ``max_used_blocks`` are the largest per-instance peaks.
        """
        if not self._inst:
            return {"time_span_s": None, "samples": 0, "tiers": {}}
        active = [s for s in self._inst.values() if s.first_t == s.first_t]
        if not active:
            return {"time_span_s": None, "samples": 0, "tiers": {}}
        first = min(s.first_t for s in active)
        last = max(s.prev_t for s in active)
        span = last - first
        tiers: dict[str, Any] = {}
        for i, name in enumerate(TIERS):
            cap = sum(s.capacity[i] for s in self._inst.values())
            peak_used = max(s.peak[i] for s in self._inst.values())
            if cap <= 0:
                tiers[name] = {"mean_utilization": None, "max_utilization": None,
                               "max_capacity_blocks": 0, "max_used_blocks": peak_used}
                continue
            integral = sum(s.integral[i] for s in self._inst.values())
            mean = float(integral / (cap * span)) if span > 0 else None
            tiers[name] = {
                "mean_utilization": mean,
                "max_utilization": max(s.peak[i] / s.capacity[i] for s in self._inst.values() if s.capacity[i]),
                "max_capacity_blocks": max(s.capacity[i] for s in self._inst.values()),
                "max_used_blocks": peak_used,
            }
        return {"time_span_s": float(span), "samples": len(self.samples), "tiers": tiers}
