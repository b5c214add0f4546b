"""A hand-edited calibration file is read strictly: every value has the JSON type its field
needs (a bool is not a number, text is not a number, a lone string is not a list), and a wrong
one is one ConfigError line naming the field and the bounded value, never silently converted
(``true`` used to become mfu 1.0, ``"hello"`` notes five one-letter notes)."""

from __future__ import annotations

import copy
import json

import pytest

from kvsched.envs.sim.calibration import CalibrationFile, calibration_path, load_calibration
from kvsched.envs.sim.errors import ConfigError

SHIPPED = json.loads(calibration_path("H100-SXM").read_text(encoding="utf-8"))


def _edited(path, where: str, key: str, value):
    d = copy.deepcopy(SHIPPED)
    (d.setdefault(where, {}) if where else d)[key] = value
    path.write_text(json.dumps(d), encoding="utf-8")
    return path


@pytest.mark.parametrize("where,key,value", [
    ("cost_params", "mbu", True), ("cost_params", "mbu", "0.5"), ("cost_params", "mbu", None),
    ("cost_params", "mbu", "x" * 5000), ("cost_params", "mbu", 10 ** 400),
    ("tail_params", "step_time_sigma", True), ("tail_params", "step_time_sigma", "0.2"),
    ("", "fitted", "mbu"), ("", "fitted", 5), ("", "notes", "hello"), ("", "train_experiments", "exp"),
    ("", "n_residuals", 3.7), ("", "n_evaluations", True), ("", "loss", "x" * 5000), ("", "wall_s", [1]),
    ("", "objective", [1, 2]), ("", "kvsched_version", 3),
])
def test_calibration_value_of_the_wrong_type_is_a_bounded_config_error(tmp_path, where, key, value):
    path = _edited(tmp_path / "cal.json", where, key, value)
    with pytest.raises(ConfigError, match=rf"{key}=") as e:
        load_calibration(path)
    text = str(e.value)
    assert "\n" not in text and len(text) < 400 + len(str(path))
    assert text.count(str(path)) == 1


def test_calibration_without_tail_params_reads_as_no_tail(tmp_path):
    d = copy.deepcopy(SHIPPED)
    d.pop("tail_params", None)
    (tmp_path / "cal.json").write_text(json.dumps(d), encoding="utf-8")
    cal = load_calibration(tmp_path / "cal.json")
    assert cal.tail_params == {} and cal.cost_with_tail() == cal.cost


def test_shipped_calibration_round_trips_unchanged():
    cal = load_calibration(calibration_path("H100-SXM"))
    assert CalibrationFile.from_dict(cal.to_dict()) == cal
