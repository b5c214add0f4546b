"""Real request traces: loaders, the bundled-trace registry, windows and rate scaling.

Every loader returns a columnar :class:`~kvsched.envs.sim.request.Workload` (see
``envs/sim/request.py``), built directly from NumPy columns (no per-request Python objects):

* :func:`load_azure_csv` -- Azure LLM inference trace 2023 (Splitwise, ISCA'24; CC-BY 4.0).
  Columns ``TIMESTAMP`` (naive wall clock with 7 fractional digits), ``ContextTokens``,
  ``GeneratedTokens``. No sessions, no prefix hashes.
* :func:`load_mooncake_jsonl` -- Mooncake FAST'25 traces (Apache-2.0). One JSON object per line
  with ``timestamp`` (ms from trace start), ``input_length``, ``output_length`` and ``hash_ids``
  (one id per 512-token prompt block; ``len(hash_ids) == ceil(input_length / 512)``).
* :func:`load_generic` -- any CSV or JSONL file, given a mapping from our field names to the
  file's column names.

Per-request scheduling priority (vLLM's ``priority``, lower is served earlier under
``--scheduling-policy priority``): an Azure-format CSV may carry an extra column ``priority`` and a
Mooncake-format JSONL file an extra key ``priority``; :func:`load_generic` maps it like any other
field. When present it must hold an integer in ``[PRIORITY_MIN, PRIORITY_MAX]`` on every row (an
empty cell, a missing or null key is an error, never a silent 0); when absent every request has
vLLM's default priority 0 (``vllm/v1/request.py`` ``Request.__init__``).

Per-request parallel samples (vLLM's ``SamplingParams.n``, ``vllm/sampling_params.py``; the
front end fans a request with ``n > 1`` out into ``n`` child requests sharing the prompt,
``vllm/v1/engine/parallel_sampling.py`` ``ParentRequest``): an Azure-format CSV may carry an extra
column ``n``, a Mooncake-format JSONL file an extra key ``n``; :func:`load_generic` maps field
``n``. Same rules as ``priority``: when present an integer in ``[1, N_MAX]`` on every row; when
absent every request has vLLM's default 1.

Conventions shared by all loaders:

* Files may be gzip-compressed (detected by content, so ``.gz`` or not). ``Workload.source_sha256``
  is the SHA-256 of the *uncompressed* bytes, so it matches the trace README whatever the
  compression.
* ``request_id`` is the 0-based index of the data row in the file (file order), so a request can
  always be traced back to its line, even after sorting.
* Line numbers in errors are 1-based lines of the (uncompressed) file; for CSV the header is
  line 1, so data row ``i`` (0-based) is line ``i + 2`` (quoted fields spanning several lines are
  not supported by these line numbers).
* Nothing is dropped silently. Any invalid value raises :class:`TraceFormatError` naming the file,
  the line, the field (and the file's column), the value and what is allowed. Empty lines carry no
  request and are skipped, but recorded in ``Workload.notes`` and logged at WARNING. Rows out of
  arrival order are sorted stably by arrival; the number of such rows is recorded in the notes and
  logged at WARNING.
* :func:`window`, :func:`scale_rate` and :func:`head` return new workloads and append a note
  describing the transformation.

Sources and licences of the bundled files: ``envs/workload/data/ATTRIBUTION.md``.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import io
import json
import logging
import math
import os
import re
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import pandas as pd

from kvsched.envs.sim import strict_json
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, TraceFormatError, bounded_repr
from kvsched.envs.sim.request import MAX_ARRIVAL_S, N_ALLOWED, N_MAX, PRIORITY_MAX, PRIORITY_MIN, Workload

__all__ = [
    "AZURE_COLUMNS",
    "BUNDLED_SHA256",
    "BUNDLED_TRACES",
    "BundledTrace",
    "DEFAULT_TRACE",
    "GENERIC_FIELDS",
    "MOONCAKE_HASH_BLOCK_TOKENS",
    "MOONCAKE_KEYS",
    "bundled_trace_path",
    "head",
    "list_traces",
    "load_azure_csv",
    "load_generic",
    "load_mooncake_jsonl",
    "load_trace",
    "scale_rate",
    "window",
]

log = logging.getLogger(__name__)

#: Azure trace columns: (timestamp, prompt tokens, output tokens).
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: Mooncake JSONL keys: (arrival ms, prompt tokens, output tokens, 512-token block hash ids).
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
#: Tokens covered by one Mooncake ``hash_ids`` entry.
MOONCAKE_HASH_BLOCK_TOKENS = 512
#: Fields :func:`load_generic` can map: required ones first.
GENERIC_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "session_id", "slo_class",
                  "prefix_hashes", "priority", "n")
#: The optional column (Azure-format CSV) or key (Mooncake-format JSONL) holding each request's
#: scheduling priority.
PRIORITY_COLUMN = "priority"
#: The optional column (Azure-format CSV) or key (Mooncake-format JSONL) holding each request's
#: number of parallel samples (vLLM's ``SamplingParams.n``).
N_COLUMN = "n"
_REQUIRED_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")
#: Largest trace file read, in bytes after decompression (default 2 GiB; the bundled traces are
#: a few MB, the full Azure 2023 and Mooncake traces tens of MB). A gzip stream expands up to
#: about 1000-fold, so a small file could otherwise exhaust the memory. Raise it with the
#: environment variable ``KVSCHED_MAX_TRACE_BYTES``.
MAX_TRACE_BYTES = 2 * 1024**3
#: Most lines of one trace file (default 50 million). Raise it with ``KVSCHED_MAX_TRACE_ROWS``.
MAX_TRACE_ROWS = 50_000_000
_TRACE_BYTES_ENV = "KVSCHED_MAX_TRACE_BYTES"
_TRACE_ROWS_ENV = "KVSCHED_MAX_TRACE_ROWS"
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


# =============================================================================================
# Reading bytes
# =============================================================================================
def _limit(default: int, env: str) -> int:
    """A size limit: ``default``, or the positive integer in environment variable ``env``.

    Raises:
        ConfigError: ``env`` is set to something other than a positive integer.
    """
    text = os.environ.get(env)
    if text is None:
        return default
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable {env}={bounded_repr(text)} is not allowed: expected a positive "
                          f"integer (default {default})")
    return value


#: Leading bytes of the compression formats kvsched does not read (gzip is read), for a clear
#: error instead of a mojibake "not the Azure format" (magic numbers: xz (tukaani.org xz-file-format
#: 1.1.0 §2.1.1.1), bzip2 ("BZh"), zip (PKWARE APPNOTE 4.3.7 local file header), zstd (RFC 8878 §3.1.1)).
_OTHER_COMPRESSION = ((b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"), (b"PK\x03\x04", "zip"),
                      (b"\x28\xb5\x2f\xfd", "zstd"))
_GZIP_MAGIC = b"\x1f\x8b"


def _compression(raw: bytes) -> str | None:
    """The name of the compression ``raw`` starts with (``gzip``, ``xz``...), or None."""
    if raw[:2] == _GZIP_MAGIC:
        return "gzip"
    return next((name for magic, name in _OTHER_COMPRESSION if raw.startswith(magic)), None)


def _shown_path(path: str | os.PathLike) -> str:
    """``path`` for a message: as given, or bounded (quoted, cut) when longer than MAX_PATH_CHARS."""
    text = str(path)
    return text if len(text) <= MAX_PATH_CHARS else bounded_repr(text, MAX_PATH_CHARS)


def _read(path: str | os.PathLike) -> tuple[bytes, str]:
    """Uncompressed content of ``path`` (gzip detected by magic bytes) and its SHA-256.

    The content is capped at :data:`MAX_TRACE_BYTES` bytes and :data:`MAX_TRACE_ROWS` lines
    (environment variables ``KVSCHED_MAX_TRACE_BYTES`` / ``KVSCHED_MAX_TRACE_ROWS`` raise them);
    a gzip stream is decompressed only up to the cap.

    Raises:
        TraceFormatError: the file cannot be read, is not a regular file, is a corrupt gzip stream,
            is compressed another way (xz, bzip2, zip, zstd; or gzip inside gzip), or exceeds a cap
            (the message names the cap and its variable).
    """
    shown = _shown_path(path)
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block open(), a folder fail obscurely
        raise TraceFormatError(f"{shown}: the trace is not a regular file")
    max_bytes = _limit(MAX_TRACE_BYTES, _TRACE_BYTES_ENV)
    max_rows = _limit(MAX_TRACE_ROWS, _TRACE_ROWS_ENV)
    too_big = (f"{shown}: the trace holds more than {max_bytes:,} bytes (uncompressed), the limit; set the "
               f"environment variable {_TRACE_BYTES_ENV} to a larger number of bytes to read it")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise TraceFormatError(f"{shown}: cannot read trace file: {e.strerror or e}") from None
    kind = _compression(raw)
    if kind is not None and kind != "gzip":
        raise TraceFormatError(f"{shown}: the trace is compressed with {kind}; kvsched reads plain or "
                               "gzip-compressed traces (decompress it first)")
    if kind == "gzip":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as g:  # every member, only up to the cap
                raw = g.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"{shown}: corrupt gzip data: {bounded_repr(str(e))[1:-1]}") from None
        inner = _compression(raw)
        if inner is not None:
            raise TraceFormatError(f"{shown}: the decompressed gzip content is itself compressed ({inner}); "
                                   "kvsched reads plain or gzip-compressed traces (decompress it first)")
    if len(raw) > max_bytes:
        raise TraceFormatError(too_big)
    rows = raw.count(b"\n") + (0 if raw.endswith(b"\n") or not raw else 1)
    if rows > max_rows:
        raise TraceFormatError(f"{shown}: the trace holds {rows:,} lines, more than the limit of {max_rows:,}; set "
                               f"the environment variable {_TRACE_ROWS_ENV} to a larger number to read it")
    return raw, hashlib.sha256(raw).hexdigest()


def _default_name(path: str | os.PathLike) -> str:
    n = Path(path).name
    for suf in (".gz", ".csv", ".jsonl", ".json"):
        if n.lower().endswith(suf):
            n = n[: -len(suf)]
    return n


def _format_of(path: str | os.PathLike) -> str | None:
    n = Path(path).name.lower()
    if n.endswith(".gz"):
        n = n[:-3]
    if n.endswith(".csv"):
        return "csv"
    if n.endswith(".jsonl") or n.endswith(".json") or n.endswith(".ndjson"):
        return "jsonl"
    return None


# =============================================================================================
# Errors and column validation
# =============================================================================================
def _bad(file: str, line: int, field: str, column: str, value: Any, allowed: str,
         others: int = 0) -> TraceFormatError:
    col = f" (column {bounded_repr(column)})" if column and column != field else ""
    more = f" [{others} more row(s) in this column are invalid too]" if others else ""
    return TraceFormatError(
        f"{file}: line {line}: field {field!r}{col} has value {bounded_repr(value)}; expected {allowed}{more}")


def _check_numbers(num: np.ndarray, raw: Sequence[Any] | np.ndarray, lines: np.ndarray, file: str, field: str,
                   column: str, *, integer: bool, minimum: float, strict: bool) -> None:
    """Raise on the first NaN / infinite / non-integral / out-of-range entry of ``num``.

    ``minimum`` is inclusive unless ``strict`` (then values must be > minimum).
    """
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(num)
        if integer:
            bad |= num != np.floor(num)
        bad |= (num <= minimum) if strict else (num < minimum)
    if bad.any():
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        v = raw[i]
        what = (f"an integer {'>' if strict else '>='} {minimum:g}" if integer
                else f"a finite number {'>' if strict else '>='} {minimum:g}")
        if isinstance(v, float) and math.isnan(v):
            what += " (NaN is not allowed)"
        raise _bad(file, int(lines[i]), field, column, v, what, len(idx) - 1)


def _numbers_from_strings(raw: np.ndarray, lines: np.ndarray, file: str, field: str,
                          column: str) -> np.ndarray:
    """Parse a CSV string column to float64; raise naming the first non-numeric cell."""
    num = pd.to_numeric(pd.Series(raw, copy=False), errors="coerce").to_numpy(dtype=np.float64)
    bad = np.isnan(num)
    if bad.any():
        # a literal "nan" parses to NaN too: both are rejected
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        v = str(raw[i])
        what = ("a number (the cell is empty)" if v.strip() == "" else
                "a number (NaN is not allowed)" if v.strip().lower() == "nan" else "a number")
        raise _bad(file, int(lines[i]), field, column, raw[i], what, len(idx) - 1)
    return num


def _numbers_from_json(vals: list, lines: np.ndarray, file: str, field: str,
                       column: str) -> np.ndarray:
    """JSON numbers (int/float, not bool/str/null) as float64; raise on the first other value."""
    types = set(map(type, vals))
    if not types <= {int, float}:
        for i, v in enumerate(vals):
            if type(v) not in (int, float):
                others = sum(type(x) not in (int, float) for x in vals) - 1
                raise _bad(file, int(lines[i]), field, column, v,
                           "a JSON number" + (" (key missing or null)" if v is None else ""),
                           others)
    return np.asarray(vals, dtype=np.float64)


def _token_column(num: np.ndarray, raw: Sequence[Any] | np.ndarray, lines: np.ndarray, file: str, field: str,
                  column: str) -> np.ndarray:
    _check_numbers(num, raw, lines, file, field, column, integer=True, minimum=1, strict=False)
    if num.size and num.max() > 2**62:
        i = int(np.argmax(num))
        raise _bad(file, int(lines[i]), field, column, raw[i], "an integer token count < 2**62")
    return num.astype(np.int64)


_PRIORITY_ALLOWED = (f"an integer priority in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served earlier, "
                     "as vLLM's priority scheduler orders requests)")


def _priority_column(raw: Sequence[Any] | np.ndarray, lines: np.ndarray, file: str, column: str,
                     numbers: Callable[..., np.ndarray]) -> np.ndarray:
    """Per-request scheduling priorities (int64) from a trace column, every row required.

    Args:
        raw: the column's cells (CSV strings or JSON values; a missing key reads as ``None``).
        numbers: the format's number parser (:func:`_numbers_from_strings` or
            :func:`_numbers_from_json`).

    Raises:
        TraceFormatError: the first empty, missing, null, non-numeric, non-integer or
            out-of-range cell, naming the file, its 1-based line, the column and the value.
    """
    num = numbers(raw, lines, file, "priority", column)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(num) | (num != np.floor(num)) | (num < PRIORITY_MIN) | (num > PRIORITY_MAX)
    if bad.any():
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        raise _bad(file, int(lines[i]), "priority", column, raw[i], _PRIORITY_ALLOWED, len(idx) - 1)
    return num.astype(np.int64)


def _n_column(raw: Sequence[Any] | np.ndarray, lines: np.ndarray, file: str, column: str,
              numbers: Callable[..., np.ndarray]) -> np.ndarray:
    """Per-request parallel samples (int64, vLLM's ``SamplingParams.n``) from a trace column,
    every row required (as :func:`_priority_column`).

    Raises:
        TraceFormatError: the first empty, missing, null, non-numeric, non-integer or
            out-of-range (< 1 or > N_MAX) cell, naming the file, its 1-based line, the column and
            the value.
    """
    num = numbers(raw, lines, file, "n", column)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(num) | (num != np.floor(num)) | (num < 1) | (num > N_MAX)
    if bad.any():
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        raise _bad(file, int(lines[i]), "n", column, raw[i], N_ALLOWED, len(idx) - 1)
    return num.astype(np.int64)


# =============================================================================================
# Assembly: sort, build columns, notes
# =============================================================================================
def _ragged_take(offsets: np.ndarray, values: np.ndarray, order: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Reorder a ragged array (row ``i`` = ``values[offsets[i]:offsets[i+1]]``) by ``order``."""
    lens = (offsets[1:] - offsets[:-1])[order]
    new_off = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    if new_off[-1] == 0:
        return new_off, np.zeros(0, dtype=np.int64)
    shift = np.repeat(offsets[:-1][order] - new_off[:-1], lens)
    return new_off, values[np.arange(new_off[-1], dtype=np.int64) + shift]


def _assemble(file: str, name: str, sha: str, arrival: np.ndarray, prompt: np.ndarray,
              output: np.ndarray, *, hash_lens: np.ndarray | None = None,
              hashes: np.ndarray | None = None, hash_block_tokens: int = 0,
              session: np.ndarray | None = None, slo_codes: np.ndarray | None = None,
              slo_names: tuple[str, ...] = ("default",), notes: Sequence[str] = (),
              priority: np.ndarray | None = None, n_samples: np.ndarray | None = None,
              lines: np.ndarray | None = None, arrival_column: str = "") -> Workload:
    n = len(arrival)
    if n == 0:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}: the trace holds no requests (no data rows)")
    beyond = arrival > MAX_ARRIVAL_S
    if lines is not None and beyond.any():  # in file order, before sorting: name the line
        idx = np.flatnonzero(beyond)
        i = int(idx[0])
        raise _bad(file, int(lines[i]), "arrival_s", arrival_column, f"{float(arrival[i]):g} s",
                   f"at most {MAX_ARRIVAL_S:g} s after the trace's start (MAX_ARRIVAL_S, about 31.7 years: "
                   "float64 seconds keep sub-microsecond resolution only up to it; a timestamp in another "
                   "unit?)", len(idx) - 1)
    notes = list(notes)
    request_id = np.arange(n, dtype=np.int64)
    if session is None:
        session = np.full(n, -1, dtype=np.int64)
    if slo_codes is None:
        slo_codes = np.zeros(n, dtype=np.int16)
    if priority is None:  # no priority column: vLLM's default for every request (the module doc)
        priority = np.zeros(n, dtype=np.int64)
    if n_samples is None:  # no n column: vLLM's default n = 1 for every request (the module doc)
        n_samples = np.ones(n, dtype=np.int64)
    if hash_lens is None or hashes is None:
        offsets = np.zeros(n + 1, dtype=np.int64)
        hashes = np.zeros(0, dtype=np.int64)
    else:
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(hash_lens, out=offsets[1:])
    if n > 1 and np.any(arrival[1:] < arrival[:-1]):
        late = int(np.count_nonzero(arrival[1:] < np.maximum.accumulate(arrival)[:-1]))
        order = np.argsort(arrival, kind="stable")
        msg = (f"sorted: {late} rows were out of arrival order in {file}; requests were sorted"
               " stably by arrival (request_id keeps the 0-based file row index)")
        log.warning(msg)
        notes.append(msg)
        arrival, prompt, output = arrival[order], prompt[order], output[order]
        request_id, session, slo_codes = request_id[order], session[order], slo_codes[order]
        priority = priority[order]
        n_samples = n_samples[order]
        offsets, hashes = _ragged_take(offsets, hashes, order)
    try:
        return Workload(
            name=name, request_id=request_id, arrival_s=np.ascontiguousarray(arrival, np.float64),
            prompt_tokens=prompt.astype(np.int64, copy=False),
            output_tokens=output.astype(np.int64, copy=False),
            session_id=session.astype(np.int64, copy=False),
            slo_class=slo_codes.astype(np.int16, copy=False), hash_offsets=offsets,
            hashes=hashes.astype(np.int64, copy=False),
            hash_block_tokens=hash_block_tokens if len(hashes) else 0,
            slo_class_names=tuple(slo_names), source_sha256=sha, notes=tuple(notes),
            priority=priority.astype(np.int64, copy=False), n=n_samples.astype(np.int64, copy=False))
    except ConfigError as e:  # should not happen after validation; keep the file in the message
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}: {e}") from None


def _check_hash_lengths(hash_lens: np.ndarray, prompt: np.ndarray, lines: np.ndarray, file: str,
                        column: str, block: int, exact: bool) -> None:
    need = -(-prompt // block)  # ceil
    bad = (hash_lens != need) if exact else (hash_lens > need)
    if bad.any():
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        rel = "exactly" if exact else "at most"
        raise _bad(file, int(lines[i]), "prefix_hashes", column, f"<{int(hash_lens[i])} ids>",
                   f"{rel} ceil(prompt_tokens / {block}) = ceil({int(prompt[i])} / {block}) = "
                   f"{int(need[i])} ids (one per {block}-token prompt block)", len(idx) - 1)


def _hash_array(flat: list, hash_lens: np.ndarray, lines: np.ndarray, file: str,
                column: str) -> np.ndarray:
    """Flat JSON hash ids -> int64, raising on the first non-integer id (naming its line)."""
    if flat and not set(map(type, flat)) <= {int}:
        offs = np.concatenate([[0], np.cumsum(hash_lens)])
        for j, v in enumerate(flat):
            if type(v) is not int:
                row = int(np.searchsorted(offs, j, side="right") - 1)
                raise _bad(file, int(lines[row]), "prefix_hashes", column, v,
                           "a list of integer hash ids")
    try:
        return np.asarray(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
    except OverflowError:
        offs = np.concatenate([[0], np.cumsum(hash_lens)])
        for j, v in enumerate(flat):
            if not -(2**63) <= v < 2**63:
                row = int(np.searchsorted(offs, j, side="right") - 1)
                raise _bad(file, int(lines[row]), "prefix_hashes", column, v,
                           "integer hash ids that fit in int64") from None
        raise


# =============================================================================================
# CSV and JSONL readers (shared by all loaders)
# =============================================================================================
def _read_csv_rows(data: bytes, file: str, columns: Sequence[str], optional: Sequence[str] = ()
                   ) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """Read the named columns as strings, and those of ``optional`` the header has. Returns
    ({column: str array}, line numbers, notes)."""
    try:
        df = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, na_filter=False,
                         skip_blank_lines=False)
    except pd.errors.EmptyDataError:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               ": the file is empty; expected a CSV header with columns "
                               f"{list(columns)}") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}: malformed CSV: {e}".strip()) from None
    found = [str(c) for c in df.columns]
    _refuse_duplicate_columns(data, file, len(found))
    missing = [c for c in columns if c not in found]
    if missing:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": line 1 (header): missing column(s) {missing}; expected "
                               f"{list(columns)}, found {found}")
    lines = np.arange(len(df), dtype=np.int64) + 2
    cols = {c: df[c].to_numpy(dtype=object) for c in (*columns, *(o for o in optional if o in found))}
    notes: list[str] = []
    if len(df):
        allv = df.to_numpy(dtype=object)
        empty = (allv == "").all(axis=1)
        if empty.any():
            notes = _blank_lines_notes(lines[empty].tolist(), file)
            keep = ~empty
            lines = lines[keep]
            cols = {c: v[keep] for c, v in cols.items()}
    return cols, lines, notes


def _refuse_duplicate_columns(data: bytes, file: str, n_columns: int) -> None:
    """Refuse a CSV header naming one column twice (pandas would rename the second ``name.1``
    and the loader read only the first, silently).

    Raises:
        TraceFormatError: naming the column (line 1).
    """
    try:
        header = pd.read_csv(io.BytesIO(data), header=None, nrows=1, dtype=str, keep_default_na=False,
                             na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError):
        return  # the full read succeeded; nothing more to learn here
    names = [str(c) for c in header.iloc[0].tolist()] if len(header) else []
    seen: set[str] = set()
    for c in names:
        if c in seen:
            raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                                   f": line 1 (header): column {bounded_repr(c)} appears twice; each column "
                                   "must be named once (which one holds the data?)")
        seen.add(c)


def _blank_lines_notes(blank: Sequence[int], file: str) -> list[str]:
    """The note on skipped empty lines (logged at WARNING): ``[]`` if ``blank`` is empty.

    Args:
        blank: 1-based line numbers of the empty lines, ascending (the first 10 are listed).
        file: the file name used in the note.
    """
    if not blank:
        return []
    msg = (f"skipped {len(blank)} empty line(s) in {file} (lines "
           f"{', '.join(map(str, blank[:10]))}{', ...' if len(blank) > 10 else ''})")
    log.warning(msg)
    return [msg]


def _jsonl_object(line: bytes, lineno: int, file: str) -> dict:
    """The JSON object on one non-empty JSONL line.

    Raises:
        TraceFormatError: the line is not valid JSON, or holds a JSON value other than an object
            (the message names the file and the 1-based line and quotes its first 80 bytes).
    """
    try:
        obj = strict_json.loads(line)
    except strict_json.DuplicateKeyError as e:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": line {lineno}: {e}; give each key once") from None
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else bounded_repr(str(e))[1:-1]
        snippet = line[:80].decode("utf-8", "replace")
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": line {lineno}: malformed JSON ({why}); the line starts "
                               f"{bounded_repr(snippet)}; expected one JSON object per line") from None
    if type(obj) is not dict:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": line {lineno}: expected a JSON object per line, got "
                               f"{type(obj).__name__}: {bounded_repr(line[:80].decode('utf-8', 'replace'))}")
    return obj


#: What a required scalar key of a JSONL trace holds (for the "is null" message).
_JSON_NUMBER_KEYS_ALLOWED = "a JSON number (null is not a value)"


def _keys_text(obj: dict, limit: int = 12) -> str:
    """The first ``limit`` keys of ``obj``, sorted, for a message (the count of the others)."""
    keys = sorted(map(str, obj))
    shown = ", ".join(bounded_repr(k, 40) for k in keys[:limit])
    return f"[{shown}{f', ... ({len(keys) - limit} more)' if len(keys) > limit else ''}]"


def _append_row_values(obj: dict, appenders: Sequence[tuple[str, Callable[[Any], None], bool]],
                       file: str, lineno: int) -> None:
    """Append one row's value of every scalar field (``None`` when the key is missing or null).

    Args:
        obj: the row's JSON object.
        appenders: per field, in order: (JSON key, the append of its value list, required?).
        file, lineno: the file and 1-based line, for the error.

    Raises:
        TraceFormatError: a required key is missing or null (the first such key in ``appenders``
            order; the message lists the keys present).
    """
    for key, app, req in appenders:
        v = obj.get(key)
        if v is None and req:
            raise TraceFormatError(
                f"{bounded_repr(str(file), MAX_PATH_CHARS)}: line {lineno}: required key {bounded_repr(key)} is "
                + (f"null; expected {_JSON_NUMBER_KEYS_ALLOWED}" if key in obj else
                   f"missing; keys present: {_keys_text(obj)}"))
        app(v)


def _row_hash_ids(obj: dict, key: str, required: bool, file: str, lineno: int) -> list:
    """One row's list of hash ids under ``key``: a missing or null optional key is ``[]``.

    The ids themselves are not checked here (see :func:`_hash_array`).

    Raises:
        TraceFormatError: the key is required and missing or null (the message says which),
            or its value is not a JSON list.
    """
    h = obj.get(key)
    if h is None:
        if required:
            if key in obj:
                raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                                       f": line {lineno}: required key {bounded_repr(key)} is null; "
                                       "expected a JSON list of integer hash ids (one per prompt block)")
            raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                                   f": line {lineno}: required key {bounded_repr(key)} is missing;"
                                   f" keys present: {_keys_text(obj)}")
        h = []
    if type(h) is not list:
        raise _bad(file, lineno, "prefix_hashes", key, h, "a JSON list of integer hash ids")
    return h


def _read_jsonl_rows(data: bytes, file: str, keys: dict[str, str], required: Sequence[str],
                     list_key: str | None = None
                     ) -> tuple[dict[str, list], np.ndarray, np.ndarray | None, list, list[str]]:
    """Parse JSONL. ``keys`` maps field -> JSON key; ``required`` fields must be present.

    The ``list_key`` field (hash ids) is flattened: returns its per-row lengths and a flat list.
    Missing optional keys read as ``None``. Empty lines are skipped and noted.

    Returns ({field: list of values}, line numbers, list lengths or None, flat list, notes).

    Raises:
        TraceFormatError: see :func:`_jsonl_object`, :func:`_append_row_values` and
            :func:`_row_hash_ids` (checked in that order per line, lines in file order).
    """
    out: dict[str, list] = {f: [] for f in keys if f != list_key}
    appenders = [(keys[f], out[f].append, f in required) for f in out]
    lens: list[int] = []
    flat: list = []
    lines: list[int] = []
    blank: list[int] = []
    lk = keys[list_key] if list_key else None
    lk_required = list_key in required if list_key else False
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            blank.append(lineno)
            continue
        obj = _jsonl_object(line, lineno, file)
        _append_row_values(obj, appenders, file, lineno)
        if lk is not None:
            h = _row_hash_ids(obj, lk, lk_required, file, lineno)
            flat.extend(h)
            lens.append(len(h))
        lines.append(lineno)
    # the final newline yields one empty piece: not a blank line of the file
    if blank and blank[-1] == data.count(b"\n") + 1:
        blank.pop()
    return (out, np.asarray(lines, dtype=np.int64),
            np.asarray(lens, dtype=np.int64) if lk is not None else None, flat,
            _blank_lines_notes(blank, file))


def _datetime_seconds(raw: np.ndarray, lines: np.ndarray, file: str, field: str, column: str,
                      *, slice26: bool) -> tuple[np.ndarray, str]:
    """Parse wall-clock timestamps; seconds since the earliest one, and that earliest one."""
    s = pd.Series(raw, copy=False).astype(str)
    if slice26:
        # Azure writes 7 fractional digits; pandas parses 6. Only that exact naive form is cut,
        # so a UTC offset ("+01:00") is never dropped.
        azure = s.str.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{7}")
        s = s.where(~azure, s.str.slice(0, 26))
    try:
        # utc=True honours offsets (also mixed ones); naive timestamps are taken as UTC
        ts = pd.to_datetime(s, format="ISO8601", errors="coerce", utc=True)
    except (ValueError, TypeError) as e:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": column {bounded_repr(column)} ({field}): timestamps cannot be parsed "
                               f"together ({e}); use one ISO 8601 form throughout") from None
    bad = ts.isna().to_numpy()
    if bad.any():
        idx = np.flatnonzero(bad)
        i = int(idx[0])
        raise _bad(file, int(lines[i]), field, column, raw[i],
                   "a timestamp like '2023-11-16 18:17:03.9799600' (ISO 8601)", len(idx) - 1)
    ts = ts.dt.tz_localize(None)
    t0 = ts.min()
    sec = (ts - t0).dt.total_seconds().to_numpy(dtype=np.float64)
    return sec, str(t0)


# =============================================================================================
# Azure
# =============================================================================================
def _azure_from_bytes(data: bytes, file: str, sha: str, name: str) -> Workload:
    t_col, p_col, o_col = AZURE_COLUMNS
    cols, lines, notes = _read_csv_rows(data, file, AZURE_COLUMNS, optional=(PRIORITY_COLUMN, N_COLUMN))
    arrival, t0 = _datetime_seconds(cols[t_col], lines, file, "arrival_s", t_col, slice26=True)
    prompt = _token_column(_numbers_from_strings(cols[p_col], lines, file, "prompt_tokens", p_col),
                           cols[p_col], lines, file, "prompt_tokens", p_col)
    output = _token_column(_numbers_from_strings(cols[o_col], lines, file, "output_tokens", o_col),
                           cols[o_col], lines, file, "output_tokens", o_col)
    priority = None
    if PRIORITY_COLUMN in cols:
        priority = _priority_column(cols[PRIORITY_COLUMN], lines, file, PRIORITY_COLUMN, _numbers_from_strings)
    n_samples = None
    if N_COLUMN in cols:
        n_samples = _n_column(cols[N_COLUMN], lines, file, N_COLUMN, _numbers_from_strings)
    notes.insert(0, f"loaded {len(lines)} rows from {file} (Azure LLM inference trace format); "
                    f"arrival_s = seconds since the earliest TIMESTAMP {t0}"
                    + (f"; per-request priority from column {PRIORITY_COLUMN!r}" if priority is not None else "")
                    + (f"; parallel samples from column {N_COLUMN!r}" if n_samples is not None else ""))
    return _assemble(file, name, sha, arrival, prompt, output, notes=notes, priority=priority, n_samples=n_samples,
                     lines=lines, arrival_column=t_col)


def load_azure_csv(path: str | os.PathLike, name: str | None = None) -> Workload:
    """Load an Azure LLM inference trace CSV (2023 format; plain or gzip).

    Source: ``github.com/Azure/AzurePublicDataset`` ``data/AzureLLMInferenceTrace_{conv,code}.csv``
    (CC-BY 4.0; cite Patel et al., *Splitwise*, ISCA 2024).

    Columns: ``TIMESTAMP`` (naive wall clock, e.g. ``2023-11-16 18:17:03.9799600``; parsed after
    truncating to 26 characters, i.e. microseconds), ``ContextTokens`` -> ``prompt_tokens``,
    ``GeneratedTokens`` -> ``output_tokens``; optional ``priority`` and ``n`` (kvsched's
    extensions, see the module docstring: an integer on every row). Other columns are ignored.

    Returns:
        A workload with ``arrival_s`` in seconds since the earliest timestamp (the first row in
        the upstream files, which are sorted), no sessions (``session_id = -1``), no prefix
        hashes, SLO class ``"default"``; ``source_sha256`` of the uncompressed file;
        ``name`` defaults to the file name without extensions.

    Raises:
        TraceFormatError: unreadable file, missing columns (expected vs found), unparsable
            timestamps, non-numeric / NaN / non-integer / zero / negative token counts, a
            ``priority`` cell that is not an integer in range, or no data rows -- naming the
            file, the 1-based line (header = line 1), the field, the value and what is allowed.
    """
    data, sha = _read(path)
    return _azure_from_bytes(data, str(path), sha, name or _default_name(path))


# =============================================================================================
# Mooncake
# =============================================================================================
def _mooncake_from_bytes(data: bytes, file: str, sha: str, name: str) -> Workload:
    k_t, k_in, k_out, k_h = MOONCAKE_KEYS
    keys = {"arrival_s": k_t, "prompt_tokens": k_in, "output_tokens": k_out, "prefix_hashes": k_h}
    vals, lines, hash_lens, flat, notes = _read_jsonl_rows(
        data, file, {**keys, "priority": PRIORITY_COLUMN, "n": N_COLUMN}, required=tuple(keys),
        list_key="prefix_hashes")
    ms = _numbers_from_json(vals["arrival_s"], lines, file, "arrival_s", k_t)
    _check_numbers(ms, vals["arrival_s"], lines, file, "arrival_s", k_t, integer=False,
                   minimum=0, strict=False)
    prompt = _token_column(_numbers_from_json(vals["prompt_tokens"], lines, file, "prompt_tokens",
                                              k_in), vals["prompt_tokens"], lines, file,
                           "prompt_tokens", k_in)
    output = _token_column(_numbers_from_json(vals["output_tokens"], lines, file, "output_tokens",
                                              k_out), vals["output_tokens"], lines, file,
                           "output_tokens", k_out)
    assert hash_lens is not None
    _check_hash_lengths(hash_lens, prompt, lines, file, k_h, MOONCAKE_HASH_BLOCK_TOKENS, exact=True)
    hashes = _hash_array(flat, hash_lens, lines, file, k_h)
    priority = None
    if any(v is not None for v in vals["priority"]):  # the key on one line: required on every line
        priority = _priority_column(vals["priority"], lines, file, PRIORITY_COLUMN, _numbers_from_json)
    n_samples = None
    if any(v is not None for v in vals["n"]):  # as priority: the key on one line, required on every line
        n_samples = _n_column(vals["n"], lines, file, N_COLUMN, _numbers_from_json)
    notes.insert(0, f"loaded {len(lines)} rows from {file} (Mooncake JSONL format); arrival_s = "
                    f"timestamp ms / 1000; hash_ids kept as 512-token prefix-block hashes"
                    + (f"; per-request priority from key {PRIORITY_COLUMN!r}" if priority is not None else "")
                    + (f"; parallel samples from key {N_COLUMN!r}" if n_samples is not None else ""))
    return _assemble(file, name, sha, ms / 1000.0, prompt, output, hash_lens=hash_lens,
                     hashes=hashes, hash_block_tokens=MOONCAKE_HASH_BLOCK_TOKENS, notes=notes, priority=priority,
                     n_samples=n_samples, lines=lines, arrival_column=k_t)


def load_mooncake_jsonl(path: str | os.PathLike, name: str | None = None) -> Workload:
    """Load a Mooncake FAST'25 trace (JSONL, one request per line; plain or gzip).

    Source: ``github.com/kvcache-ai/Mooncake`` ``FAST25-release/traces/*.jsonl`` (Apache-2.0;
    cite Qin et al., *Mooncake*, FAST 2025).

    Keys: ``timestamp`` (arrival in **milliseconds** from the trace start; ``arrival_s = ms /
    1000``), ``input_length`` -> ``prompt_tokens``, ``output_length`` -> ``output_tokens``,
    ``hash_ids`` -> ``prefix_hashes`` with ``hash_block_tokens = 512`` (kept as int64; the
    simulator maps each 512-token hash to 32 KV blocks of 16 tokens); optional ``priority`` and
    ``n`` (kvsched's extensions, see the module docstring: once on any line, an integer on every
    line).
    Other keys are ignored.

    Returns:
        A workload (no sessions, SLO class ``"default"``) with ``source_sha256`` of the
        uncompressed file; ``name`` defaults to the file name without extensions.

    Raises:
        TraceFormatError: malformed JSON line, a line that is not an object, a missing/null key,
            non-numeric / NaN / negative timestamp, non-integer / zero / negative token counts,
            non-integer hash ids, ``len(hash_ids) != ceil(input_length / 512)``, or a ``priority``
            that is missing, null or not an integer in range on some line while another line has
            one -- naming the file, the 1-based line, the field, the value and what is allowed.
    """
    data, sha = _read(path)
    return _mooncake_from_bytes(data, str(path), sha, name or _default_name(path))


# =============================================================================================
# Generic
# =============================================================================================
def _parse_hash_cell(cell: str, line: int, file: str, column: str) -> list[int]:
    s = cell.strip()
    if not s:
        return []
    try:
        if s.startswith("["):
            try:
                v = json.loads(s)
            except RecursionError:
                raise ValueError("nested too deeply") from None
            if type(v) is not list or not all(type(x) is int for x in v):
                raise ValueError
            return v
        return [int(x) for x in re.split(r"[\s;,]+", s) if x]
    except ValueError:
        raise _bad(file, line, "prefix_hashes", column, cell,
                   "integer hash ids as a JSON list '[1, 2, 3]' or separated by spaces/semicolons"
                   ) from None


def _check_column_map(columns: dict[str, str]) -> None:
    """Check :func:`load_generic`'s ``columns``: a dict over :data:`GENERIC_FIELDS` holding every
    required field (``arrival_s``, ``prompt_tokens``, ``output_tokens``).

    Raises:
        ConfigError: ``columns`` is not a dict, maps an unknown field (the message lists the
            allowed ones) or misses a required one.
    """
    if not isinstance(columns, dict):
        raise ConfigError(f"columns={bounded_repr(columns)} must be a dict mapping field -> file column")
    unknown = [f for f in columns if f not in GENERIC_FIELDS]
    if unknown:
        raise ConfigError(f"columns has unknown field(s) {unknown}; allowed: {list(GENERIC_FIELDS)}")
    missing = [f for f in _REQUIRED_FIELDS if f not in columns]
    if missing:
        raise ConfigError(f"columns must map the required field(s) {missing}; required: "
                          f"{list(_REQUIRED_FIELDS)}, given: {columns}")


def _generic_format(path: str | os.PathLike, fmt: str | None) -> str:
    """``fmt`` checked, or (``None``) inferred from the file name: ``"csv"`` or ``"jsonl"``.

    Raises:
        TraceFormatError: ``fmt`` is ``None`` and the suffix is neither ``.csv`` nor
            ``.jsonl``/``.json``/``.ndjson`` (optionally ``.gz``).
        ConfigError: ``fmt`` is given but is neither ``"csv"`` nor ``"jsonl"``.
    """
    if fmt is None:
        fmt = _format_of(path)
        if fmt is None:
            raise TraceFormatError(f"{bounded_repr(str(path), MAX_PATH_CHARS)}"
                                   ": cannot tell the format from the file name; expected a "
                                   "suffix .csv or .jsonl (optionally .gz), or pass fmt='csv'/'jsonl'")
    if fmt not in ("csv", "jsonl"):
        raise ConfigError(f"fmt={bounded_repr(fmt)} is not allowed: expected 'csv', 'jsonl' or None")
    return fmt


def _check_generic_args(path: str | os.PathLike, columns: dict[str, str], time_unit: str,
                        fmt: str | None, hash_block_tokens: int) -> str:
    """Check :func:`load_generic`'s arguments before the file is read; returns the format.

    Checked in this order: ``columns`` (:func:`_check_column_map`), ``time_unit``, ``fmt``
    (:func:`_generic_format`), then ``hash_block_tokens`` (only when ``prefix_hashes`` is mapped).

    Returns:
        ``"csv"`` or ``"jsonl"``.

    Raises:
        ConfigError: a bad argument, as listed (the first one found).
        TraceFormatError: the format cannot be told from the file name.
    """
    _check_column_map(columns)
    if time_unit not in (*_TIME_UNITS, "datetime"):
        raise ConfigError(f"time_unit={bounded_repr(time_unit)} is not allowed: expected one of "
                          f"{[*_TIME_UNITS, 'datetime']}")
    fmt = _generic_format(path, fmt)
    if "prefix_hashes" in columns and (isinstance(hash_block_tokens, bool)
                                       or not isinstance(hash_block_tokens, int) or hash_block_tokens <= 0):
        raise ConfigError(f"hash_block_tokens={bounded_repr(hash_block_tokens)} is not allowed: expected an "
                          "integer > 0 (tokens per prefix hash) when 'prefix_hashes' is mapped")
    return fmt


class _GenericRows(NamedTuple):
    """A generic trace's data rows as read, before the values are range-checked.

    Every per-row sequence has one entry per data row (empty lines skipped), in file order.

    Attributes:
        raw: field -> the row cells as read: CSV strings (object array) or JSON values (list).
        lines: 1-based file line of each row (int64).
        arrival: float64 arrival numbers in the file's time unit, or with
            ``time_unit="datetime"`` seconds since the earliest timestamp.
        t0: the earliest timestamp (``time_unit="datetime"`` only; else ``""``).
        tokens: ``prompt_tokens`` and ``output_tokens`` as float64 numbers (not yet checked as
            counts).
        hash_lens: hash ids per row (int64); ``None`` when ``prefix_hashes`` is not mapped.
        flat: all rows' hash ids concatenated in row order (not yet checked as int64).
        sess_raw: the ``session_id`` cells; ``None`` when not mapped.
        slo_raw: the ``slo_class`` cells; ``None`` when not mapped.
        empty: the cell that means "no value": ``""`` (CSV) or ``None`` (JSONL).
        notes: the reader's notes (skipped empty lines).
    """

    raw: dict[str, Any]
    lines: np.ndarray
    arrival: np.ndarray
    t0: str
    tokens: dict[str, np.ndarray]
    hash_lens: np.ndarray | None
    flat: list
    sess_raw: Sequence[Any] | None
    slo_raw: Sequence[Any] | None
    empty: Any
    notes: list[str]


def _parse_arrivals(raw: Any, lines: np.ndarray, file: str, column: str, time_unit: str,
                    numbers: Callable[..., np.ndarray]) -> tuple[np.ndarray, str]:
    """The arrival cells as float64 and the earliest timestamp (``""`` unless datetime).

    Args:
        raw: the arrival cells (CSV strings or JSON values).
        numbers: the number parser of the format (:func:`_numbers_from_strings` or
            :func:`_numbers_from_json`), used unless ``time_unit == "datetime"``.

    Returns:
        ``(arrival, t0)``: numbers in ``time_unit`` (not range-checked, not scaled), or for
        ``"datetime"`` seconds since the earliest timestamp ``t0``.

    Raises:
        TraceFormatError: a cell that is not a number (not a timestamp), naming its line.
    """
    if time_unit == "datetime":
        return _datetime_seconds(np.asarray(raw, dtype=object), lines, file, "arrival_s", column,
                                 slice26=False)
    return numbers(raw, lines, file, "arrival_s", column), ""


def _csv_hash_cells(cells: np.ndarray, lines: np.ndarray, file: str,
                    column: str) -> tuple[np.ndarray, list[int]]:
    """Parse a CSV column of hash-id lists (:func:`_parse_hash_cell`).

    Returns:
        ``(hash_lens, flat)``: ids per row (int64) and all ids concatenated in row order.

    Raises:
        TraceFormatError: the first cell that is not a list of integers, naming its line.
    """
    per_row = [_parse_hash_cell(c, int(ln), file, column) for c, ln in zip(cells, lines)]
    hash_lens = np.fromiter(map(len, per_row), dtype=np.int64, count=len(per_row))
    return hash_lens, [h for r in per_row for h in r]


def _generic_csv_rows(data: bytes, file: str, columns: dict[str, str], time_unit: str,
                      has_hashes: bool) -> _GenericRows:
    """Read a generic CSV trace's mapped columns (:func:`_read_csv_rows`).

    Parsed in this order: arrivals, prompt tokens, output tokens, hash-id cells.

    Raises:
        TraceFormatError: a malformed file, a missing column or an unparsable cell (the first
            one in that order), naming the file, line, field, column and value.
    """
    cols, lines, notes = _read_csv_rows(data, file, list(dict.fromkeys(columns.values())))
    raw: dict[str, Any] = {f: cols[c] for f, c in columns.items()}
    arrival, t0 = _parse_arrivals(raw["arrival_s"], lines, file, columns["arrival_s"], time_unit,
                                  _numbers_from_strings)
    tokens = {f: _numbers_from_strings(raw[f], lines, file, f, columns[f])
              for f in ("prompt_tokens", "output_tokens")}
    hash_lens: np.ndarray | None = None
    flat: list = []
    if has_hashes:
        hash_lens, flat = _csv_hash_cells(raw["prefix_hashes"], lines, file, columns["prefix_hashes"])
    return _GenericRows(raw, lines, arrival, t0, tokens, hash_lens, flat,
                        list(raw["session_id"]) if "session_id" in raw else None,
                        list(raw["slo_class"]) if "slo_class" in raw else None, "", notes)


def _generic_jsonl_rows(data: bytes, file: str, columns: dict[str, str], time_unit: str,
                        has_hashes: bool) -> _GenericRows:
    """Read a generic JSONL trace's mapped keys (:func:`_read_jsonl_rows`; missing optional keys
    read as ``None``).

    Parsed in this order: every line (JSON, required keys, hash-id lists), then arrivals, prompt
    tokens, output tokens.

    Raises:
        TraceFormatError: a malformed line, a missing/null required key, a hash-id value that is
            not a list, or a value of the wrong type (the first one in that order), naming the
            file, line, field, key and value.
    """
    vals, lines, hash_lens, flat, notes = _read_jsonl_rows(
        data, file, dict(columns), required=_REQUIRED_FIELDS,
        list_key="prefix_hashes" if has_hashes else None)
    arrival, t0 = _parse_arrivals(vals["arrival_s"], lines, file, columns["arrival_s"], time_unit,
                                  _numbers_from_json)
    tokens = {f: _numbers_from_json(vals[f], lines, file, f, columns[f])
              for f in ("prompt_tokens", "output_tokens")}
    return _GenericRows(vals, lines, arrival, t0, tokens, hash_lens, flat, vals.get("session_id"),
                        vals.get("slo_class"), None, notes)


def _generic_token_counts(rows: _GenericRows, file: str,
                          columns: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output token counts (int64, one per row), prompt checked first.

    Raises:
        TraceFormatError: a count that is not an integer in ``[1, 2**62]``, naming its line.
    """
    prompt = _token_column(rows.tokens["prompt_tokens"], rows.raw["prompt_tokens"], rows.lines, file,
                           "prompt_tokens", columns["prompt_tokens"])
    output = _token_column(rows.tokens["output_tokens"], rows.raw["output_tokens"], rows.lines, file,
                           "output_tokens", columns["output_tokens"])
    return prompt, output


def _generic_arrival_s(rows: _GenericRows, file: str, column: str, time_unit: str,
                       rebase_time: bool) -> tuple[np.ndarray, str]:
    """Arrival times in seconds, and the end of the workload's "loaded ..." note saying how.

    Numeric arrivals must be finite and >= 0 (any finite value with ``rebase_time``); they are
    scaled by ``time_unit`` and, with ``rebase_time``, shifted so the earliest is 0. Datetime
    arrivals are already seconds since the earliest timestamp.

    Returns:
        ``(arrival_s, note_tail)``: float64 seconds, one per row, in file order.

    Raises:
        TraceFormatError: a NaN / infinite / negative (without ``rebase_time``) arrival.
    """
    if time_unit == "datetime":
        return rows.arrival, f", arrival_s = seconds since the earliest timestamp {rows.t0})"
    _check_numbers(rows.arrival, rows.raw["arrival_s"], rows.lines, file, "arrival_s", column,
                   integer=False, minimum=-np.inf if rebase_time else 0, strict=rebase_time)
    arrival = rows.arrival * _TIME_UNITS[time_unit]
    note_tail = f", time unit {time_unit})"
    if rebase_time and len(arrival):
        t_min = float(arrival.min())
        arrival = arrival - t_min
        note_tail += f"; arrivals rebased by -{t_min:g} s to start at 0"
    return arrival, note_tail


def _generic_hashes(rows: _GenericRows, prompt: np.ndarray, file: str, column: str,
                    block: int, exact: bool) -> np.ndarray | None:
    """The flat int64 hash ids, ``None`` when ``prefix_hashes`` is not mapped.

    Each row holds at most (``exact``: exactly) ``ceil(prompt / block)`` ids.

    Raises:
        TraceFormatError: a row with too many (or, ``exact``, a wrong number of) ids, then an id
            that is not an integer fitting in int64, naming its line.
    """
    if rows.hash_lens is None:
        return None
    _check_hash_lengths(rows.hash_lens, prompt, rows.lines, file, column, block, exact=exact)
    return _hash_array(rows.flat, rows.hash_lens, rows.lines, file, column)


def _generic_labels(rows: _GenericRows, file: str, columns: dict[str, str]
                    ) -> tuple[np.ndarray | None, np.ndarray | None, tuple[str, ...], list[str]]:
    """The optional per-request labels: session ids (:func:`_session_column`) and SLO classes
    (:func:`_slo_column`).

    Returns:
        ``(session, slo_codes, slo_names, notes)``: int64 session ids or ``None`` (not mapped),
        int16 class codes or ``None`` with names ``("default",)`` (not mapped), and the note on
        renumbered session ids if any.

    Raises:
        TraceFormatError: 32768 distinct SLO classes; OverflowError: more (see
            :func:`_slo_column`).
    """
    session, notes = None, []
    if rows.sess_raw is not None:
        session, note = _session_column(rows.sess_raw, rows.empty, rows.lines, file, columns["session_id"])
        if note:
            notes.append(note)
    if rows.slo_raw is None:
        return session, None, ("default",), notes
    return (session, *_slo_column(rows.slo_raw, file, columns["slo_class"]), notes)


def load_generic(path: str | os.PathLike, columns: dict[str, str], time_unit: str = "s",
                 fmt: str | None = None, name: str | None = None, *,
                 hash_block_tokens: int = 0, exact_hash_length: bool = False,
                 rebase_time: bool = False) -> Workload:
    """Load any CSV or JSONL request trace given a column mapping.

    Args:
        path: ``.csv`` / ``.jsonl`` (``.json``, ``.ndjson``), optionally ``.gz``.
        columns: our field name -> the file's column (CSV header) or key (JSONL). Required:
            ``arrival_s``, ``prompt_tokens``, ``output_tokens``. Optional: ``session_id``
            (integers, or any strings which are then numbered 0, 1, ... in order of first
            appearance; empty/null -> -1 = unknown), ``slo_class`` (class names; empty/null ->
            ``"default"``), ``prefix_hashes`` (a list of integer hash ids per row: a JSON list in
            JSONL; in CSV a cell ``"[1, 2, 3]"`` or ``"1 2 3"`` / ``"1;2;3"``; empty -> none),
            ``priority`` (an integer in ``[PRIORITY_MIN, PRIORITY_MAX]`` on every row, lower is
            served earlier; not mapped: every request has vLLM's default 0), ``n`` (parallel
            samples, an integer in ``[1, N_MAX]`` on every row; not mapped: 1, vLLM's default).
        time_unit: unit of the arrival column: ``"s"``, ``"ms"`` or ``"us"`` (numbers), or
            ``"datetime"`` (ISO-8601 wall-clock strings; arrival = seconds since the earliest).
        fmt: ``"csv"`` or ``"jsonl"``; ``None`` infers it from the suffix.
        name: workload name (default: the file name without extensions).
        hash_block_tokens: tokens per prefix hash; required (> 0) when ``prefix_hashes`` is
            mapped.
        exact_hash_length: require ``len(prefix_hashes) == ceil(prompt_tokens /
            hash_block_tokens)`` per row (otherwise at most that many).
        rebase_time: subtract the earliest numeric arrival (e.g. for epoch timestamps); noted.

    Returns:
        A workload sorted by arrival (``arrival_s`` in seconds, >= 0).

    Raises:
        ConfigError: bad arguments (unknown fields, missing required fields, bad ``time_unit`` /
            ``fmt`` / ``hash_block_tokens``).
        TraceFormatError: missing columns/keys, malformed rows, non-numeric / NaN / negative
            values, zero token counts, unparsable timestamps, bad hash lists, a priority that is
            not an integer in range -- naming the file, the 1-based line, the field, the value
            and what is allowed.
    """
    fmt = _check_generic_args(path, columns, time_unit, fmt, hash_block_tokens)
    has_hashes = "prefix_hashes" in columns
    file = str(path)
    data, sha = _read(path)
    read = _generic_csv_rows if fmt == "csv" else _generic_jsonl_rows
    rows = read(data, file, columns, time_unit, has_hashes)
    prompt, output = _generic_token_counts(rows, file, columns)
    arrival, note_tail = _generic_arrival_s(rows, file, columns["arrival_s"], time_unit, rebase_time)
    hashes = _generic_hashes(rows, prompt, file, columns.get("prefix_hashes", ""), hash_block_tokens,
                             exact_hash_length)
    session, slo_codes, slo_names, label_notes = _generic_labels(rows, file, columns)
    priority = None
    if "priority" in columns:
        priority = _priority_column(rows.raw["priority"], rows.lines, file, columns["priority"],
                                    _numbers_from_strings if fmt == "csv" else _numbers_from_json)
    n_samples = None
    if "n" in columns:
        n_samples = _n_column(rows.raw["n"], rows.lines, file, columns["n"],
                              _numbers_from_strings if fmt == "csv" else _numbers_from_json)
    notes = [f"loaded {len(rows.lines)} rows from {file} (generic {fmt}, columns {columns}{note_tail}",
             *rows.notes, *label_notes]
    return _assemble(file, name or _default_name(path), sha, arrival, prompt, output,
                     hash_lens=rows.hash_lens if has_hashes else None, hashes=hashes,
                     hash_block_tokens=hash_block_tokens if has_hashes else 0, session=session,
                     slo_codes=slo_codes, slo_names=slo_names, notes=notes, priority=priority,
                     n_samples=n_samples, lines=rows.lines, arrival_column=columns["arrival_s"])


def _session_column(vals: Sequence[Any], empty: Any, lines: np.ndarray, file: str, column: str
                    ) -> tuple[np.ndarray, str]:
    """Integer session ids (empty/null -> -1); non-integer ids are numbered by first appearance."""
    out = np.full(len(vals), -1, dtype=np.int64)
    ints = True
    for i, v in enumerate(vals):
        if v is None or v == "":
            continue
        if type(v) is int or (isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v)):
            out[i] = int(v)
        else:
            ints = False
            break
    if ints:
        return out, ""
    codes: dict[str, int] = {}
    for i, v in enumerate(vals):
        if v is None or v == "":
            out[i] = -1
        else:
            out[i] = codes.setdefault(str(v), len(codes))
    return out, (f"session ids in column {column!r} of {file} are not all non-negative integers; "
                 f"numbered {len(codes)} distinct ids 0..{len(codes) - 1} by first appearance")


def _slo_column(vals: Sequence[Any], file: str, column: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """SLO class names -> int16 codes numbered by first appearance (empty/null -> ``"default"``).

    Returns:
        ``(codes, names)``: int16 codes, one per row, and the class names in code order.

    Raises:
        TraceFormatError: 32768 distinct classes (at most 32767 are allowed).
        OverflowError: more than 32768 distinct classes: storing code 32768 in the int16 array
            fails before the check above (behaviour kept as found).
    """
    names: dict[str, int] = {}
    codes = np.empty(len(vals), dtype=np.int16)
    for i, v in enumerate(vals):
        key = "default" if v is None or v == "" else str(v)
        codes[i] = names.setdefault(key, len(names))
    if len(names) > np.iinfo(np.int16).max:
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": column {bounded_repr(column)} has {len(names)} "
                               "distinct SLO classes; at most 32767 are allowed")
    return codes, tuple(names) or ("default",)


# =============================================================================================
# Bundled traces
# =============================================================================================
class BundledTrace(NamedTuple):
    """A trace shipped in ``kvsched/envs/workload/data`` (see ``ATTRIBUTION.md``)."""

    filename: str
    loader: Callable[..., Workload]
    description: str
    attribution: str


#: name -> (filename, loader, description, attribution). The first entry is the default.
BUNDLED_TRACES: dict[str, BundledTrace] = {
    "azure-conv-2023": BundledTrace(
        "AzureLLMInferenceTrace_conv.csv.gz", load_azure_csv,
        "Azure LLM inference 2023, conversation: 19,366 requests over 58 min (2023-11-16), "
        "mean input 1,155 / output 211 tokens; no sessions or prefix hashes",
        "Azure/AzurePublicDataset, CC-BY 4.0; Patel et al., Splitwise, ISCA 2024"),
    "mooncake-conversation": BundledTrace(
        "mooncake_conversation_trace.jsonl.gz", load_mooncake_jsonl,
        "Mooncake (Kimi) conversation: 12,031 requests over 59 min, mean input 12,035 / output "
        "343 tokens; 512-token prefix-block hash ids (reuse ratio 0.366)",
        "kvcache-ai/Mooncake FAST25-release, Apache-2.0; Qin et al., Mooncake, FAST 2025"),
}
#: SHA-256 of each bundled file's uncompressed content (from the traces README).
BUNDLED_SHA256: dict[str, str] = {
    "azure-conv-2023": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "mooncake-conversation": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
}
DEFAULT_TRACE = "azure-conv-2023"


def bundled_trace_path(name: str):
    """The packaged file of bundled trace ``name`` (an ``importlib.resources`` Traversable).

    Raises:
        ConfigError: ``name`` is not a bundled trace (the message lists them).
    """
    if name not in BUNDLED_TRACES:
        raise ConfigError(f"unknown bundled trace {bounded_repr(name)}; bundled traces: {list(BUNDLED_TRACES)}")
    return importlib.resources.files("kvsched.envs.workload") / "data" / BUNDLED_TRACES[name].filename


def list_traces() -> list[dict[str, str]]:
    """One row per bundled trace for a CLI table: name, default, file, description, attribution."""
    return [{"name": n, "default": "yes" if n == DEFAULT_TRACE else "", "file": t.filename,
             "description": t.description, "attribution": t.attribution}
            for n, t in BUNDLED_TRACES.items()]


def _sniff(data: bytes, file: str, fmt: str | None) -> str:
    """'azure' or 'mooncake' from the content of a .csv / .jsonl file, else TraceFormatError."""
    hint = ("load it with kvsched.envs.workload.traces.load_generic(path, columns={'arrival_s': ..., "
            "'prompt_tokens': ..., 'output_tokens': ...}, time_unit=...)")
    if fmt == "csv":
        header = data.split(b"\n", 1)[0].decode("utf-8", "replace").strip().lstrip("\ufeff")
        found = [c.strip().strip('"') for c in header.split(",")]
        if set(AZURE_COLUMNS) <= set(found):
            return "azure"
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                               f": CSV header {bounded_repr(found, 300)} is not the Azure trace format (needs "
                               f"columns {list(AZURE_COLUMNS)}); {hint}")
    if fmt == "jsonl":
        for lineno, line in enumerate(data.split(b"\n"), 1):
            if line.strip():
                obj = _jsonl_object(line, lineno, file)
                if set(MOONCAKE_KEYS) <= set(obj):
                    return "mooncake"
                raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                                       f": line {lineno}: JSON keys {_keys_text(obj)} are not the "
                                       f"Mooncake format (needs {list(MOONCAKE_KEYS)}); {hint}")
        raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}: the file holds no JSON lines")
    raise TraceFormatError(f"{bounded_repr(str(file), MAX_PATH_CHARS)}"
                           ": unknown trace format; expected .csv (Azure) or .jsonl "
                           f"(Mooncake), optionally .gz; otherwise {hint}")


def load_trace(name_or_path: str | os.PathLike, name: str | None = None) -> Workload:
    """Load a bundled trace by name (see :data:`BUNDLED_TRACES`) or a trace file by path.

    A path ending in ``.csv``/``.csv.gz`` is read as the Azure format if its header has
    ``TIMESTAMP, ContextTokens, GeneratedTokens``; ``.jsonl``/``.jsonl.gz`` as Mooncake if its
    first object has ``timestamp, input_length, output_length, hash_ids``.

    Returns:
        The workload; a bundled trace is named by its registry name and its content hash is
        checked against :data:`BUNDLED_SHA256`.

    Raises:
        ConfigError: ``name_or_path`` is neither a bundled name nor an existing file (the message
            lists the bundled names).
        TraceFormatError: the file is in neither format (the message points to
            :func:`load_generic`), a bundled file's SHA-256 does not match, or any loader error.
    """
    key = os.fspath(name_or_path)
    if not isinstance(key, str) or not key.strip():  # Path("") is ".": never the current folder
        raise ConfigError(f"trace {bounded_repr(key)}: an empty name or path; give a bundled trace name "
                          f"({', '.join(BUNDLED_TRACES)}) or a trace file")
    if key in BUNDLED_TRACES:
        entry = BUNDLED_TRACES[key]
        with importlib.resources.as_file(bundled_trace_path(key)) as p:
            w = entry.loader(p, name=name or key)
        if w.source_sha256 != BUNDLED_SHA256[key]:
            raise TraceFormatError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}"
                                   f": bundled trace {bounded_repr(key)} has sha256 {w.source_sha256}, "
                                   f"expected {BUNDLED_SHA256[key]}; the package data is damaged")
        return w
    p = Path(key)
    if p.exists() and not p.is_file():
        raise ConfigError(f"trace {bounded_repr(key, MAX_PATH_CHARS)} is not a regular file (a folder, a FIFO or a "
                          "device); give a trace file")
    if not p.is_file():
        raise ConfigError(f"trace {bounded_repr(key)} is neither a bundled trace nor an existing file; bundled "
                          f"traces: {list(BUNDLED_TRACES)} (see `kvsched traces`)")
    data, sha = _read(p)
    kind = _sniff(data, key, _format_of(p))
    nm = name or _default_name(p)
    if kind == "azure":
        return _azure_from_bytes(data, key, sha, nm)
    return _mooncake_from_bytes(data, key, sha, nm)


# =============================================================================================
# Windows, rate scaling, head
# =============================================================================================
def _span(w: Workload) -> str:
    if not len(w):
        return "the trace is empty"
    return (f"the trace spans {w.arrival_s[0]:.3f}-{w.arrival_s[-1]:.3f} s "
            f"({len(w)} requests)")


def _slice(w: Workload, lo: int, hi: int, arrival: np.ndarray, note: str) -> Workload:
    off = w.hash_offsets
    return replace(
        w, request_id=w.request_id[lo:hi], arrival_s=arrival,
        prompt_tokens=w.prompt_tokens[lo:hi], output_tokens=w.output_tokens[lo:hi],
        session_id=w.session_id[lo:hi], slo_class=w.slo_class[lo:hi],
        hash_offsets=off[lo:hi + 1] - off[lo], hashes=w.hashes[off[lo]:off[hi]],
        notes=w.notes + (note,), priority=w.priority[lo:hi], n=w.n[lo:hi])


def window(w: Workload, start_s: float, end_s: float, rebase: bool = True, allow_empty: bool = False) -> Workload:
    """Requests with ``start_s <= arrival_s < end_s`` (seconds).

    With ``rebase`` the kept arrivals are shifted by ``-start_s`` (so the window starts at 0).
    With ``allow_empty`` a window holding no requests is an empty workload (an episode with
    nothing to serve) instead of an error.

    Raises:
        ConfigError: non-finite bounds, ``start_s >= end_s``, or (without ``allow_empty``) a
            window holding no requests (the message gives the trace span).
    """
    for f, v in (("start_s", start_s), ("end_s", end_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not math.isfinite(v):
            raise ConfigError(f"window {f}={bounded_repr(v)} is not allowed: expected a finite number of seconds")
    if start_s >= end_s:
        raise ConfigError(f"window start_s={bounded_repr(start_s)} must be < end_s={bounded_repr(end_s)}")
    if rebase and start_s < 0:
        raise ConfigError(f"window start_s={bounded_repr(start_s)} must be >= 0 when rebase=True "
                          "(rebased arrivals would be negative)")
    lo = int(np.searchsorted(w.arrival_s, start_s, side="left"))
    hi = int(np.searchsorted(w.arrival_s, end_s, side="left"))
    if hi <= lo and not allow_empty:
        raise ConfigError(f"window [{start_s:g}, {end_s:g}) s of {bounded_repr(w.name)} holds no requests; "
                          f"{_span(w)}")
    if hi <= lo:
        return _slice(w, lo, lo, np.zeros(0), f"window [{start_s:g}, {end_s:g}) s: no requests")
    arr = w.arrival_s[lo:hi] - start_s if rebase else w.arrival_s[lo:hi]
    note = (f"window [{start_s:g}, {end_s:g}) s: kept {hi - lo} of {len(w)} requests"
            + (f"; arrivals rebased by -{start_s:g} s" if rebase and start_s > 0 else "")
            + (f"; the window ends after the last arrival ({float(w.arrival_s[-1]):.1f} s), so it"
               f" covers only {float(w.arrival_s[-1]) - start_s:.1f} s of traffic"
               if end_s > float(w.arrival_s[-1]) and end_s != math.inf else ""))
    return _slice(w, lo, hi, np.maximum(arr, 0.0), note)


def scale_rate(w: Workload, factor: float) -> Workload:
    """Divide every arrival by ``factor``: ``factor=2`` doubles the request rate (halves the span).

    Raises:
        ConfigError: ``factor`` is not a finite number > 0.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)) \
            or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"scale_rate factor={bounded_repr(factor)} is not allowed: expected a finite number "
                          "> 0 (2 = twice the request rate)")
    span = float(w.arrival_s[-1] - w.arrival_s[0]) if len(w) else 0.0
    note = (f"scale_rate x{factor:g}: arrivals divided by {factor:g} (request rate x{factor:g}; "
            f"span {span:.3f} s -> {span / factor:.3f} s)")
    return w.with_arrivals(w.arrival_s / float(factor), note)


def head(w: Workload, n: int) -> Workload:
    """The first ``n`` requests in arrival order (all of them, noted, if ``n >= len(w)``).

    Raises:
        ConfigError: ``n`` is not an integer >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"head n={bounded_repr(n)} is not allowed: expected an integer >= 1")
    n = int(n)
    if n >= len(w):
        note = f"head({n}): kept all {len(w)} requests (the workload has no more)"
        return replace(w, notes=w.notes + (note,))
    note = f"head({n}): kept the first {n} of {len(w)} requests (arrivals up to " \
           f"{w.arrival_s[n - 1]:.3f} s)"
    return _slice(w, 0, n, w.arrival_s[:n], note)
