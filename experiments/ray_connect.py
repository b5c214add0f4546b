"""Moved to :mod:`kvsched.runner.ray_connect` (the house redesign, issue #18); this alias keeps old imports
working and warns. It will be removed in kvsched 0.3."""

import warnings as _warnings

import kvsched.runner.ray_connect as _moved

_warnings.warn("kvsched.experiments.ray_connect moved to kvsched.runner.ray_connect; import it from there",
               DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
