"""Error types and bounded messages (envs/sim/errors.py)."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import (MAX_VALUE_CHARS, ConfigError, KvschedError, TraceFormatError,
                                     UnknownPresetError, bounded_repr, require)


def test_every_error_is_a_kvsched_error_and_the_builtin_it_replaces():
    assert issubclass(ConfigError, KvschedError) and issubclass(ConfigError, ValueError)
    assert issubclass(TraceFormatError, KvschedError) and issubclass(TraceFormatError, ValueError)
    assert issubclass(UnknownPresetError, ConfigError) and issubclass(UnknownPresetError, KeyError)


def test_unknown_preset_message_is_not_quoted_like_a_key_error():
    e = UnknownPresetError("unknown model 'x'; known: a, b")
    assert str(e) == "unknown model 'x'; known: a, b"
    assert str(KeyError("unknown model")) == "'unknown model'"  # what KeyError alone would print
    assert str(UnknownPresetError()) == ""


def test_bounded_repr_keeps_short_values_whole():
    assert bounded_repr("abc") == "'abc'"
    assert bounded_repr([1, 2, 3]) == "[1, 2, 3]"
    assert bounded_repr(2.5) == "2.5"


@pytest.mark.parametrize("value", [
    "x" * 1_000_000,                                # a huge string
    list(range(1_000_000)),                         # a huge list (an expanded YAML alias bomb)
    {i: [i] * 1000 for i in range(10_000)},         # a huge mapping of lists
    [[[[["deep"] * 100] * 100] * 100] * 100],       # deep nesting
    b"\x00" * 500_000,                              # bytes
])
def test_bounded_repr_bounds_huge_values(value):
    text = bounded_repr(value)
    assert len(text) <= MAX_VALUE_CHARS
    assert len(bounded_repr(value, limit=40)) <= 40


def test_bounded_repr_marks_a_cut_with_dots():
    text = bounded_repr("y" * 500, limit=30)
    assert len(text) == 30 and "..." in text and text.startswith("'y")
    text = bounded_repr(list(range(100)), limit=1000)
    assert text.endswith("...]") and len(text) < 60  # a long list keeps its first items


def test_require_names_field_value_and_what_is_allowed():
    require(True, "Spec.field", 1, "anything")  # no error
    with pytest.raises(ConfigError) as info:
        require(False, "Spec.tp", 3, "one of 1, 2, 4, 8")
    assert str(info.value) == "Spec.tp=3 is not allowed: expected one of 1, 2, 4, 8"
    with pytest.raises(ConfigError) as info:
        require(False, "Spec.name", "n" * 10_000, "a short name")
    assert len(str(info.value)) < MAX_VALUE_CHARS + 80


def test_bounded_repr_raises_a_limit_below_three_to_the_markers_length():
    assert bounded_repr("abcdef", limit=1) == "..."
    assert len(bounded_repr("x" * 10_000, limit=0)) == 3
