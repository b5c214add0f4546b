"""The SLO reward (envs/reward.py): its per-tag memo judges records exactly as ``summarize`` does,
untagged records by their length class (found reviewing the cheaper Knobs-v0 step)."""

from __future__ import annotations

import math

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from kvsched.envs.reward import RewardConfig, SLOReward
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
def test_slo_reward_counts_met_as_summarize(rows):
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
        met, missed, _, _ = reward._judge(rows)
        assert (met, missed) == (expected, len(rows) - expected)
    assert [reward.is_met(r) for r in rows].count(True) == expected


def test_untagged_record_goes_by_length_class_even_with_a_class_named_none():
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
