"""Moved to :mod:`kvsched.runner.sweep` (the house redesign, issue #18); this alias keeps old imports
working and warns. It will be removed in kvsched 0.3."""

import warnings as _warnings

import kvsched.runner.sweep as _moved

_warnings.warn("kvsched.experiments.sweep moved to kvsched.runner.sweep; import it from there",
               DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
