"""Error types of kvsched.

Every error names the field (or file and line), the offending value and what is allowed,
so a researcher can fix the input without reading the source.
"""

from __future__ import annotations


class KvschedError(Exception):
    """Base class of every error kvsched raises on purpose."""


class ConfigError(KvschedError, ValueError):
    """A configuration value (spec, preset, scenario, CLI flag) is out of its allowed range."""


class TraceFormatError(KvschedError, ValueError):
    """A trace file is malformed; the message names the file and the line."""


class UnknownPresetError(ConfigError, KeyError):
    """A preset name is unknown; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


#: Longest rendering of a user-given value inside an error message (characters).
MAX_VALUE_CHARS = 120


def bounded_repr(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` cut to at most ``limit`` characters (``...`` and the full length marked).

    Error messages print what a user gave; a value can be huge (a YAML alias bomb expands a
    600-byte file into millions of items), so every message bounds what it prints. Containers
    are rendered through :func:`reprlib.repr`-style truncation first, so a huge list is never
    fully converted to text; a text cut short ends in ``...``. ``limit`` is at least 3 (the
    marker's length; smaller limits are raised to 3).
    """
    limit = max(3, int(limit))
    import reprlib

    r = reprlib.Repr()
    r.maxstring = limit
    r.maxother = limit
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 8
    r.maxdict = 8
    r.maxlevel = 3
    text = r.repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return text


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise :class:`ConfigError` naming ``field``, ``value`` (bounded) and ``allowed`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={bounded_repr(value)} is not allowed: expected {allowed}")
