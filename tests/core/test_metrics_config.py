"""MetricsConfig and SLO (envs/sim/metrics_config.py): validation naming the field, defaults, and a
frozen, hashable, picklable configuration."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.metrics import SLO, MetricsConfig, summarize
from simkit import four_requests


@pytest.mark.parametrize("kwargs, field", [
    ({"long_prompt_tokens": 0}, "long_prompt_tokens"),
    ({"long_prompt_tokens": 1.5}, "long_prompt_tokens"),
    ({"long_prompt_tokens": True}, "long_prompt_tokens"),
    ({"slos": {"short": SLO(1.0, 0.1)}}, "slos"),
    ({"slos": {"short": SLO(1.0, 0.1), "long": 3.0}}, "slos"),
    ({"slos": {"short": SLO(1.0, 0.1), "long": {"ttft_s": 1.0, "tpot": 0.1}}}, "slos"),
    ({"percentiles": ()}, "percentiles"),
    ({"percentiles": (0, 50)}, "percentiles"),
    ({"percentiles": (50, 150)}, "percentiles"),
    ({"percentiles": (50, 50)}, "percentiles"),
    ({"starvation_factor": 0.0}, "starvation_factor"),
    ({"starvation_factor": float("nan")}, "starvation_factor"),
])
def test_bad_metrics_config_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MetricsConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"ttft_s": 0.0, "tpot_s": 0.1}, "ttft_s"),
    ({"ttft_s": 1.0, "tpot_s": -0.1}, "tpot_s"),
    ({"ttft_s": 1.0, "tpot_s": 0.1, "e2e_s": float("nan")}, "e2e_s"),
    ({"ttft_s": float("inf"), "tpot_s": 0.1}, "ttft_s"),
])
def test_bad_slo_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SLO(**kwargs)


def test_config_frozen_hashable_picklable_and_defaults():
    cfg = MetricsConfig()
    assert cfg.long_prompt_tokens == 8192 and cfg.percentiles == (50, 90, 99)
    assert cfg.slos["short"] == SLO(ttft_s=1.0, tpot_s=0.1)
    assert cfg.slos["long"] == SLO(ttft_s=10.0, tpot_s=0.2)
    same = MetricsConfig(slos={"long": {"ttft_s": 10.0, "tpot_s": 0.2},
                               "short": SLO(1.0, 0.1)})
    assert same == cfg and hash(same) == hash(cfg)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.starvation_factor = 2.0  # type: ignore[misc]
    assert MetricsConfig(percentiles=(99.9, 50)).percentiles == (50, 99.9)
    s = summarize(four_requests(), {}, None, MetricsConfig(percentiles=(99.9, 50)))
    assert set(s["classes"]["all"]["ttft_s"]) == {"count", "mean", "max", "p50", "p99.9"}


def test_slo_of_an_unknown_class_is_an_error_and_known_ones_round_trip() -> None:
    cfg = MetricsConfig()
    assert cfg.slo("short") == SLO(ttft_s=1.0, tpot_s=0.1)
    with pytest.raises(KeyError):
        cfg.slo("platinum")
    d = cfg.to_dict()
    assert d["long_prompt_tokens"] == 8192 and d["slos"]["long"]["ttft_s"] == 10.0
