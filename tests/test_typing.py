"""The simulator core type-checks: ``mypy`` from the repository root, with the committed
configuration (``[tool.mypy]`` in pyproject.toml: the core's files, resolved as ``kvsched.*``
through the symlinks in ``kvsched/``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_passes_on_the_core_from_the_repository_root():
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-1000:]
    assert "Success" in res.stdout
