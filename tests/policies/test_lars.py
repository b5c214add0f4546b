"""LARS parameters (policies/lars.py) as Knobs-v0 sets them: a subclass deriving from its
parameters sees the bound context, and a chunk multiple above the chunk ceiling is refused."""

from __future__ import annotations

import dataclasses

import pytest

from kvsched.envs.sim.errors import ConfigError


def test_lars_subclass_set_params_sees_the_bound_context():
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


def test_lars_chunk_multiple_above_the_chunk_ceiling_is_a_config_error():
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
