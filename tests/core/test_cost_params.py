"""CostParams (envs/sim/cost_params.py): validation of every field and the front-end delay."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cost_params import CostParams
from kvsched.envs.sim.errors import ConfigError


def test_cost_params_validation() -> None:
    for kw in ({"mfu_max": 0.0}, {"mfu_max": 1.5}, {"mbu": 0.0}, {"mfu_half_tokens": -1.0},
               {"step_overhead_s": -1e-3}, {"allreduce_latency_s": float("nan")}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            CostParams(**kw)


@pytest.mark.parametrize("name", ["request_overhead_s", "prompt_token_overhead_s", "output_token_overhead_s"])
def test_negative_overheads_are_rejected_naming_the_field(name):
    with pytest.raises(ConfigError, match=name):
        CostParams(**{name: -1e-3})


def test_server_delay_is_per_request_plus_per_prompt_token() -> None:
    c = CostParams(request_overhead_s=0.01, prompt_token_overhead_s=1e-5)
    assert c.server_delay_s(100) == pytest.approx(0.011)
    d = c.server_delay_s(np.array([0, 1000]))
    assert d.tolist() == [pytest.approx(0.01), pytest.approx(0.02)]
    assert CostParams(request_overhead_s=0.0, prompt_token_overhead_s=0.0).server_delay_s(5000) == 0.0
