"""One small name registry for presets, scheduler policies and cluster routers.

A :class:`Registry` maps names to entries (a :class:`~kvsched.envs.sim.specs.ModelSpec` preset,
a policy class, a router class, ...). Lookups accept the exact name, then the name ignoring case
and surrounding spaces, then an alias; an unknown name raises
:class:`~kvsched.envs.sim.errors.UnknownPresetError` listing the known names. The core owns the
class; the policy and router registries live with the policies (:mod:`kvsched.policies.base`,
:mod:`kvsched.policies.routing`) and fill themselves when that package is imported, so the
simulator core never imports a policy.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Mapping, TypeVar

from .errors import UnknownPresetError, bounded_repr

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one kind.

    Args:
        kind: what the entries are, for messages ("model", "policy", "router", ...).
        entries: initial ``name -> entry`` mapping (insertion order is the listing order). A
            ``dict`` is used as the registry's store, not copied: entries added to either show
            in both.
        aliases: other accepted names (matched ignoring case) -> canonical name.
        sort_names: list known names sorted (True) or in insertion order (False) in
            :meth:`names` and in error messages.

    Raises:
        ValueError: an alias naming no entry.
    """

    __slots__ = ("kind", "_entries", "_aliases", "_sort")

    def __init__(self, kind: str, entries: Mapping[str, T] | None = None,
                 aliases: Mapping[str, str] | None = None, sort_names: bool = False) -> None:
        self.kind = kind
        # a dict given is the registry's own store, not a copy: a preset table (``MODEL_PRESETS``)
        # and its registry (``MODELS``) stay one table, whichever of the two is added to
        self._entries: dict[str, T] = entries if isinstance(entries, dict) else dict(entries or {})
        self._aliases: dict[str, str] = {}
        self._sort = sort_names
        for alias, name in (aliases or {}).items():
            self.add_alias(alias, name)

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name`` (a later ``add`` of the same name replaces it)."""
        self._entries[name] = entry
        return entry

    def add_alias(self, alias: str, name: str) -> None:
        """Accept ``alias`` (any case) for the entry ``name``.

        Raises:
            ValueError: ``name`` is not registered.
        """
        if name not in self._entries:
            raise ValueError(f"alias {bounded_repr(alias)} names no {self.kind} {bounded_repr(name)}")
        self._aliases[alias.strip().casefold()] = name

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: ``@REGISTRY.register("fcfs")`` adds the class and sets its ``name``."""

        def deco(cls: type) -> type:
            self.add(name, cls)  # type: ignore[arg-type]
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def canonical(self, name: object) -> str:
        """The registered name ``name`` refers to.

        Raises:
            UnknownPresetError: not a string, or no entry of that name or alias (the message
                lists the known names).
        """
        if isinstance(name, str):
            if name in self._entries:
                return name
            key = name.strip().casefold()
            for known in self._entries:  # a few entries, looked up while reading a configuration
                if known.strip().casefold() == key:
                    return known
            if key in self._aliases:
                return self._aliases[key]
        raise UnknownPresetError(f"unknown {self.kind} {bounded_repr(name)}; known: {', '.join(self.names())}")

    def get(self, name: object) -> T:
        """The entry ``name`` refers to (see :meth:`canonical`)."""
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        """Registered names (aliases not included)."""
        return sorted(self._entries) if self._sort else list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs in listing order."""
        return [(n, self._entries[n]) for n in self.names()]

    def __contains__(self, name: object) -> bool:
        try:
            self.canonical(name)
        except UnknownPresetError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
