"""The per-request records frame: its columns, statuses, length classes and checks.

The simulator writes one row per arrived request (``envs/sim/recorder.py``) into a
:class:`pandas.DataFrame` whose columns are :data:`RECORD_COLUMNS`; this module names those
columns, the allowed :data:`STATUSES`, the length class of a request (:func:`length_class`), the
per-link byte counters of a frame (:func:`byte_columns`: the standard :data:`BYTE_COLUMNS` plus
any ``bytes_<from>_to_<to>`` column of a user-defined KV tier) and validates a frame before it
is summarised (:func:`check_records`). Definitions follow REFERENCE.md §6 (Metrics).

Times are seconds from the start of the workload; token counts and bytes are integers.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .errors import ConfigError, require, bounded_repr
from .metrics_config import MetricsConfig

__all__ = [
    "BYTE_COLUMNS",
    "RECORD_COLUMNS",
    "STATUSES",
    "BYTE_COLUMN_PREFIX",
    "length_class",
    "byte_columns",
    "check_records",
]

#: Per-link byte counters every records frame has, in order (``bytes_hbm_to_pnm``: KV migrated
#: GPU->PNM). A frame may add ``bytes_<from>_to_<to>`` columns for user-defined tiers.
BYTE_COLUMNS: tuple[str, ...] = (
    "bytes_hbm_to_dram",
    "bytes_dram_to_hbm",
    "bytes_hbm_to_nvme",
    "bytes_nvme_to_hbm",
    "bytes_hbm_to_pnm",
)

#: Prefix of every per-link byte column; the rest of the name is ``<from>_to_<to>``.
BYTE_COLUMN_PREFIX = "bytes_"

# tier names are lower case [a-z][a-z0-9_]* (TierSpec.name)
_BYTE_COLUMN = re.compile(r"bytes_[a-z][a-z0-9_]*_to_[a-z][a-z0-9_]*")

#: Columns of the per-request records DataFrame, in order. Times are seconds from the start of
#: the workload; token counts and bytes are integers.
#:
#: request_id (int), instance_id (int), arrival_s (float), prompt_tokens (int),
#: output_tokens (int, requested), slo_class (str, the trace's tag), length_class ("short" |
#: "long", the class the summary groups by: prompt_tokens >= MetricsConfig.long_prompt_tokens),
#: status ("finished" | "rejected"), reject_reason (str, "" if none), first_scheduled_s,
#: first_token_s, finish_s (float, NaN when the event did not happen; finish_s is NaN for
#: rejected requests), generated_tokens (int), preemptions (int), recomputed_tokens (int),
#: prefix_hit_tokens (int), max_itl_s (float, the largest gap between two of the request's
#: tokens, NaN with < 2 tokens), and the per-link byte counters in :data:`BYTE_COLUMNS`.
RECORD_COLUMNS: tuple[str, ...] = (
    "request_id",
    "instance_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "slo_class",
    "length_class",
    "status",
    "reject_reason",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "generated_tokens",
    "preemptions",
    "recomputed_tokens",
    "prefix_hit_tokens",
    "max_itl_s",
) + BYTE_COLUMNS

#: Allowed values of the ``status`` column.
STATUSES: tuple[str, ...] = ("finished", "rejected")


def length_class(prompt_tokens: np.ndarray, cfg: MetricsConfig) -> np.ndarray:
    """Length class of each request: "long" when ``prompt_tokens >= cfg.long_prompt_tokens``.

    Args:
        prompt_tokens: integer array of prompt lengths (tokens), any shape.
        cfg: the metrics configuration.

    Returns:
        A string array (dtype ``<U5``) of the same shape with "short" or "long".
    """
    p = np.asarray(prompt_tokens)
    return np.where(p >= cfg.long_prompt_tokens, "long", "short")


def byte_columns(records: pd.DataFrame) -> list[str]:
    """The per-link byte columns of ``records``: every column named ``bytes_*``, frame order.

    Besides the standard :data:`BYTE_COLUMNS` these are the columns of user-defined KV tiers
    (e.g. ``bytes_hbm_to_cxl``). Names are not checked here (:func:`check_records` does).
    """
    return [c for c in records.columns if str(c).startswith(BYTE_COLUMN_PREFIX)]


def check_records(records: pd.DataFrame) -> None:
    """Validate a records frame before it is summarised.

    Raises:
        ConfigError: ``records`` is not a DataFrame, misses a column of :data:`RECORD_COLUMNS`,
            has a ``bytes_*`` column not named ``bytes_<from>_to_<to>`` (lower-case tier names),
            has a status outside :data:`STATUSES`, or a row with a non-finite ``arrival_s`` or,
            for a finished request, timestamps not ordered arrival <= first_scheduled <=
            first_token <= finish or fewer than one generated token.
    """
    if not isinstance(records, pd.DataFrame):
        raise ConfigError(
            f"records={type(records).__name__} is not allowed: expected a pandas DataFrame")
    missing = [c for c in RECORD_COLUMNS if c not in records.columns]
    require(not missing, "records columns", missing,
            f"all of RECORD_COLUMNS {list(RECORD_COLUMNS)}")
    bad_names = [c for c in byte_columns(records) if not _BYTE_COLUMN.fullmatch(str(c))]
    require(not bad_names, "records byte columns", bad_names,
            "bytes_<from>_to_<to> with lower-case tier names [a-z][a-z0-9_]*")
    status = records["status"].astype(str).to_numpy()
    bad = ~np.isin(status, STATUSES)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(
            f"records.status={bounded_repr(status[i])} (request_id={records['request_id'].iloc[i]}) is not"
            f" allowed: expected one of {list(STATUSES)}")
    _check_timestamps(records, status == "finished", status)


def _check_timestamps(records: pd.DataFrame, fin: np.ndarray, status: np.ndarray) -> None:
    """Every arrival is finite; a finished request (``fin``, bool per row) has finite, ordered
    timestamps and at least one generated token.

    Raises:
        ConfigError: naming the first offending request and its values.
    """
    a = records["arrival_s"].to_numpy(dtype=np.float64)
    s = records["first_scheduled_s"].to_numpy(dtype=np.float64)
    f = records["first_token_s"].to_numpy(dtype=np.float64)
    e = records["finish_s"].to_numpy(dtype=np.float64)
    g = records["generated_tokens"].to_numpy()
    ok = np.isfinite(a)
    ok &= ~fin | (np.isfinite(s) & np.isfinite(f) & np.isfinite(e) & (g >= 1))
    with np.errstate(invalid="ignore"):
        ok &= ~fin | ((a <= s) & (s <= f) & (f <= e))
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ConfigError(
            f"record request_id={records['request_id'].iloc[i]} has arrival_s={bounded_repr(a[i])},"
            f" first_scheduled_s={bounded_repr(s[i])}, first_token_s={bounded_repr(f[i])},"
            f" finish_s={bounded_repr(e[i])},"
            f" generated_tokens={bounded_repr(g[i])}, status={bounded_repr(status[i])}: not allowed: expected a finite"
            " arrival_s and, for finished requests, finite arrival <= first_scheduled <="
            " first_token <= finish with generated_tokens >= 1")
