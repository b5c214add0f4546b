"""Breaker review of the cheaper ``kvsched/Knobs-v0`` step (commits 9a3c6b3, 0af909e): the
reward's per-tag memo against ``summarize``, the action mapping's error paths, and the
parameter builder against ``dataclasses.replace`` + full validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from kvsched.envs.reward import RewardConfig, SLOReward
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import RECORD_COLUMNS, SLO, MetricsConfig, summarize

#: configured SLO classes, including names a str() of an odd tag produces
_SLOS = {"short": SLO(1.0, 0.1), "long": SLO(10.0, 0.2), "gold": SLO(0.5, 0.05, e2e_s=4.0),
         "None": SLO(2.0, 0.3, e2e_s=3.0), "nan": SLO(0.25, 0.02)}
_LONG = 4096
#: record tags as the recorder writes them (a class name or None), configured or not
_TAGS = [None, "short", "long", "gold", "None", "nan", "bronze", "", "1"]
_BOUNDS = [0.02, 0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 1.0, 2.0, 3.0, 4.0, 10.0]


@hst.composite
def _row(draw, rid):
    a = draw(hst.sampled_from([0.0, 0.1, 1.0 / 3.0, 7.7, 100.0]))
    prompt = draw(hst.sampled_from([1, _LONG - 1, _LONG, _LONG + 1, 20000]))
    tag = draw(hst.sampled_from(_TAGS))
    status = draw(hst.sampled_from(["finished", "finished", "finished", "rejected"]))
    g = draw(hst.sampled_from([1, 2, 3, 17]))
    if status == "rejected":
        s = f = e = math.nan
        g = 0
    else:
        # times at, just under and just over the configured bounds
        nudge = draw(hst.sampled_from([-1e-9, 0.0, 0.0, 1e-9]))
        ttft = draw(hst.sampled_from(_BOUNDS)) + nudge
        s = a + ttft * draw(hst.sampled_from([0.0, 0.5, 1.0]))
        f = a + ttft
        step = draw(hst.sampled_from(_BOUNDS)) + draw(hst.sampled_from([-1e-9, 0.0, 1e-9]))
        e = f + step * (g - 1) + draw(hst.sampled_from([0.0, 0.0, 1.5]))
        s = min(s, f)
    return (rid, 0, a, prompt, max(g, 1), tag, "long" if prompt >= _LONG else "short", status,
            None if status == "finished" else "too_long", s, f, e, g, 0, 0, 0, 0.0) + \
        (0,) * (len(RECORD_COLUMNS) - 17)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.integers(1, 12).flatmap(lambda n: hst.tuples(*[_row(i) for i in range(n)])))
def test_promise_slo_reward_counts_met_as_summarize(rows):
    """SLOReward (memo per record tag, length class by ``prompt >= long_prompt_tokens``) counts
    exactly the met/missed requests ``summarize`` counts, over rows with tags None, unknown,
    configured, "None"/"nan" (str() of odd tags), rejected rows (NaN times), 1-token outputs,
    prompts at the long-class edge and latencies at, just under and just over each bound. The
    same reward object judges the rows twice (memo filled on the first pass)."""
    cfg = MetricsConfig(long_prompt_tokens=_LONG, slos=_SLOS)
    df = pd.DataFrame(list(rows), columns=list(RECORD_COLUMNS))
    expected = summarize(df, None, None, cfg)["classes"]["all"]["slo"]["met"]
    reward = SLOReward(RewardConfig(), cfg)
    for _ in range(2):
        met, missed, _ = reward._judge(rows)
        assert (met, missed) == (expected, len(rows) - expected)
    assert [reward.is_met(r) for r in rows].count(True) == expected


def test_defect_untagged_record_goes_by_length_class_even_with_a_class_named_none():
    """A record with ``slo_class=None`` (untagged) is judged by its length class. With a
    configured class literally named "None", SLOReward's per-tag memo looked up str(None) and
    judged it by that class (TTFT 2 s: met), while ``summarize`` (pandas 3 keeps the missing
    tag missing) and ``SLOReward.judged_slo`` used the length class (short, TTFT 1 s: missed)."""
    cfg = MetricsConfig(long_prompt_tokens=_LONG, slos=_SLOS)
    row = (0, 0, 0.0, 100, 1, None, "short", "finished", None, 0.0, 1.5, 1.5, 1, 0, 0, 0, 0.0) + \
        (0,) * (len(RECORD_COLUMNS) - 17)
    reward = SLOReward(RewardConfig(), cfg)
    assert reward.judged_slo(None, 100) == _SLOS["short"]
    assert reward._judge([row])[:2] == (0, 1)
    df = pd.DataFrame([row], columns=list(RECORD_COLUMNS))
    assert summarize(df, None, None, cfg)["classes"]["all"]["slo"]["met"] == 0
    # the tag "None" (a str) is the class "None": met (1.5 s <= 2 s) by both
    tagged = row[:5] + ("None",) + row[6:]
    assert reward._judge([tagged])[:2] == (1, 0)
    df = pd.DataFrame([tagged, row], columns=list(RECORD_COLUMNS))
    assert summarize(df, None, None, cfg)["classes"]["all"]["slo"]["met"] == 1


def test_defect_knob_action_that_is_not_real_numbers_raises_config_error():
    """Every bad action raises ConfigError naming ``action``. Before: a complex array was
    accepted with its imaginary part dropped (a ComplexWarning only), a masked array with its
    masked entries' hidden values used, strings parsed as numbers, a structured array read as
    its field; a complex list, a dict or ragged nesting raised TypeError / ValueError."""
    import warnings

    from kvsched.envs.knob_env import KnobEnv

    env = KnobEnv(max_requests=50)
    good = [0.5, -0.5, 0.0, 1.0]
    ok = env.values(np.array(good))
    bad = [np.array(good) + 0.5j, np.array(good, dtype=np.complex64) + 0.5j, [complex(x, 1) for x in good],
           np.ma.array(good, mask=[0, 1, 0, 0]), ["0.5", "-0.5", "0", "1"], np.array(["0.5", "-0.5", "0", "1"]),
           np.zeros(4, dtype=[("a", "f8")]), {"kappa": 0.5}, [0.5, [0.1], 0.0, 1.0],
           np.array([0.5, None, 0.0, 1.0], dtype=object), np.array([0, 0, 0, 1], dtype="m8[s]")]
    for a in bad:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no ComplexWarning on the way to the error either
            with pytest.raises(ConfigError, match="action"):
                env.values(a)
    # real numbers in any form keep their values
    for a in (np.ma.array(good, mask=[0, 0, 0, 0]), np.array(good, dtype=object), good, tuple(good),
              np.array(good, dtype=np.complex128).real, np.array([good])):
        assert env.values(a) == ok
    assert env.values(np.array([1, -1, 0, 1], dtype=object)) == env.values(np.array([1.0, -1.0, 0.0, 1.0]))


def test_defect_lars_subclass_set_params_sees_the_bound_context():
    """``LARS.bind`` calls ``set_params`` (9a3c6b3); it did so before storing the step overhead
    and token budget it takes from the context, so a subclass deriving more from its parameters
    and the bound context in ``set_params`` (as its docstring invites) failed at bind with
    AttributeError. Both must be set first; the candidates are unchanged."""
    from kvsched.envs.knob_env import KnobEnv
    from kvsched.policies.lars import LARS

    class Capped(LARS):
        def set_params(self, params) -> None:
            super().set_params(params)
            self.cap_tokens = min(params.max_chunk_tokens, self._budget)

    env = KnobEnv(max_requests=50)
    env.reset(seed=0)
    pol = env.cluster.instances[0].policy
    sub = Capped(pol.params)
    sub.bind(pol.ctx)
    assert sub.cap_tokens == min(pol.params.max_chunk_tokens, pol.ctx.spec.token_budget)
    assert sub._candidates is pol._candidates and sub._budget == pol._budget
    sub.set_params(dataclasses.replace(pol.params, max_chunk_tokens=256))
    assert sub.cap_tokens == min(256, pol.ctx.spec.token_budget) and sub._candidates[-1] == 256




def test_defect_lars_chunk_multiple_above_chunk_ceiling_is_a_config_error():
    """``chunk_multiple_tokens`` above ``max_chunk_tokens`` (e.g. 512 > 256) passed validation,
    left LARS no chunk candidate (``set_params``' docstring promises at least one) and the run
    crashed in ``chunk_limit`` with IndexError. It is now a ConfigError naming the field, by
    the full validation and by the Knobs-v0 builder's own-field check; multiple == ceiling
    keeps its one candidate."""
    from kvsched.envs.knob_env import ParamsBuilder
    from kvsched.policies.base import make_policy
    from kvsched.policies.lars import LARSParams

    with pytest.raises(ConfigError, match="LARSParams.chunk_multiple_tokens=512"):
        LARSParams(chunk_multiple_tokens=512, max_chunk_tokens=256)
    assert make_policy("lars", {"chunk_multiple_tokens": 512}).params.max_chunk_tokens == 8192  # fine
    with pytest.raises(ConfigError, match="chunk_multiple_tokens"):
        make_policy("lars", {"chunk_multiple_tokens": 512, "max_chunk_tokens": 500})
    build = ParamsBuilder(LARSParams(chunk_multiple_tokens=512, min_chunk_tokens=32), ["max_chunk_tokens"])
    with pytest.raises(ConfigError, match="chunk_multiple_tokens"):
        build({"max_chunk_tokens": 256})
    from kvsched.envs.knob_env import KnobEnv

    env = KnobEnv(max_requests=50)
    env.reset(seed=0)
    pol = env.cluster.instances[0].policy
    pol.set_params(LARSParams(chunk_multiple_tokens=256, max_chunk_tokens=256, min_chunk_tokens=32))
    assert pol._candidates.tolist() == [256.0]
    assert pol.chunk_limit(100, 0, 0, 0.0, 0) == 256
