"""Where a result came from: the checkout's commit (used by the suite's results and by training
runs' metadata)."""

from __future__ import annotations

from pathlib import Path


def git_commit() -> str | None:
    """The repository's commit (``+dirty`` with uncommitted changes), or None outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
