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


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise :class:`ConfigError` naming ``field``, ``value`` and ``allowed`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} is not allowed: expected {allowed}")
