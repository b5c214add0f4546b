"""Skip marks for tests of optional packages, decided without importing them (not a test module).

``pytest.importorskip("stable_baselines3")`` at a test module's top imports torch while pytest
collects, ~2 s of the collection for every run, even one that selects no such test; jax (Minari)
and Ray cost as much. :func:`needs` asks :func:`importlib.util.find_spec` instead, which only
locates the package; the test bodies import what they use.
"""

from __future__ import annotations

import importlib.util

import pytest


def installed(module: str) -> bool:
    """Whether top-level package ``module`` can be imported (located, not imported)."""
    return importlib.util.find_spec(module) is not None


def needs(*modules: str, reason: str = "") -> pytest.MarkDecorator:
    """A mark skipping the test (or the module: ``pytestmark = needs(...)``) unless every one of
    ``modules`` (top-level package names) is installed; the skip names the missing ones."""
    missing = [m for m in modules if not installed(m)]
    why = f"not installed: {', '.join(missing)}" + (f" ({reason})" if reason else "")
    return pytest.mark.skipif(bool(missing), reason=why)


class lazy_module:
    """Module ``name``, imported at the first attribute read (``th = lazy_module("torch")``:
    ``th.zeros(1)`` imports torch then, inside a test, not while pytest collects)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection probes objects (__test__, _mock_name): not an import
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)
