"""JSON parsed strictly: a key given twice in one object is an error, not the last one kept.

The standard :func:`json.loads` keeps the last of duplicate keys without a word (RFC 8259 §4
leaves duplicates' meaning to the reader), so ``{"kappa": 1, "kappa": 2}`` would silently run
with ``kappa=2``. kvsched's YAML loader refuses duplicates
(:mod:`kvsched.envs.sim.yaml_loading`); every JSON kvsched reads from a user (command-line
flags, policy files, run metadata, JSONL traces) goes through :func:`loads` for the same rule.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from .errors import bounded_repr


class DuplicateKeyError(ValueError):
    """A JSON object gives one key twice (the message names the key)."""


class NumberTooLongError(json.JSONDecodeError):
    """A JSON integer has more digits than Python converts (``sys.get_int_max_str_digits()``, 4,300).

    A :class:`json.JSONDecodeError` (so every caller's "malformed JSON" handling reports it),
    positioned at the number; Python's own ``ValueError`` would otherwise escape as a traceback.
    """


def _number_too_long(text: str | bytes) -> NumberTooLongError:
    limit = sys.get_int_max_str_digits()
    doc = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text
    m = re.search(r"\d{%d,}" % (limit + 1), doc)
    return NumberTooLongError(f"a number with more than {limit:,} digits is not allowed", doc, m.start() if m else 0)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(f"key {bounded_repr(key)} appears twice in one JSON object")
            seen.add(key)
    return obj


def loads(text: str | bytes) -> Any:
    """:func:`json.loads` refusing duplicate keys.

    Raises:
        json.JSONDecodeError: malformed JSON (as :func:`json.loads`), or :class:`NumberTooLongError`
            (an integer of more than ``sys.get_int_max_str_digits()`` digits).
        DuplicateKeyError: a key appears twice in one object.
        RecursionError: nesting deeper than the interpreter's recursion limit (callers turn it
            into their own error).
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_object)
    except (json.JSONDecodeError, DuplicateKeyError):
        raise
    except ValueError as e:  # int() of too many digits (CPython's int_max_str_digits, CVE-2020-10735)
        if "digits" not in str(e):
            raise
        raise _number_too_long(text) from None


def parse_object(text: str, where: str, expected: str) -> dict[str, Any]:
    """The JSON object in ``text`` (a command-line flag's value, say), duplicate keys refused.

    Args:
        text: the JSON text.
        where: what errors name first (``--policy-params``, a file).
        expected: what the object holds, for the messages (``the policy's parameters``).

    Raises:
        ConfigError: malformed JSON, nested too deeply, a duplicate key, an integer of too many
            digits, or not an object;
            one line naming ``where`` and the value (bounded).
    """
    from .errors import ConfigError

    try:
        value = loads(text)
    except NumberTooLongError as e:
        raise ConfigError(f"{where}: {e.msg} (at char {e.pos}); expected a JSON object of {expected}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON ({e.msg} at char {e.pos}); expected a JSON object of "
                          f"{expected}") from None
    except DuplicateKeyError as e:
        raise ConfigError(f"{where}: {e}; give each key once") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply; expected a JSON object of {expected}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}={bounded_repr(text)}: must be a JSON object of {expected}")
    return value
