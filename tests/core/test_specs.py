"""The public spec API (envs/sim/specs.py): one import re-exports every spec class, preset table
and reader; preset lookups across models, GPUs and links are case-insensitive, know aliases and
list the known names when a name is unknown."""

from __future__ import annotations

import pytest

from kvsched.envs.sim import (calibration, cost_params, hardware, hf_config, instance_spec, model_spec, spec_io, specs,
                              tiers)
from kvsched.envs.sim.errors import UnknownPresetError
from kvsched.envs.sim.specs import GPU_PRESETS, LINK_PRESETS, MODEL_PRESETS, get_gpu, get_link, get_model


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(UnknownPresetError) as info:
        get_model("llama-9b")
    msg = str(info.value)
    assert "llama-9b" in msg and all(name in msg for name in MODEL_PRESETS)
    with pytest.raises(UnknownPresetError, match="H100-SXM"):
        get_gpu("TPU-v5")
    with pytest.raises(UnknownPresetError, match="pcie5"):
        get_link("cxl")


def test_lookup_is_case_insensitive_and_knows_aliases() -> None:
    assert get_model("llama-3.1-8b") is MODEL_PRESETS["Llama-3.1-8B"]
    assert get_model("meta-llama/Llama-2-7b-hf") is MODEL_PRESETS["Llama-2-7B"]
    assert get_gpu("h100") is GPU_PRESETS["H100-SXM"]
    assert get_link("PCIE4") is LINK_PRESETS["pcie4"]


def test_every_public_name_is_the_defining_modules_object() -> None:
    homes = (calibration, cost_params, hardware, hf_config, instance_spec, model_spec, spec_io, tiers)
    for name in specs.__all__:
        obj = getattr(specs, name)
        assert any(getattr(m, name, None) is obj for m in homes), f"specs.{name} is not its defining module's object"
    assert len(set(specs.__all__)) == len(specs.__all__)
