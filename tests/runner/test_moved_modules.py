"""Modules the house redesign (#18) moved to kvsched.runner keep their old import paths, with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("name, attr", [("scenario", "load_scenario"), ("sweep", "run_cells"),
                                        ("ray_connect", "init_ray")])
def test_an_old_import_path_warns_and_gives_the_moved_object(name, attr):
    sys.modules.pop(f"kvsched.experiments.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"kvsched.runner.{name}"):
        old = importlib.import_module(f"kvsched.experiments.{name}")
    new = importlib.import_module(f"kvsched.runner.{name}")
    assert getattr(old, attr) is getattr(new, attr)
