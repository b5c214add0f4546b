"""The seeded step-time noise (kvsched.envs.sim.step_noise): neutral when off, byte-exact per
seed, different across seeds, mean-one factor, per-instance streams, validated fields."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.specs import CostParams
from kvsched.envs.sim.step_noise import StepNoise, step_noise_for
from kvsched.runner.simulate import simulate
from kvsched.envs.sim.instance import InstanceOptions

from simkit import assert_identical, make_spec, run, short_only

NOISY = dict(step_time_sigma=0.2, hiccup_probability=0.05, hiccup_mean_s=0.02)


def _spec(**cost):
    return make_spec(cost=dataclasses.replace(CostParams(), **cost))


def _sim(w, spec, seed, ff=True, n_instances=1):
    return simulate(w, spec, "fcfs", n_instances=n_instances, seed=seed,
                    options=InstanceOptions(fast_forward=ff, check_invariants=True))


@pytest.fixture(scope="module")
def workload():
    return short_only(rate=6.0, dur=10.0, seed=3)


def test_noise_off_by_default_draws_nothing_and_ignores_the_seed(workload):
    spec = _spec()
    assert step_noise_for(spec.cost_params, 0, 0) is None
    base = run(workload, spec)  # fast-forward on, seed 0: today's path
    assert_identical(base, _sim(workload, spec, seed=11))
    assert_identical(base, _sim(workload, spec, seed=11, ff=False))


def test_hiccup_without_length_or_probability_is_off():
    assert not CostParams(hiccup_probability=0.1).step_noise_on
    assert not CostParams(hiccup_mean_s=0.1).step_noise_on
    assert CostParams(hiccup_probability=0.1, hiccup_mean_s=0.1).step_noise_on
    assert CostParams(step_time_sigma=0.01).step_noise_on


def test_same_seed_gives_byte_identical_records_with_noise_on(workload):
    spec = _spec(**NOISY)
    a = _sim(workload, spec, seed=5)
    assert_identical(a, _sim(workload, spec, seed=5))
    # fast-forward is turned off under noise, so asking for it changes nothing
    assert_identical(a, _sim(workload, spec, seed=5, ff=False))


def test_different_seeds_give_different_step_times(workload):
    spec = _spec(**NOISY)
    a, b = _sim(workload, spec, seed=1).records, _sim(workload, spec, seed=2).records
    assert not np.array_equal(a["first_token_s"].to_numpy(), b["first_token_s"].to_numpy())
    pd.testing.assert_series_equal(a["arrival_s"], b["arrival_s"])  # the workload is the same


def test_noise_moves_the_latencies_of_a_run(workload):
    off = _sim(workload, _spec(), seed=0).records
    on = _sim(workload, _spec(**NOISY), seed=0).records
    assert not np.array_equal(off["finish_s"].to_numpy(), on["finish_s"].to_numpy())


def test_instances_of_one_cluster_draw_separate_streams():
    c = CostParams(step_time_sigma=0.3)
    a = [StepNoise(c, 7, 0).apply(1.0) for _ in range(5)]
    b = [StepNoise(c, 7, 1).apply(1.0) for _ in range(5)]
    assert a != b


def test_lognormal_factor_has_mean_one_and_the_configured_sigma():
    c = CostParams(step_time_sigma=0.25)
    n = StepNoise(c, 3, 0)
    f = np.array([n.apply(1.0) for _ in range(20_000)])
    assert abs(f.mean() - 1.0) < 0.01
    assert abs(np.log(f).std() - 0.25) < 0.01
    assert n.hiccups == 0 and n.steps == 20_000


def test_hiccups_have_the_configured_rate_and_mean():
    c = CostParams(step_time_sigma=0.0, hiccup_probability=0.1, hiccup_mean_s=0.03)
    n = StepNoise(c, 4, 0)
    extra = np.array([n.apply(0.01) - 0.01 for _ in range(20_000)])
    hit = extra > 0
    assert abs(hit.mean() - 0.1) < 0.01
    assert abs(extra[hit].mean() - 0.03) < 0.003
    assert n.hiccups == int(hit.sum())


@pytest.mark.parametrize("field,value", [("step_time_sigma", -0.1), ("step_time_sigma", 1.5),
                                         ("front_end_hiccup_probability", 1.0), ("front_end_hiccup_mean_s", -1.0),
                                         ("hiccup_probability", 1.0), ("hiccup_probability", -0.01),
                                         ("hiccup_mean_s", -1e-3), ("hiccup_mean_s", float("nan"))])
def test_tail_fields_out_of_range_are_one_line_errors(field, value):
    with pytest.raises(ConfigError, match=field) as e:
        CostParams(**{field: value})
    assert "\n" not in str(e.value)


FRONT = dict(front_end_hiccup_probability=0.2, front_end_hiccup_mean_s=0.05)


def test_front_end_hiccups_are_seeded_per_request_and_off_by_default(workload):
    from kvsched.envs.sim.step_noise import front_end_hiccups_s

    assert front_end_hiccups_s(CostParams(), 0, 10) is None
    assert front_end_hiccups_s(CostParams(front_end_hiccup_probability=0.5), 0, 10) is None  # no length
    c = CostParams(**FRONT)
    a = front_end_hiccups_s(c, 3, 20_000)
    assert np.array_equal(a, front_end_hiccups_s(c, 3, 20_000))
    assert not np.array_equal(a, front_end_hiccups_s(c, 4, 20_000))
    assert abs((a > 0).mean() - 0.2) < 0.01 and abs(a[a > 0].mean() - 0.05) < 0.003
    spec = _spec(**FRONT)
    r1, r2 = _sim(workload, spec, seed=1), _sim(workload, spec, seed=1)
    assert_identical(r1, r2)
    off = _sim(workload, _spec(), seed=1).records
    late = r1.records["first_token_s"].to_numpy() - off["first_token_s"].to_numpy()
    assert (late > 0.01).any()  # some requests reach the engine late


def test_instances_of_one_cluster_must_share_the_front_end_hiccups():
    from kvsched.envs.sim.cluster import Cluster
    from kvsched.policies.base import make_policy

    with pytest.raises(ConfigError, match="front_end_hiccup_probability") as e:
        Cluster([_spec(), _spec(**FRONT)], lambda: make_policy("fcfs"))
    assert "\n" not in str(e.value)


def test_a_calibrated_h100_beside_an_uncalibrated_gpu_shares_the_front_end_and_other_values_are_refused():
    """A GPU without a calibration file takes the H100 calibration's host-side fields, so a
    cluster mixing the two builds with one front end (docs/disaggregation.md, Limits); an instance
    whose `cost:` gives other front-end values is refused naming what differs and how to align it,
    in one line."""
    import dataclasses

    from kvsched.envs.sim.cluster import Cluster
    from kvsched.envs.sim.specs import get_gpu
    from kvsched.policies.base import make_policy

    h100, h200, l40s = make_spec(), make_spec(gpu=get_gpu("H200")), make_spec(gpu=get_gpu("L40S"))
    assert h200.cost_params == h100.cost_params  # same chip: the H100 calibration whole
    assert l40s.cost_params.request_overhead_s == h100.cost_params.request_overhead_s
    assert l40s.cost_params.mbu != h100.cost_params.mbu  # GPU-side fields stay the L40S's own defaults
    Cluster([h100, h200, l40s], lambda: make_policy("fcfs"))
    other = dataclasses.replace(h200, cost=dataclasses.replace(h200.cost_params, request_overhead_s=0.01))
    with pytest.raises(ConfigError, match="request_overhead_s") as e:
        Cluster([h100, other], lambda: make_policy("fcfs"))
    msg = str(e.value)
    assert "\n" not in msg and "instance 1 (H200)" in msg and "cost:" in msg


def test_front_end_hiccups_keep_fast_forward_equal_to_stepping(workload):
    spec = _spec(**FRONT)
    assert_identical(_sim(workload, spec, seed=2, ff=True), _sim(workload, spec, seed=2, ff=False))
