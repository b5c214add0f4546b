"""KV occupancy over time (envs/sim/occupancy.py): the exact time-weighted integral on a
hand-computed series, peaks, one sample per interval, the frame's columns per tier, a
fast-forwarded stretch equal to its step-by-step changes, and a cluster's idle instances."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.occupancy import OccupancyTracker
from kvsched.envs.sim.request import Request, Workload
from simkit import make_spec, run

STANDARD = ("hbm", "dram", "nvme", "pnm")


def test_cluster_utilisation_counts_idle_instances():
    """Four instances of 100 HBM blocks each, one request (round-robin sends it to instance 0).

    Defect (envs/sim/occupancy.py ``OccupancyTracker.summary``): capacities are summed only
    over instances that reported a change, i.e. that ever scheduled. Idle instances (or ones
    that only received rejected requests) vanish, so the cluster's mean HBM utilisation is
    reported as ~0.52 of 100 blocks instead of ~0.13 of the 400 blocks the cluster has.

    Expected: the summary covers every instance of the cluster: total capacity 4 x 100 and a
    mean utilisation of at most a quarter of the busy instance's peak (54 / 100).
    """
    spec = make_spec(hbm_kv_blocks=100, max_num_batched_tokens=2048)
    res = run(Workload.from_requests([Request(0, 0.0, 800, 50)]), spec, n_instances=4)
    hbm = res.summary["kv_occupancy"]["tiers"]["hbm"]
    assert hbm["mean_utilization"] <= 0.25 * 0.54 + 1e-9


def test_time_weighted_integral_and_peaks_on_a_hand_computed_series():
    occ = OccupancyTracker(1.0)
    occ.register(0, STANDARD, (100, 50, 0, 0))
    occ.change(0, 0.0, (10, 0, 0, 0))   # 10 HBM blocks for 2 s
    occ.change(0, 2.0, (30, 5, 0, 0))   # 30 HBM + 5 DRAM blocks for 3 s
    occ.change(0, 5.0, (0, 0, 0, 0))
    s = occ.summary()
    assert s["time_span_s"] == 5.0 and s["samples"] == 3
    hbm, dram, nvme = (s["tiers"][t] for t in ("hbm", "dram", "nvme"))
    assert hbm == {"mean_utilization": (10 * 2 + 30 * 3) / (100 * 5), "max_utilization": 0.3,
                   "max_capacity_blocks": 100, "max_used_blocks": 30}
    assert dram["mean_utilization"] == 5 * 3 / (50 * 5) and dram["max_utilization"] == 0.1
    assert nvme == {"mean_utilization": None, "max_utilization": None, "max_capacity_blocks": 0, "max_used_blocks": 0}


def test_one_sample_per_interval_the_first_change_in_it():
    occ = OccupancyTracker(1.0)
    occ.register(0, STANDARD, (100, 0, 0, 0))
    for t, u in ((0.0, 1), (0.5, 2), (1.2, 3), (1.7, 4), (3.0, 5)):
        occ.change(0, t, (u, 0, 0, 0))
    df = occ.frame()
    assert df["time_s"].tolist() == [0.0, 1.2, 3.0] and df["used_blocks_hbm"].tolist() == [1, 3, 5]


def test_frame_has_a_column_pair_per_tier_of_any_instance_standard_first():
    occ = OccupancyTracker(1.0)
    occ.register(0, ("hbm", "dram", "nvme", "cxl", "pnm"), (100, 10, 0, 40, 0))
    occ.register(1, STANDARD, (200, 0, 0, 0))
    occ.change(1, 0.5, (7, 0, 0, 0))
    occ.change(0, 0.5, (9, 1, 0, 3, 0))
    df = occ.frame()
    assert list(df.columns) == ["time_s", "instance_id",
                                "used_blocks_hbm", "capacity_blocks_hbm", "used_blocks_dram", "capacity_blocks_dram",
                                "used_blocks_nvme", "capacity_blocks_nvme", "used_blocks_pnm", "capacity_blocks_pnm",
                                "used_blocks_cxl", "capacity_blocks_cxl"]
    assert df["instance_id"].tolist() == [0, 1]  # sorted by time, then instance
    assert df["used_blocks_cxl"].tolist() == [3, 0] and df["capacity_blocks_cxl"].tolist() == [40, 0]
    assert occ.tier_names == ["hbm", "dram", "nvme", "pnm", "cxl"]


@pytest.mark.parametrize("k", [10, 200])  # the scalar path (<= 64 steps) and the NumPy path
def test_a_stretch_is_exactly_its_step_by_step_changes(k):
    rng = np.random.default_rng(k)
    ends = np.cumsum(rng.uniform(0.01, 0.2, k)) + 0.3
    used = np.cumsum(rng.integers(0, 3, k)) + 20
    end_used = used - rng.integers(0, 5, k)

    def tracker():
        occ = OccupancyTracker(0.5)
        occ.register(0, STANDARD, (400, 30, 0, 0))
        occ.change(0, 0.3, (int(used[0]), 3, 0, 0))  # the stretch's first step starts at 0.3 s
        return occ

    fast = tracker()
    fast.stretch(0, ends, used, hbm_end_used=end_used)
    fast.change(0, float(ends[-1]), (int(end_used[-1]), 3, 0, 0))
    slow = tracker()
    for j in range(k - 1):
        slow.change(0, float(ends[j]), (int(end_used[j]), 3, 0, 0))
        slow.change(0, float(ends[j]), (int(used[j + 1]), 3, 0, 0))
    slow.change(0, float(ends[-1]), (int(end_used[-1]), 3, 0, 0))
    assert fast.summary() == slow.summary()
    pd.testing.assert_frame_equal(fast.frame(), slow.frame(), check_exact=True)


def test_bad_interval_and_tier_list_are_refused():
    with pytest.raises(ValueError, match="interval_s=0"):
        OccupancyTracker(0)
    occ = OccupancyTracker()
    with pytest.raises(ValueError, match="2 tier names but 3 capacities"):
        occ.register(0, ("hbm", "pnm"), (1, 2, 3))
    assert occ.summary() == {"time_span_s": None, "samples": 0, "tiers": {}}
    occ.register(0, STANDARD, (1, 0, 0, 0))
    assert occ.summary() == {"time_span_s": None, "samples": 0, "tiers": {}}  # registered, never changed
