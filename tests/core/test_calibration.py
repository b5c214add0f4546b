"""Calibration files and the fit (envs/sim/calibration.py): a calibration file round trip and its
errors, the shipped H100 calibration as the default cost of presets, and a fit that recovers a
known function. (The calibrate / validate commands: tests/experiments/test_calibrate.py.)"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kvsched.envs.sim.calibration import (CalibrationFile, FitParam, calibrated_cost_params, calibration_path,
                                          fit_cost_params, load_calibration, save_calibration)
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.specs import (CostParams, InstanceSpec, default_cost_params, get_gpu, get_model,
                                    instance_spec_from_dict)

H100 = get_gpu("H100-SXM")
A100 = get_gpu("A100-80GB")
L7 = get_model("Llama-2-7B")


def test_calibration_file_round_trip_and_errors(tmp_path):
    cal = CalibrationFile(gpu="H100-SXM", version=3, cost=CostParams(mbu=0.8), fitted=("mbu",), train=("a", "b"),
                          loss=0.5, n_residuals=7, notes=("x",))
    p = tmp_path / "c.json"
    save_calibration(cal, p)
    assert load_calibration(p) == cal
    text = p.read_text()
    save_calibration(load_calibration(p), p)
    assert p.read_text() == text  # byte-identical rewrite
    d = json.loads(text)
    for bad, match in (({**d, "format": "x"}, "format"), ({**d, "extra": 1}, "extra"),
                       ({**d, "cost_params": {**d["cost_params"], "mbu": 2.0}}, "mbu"),
                       ({**d, "cost_params": {**d["cost_params"], "speed": 1}}, "speed"),
                       ({**d, "version": 0}, "version")):
        p.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            load_calibration(p)
    with pytest.raises(ConfigError, match="fitted"):
        CalibrationFile(gpu="H100-SXM", version=1, cost=CostParams(), fitted=("speed",))


def test_presets_use_their_shipped_calibration_and_the_h100_host_terms_elsewhere():
    """H100-SXM and A100-80GB ship calibrations; a GPU without one (L40S) takes the literature
    defaults for the GPU-side fields and the H100 calibration's host-side fields."""
    from kvsched.envs.sim.calibration import HOST_FIELDS

    shipped = calibration_path("H100-SXM")
    assert shipped.is_file(), "the H100-SXM calibration file must ship with the package"
    cal = load_calibration(shipped)
    assert cal.gpu == "H100-SXM" and cal.fitted and cal.train
    assert default_cost_params(H100) == cal.cost == calibrated_cost_params("H100-SXM")
    assert InstanceSpec(model=L7, gpu=H100).cost == cal.cost
    a100 = load_calibration(calibration_path("A100-80GB"))
    assert set(a100.fitted) == {"mfu_max", "mfu_half_tokens", "mbu"} and a100.train
    assert InstanceSpec(model=L7, gpu=A100).cost == a100.cost == calibrated_cost_params("A100-80GB")
    assert all(getattr(a100.cost, f) == getattr(cal.cost, f) for f in HOST_FIELDS)
    l40s = get_gpu("L40S")
    assert calibrated_cost_params("L40S") is None
    transferred = InstanceSpec(model=L7, gpu=l40s).cost
    assert transferred == dataclasses.replace(CostParams(), **{f: getattr(cal.cost, f) for f in HOST_FIELDS})
    # a default cost follows the GPU; an explicit one stays
    assert InstanceSpec(model=L7, gpu=H100).with_overrides(gpu=l40s).cost == transferred
    assert InstanceSpec(model=L7, gpu=H100).with_overrides(gpu=A100).cost == a100.cost
    # the H200 is the H100's chip with more and faster HBM: it takes the H100 calibration whole
    assert calibrated_cost_params("H200") is None and InstanceSpec(model=L7, gpu=get_gpu("H200")).cost == cal.cost
    pinned = CostParams(mbu=0.5)
    assert InstanceSpec(model=L7, gpu=H100, cost=pinned).with_overrides(gpu=A100).cost == pinned
    # omitted cost keys in a dict spec take the GPU's default, given ones override
    spec = instance_spec_from_dict({"model": "Llama-2-7B", "gpu": "H100-SXM", "cost": {"mbu": 0.5}})
    assert spec.cost == dataclasses.replace(cal.cost, mbu=0.5)
    with pytest.raises(ConfigError, match="speed"):
        instance_spec_from_dict({"model": "Llama-2-7B", "gpu": "H100-SXM", "cost": {"speed": 1}})


def test_fit_recovers_a_known_function_exactly():
    # a smooth stand-in for the simulator: residuals vanish only at the true parameters
    true = CostParams(mbu=0.8, step_overhead_s=2e-3)
    xs = np.linspace(0.1, 2.0, 12)

    def model(c):
        return 1e-3 * xs / c.mbu + c.step_overhead_s * (1 + xs ** 2)

    target = model(true)
    fit = fit_cost_params(lambda c: np.log(model(c) / target), CostParams(mbu=0.4, step_overhead_s=1e-4),
                          [FitParam("mbu", 0.1, 1.0), FitParam("step_overhead_s", 1e-5, 1e-2)], max_nfev=50,
                          loss="linear", diff_step=1e-4, xtol=1e-10, ftol=1e-12)
    assert math.isclose(fit.values["mbu"], 0.8, rel_tol=1e-4)
    assert math.isclose(fit.values["step_overhead_s"], 2e-3, rel_tol=1e-4)
    with pytest.raises(ConfigError, match="FitParam"):
        FitParam("speed", 0.1, 1.0)
    with pytest.raises(ConfigError, match="bounds"):
        FitParam("mbu", 0.5, 0.1)


def test_default_cost_source_says_which_gpus_run_on_unvalidated_defaults():
    """A run on a GPU other than the H100 said nothing about its cost parameters; the line that
    `kvsched simulate`, `compare` and `presets` print names where they come from."""
    from kvsched.envs.sim.calibration import default_cost_source

    assert default_cost_source("H100-SXM") is None  # fitted on real vLLM runs
    a100 = default_cost_source(A100)
    assert a100 is not None and "shipped calibration" in a100 and "mfu_max" in a100 and "not validated" in a100
    l40s = default_cost_source("L40S")
    assert l40s is not None and "no calibration" in l40s and "H100-SXM" in l40s and "not validated" in l40s
    h200 = default_cost_source("H200")
    assert h200 is not None and "H100-SXM calibration whole" in h200
    assert InstanceSpec(model=L7, gpu=A100).cost_is_default
    assert not InstanceSpec(model=L7, gpu=A100, cost=CostParams()).cost_is_default
