"""Files written whole or not at all.

Every file kvsched writes (results, records, plots, calibrations, checkpoints' sidecars) goes
through :func:`replacing`: the content is written to a temporary file in the destination's
folder and renamed over the destination with :func:`os.replace`, which POSIX and Windows make
atomic within one file system. A crash, a full disk or an exception part-way leaves the old file
(or none), never half of a new one; the temporary file is removed on failure.

The temporary name keeps the destination's suffix, so writers that infer the format from the
name (``Figure.savefig``, ``DataFrame.to_parquet``) still see ``.png`` / ``.parquet``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it replaces ``path``, else it is removed.

    Args:
        path: the destination file; its folder must exist.

    Raises:
        FileNotFoundError: the destination's folder does not exist.
        Whatever the ``with`` body raises (after removing the temporary file).
    """
    dest = Path(path)
    tmp = _create_temporary(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _create_temporary(dest: Path) -> Path:
    """Create an empty, new file beside ``dest`` and return its path.

    Created with mode 0o666 through ``os.open`` so the process umask applies as to any new file
    (``tempfile.mkstemp`` would make it 0o600, and the replaced file private).
    """
    for _ in range(100):
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{dest.suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {dest}")  # pragma: no cover


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (see :func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (see :func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)
