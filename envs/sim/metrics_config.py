"""Metrics configuration: length classes, latency SLOs and how requests are judged.

:class:`SLO` is one class's latency objective (TTFT, TPOT, optional E2E, seconds);
:class:`SLOTable` an immutable, hashable mapping ``class name -> SLO``; :class:`MetricsConfig`
holds the long-prompt threshold that splits requests into the :data:`LENGTH_CLASSES`
("short" / "long"), the SLO table, the reported percentiles and the starvation factor.

Sources: the length split at 8192 tokens is the ">8k" column of the trace README; the
starvation rule is REFERENCE.md §6 ("e.g. 10x their SLO"); the default SLOs are kvsched's own
choice for interactive chat (see :func:`_default_slos`), not taken from a paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import ConfigError, require, bounded_repr

__all__ = ["SLO", "SLOTable", "MetricsConfig", "LENGTH_CLASSES", "is_positive_finite"]


def is_positive_finite(x: object) -> bool:
    """True for a real number (not a bool) that is finite and > 0."""
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
            and math.isfinite(float(x)) and float(x) > 0)


@dataclass(frozen=True)
class SLO:
    """Latency service-level objective of one request class.

    Attributes:
        ttft_s: time-to-first-token bound in seconds (> 0).
        tpot_s: time-per-output-token bound in seconds (> 0); requests with a single output
            token have no TPOT and meet this bound by definition.
        e2e_s: optional end-to-end latency bound in seconds (> 0), ``None`` to ignore.

    Raises:
        ConfigError: a bound is not a finite number > 0.
    """

    ttft_s: float
    tpot_s: float
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        require(is_positive_finite(self.ttft_s), "SLO.ttft_s", self.ttft_s, "a finite number > 0 (s)")
        require(is_positive_finite(self.tpot_s), "SLO.tpot_s", self.tpot_s, "a finite number > 0 (s)")
        require(self.e2e_s is None or is_positive_finite(self.e2e_s), "SLO.e2e_s", self.e2e_s,
                "None or a finite number > 0 (s)")

    def to_dict(self) -> dict[str, float | None]:
        """``{"ttft_s", "tpot_s", "e2e_s"}`` as plain floats (``e2e_s`` may be ``None``)."""
        return {"ttft_s": float(self.ttft_s), "tpot_s": float(self.tpot_s),
                "e2e_s": None if self.e2e_s is None else float(self.e2e_s)}


class SLOTable(Mapping[str, SLO]):
    """Immutable, hashable, picklable mapping ``class name -> SLO`` (sorted by name).

    Built from a dict, a mapping or an iterable of ``(name, SLO)`` pairs; an SLO may also be
    given as a mapping ``{"ttft_s": ..., "tpot_s": ..., "e2e_s": ...}`` (e.g. from YAML).

    Raises:
        ConfigError: a name is not a non-empty string, is duplicated, or a value is not an SLO.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | Any = ()) -> None:
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        out: dict[str, SLO] = {}
        for pair in pairs:
            require(isinstance(pair, tuple) and len(pair) == 2, "MetricsConfig.slos entry", pair,
                    "(name, SLO) pairs")
            name, slo = pair
            require(isinstance(name, str) and name != "", "MetricsConfig.slos key", name,
                    "a non-empty string")
            require(name not in out, "MetricsConfig.slos key", name, "unique class names")
            if isinstance(slo, Mapping):
                unknown = set(slo) - {"ttft_s", "tpot_s", "e2e_s"}
                require(not unknown, f"MetricsConfig.slos[{name!r}]", dict(slo),
                        "keys ttft_s, tpot_s and optionally e2e_s")
                try:
                    slo = SLO(**slo)
                except TypeError:
                    raise ConfigError(
                        f"MetricsConfig.slos[{bounded_repr(name)}]={bounded_repr(dict(slo))} is not allowed: expected"
                        " keys ttft_s, tpot_s and optionally e2e_s") from None
            require(isinstance(slo, SLO), f"MetricsConfig.slos[{name!r}]", slo,
                    "an SLO or a mapping with ttft_s/tpot_s[/e2e_s]")
            out[name] = slo
        self._items: tuple[tuple[str, SLO], ...] = tuple(sorted(out.items()))

    def __getitem__(self, key: str) -> SLO:
        for name, slo in self._items:
            if name == key:
                return slo
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SLOTable):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __reduce__(self):  # pickle via the pairs
        return (SLOTable, (self._items,))

    def __repr__(self) -> str:
        return f"SLOTable({dict(self._items)!r})"


def _default_slos() -> SLOTable:
    # kvsched defaults for interactive chat; NOT taken from a paper. TTFT 1 s for short
    # prompts; TPOT 100 ms is ~10 tokens/s, about human reading speed (the llm-d blog reports
    # ITLs of 25-50 ms on real deployments, so this is a loose bound). Long prompts (>= 8192
    # tokens) get 10 s TTFT (prefill of tens of thousands of tokens) and 200 ms TPOT.
    return SLOTable({"short": SLO(ttft_s=1.0, tpot_s=0.1), "long": SLO(ttft_s=10.0, tpot_s=0.2)})


LENGTH_CLASSES: tuple[str, ...] = ("short", "long")


@dataclass(frozen=True)
class MetricsConfig:
    """How requests are classed and judged.

    Attributes:
        long_prompt_tokens: requests with ``prompt_tokens >= long_prompt_tokens`` are class
            "long", the rest "short" (default 8192: the ">8k" column of the trace README).
            Integer >= 1.
        slos: class name -> :class:`SLO`; stored as an immutable :class:`SLOTable` (a dict or
            pairs are accepted). Must contain "short" and "long". A request is judged against
            ``slos[record.slo_class]`` when its ``slo_class`` is a key here, otherwise against
            its length class. Defaults (kvsched's own choice for interactive chat, not from a
            paper): short = SLO(ttft_s=1.0, tpot_s=0.1), long = SLO(ttft_s=10.0, tpot_s=0.2);
            TPOT 100 ms ~ 10 tok/s reading speed, the llm-d blog reports ITL 25-50 ms.
        percentiles: percentiles reported for every latency, each in (0, 100], unique, sorted
            on construction; keys are ``f"p{q:g}"`` (``p50``, ``p99.9``).
        starvation_factor: a request is starved when its queueing delay exceeds
            ``starvation_factor * (its TTFT SLO)`` (REFERENCE §6 "e.g. 10x their SLO"); > 0.

    Raises:
        ConfigError: naming the field, the value and what is allowed.
    """

    long_prompt_tokens: int = 8192
    slos: SLOTable = field(default_factory=_default_slos)
    percentiles: tuple[float, ...] = (50, 90, 99)
    starvation_factor: float = 10.0

    def __post_init__(self) -> None:
        lpt = self.long_prompt_tokens
        require(isinstance(lpt, (int, np.integer)) and not isinstance(lpt, bool) and lpt >= 1,
                "MetricsConfig.long_prompt_tokens", lpt, "an integer >= 1 (tokens)")
        object.__setattr__(self, "long_prompt_tokens", int(lpt))

        slos = self.slos if isinstance(self.slos, SLOTable) else SLOTable(self.slos)
        missing = [c for c in LENGTH_CLASSES if c not in slos]
        require(not missing, "MetricsConfig.slos", dict(slos),
                f"a mapping that contains the length classes {list(LENGTH_CLASSES)}"
                f" (missing {missing})")
        object.__setattr__(self, "slos", slos)

        ps = self.percentiles
        require(isinstance(ps, (tuple, list)) and len(ps) > 0, "MetricsConfig.percentiles", ps,
                "a non-empty tuple of numbers in (0, 100]")
        ok = all(isinstance(q, (int, float, np.integer, np.floating)) and not isinstance(q, bool)
                 and math.isfinite(float(q)) and 0 < float(q) <= 100 for q in ps)
        require(ok, "MetricsConfig.percentiles", ps, "numbers q with 0 < q <= 100")
        require(len({float(q) for q in ps}) == len(ps), "MetricsConfig.percentiles", ps,
                "unique values")
        norm = tuple(sorted(int(q) if float(q).is_integer() else float(q) for q in ps))
        object.__setattr__(self, "percentiles", norm)

        require(is_positive_finite(self.starvation_factor), "MetricsConfig.starvation_factor",
                self.starvation_factor, "a finite number > 0")

    def slo(self, name: str) -> SLO:
        """The SLO of class ``name``. Raises KeyError when unknown."""
        return self.slos[name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy of the configuration."""
        return {
            "long_prompt_tokens": self.long_prompt_tokens,
            "slos": {k: v.to_dict() for k, v in self.slos.items()},
            "percentiles": [float(q) for q in self.percentiles],
            "starvation_factor": float(self.starvation_factor),
        }
