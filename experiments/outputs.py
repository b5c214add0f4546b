"""Checks of the command line's output paths, made before the work that fills them.

A tuning study, a bench run or an export's simulation can take minutes; an ``--out`` that
cannot be written must fail before it starts, naming the flag and why, not as an ``OSError``
traceback after it (which loses the results).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvsched.envs.sim.errors import KvschedError, bounded_repr, MAX_PATH_CHARS


def _probe(folder: Path) -> None:
    """Create and remove a file in ``folder`` (raises the ``OSError`` when it cannot be written).
    The probe has a short name of its own (``tempfile``), so that neither a long output name
    (a probe named after it could exceed the file system's 255 bytes) nor another process
    probing the same folder at once makes a writable folder fail the check."""
    with tempfile.TemporaryFile(dir=folder, prefix=".kvsched-write-test-"):
        pass


def prepare_out_dir(out: Path, flag: str = "--out") -> None:
    """Create the output folder ``out`` and check that a file can be written in it.

    Raises:
        KvschedError: ``out`` exists and is not a folder, or it cannot be made or written.
    """
    if out.exists() and not out.is_dir():
        raise KvschedError(f"{flag} {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        _probe(out)
    except OSError as e:
        raise KvschedError(f"{flag} {out}: cannot write there ({e.strerror})") from None


def prepare_out_file(path: Path | None, flag: str = "--out") -> None:
    """Create the folder of the output file ``path`` and refuse a path that cannot be written as
    a file (nothing to do for ``None``). The file itself is neither created nor truncated.

    Raises:
        KvschedError: naming the flag, the path and why (the folder cannot be made, the path is
            a folder, or the folder cannot be written).
    """
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: {bounded_repr(str(path.parent), MAX_PATH_CHARS)} is not a folder") from None
    except OSError as e:
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: its folder cannot be made ({e.strerror})") from None
    if path.is_dir():
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: it is a folder; give a file name")
    try:
        _probe(path.parent)
    except OSError as e:
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: its folder cannot be written ({e.strerror})") \
            from None
