"""Checking and repairing an Optuna journal file before a study is opened on it.

Optuna's :class:`~optuna.storages.journal.JournalFileBackend` appends one JSON record per line
(``{"op_code":N,"worker_id":...}``, written with one ``write`` under its lock file) and replays
the lines when a storage opens (``read_logs``). A write cut short (no space left on device, a
file system that fails mid-write) leaves the last record without its end: ``read_logs`` skips
an unterminated last line, but the next append is written after the fragment, so the two make
one line that is not JSON, and from then on every replay raises on it (a resumed study can no
longer be opened, although every earlier record is intact).

:func:`check_journal` reads the file the way ``read_logs`` does and finds the first line that is
not a complete record (no line end, not JSON, not an object with an integer ``op_code`` and a
``worker_id``), and whether any complete record follows it:

- no bad line: nothing to do;
- the first line is bad, no record follows and it does not start as an Optuna record
  (``{"op_code":``): the file is not a journal (someone else's file, garbage) and is refused with
  a one-line error, untouched;
- damage in the middle (a bad line followed by complete records): refused with a one-line error
  naming the first damaged line, the file left untouched. Dropping the bad line and keeping the
  later records would renumber studies and trials (Optuna numbers them by the order of their
  creation records), and cutting the file there would silently drop finished trials: a person
  must look at it (the records after the damage are intact in the file);
- a torn tail (bad lines with no complete record after them: a write cut short, e.g. by a full
  disk): the file is repaired. The original is kept beside it as ``<journal>.torn-<n>.bak`` (the
  first free ``n``), the complete records are written to the journal whole or not at all
  (:mod:`kvsched.atomic_files`), and one message says how many lines and bytes were dropped.
  The caller (:func:`kvsched.experiments.tune.make_storage`) then marks ``FAIL`` the trials the
  lost records left ``RUNNING`` without a live worker (:func:`kvsched.experiments.tune_gate.fail_dead_trials`).

The scan and the repair hold Optuna's own journal lock (:class:`JournalFileSymlinkLock`, the
lock ``append_logs`` takes), so a record another worker is writing at that moment is never
mistaken for a torn one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvsched import atomic_files
from kvsched.envs.sim.errors import ConfigError, bounded_repr

#: How every record of Optuna's journal starts (``json.dumps({"op_code": ..., ...}, separators=(",", ":"))``).
RECORD_START = b'{"op_code":'


@dataclass(frozen=True)
class JournalScan:
    """Where the complete records of a journal end.

    Attributes:
        good_bytes: length of the leading run of complete records, bytes.
        good_lines: number of those records.
        bad_bytes: bytes after them (0: the journal is sound).
        bad_lines: lines after them (an unterminated fragment counts as one).
        first_bad: the first bad line (its first bytes only), or ``b""``.
        records_after: complete records after the first bad line (> 0: damage in the middle).
    """

    good_bytes: int
    good_lines: int
    bad_bytes: int
    bad_lines: int
    first_bad: bytes = b""
    records_after: int = 0

    @property
    def sound(self) -> bool:
        return self.bad_bytes == 0

    @property
    def torn_tail(self) -> bool:
        """Bad lines at the end only (a write cut short): repairable by cutting them off."""
        return not self.sound and self.records_after == 0


def _is_record(line: bytes) -> bool:
    if not line.endswith(b"\n"):
        return False
    try:
        rec = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return False
    return (isinstance(rec, dict) and isinstance(rec.get("op_code"), int)
            and not isinstance(rec.get("op_code"), bool) and "worker_id" in rec)


def scan_journal(path: str | Path) -> JournalScan:
    """Find the leading run of complete records of the journal file ``path`` and count the
    complete records after the first bad line (see module doc).

    Raises:
        OSError: the file cannot be read.
    """
    good_bytes = good_lines = 0
    with open(path, "rb") as f:
        for line in f:
            if not _is_record(line):
                size = Path(path).stat().st_size
                bad_lines, after = 1, 0
                for rest in f:
                    bad_lines += rest.endswith(b"\n")
                    after += _is_record(rest)
                return JournalScan(good_bytes, good_lines, size - good_bytes, bad_lines, line[:80], after)
            good_bytes += len(line)
            good_lines += 1
    return JournalScan(good_bytes, good_lines, 0, 0)


def _backup_name(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.torn-{n}.bak").exists():
        n += 1
    return path.with_name(f"{path.name}.torn-{n}.bak")


def check_journal(path: str | Path, flag: str = "--storage") -> str | None:
    """Refuse a file that is not an Optuna journal; repair a torn one (see module doc).

    Args:
        path: the journal file (a missing or empty file is a new journal: nothing to do).
        flag: the command-line flag named in messages.

    Returns:
        ``None`` when the journal is sound, else the one-line message saying what was dropped
        and where the original is kept (for the caller to print).

    Raises:
        ConfigError: the file is not an Optuna journal, is damaged in the middle (left untouched),
            or it cannot be read, backed up or rewritten (e.g. the disk is still full), naming the path and the reason.
    """
    p = Path(path)
    shown = bounded_repr(str(p))
    try:
        if not p.is_file() or p.stat().st_size == 0:
            return None
        scan = scan_journal(p)
        if scan.sound:
            return None
        from optuna.storages.journal import JournalFileSymlinkLock

        lock = JournalFileSymlinkLock(str(p))  # the lock Optuna's append_logs takes
        lock.acquire()
        try:
            scan = scan_journal(p)  # again, now that no worker is appending
            if scan.sound:
                return None
            if scan.records_after:
                raise ConfigError(f"{flag} {shown}: line {scan.good_lines + 1} of the journal is damaged "
                                  f"({bounded_repr(scan.first_bad)} is not a complete record) and "
                                  f"{scan.records_after} complete record(s) follow it; the file was left untouched "
                                  "(cutting it there would drop them): restore it from a copy, or give a new file "
                                  "name")
            if scan.good_lines == 0 and not scan.first_bad.startswith(RECORD_START):
                raise ConfigError(f"{flag} {shown} is not an Optuna journal file (its first line "
                                  f"{bounded_repr(scan.first_bad)} is not a journal record); give a journal "
                                  "that kvsched tune wrote, or a new file name")
            backup = _backup_name(p)
            with atomic_files.replacing(backup) as tmp:
                shutil.copyfile(p, tmp)
            with open(p, "rb") as f:
                good = f.read(scan.good_bytes)
            atomic_files.write_bytes(p, good)
        finally:
            lock.release()
    except OSError as e:
        raise ConfigError(f"{flag} {shown}: cannot check or repair the journal ({e.strerror or e}); "
                          "nothing was changed, free space or fix permissions and run again") from None
    return (f"{flag} {shown}: the journal ends in {scan.bad_lines} line(s) ({scan.bad_bytes} bytes) that are not "
            f"complete records (a write cut short, e.g. by a full disk); recovered the study up to its last complete "
            f"record (line {scan.good_lines}, {scan.good_bytes} bytes kept), the original is kept as "
            f"{bounded_repr(str(backup))}")
