"""Value types of the command line's flags (argparse ``type=`` callables and actions).

Each checks a flag's value where argparse reads it, so that a bad value is reported as the flag
(``kvsched simulate: error: argument --rate-scale: -1 is not allowed: expected a finite number
> 0``, exit status 2), not as the scenario field or library argument it ends up in.
"""

from __future__ import annotations

import argparse
import math


def count(text: str) -> int:
    """argparse type of a count flag (``--instances``, ``--max-requests``, ``--seeds``,
    ``--windows``): an integer >= 1, so that a bad value names the flag, not the scenario field
    it overrides."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected an integer >= 1") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not allowed: expected an integer >= 1")
    return v


#: the largest ``--seed``: NumPy's legacy seeding (which Stable-Baselines3 calls) takes seeds
#: below 2**32, and the seeds derived from a flag's value (``seed + k`` per worker or
#: environment, ``seed + 10_000`` for evaluation) must stay below it too
MAX_SEED = 2**31 - 1


def seed(text: str) -> int:
    """argparse type of a ``--seed`` flag: an integer in [0, :data:`MAX_SEED`] (non-negative:
    Gymnasium's ``reset(seed=...)``, NumPy and Optuna's samplers reject negative seeds)."""
    allowed = f"an integer in [0, {MAX_SEED}]"
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected {allowed}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{v} is not allowed: expected {allowed}")
    return v


def number(minimum: float, strict: bool):
    """argparse type of a number flag (``--rate-scale``: > 0; ``--router-delay``, ``--window``:
    >= 0): a finite float checked as the flag, so that a bad value names it."""
    allowed = f"a finite number {'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected {allowed}") from None
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"{text} is not allowed: expected {allowed}")
        return v

    parse.__name__ = "number"  # argparse names the type in some messages
    return parse


class Window(argparse.Action):
    """``--window START_S END_S``: two numbers >= 0 (checked by the type) with START_S < END_S."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        start, end = values
        if start >= end:
            parser.error(f"argument {option_string}: {start:g} {end:g} is not allowed: expected START_S < END_S")
        setattr(namespace, self.dest, values)
