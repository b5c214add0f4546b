"""LogHistogram (envs/sim/histogram.py): bin widths, percentiles against NumPy, weights, merging,
edges, serialisation, and identical binning on every code path."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.histogram import LogHistogram


def test_histogram_bins_are_narrow_enough():
    e = LogHistogram.EDGES
    assert e[0] == pytest.approx(1e-6) and e[-1] == pytest.approx(1e4)
    assert np.max(e[1:] / e[:-1]) <= 1.005


def test_histogram_percentiles_match_numpy_within_half_percent():
    # Tolerance: 0.5 % relative. Bin edges differ by <= 0.5 % and the answer is the geometric
    # bin midpoint (<= 0.25 % from any value in the bin); with 100k samples the rank
    # convention (inverted CDF vs numpy's linear interpolation) moves it by far less.
    x = np.random.default_rng(0).lognormal(mean=-3.0, sigma=1.0, size=100_000)
    h = LogHistogram()
    h.add(x)
    assert h.count == x.size
    assert h.mean == pytest.approx(x.mean(), rel=1e-12)
    assert h.min == x.min() and h.max == x.max()
    for q in (1, 10, 25, 50, 75, 90, 99, 99.9):
        exact = np.percentile(x, q)
        assert abs(h.percentile(q) - exact) / exact <= 0.005, q
    assert h.percentile(0) == x.min() and h.percentile(100) == x.max()


def test_histogram_weights_equal_repeated_adds():
    vals = np.array([0.01, 0.5, 3.0, 0.01])
    w = np.array([3, 0, 5, 2])
    hw = LogHistogram()
    hw.add(vals, w)
    hr = LogHistogram()
    for v, k in zip(vals, w):
        for _ in range(k):
            hr.add(float(v))
    ha = LogHistogram()
    for v, k in zip(vals, w):
        ha.add_repeated(float(v), int(k))
    for h in (hr, ha):
        assert np.array_equal(hw.counts, h.counts)
        assert hw.count == h.count == 10
        assert hw.min == h.min == 0.01 and hw.max == h.max == 3.0  # 0.5 had weight 0
        assert hw.mean == pytest.approx(h.mean, rel=1e-12)
        assert hw.percentile(50) == h.percentile(50)


def test_histogram_small_and_large_batches_agree():
    x = np.random.default_rng(2).lognormal(-2, 2, 2000)  # > small-batch cutoff
    big = LogHistogram()
    big.add(x)
    small = LogHistogram()
    for chunk in np.array_split(x, 200):
        small.add(chunk)
    assert np.array_equal(big.counts, small.counts)


def test_histogram_merge_equals_adding_both():
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(-3, 1, 5000), rng.lognormal(0, 1, 300)
    ha, hb, hab = LogHistogram(), LogHistogram(), LogHistogram()
    ha.add(a)
    hb.add(b)
    hab.add(np.concatenate([a, b]))
    m = ha.copy().merge(hb)
    assert np.array_equal(m.counts, hab.counts)
    assert (m.count, m.min, m.max) == (hab.count, hab.min, hab.max)
    assert m.mean == pytest.approx(hab.mean, rel=1e-12)
    for q in (50, 90, 99):
        assert m.percentile(q) == hab.percentile(q)
    assert ha.count == 5000  # the copy was merged, not ha


def test_histogram_empty_and_edges():
    h = LogHistogram()
    assert h.count == 0
    assert math.isnan(h.mean) and math.isnan(h.percentile(50)) and math.isnan(h.percentile(0))
    assert h.to_dict()["min_s"] is None
    h.add(np.array([0.0, 1e-7, 1e5]))
    assert h.counts[0] == 2 and h.counts[-1] == 1  # underflow to bin 0, overflow bin
    assert h.percentile(90) == 1e5  # overflow bin answers with the exact max
    assert h.percentile(0) == 0.0
    assert 0.0 <= h.percentile(50) <= 1.005e-6
    with pytest.raises(ConfigError, match="value"):
        h.add(np.array([0.1, -1.0]))
    with pytest.raises(ConfigError, match="value"):
        h.add(float("nan"))
    with pytest.raises(ConfigError, match="weight"):
        h.add(np.array([0.1]), np.array([-1]))
    with pytest.raises(ConfigError, match="q="):
        h.percentile(101)
    assert h.count == 3  # failed adds changed nothing


def test_histogram_to_dict_round_trip():
    h = LogHistogram()
    h.add(np.random.default_rng(4).lognormal(-3, 1, 1000))
    d = h.to_dict()
    json.dumps(d)
    r = LogHistogram.from_dict(json.loads(json.dumps(d)))
    assert np.array_equal(r.counts, h.counts)
    assert (r.count, r.sum, r.min, r.max) == (h.count, h.sum, h.min, h.max)


def test_histogram_bin_convention_and_geometric_midpoint():
    e = LogHistogram.EDGES
    k = 2000
    h = LogHistogram()
    h.add(e[k])  # bins are (e[i], e[i+1]]: an exact edge belongs to the bin below
    assert h.counts[k - 1] == 1
    h = LogHistogram()
    a = e[k] * 1.0001  # just above the lower edge of bin k
    h.add(np.array([a, 1.0]))
    # rank 1 lies in bin k: the answer is its geometric midpoint (inside [min, max])
    assert h.percentile(50) == pytest.approx(math.sqrt(e[k] * e[k + 1]), rel=1e-12)
    assert h.percentile(50) / a - 1 <= 0.0025


def test_histogram_batch_and_scalar_paths_agree_on_edges():
    # exact edges, values just around them, underflow and overflow: the large-batch (log10)
    # path, the small-batch (searchsorted) path and the scalar path must bin identically
    e = LogHistogram.EDGES
    vals = np.concatenate([e, np.nextafter(e, 0), np.nextafter(e, np.inf), [0.0, 1e-9, 2e4]])
    big = LogHistogram()
    big.add(vals)
    small = LogHistogram()
    for chunk in np.array_split(vals, 200):
        small.add(chunk)
    scalar = LogHistogram()
    for v in vals:
        scalar.add(float(v))
    ref = np.bincount(np.maximum(np.searchsorted(e, vals, side="left") - 1, 0),
                      minlength=LogHistogram.N_BINS + 1)
    assert np.array_equal(big.counts, ref)
    assert np.array_equal(small.counts, ref)
    assert np.array_equal(scalar.counts, ref)
