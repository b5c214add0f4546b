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
