"""Value types of the command line's flags (argparse ``type=`` callables and actions).

Each checks a flag's value where argparse reads it, so that a bad value is reported as the flag
(``kvsched simulate: error: argument --rate-scale: -1 is not allowed: expected a finite number
> 0``, exit status 2), not as the scenario field or library argument it ends up in.
"""

from __future__ import annotations

import argparse
import math

from kvsched.envs.sim.errors import bounded_repr


def integer(minimum: int, maximum: int | None = None):
    """argparse type of an integer flag in [``minimum``, ``maximum``] (no upper bound when
    ``maximum`` is None), checked as the flag, so that a bad value names it."""
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{bounded_repr(text)} is not allowed: expected {allowed}") from None
        if v < minimum or (maximum is not None and v > maximum):
            raise argparse.ArgumentTypeError(f"{bounded_repr(v)} is not allowed: expected {allowed}")
        return v

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


#: argparse type of a count flag (``--instances``, ``--max-requests``, ``--seeds``, ``--windows``,
#: tune's ``--trials`` and ``--workers``): an integer >= 1, so that a bad value names the flag,
#: not the scenario field it overrides
count = integer(1)

#: the most instances of one scenario (``n_instances``, ``--instances``): a cluster role's bound
#: (:data:`kvsched.envs.sim.disagg.MAX_ROLE_INSTANCES`); each instance holds its own KV pools
MAX_INSTANCES = 9999  # = kvsched.envs.sim.disagg.MAX_ROLE_INSTANCES (Scenario.n_instances checks it too)

#: the most seeds or windows one ``compare`` runs per policy: every run is a whole simulation
MAX_REPEATS = 10_000

#: argparse type of ``--instances``
instances = integer(1, MAX_INSTANCES)

#: argparse type of ``compare --seeds`` / ``--windows``
repeats = integer(1, MAX_REPEATS)

#: the largest ``--seed``: NumPy's legacy seeding (which Stable-Baselines3 calls) takes seeds
#: below 2**32, and the seeds derived from a flag's value (``seed + k`` per worker or
#: environment, ``seed + 10_000`` for evaluation) must stay below it too
MAX_SEED = 2**31 - 1

#: argparse type of a ``--seed`` flag: an integer in [0, :data:`MAX_SEED`] (non-negative:
#: Gymnasium's ``reset(seed=...)``, NumPy and Optuna's samplers reject negative seeds)
seed = integer(0, MAX_SEED)


def number(minimum: float, strict: bool):
    """argparse type of a number flag (``--rate-scale``: > 0; ``--router-delay``, ``--window``:
    >= 0): a finite float checked as the flag, so that a bad value names it."""
    allowed = f"a finite number {'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{bounded_repr(text)} is not allowed: expected {allowed}") from None
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"{bounded_repr(text)[1:-1]} is not allowed: expected {allowed}")
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


def comma_list(text: str, flag: str) -> list[str]:
    """The items of a comma-separated flag value (``"fcfs,lars"``), spaces around them removed.

    An empty item (``"fcfs,,lars"``, ``"fcfs,"``, ``""``) is refused, not skipped: a doubled or
    trailing comma usually means a name went missing.

    Raises:
        ConfigError: an empty item; one line naming ``flag`` and the value (bounded).
    """
    from kvsched.envs.sim.errors import ConfigError

    items = [s.strip() for s in text.split(",")]
    if not all(items):
        raise ConfigError(f"{flag}={bounded_repr(text)}: empty item in a comma list (a doubled, leading or "
                          "trailing comma?); give names separated by single commas")
    return items


def timeline_file(text: str):
    """argparse type of ``--timeline FILE``: a ``*.json`` or ``*.json.gz`` name
    (:func:`kvsched.runner.timeline.timeline_path`)."""
    from kvsched.envs.sim.errors import ConfigError
    from kvsched.runner.timeline import timeline_path

    try:
        return timeline_path(text, "FILE")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("FILE=")) from None


def timeline_window(text: str) -> tuple[float, float]:
    """argparse type of ``--timeline-window START:END`` (simulated seconds; END may be empty)
    (:func:`kvsched.runner.timeline.parse_window`)."""
    from kvsched.envs.sim.errors import ConfigError
    from kvsched.runner.timeline import parse_window

    try:
        return parse_window(text, "START:END")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("START:END=")) from None


def timeline_dir(text: str):
    """argparse type of compare's ``--timeline DIR``: a non-empty folder name (an empty one would
    mean the current folder)."""
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError(f"{bounded_repr(text)} is not allowed: expected a folder for the runs' "
                                         "timeline files")
    return Path(text)
