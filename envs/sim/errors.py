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
#: Longest rendering of a file path inside an error message: a file name at the system's limit
#: (255 bytes) with its folders is shown whole (a user must see which file); a longer path is cut
#: in the middle, keeping both ends.
MAX_PATH_CHARS = 320


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


def text_number_hint(value: object, integer: bool = False) -> str:
    """When ``value`` is text that reads as a number, a note saying why and how to write it.

    YAML 1.1 (PyYAML) reads a number in exponent form as a string unless its mantissa has a dot
    and its exponent a sign (``1e12`` and ``1.0e12`` are text, ``1.0e+12`` a number); a field
    expecting a number then sees text. ``integer``: the field takes an integer, so only the
    digits are suggested. Returns ``""`` for anything else (and for long texts, which are no
    number anyone typed).
    """
    if not isinstance(value, str) or len(value) > 64:
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    import math

    if not math.isfinite(number):
        return ""
    plain = f"{int(number)}" if number.is_integer() and abs(number) < 1e18 else _yaml_float(repr(number))
    if "e" in value.lower():
        # YAML 1.1's float needs a dot in the mantissa and a sign in the exponent ([-+]?[0-9]*\.[0-9.]*
        # ([eE][-+][0-9]+)?, yaml.org/type/float.html): 1e9 and 1.0e9 are text, 1.0e+9 is a number
        mantissa, _, exponent = value.lower().partition("e")
        sign = "" if exponent[:1] in ("+", "-") else "+"
        suggestion = f"{mantissa}{'' if '.' in mantissa else '.0'}e{sign}{exponent}"
        if integer:  # an integer field refuses 1.0e+1 (a float): only the digits will do
            if not (number.is_integer() and abs(number) < 1e18):
                return f" (YAML 1.1 reads {value} as text, not a number; this field takes an integer)"
            return f" (YAML 1.1 reads {value} as text, not a number: write {plain})"
        spellings = suggestion if "e" in plain else f"{suggestion} or {plain}"  # 1.0e-05 repeats 1.0e-5
        return (f" (YAML 1.1 reads {value} as text, not a number: a number with an exponent needs a dot in "
                f"its mantissa and a signed exponent, write {spellings})")
    return f" (this is text, not a number: write {plain} without quotes)"


def _yaml_float(text: str) -> str:
    """Python's ``repr`` of a float spelled as YAML 1.1 reads a float: ``1e+30`` -> ``1.0e+30``,
    ``5e-07`` -> ``5.0e-07`` (a dot in the mantissa; ``repr`` always signs the exponent)."""
    mantissa, e, exponent = text.partition("e")
    if not e:
        return text
    return f"{mantissa}{'' if '.' in mantissa else '.0'}e{exponent}"


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise :class:`ConfigError` naming ``field``, ``value`` (bounded) and ``allowed`` unless ``ok``
    (with :func:`text_number_hint` when the value is a number written as text)."""
    if not ok:
        raise ConfigError(f"{field}={bounded_repr(value)} is not allowed: expected {allowed}"
                          f"{text_number_hint(value)}")
