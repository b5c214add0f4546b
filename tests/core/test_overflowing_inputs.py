"""Out-of-range but well-typed inputs are refused with one ConfigError line, never a traceback,
hang or NaN: integers too large for a float, model sizes far beyond any model, an expert count
that would make the routing table take minutes, and cost parameters whose products overflow."""

from __future__ import annotations

import dataclasses
import pytest

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.cost_params import CostParams
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.hardware import GPU_PRESETS
from kvsched.envs.sim.instance_spec import InstanceSpec
from kvsched.envs.sim.model_spec import MAX_EXPERTS, MODEL_PRESETS, ModelSpec
from kvsched.envs.sim.spec_io import instance_spec_from_dict
from kvsched.envs.sim.spec_validation import is_real

HUGE_INT = 10 ** 400  # YAML reads a 401-digit number as a Python int; float() of it overflows
MIXTRAL = MODEL_PRESETS["Mixtral-8x7B"]


def test_is_real_refuses_integers_too_large_for_a_float():
    assert not is_real(HUGE_INT)
    assert is_real(10 ** 300)


@pytest.mark.parametrize("key", ["mbu", "step_time_sigma", "hiccup_mean_s", "moe_efficiency"])
def test_huge_integer_in_a_cost_field_is_a_config_error(key):
    with pytest.raises(ConfigError, match=f"cost.{key}=") as e:
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "cost": {key: HUGE_INT}}, "s.yaml")
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)


def test_huge_integer_in_an_instance_float_field_is_a_config_error():
    with pytest.raises(ConfigError, match="gpu_memory_utilization="):
        instance_spec_from_dict({"model": "Llama-3.1-8B", "gpu": "H100-SXM", "gpu_memory_utilization": HUGE_INT})


@pytest.mark.parametrize("field", ["n_layers", "hidden_size", "head_dim", "vocab_size", "kv_lora_rank",
                                   "expert_intermediate_size", "n_shared_experts", "moe_layer_step"])
def test_model_sizes_beyond_two_to_the_40_are_config_errors(field):
    with pytest.raises(ConfigError, match=rf"{field}=.*2\*\*40"):
        dataclasses.replace(MIXTRAL, **{field: HUGE_INT})


def test_moe_model_with_a_trillion_layers_is_refused_at_once_not_looped_over():
    # the MoE layers are counted in closed form; a loop over 10**12 layers never returned
    with pytest.raises(ConfigError, match="n_params"):
        dataclasses.replace(MIXTRAL, n_layers=10 ** 12)


def test_expert_count_above_max_experts_is_refused_before_any_table_is_built():
    with pytest.raises(ConfigError, match=rf"n_experts=.*\[0, {MAX_EXPERTS}\]"):
        dataclasses.replace(MIXTRAL, n_experts=10 ** 11)  # was a 745 GiB allocation
    with pytest.raises(ConfigError, match="n_experts="):
        dataclasses.replace(MIXTRAL, n_experts=10 ** 9, routing_skew=0.5)  # was a hang


@pytest.mark.parametrize("layers,first,step", [(48, 0, 1), (48, 3, 1), (48, 0, 2), (61, 3, 4), (7, 6, 7), (9, 2, 5)])
def test_moe_layer_count_is_the_llama4_rule(layers, first, step):
    m = dataclasses.replace(MIXTRAL, n_layers=layers, first_dense_layers=first, moe_layer_step=step,
                            n_params=1e12)
    assert m.n_moe_layers == sum(1 for i in range(first, layers) if (i + 1) % step == 0)


def test_cost_parameters_that_overflow_the_step_time_are_a_config_error():
    cost = dataclasses.replace(CostParams(), moe_efficiency=1e-300)  # expert bytes / 1e-300 = inf
    spec = InstanceSpec(model=MIXTRAL, gpu=GPU_PRESETS["H100-SXM"], tp=2, cost=cost)
    with pytest.raises(ConfigError, match="expert bytes per distinct expert = inf") as e:
        CostModel(spec)
    assert "\n" not in str(e.value)
