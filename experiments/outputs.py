"""Checks of the command line's output paths, made before the work that fills them.

A tuning study, a bench run or an export's simulation can take minutes; an ``--out`` that
cannot be written must fail before it starts, naming the flag and why, not as an ``OSError``
traceback after it (which loses the results).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvsched.envs.sim.errors import MAX_PATH_CHARS, KvschedError, bounded_repr

#: Longest name :func:`file_name` accepts, UTF-8 bytes (file systems allow 255; suffixes such as
#: ``.journal.torn-<n>.bak`` are added to some).
MAX_NAME_BYTES = 200


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
        raise KvschedError(f"{flag} {bounded_repr(str(out), MAX_PATH_CHARS)}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        _probe(out)
    except OSError as e:
        raise KvschedError(f"{flag} {bounded_repr(str(out), MAX_PATH_CHARS)}: cannot write there ({e.strerror})") \
            from None


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
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: "
                           f"{bounded_repr(str(path.parent), MAX_PATH_CHARS)} is not a folder") from None
    except OSError as e:
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: "
                           f"its folder cannot be made ({e.strerror})") from None
    if path.is_dir():
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: "
                           "it is a folder; give a file name")
    try:
        _probe(path.parent)
    except OSError as e:
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: "
                           f"its folder cannot be written ({e.strerror})") \
            from None


def file_name(name: str, what: str) -> str:
    """Check a user-given name (a study, a scenario's ``name``) that becomes a file or folder name
    inside an output folder, and return it unchanged.

    A name that could leave the folder or name something else is refused, not rewritten (two
    different names must not map to one file): empty, ``.`` or ``..``, a path separator (``/``
    or ``\\``, on every system, so a study name means the same everywhere), a NUL or another
    control character, or longer than :data:`MAX_NAME_BYTES` bytes.

    Raises:
        KvschedError: naming ``what``, the name (bounded) and what is allowed.
    """
    text = str(name)
    bad = None
    if text in ("", ".", ".."):
        bad = "it names no file (empty, '.' or '..')"
    elif "/" in text or "\\" in text:
        bad = "it holds a path separator ('/' or '\\') and would write outside the output folder"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        bad = "it holds a control character"
    elif len(text.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        bad = f"it is longer than {MAX_NAME_BYTES} bytes"
    if bad is not None:
        raise KvschedError(f"{what}={bounded_repr(text)} is not allowed: {bad}; it becomes a file name, so use a "
                           "name without '/', '\\' or control characters, other than '.' and '..'")
    return text


def inside(folder: Path, name: str, what: str, suffix: str = "") -> Path:
    """``folder / (name + suffix)`` after :func:`file_name` checked ``name``; the result is
    checked to lie directly in ``folder`` (defence in depth).

    Raises:
        KvschedError: ``name`` is not allowed (see :func:`file_name`).
    """
    path = folder / (file_name(name, what) + suffix)
    if path.parent != folder:  # pragma: no cover - file_name refuses every name that could do this
        raise KvschedError(f"{what}={bounded_repr(name)} is not allowed: it would write outside {folder}")
    return path


def os_reason(e: OSError) -> str:
    """The system's reason for ``e``, with the errno's name (``No space left on device (ENOSPC)``)."""
    import errno

    reason = e.strerror or str(e)
    name = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    return f"{reason} ({name})" if name else reason
