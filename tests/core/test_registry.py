"""The name registry (envs/sim/registry.py): exact, case-insensitive and alias lookups; unknown
names raise an error listing the known ones with the given name bounded."""

from __future__ import annotations

import pytest

from kvsched.envs.sim.errors import MAX_VALUE_CHARS, UnknownPresetError
from kvsched.envs.sim.registry import Registry


def fruit() -> Registry[int]:
    return Registry("fruit", {"Apple": 1, "banana": 2}, aliases={"Malus": "Apple"})


def test_lookup_by_exact_name_folded_case_and_spaces_and_alias():
    r = fruit()
    assert r.get("Apple") == 1 and r.canonical("Apple") == "Apple"
    assert r.get("  aPPLE ") == 1 and r.canonical("BANANA") == "banana"
    assert r.get("malus") == 1 and r.canonical(" MALUS") == "Apple"


def test_unknown_name_lists_the_known_names_but_not_aliases():
    with pytest.raises(UnknownPresetError) as info:
        fruit().get("cherry")
    assert str(info.value) == "unknown fruit 'cherry'; known: Apple, banana"


@pytest.mark.parametrize("name", [None, 3, ("Apple",), b"Apple"])
def test_a_name_that_is_not_a_string_is_unknown(name):
    r = fruit()
    with pytest.raises(UnknownPresetError, match="unknown fruit"):
        r.get(name)
    assert name not in r


def test_a_huge_unknown_name_is_bounded_in_the_message():
    with pytest.raises(UnknownPresetError) as info:
        fruit().get("x" * 100_000)
    assert len(str(info.value)) < MAX_VALUE_CHARS + 60


def test_alias_of_a_missing_entry_is_refused():
    r = fruit()
    with pytest.raises(ValueError, match="alias 'pear' names no fruit 'Pear'"):
        r.add_alias("pear", "Pear")


def test_names_listing_order_membership_and_replacement():
    r = Registry("fruit", {"b": 1, "a": 2})
    assert r.names() == ["b", "a"] and list(r) == ["b", "a"] and len(r) == 2
    s = Registry("fruit", {"b": 1, "a": 2}, sort_names=True)
    assert s.names() == ["a", "b"] and s.items() == [("a", 2), ("b", 1)]
    assert "A" in s and "c" not in s
    s.add("a", 5)  # a later add replaces
    assert s.get("a") == 5 and len(s) == 2


def test_register_decorator_adds_the_class_and_sets_its_name():
    r: Registry[type] = Registry("policy")

    @r.register("my-policy")
    class Mine:
        pass

    assert r.get("MY-POLICY") is Mine and Mine.name == "my-policy"


def test_a_preset_table_and_its_registry_are_one_table():
    """A preset added to the public table (``MODEL_PRESETS["x"] = ...``, as before the Registry)
    is found by ``get_model`` and YAML; one added to the registry is listed by ``kvsched presets``
    (``presets_rows`` reads the table). The registry used to copy the table at import, so each
    addition was seen by only one of the two."""
    import dataclasses

    from kvsched.envs.sim.specs import (GPU_PRESETS, GPUS, MODEL_PRESETS, MODELS, get_gpu, get_model,
                                        instance_spec_from_dict, presets_rows)

    mine = dataclasses.replace(MODEL_PRESETS["Llama-3.1-8B"], name="My-8B")
    MODEL_PRESETS["My-8B"] = mine
    try:
        assert get_model("my-8b") is mine and "My-8B" in MODELS.names()
        assert instance_spec_from_dict({"model": "My-8B", "gpu": "H100-SXM"}).model is mine
    finally:
        del MODEL_PRESETS["My-8B"]
    with pytest.raises(UnknownPresetError):
        get_model("My-8B")
    gpu = dataclasses.replace(GPU_PRESETS["H100-SXM"], name="My-GPU")
    GPUS.add("My-GPU", gpu)
    try:
        assert GPU_PRESETS["My-GPU"] is gpu and get_gpu("MY-GPU") is gpu
        assert any(row["name"] == "My-GPU" for row in presets_rows()["gpus"])
    finally:
        del GPU_PRESETS["My-GPU"]
