"""Every tracked Python file keeps its lines to at most ``MAX_LINE_CHARS`` characters (decoded as
UTF-8, so ``Σ`` or ``§`` counts once). The files come from ``git ls-files`` (a virtualenv under
``.venv`` is skipped); outside a git checkout the test is skipped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE_CHARS = 120


def long_lines(text: str, limit: int = MAX_LINE_CHARS) -> list[tuple[int, int]]:
    """(1-based line number, length in characters) of each line of ``text`` longer than ``limit``."""
    lengths = (len(line.rstrip("\r")) for line in text.split("\n"))
    return [(i, n) for i, n in enumerate(lengths, 1) if n > limit]


def tracked_python_files() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    res = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.strip()[:200]}")
    names = [n for n in res.stdout.split("\0") if n]
    return [ROOT / n for n in names
            if ".venv" not in Path(n).parts and (ROOT / n).is_file()]


def test_long_lines_counts_characters_not_bytes():
    assert long_lines("é" * 120 + "\n" + "x" * 120 + "\r\n") == []
    assert long_lines("ok\n" + "Σ" * 121 + "\nok") == [(2, 121)]


def test_tracked_python_lines_are_at_most_120_characters():
    files = tracked_python_files()
    assert files, "git ls-files found no Python files"
    found = [f"{p.relative_to(ROOT)}:{i} ({n} chars)"
             for p in files for i, n in long_lines(p.read_text(encoding="utf-8"))]
    assert not found, f"{len(found)} line(s) over {MAX_LINE_CHARS} characters:\n" + "\n".join(found)
