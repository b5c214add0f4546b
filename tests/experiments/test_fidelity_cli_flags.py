"""``kvsched validate`` and ``kvsched calibrate`` check their number flags as flags (a negative or
NaN stage cap used to skip every run or replay whole stages; ``--jobs 0`` started a pool of no
workers), and a missing ``--calibration`` file is one error line, not a FileNotFoundError
traceback."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.cli import main
from kvsched.experiments.validate import calibration_or_default


@pytest.mark.parametrize("argv, flag, allowed", [
    (["validate", "--stage-cap-s", "-1"], "--stage-cap-s", "a finite number > 0"),
    (["validate", "--stage-cap-s", "nan"], "--stage-cap-s", "a finite number > 0"),
    (["validate", "--jobs", "0"], "--jobs", "an integer >= 1"),
    (["calibrate", "--jobs", "0"], "--jobs", "an integer >= 1"),
    (["calibrate", "--coarse-cap-s", "0"], "--coarse-cap-s", "a finite number > 0"),
    (["calibrate", "--fine-cap-s", "-5"], "--fine-cap-s", "a finite number > 0"),
    (["calibrate", "--tail-cap-s", "inf"], "--tail-cap-s", "a finite number > 0"),
    (["calibrate", "--diff-step", "0"], "--diff-step", "a finite number > 0"),
    (["calibrate", "--coarse-nfev", "0"], "--coarse-nfev", "an integer >= 1"),
    (["calibrate", "--fine-nfev", "-1"], "--fine-nfev", "an integer >= 0"),
    (["calibrate", "--version", "0"], "--version", "an integer >= 1"),
])
def test_fidelity_number_flags_are_checked_as_flags(argv, flag, allowed, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert f"argument {flag}:" in err.splitlines()[-1] and allowed in err.splitlines()[-1]


def test_a_missing_calibration_file_is_a_config_error_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--calibration '.*nope\.json' is not allowed: expected an existing"):
        calibration_or_default(tmp_path / "nope.json")


def test_a_calibration_of_another_gpu_is_refused_where_it_would_price_the_h100_runs(tmp_path, capsys):
    """`validate --calibration A100-80GB.json` applied the A100 file to the H100 runs it replays,
    and `calibrate --tail-only` fitted an H100 tail onto it; both are refused in one line, before any
    ground truth is read."""
    from kvsched.envs.sim.calibration import CalibrationFile, save_calibration
    from kvsched.envs.sim.specs import CostParams

    a100 = tmp_path / "A100.json"
    save_calibration(CalibrationFile("A100-80GB", 1, CostParams()), a100)
    with pytest.raises(ConfigError, match=r"it calibrates 'A100-80GB', and validate applies --calibration to the "
                                          r"runs on H100-SXM") as e:
        calibration_or_default(a100)
    assert "\n" not in str(e.value)
    assert main(["calibrate", "--tail-only", "--out", str(a100), "--groundtruth", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "it calibrates 'A100-80GB'" in err and "tail is fitted on vLLM runs on H100-SXM" in err
    assert err.count("\n") == 1
