"""Validation helpers of the specs (envs/sim/spec_validation.py): integers and reals as the specs
accept them (NumPy scalars yes, booleans and non-finite numbers no) and errors naming owner.field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvsched.envs.sim.errors import MAX_VALUE_CHARS, ConfigError
from kvsched.envs.sim.spec_validation import (as_float, int_at_least, is_int, is_real, non_negative, positive,
                                              real_in, string)


def test_integers_are_python_or_numpy_integers_but_not_booleans():
    assert is_int(3) and is_int(np.int32(3)) and is_int(np.uint8(0))
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(3.0) and not is_int("3")


def test_reals_are_finite_numbers_but_not_booleans():
    assert is_real(1) and is_real(2.5) and is_real(np.float32(0.5)) and is_real(np.int64(-2))
    for bad in (math.nan, math.inf, -math.inf, True, np.bool_(False), "1.0", None, 1j):
        assert not is_real(bad), bad


def test_int_at_least_names_owner_field_value_and_bound():
    int_at_least("Spec", "n", 4, 4)
    with pytest.raises(ConfigError, match=r"^Spec.n=3 is not allowed: expected an integer >= 4$"):
        int_at_least("Spec", "n", 3, 4)
    with pytest.raises(ConfigError, match="Spec.n=True"):
        int_at_least("Spec", "n", True, 0)


def test_positive_non_negative_and_ranges():
    positive("Spec", "x", 1e-12)
    non_negative("Spec", "x", 0)
    with pytest.raises(ConfigError, match=r"Spec.x=0 .*> 0"):
        positive("Spec", "x", 0)
    with pytest.raises(ConfigError, match=r"Spec.x=-1 .*>= 0"):
        non_negative("Spec", "x", -1)
    with pytest.raises(ConfigError, match="Spec.x=nan"):
        non_negative("Spec", "x", math.nan)
    real_in("Spec", "u", 0.5, lambda v: 0 < v <= 1, "a number in (0, 1]")
    with pytest.raises(ConfigError, match=r"Spec.u=1.5 is not allowed: expected a number in \(0, 1\]"):
        real_in("Spec", "u", 1.5, lambda v: 0 < v <= 1, "a number in (0, 1]")


def test_string_refuses_other_types_with_a_bounded_value():
    string("Spec", "name", "ok")
    with pytest.raises(ConfigError) as info:
        string("Spec", "name", list(range(100_000)))
    assert "Spec.name=" in str(info.value) and len(str(info.value)) < MAX_VALUE_CHARS + 60


def test_as_float_reads_numeric_strings_as_yaml_1_1_writes_them():
    assert as_float("1e9", "x") == 1e9 and as_float(3, "x") == 3 and type(as_float(3, "x")) is int
    for bad in ("lots", True, None, "nan", math.inf):
        with pytest.raises(ConfigError, match="where.field="):
            as_float(bad, "where.field")
