"""KV occupancy per tier over time: exact time-weighted statistics plus a sampled series.

Occupancy (blocks in use, i.e. referenced by a request, per tier) is piecewise constant: it
changes only when a step is planned (allocation), a step ends (frees) or a transfer lands.
The tracker integrates ``used_blocks x seconds`` exactly at each change point, keeps the peak,
and keeps one sample per ``interval_s`` of simulated time for plots (the first change point
in each interval). A fast-forwarded stretch reports its per-step values at once; the float
operations are the same, in the same order, as stepping one by one, so results are identical
with and without fast-forward.

Tiers are data (:mod:`kvsched.envs.sim.tiers`): each instance registers its tier names; the
frame and the summary have one column pair / entry per tier name of any instance (standard tiers
first, then extra tiers in the order first seen; 0 for an instance without that tier).
"""

from __future__ import annotations

from .errors import bounded_repr

from typing import Any, Sequence

import numpy as np
import pandas as pd

from .tiers import STANDARD_TIERS

#: The standard tiers, always present in the frame and the summary.
TIERS: tuple[str, ...] = STANDARD_TIERS


class _InstanceOccupancy:
    __slots__ = ("names", "capacity", "prev_t", "prev_used", "first_t", "integral", "peak", "last_cell", "pnm",
                 "lower_in_use")

    def __init__(self, names: tuple[str, ...], capacity: tuple[int, ...]) -> None:
        self.names = names
        self.capacity = capacity
        self.prev_t = float("nan")
        self.prev_used = (0,) * len(names)
        self.first_t = float("nan")
        self.integral = [0.0] * len(names)
        self.peak = [0] * len(names)
        self.last_cell = -1
        self.pnm = names.index("pnm") if "pnm" in names else -1
        self.lower_in_use = False  # a tier other than HBM holds blocks in prev_used


class OccupancyTracker:
    """Tracks the blocks in use per tier of each instance.

    Args:
        interval_s: spacing (simulated seconds) of the kept samples; > 0.

    Raises:
        ValueError: ``interval_s`` not > 0.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"occupancy interval_s={bounded_repr(interval_s)} must be > 0")
        self.interval_s = float(interval_s)
        self._inst: dict[int, _InstanceOccupancy] = {}
        self._names: list[str] = list(TIERS)
        self.samples: list[tuple] = []

    def register(self, inst_id: int, tier_names: Sequence[str], capacity: Sequence[int]) -> None:
        """Declare an instance, its tier names (HBM first, PNM last) and capacity per tier
        (counted even if it never runs)."""
        names = tuple(tier_names)
        if len(names) != len(capacity):
            raise ValueError(f"instance {inst_id}: {len(names)} tier names but {len(capacity)} capacities")
        self._inst[inst_id] = _InstanceOccupancy(names, tuple(int(c) for c in capacity))
        for n in names:
            if n not in self._names:
                self._names.append(n)

    @property
    def tier_names(self) -> list[str]:
        """Every tier name of the registered instances (standard ones first)."""
        return list(self._names)

    def change(self, inst_id: int, t: float, used: tuple[int, ...]) -> None:
        """Occupancy of ``inst_id`` is ``used`` (blocks per tier, its tier order) from time ``t`` (s) on."""
        s = self._inst[inst_id]
        prev_t = s.prev_t
        prev = s.prev_used
        if prev_t == prev_t:  # not NaN: integrate the previous value over [prev_t, t)
            dt = t - prev_t
            integral = s.integral
            integral[0] = integral[0] + prev[0] * dt  # HBM
            if s.lower_in_use:  # x + 0 * dt == x: empty tiers need no addition
                for i in range(1, len(prev)):
                    p = prev[i]
                    if p:
                        integral[i] = integral[i] + p * dt
        else:
            s.first_t = t
        peak = s.peak
        if used[0] > peak[0]:
            peak[0] = used[0]
        s.lower_in_use = any(used[1:])
        if s.lower_in_use:
            for i in range(1, len(used)):
                if used[i] > peak[i]:
                    peak[i] = used[i]
        s.prev_t = t
        s.prev_used = used
        cell = int(t // self.interval_s)
        if cell > s.last_cell:
            s.last_cell = cell
            self.samples.append((t, inst_id, used))

    def stretch(self, inst_id: int, ends: np.ndarray, hbm_used: np.ndarray,
                pnm_used: np.ndarray | None = None, hbm_end_used: np.ndarray | None = None) -> None:
        """A fast-forwarded stretch: step ``k`` held ``hbm_used[k]`` HBM blocks until ``ends[k]``.

        Equivalent to, for each interior step end ``ends[k]`` (k < K-1): ``change`` with the
        value before the next allocation (``hbm_end_used[k]``: after the frees of requests that
        finished in step ``k``; ``hbm_used[k]`` when not given) then with ``hbm_used[k+1]``. The
        last step's end is reported by the caller with ``change`` (after its frees). Lower tiers
        stay constant inside a stretch; PNM too unless ``pnm_used`` (same form as ``hbm_used``)
        is given (PNM-resident decodes grow there). Shapes: ``(K,)`` each.
        """
        k = len(ends)
        s = self._inst[inst_id]
        if k < 2:
            return
        if k <= self._SCALAR_STEPS and pnm_used is None:
            self._stretch_scalar(s, inst_id, ends.tolist(), hbm_used.tolist(),
                                 None if hbm_end_used is None else hbm_end_used.tolist())
            return
        t_int = ends[:-1]
        prev = np.empty(k - 1)
        prev[0] = s.prev_t
        prev[1:] = t_int[:-1]
        dt = t_int - prev
        acc = np.empty(k)
        self._integrate(s, 0, acc, hbm_used[:-1].astype(np.float64) * dt)
        ip = s.pnm
        if pnm_used is not None:
            self._integrate(s, ip, acc, pnm_used[:-1].astype(np.float64) * dt)
            top_p = int(pnm_used.max())
            if top_p > s.peak[ip]:
                s.peak[ip] = top_p
        for i in range(1, len(s.names)):
            if s.prev_used[i] and not (pnm_used is not None and i == ip):
                self._integrate(s, i, acc, s.prev_used[i] * dt)  # x + 0.0 == x: a zero tier needs no additions
        top = int(hbm_used.max())
        if top > s.peak[0]:
            s.peak[0] = top
        self._sample_stretch(s, inst_id, t_int, hbm_used if hbm_end_used is None else hbm_end_used, pnm_used)
        s.prev_t = float(t_int[-1])
        last = list(s.prev_used)
        last[0] = int(hbm_used[-1])
        if pnm_used is not None:
            last[ip] = int(pnm_used[-1])
        s.prev_used = tuple(last)
        s.lower_in_use = any(s.prev_used[1:])

    @staticmethod
    def _integrate(s: _InstanceOccupancy, i: int, acc: np.ndarray, terms: np.ndarray) -> None:
        """``integral[i]`` plus ``terms`` added one by one (a cumulative sum: the same float
        additions, in the same order, as one ``change`` per step end)."""
        acc[0] = s.integral[i]
        acc[1:] = terms
        s.integral[i] = float(np.cumsum(acc)[-1])

    def _sample_stretch(self, s: _InstanceOccupancy, inst_id: int, t_int: np.ndarray, sampled: np.ndarray,
                        pnm_used: np.ndarray | None) -> None:
        """Keep the samples of a stretch's interior step ends that open a new interval."""
        cells = np.floor_divide(t_int, self.interval_s).astype(np.int64)
        new = np.flatnonzero(cells > np.maximum.accumulate(np.concatenate([[s.last_cell], cells[:-1]])))
        row = list(s.prev_used)
        for j in new.tolist():
            row[0] = int(sampled[j])
            if pnm_used is not None:
                row[s.pnm] = int(pnm_used[j])
            self.samples.append((float(t_int[j]), inst_id, tuple(row)))
        if len(new):
            s.last_cell = int(cells[new[-1]])

    #: Stretches up to this many steps are integrated with Python floats (fewer calls).
    _SCALAR_STEPS = 64

    def _stretch_scalar(self, s: _InstanceOccupancy, inst_id: int, ends: list[float], used: list[int],
                        end_used: list[int] | None = None) -> None:
        """:meth:`stretch` for a short stretch: the same float operations in the same order
        (``x + u * dt`` per step end, as the cumulative sums do), one Python pass."""
        if end_used is None:
            end_used = used
        prev_t = s.prev_t
        integral = s.integral
        i0 = integral[0]
        # the constant tiers of the stretch (all but HBM), integrated only when not empty
        const = [(i, u) for i, u in enumerate(s.prev_used) if i and u]
        iv = self.interval_s
        last_cell = s.last_cell
        samples = self.samples
        row = list(s.prev_used)
        for j in range(len(ends) - 1):
            t = ends[j]
            dt = t - prev_t
            i0 = i0 + float(used[j]) * dt
            for i, u in const:
                integral[i] = integral[i] + u * dt
            cell = int(t // iv)
            if cell > last_cell:
                last_cell = cell
                row[0] = end_used[j]
                samples.append((t, inst_id, tuple(row)))
            prev_t = t
        integral[0] = i0
        top = max(used)
        if top > s.peak[0]:
            s.peak[0] = top
        s.last_cell = last_cell
        s.prev_t = prev_t
        row[0] = used[-1]
        s.prev_used = tuple(row)
        s.lower_in_use = any(s.prev_used[1:])

    def frame(self) -> pd.DataFrame:
        """Samples: ``time_s``, ``instance_id``, then ``used_blocks_<tier>``,
        ``capacity_blocks_<tier>`` per tier of :attr:`tier_names` (0 where an instance lacks it)."""
        names = self._names
        index = {n: i for i, n in enumerate(names)}
        caps: dict[int, list[int]] = {}
        where: dict[int, list[int]] = {}
        for inst_id, s in self._inst.items():
            cap = [0] * len(names)
            for n, c in zip(s.names, s.capacity):
                cap[index[n]] = c
            caps[inst_id] = cap
            where[inst_id] = [index[n] for n in s.names]
        rows = []
        for t, inst_id, used in self.samples:
            row = [t, inst_id]
            u = [0] * len(names)
            for j, v in zip(where[inst_id], used):
                u[j] = v
            for k in range(len(names)):
                row.append(u[k])
                row.append(caps[inst_id][k])
            rows.append(row)
        cols = ["time_s", "instance_id"]
        for n in names:
            cols += [f"used_blocks_{n}", f"capacity_blocks_{n}"]
        df = pd.DataFrame.from_records(rows, columns=cols)
        return df.sort_values(["time_s", "instance_id"], kind="stable").reset_index(drop=True)

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
        for name in self._names:
            tiers[name] = self._tier_summary(name, span)
        return {"time_span_s": float(span), "samples": len(self.samples), "tiers": tiers}

    def _tier_summary(self, name: str, span: float) -> dict[str, Any]:
        per = [(s, s.names.index(name)) for s in self._inst.values() if name in s.names]
        cap = sum(s.capacity[i] for s, i in per)
        peak_used = max((s.peak[i] for s, i in per), default=0)
        if cap <= 0:
            return {"mean_utilization": None, "max_utilization": None, "max_capacity_blocks": 0,
                    "max_used_blocks": peak_used}
        integral = sum(s.integral[i] for s, i in per)
        mean = float(integral / (cap * span)) if span > 0 else None
        return {
            "mean_utilization": mean,
            "max_utilization": max(s.peak[i] / s.capacity[i] for s, i in per if s.capacity[i]),
            "max_capacity_blocks": max(s.capacity[i] for s, i in per),
            "max_used_blocks": peak_used,
        }
