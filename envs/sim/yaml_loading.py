"""Reading kvsched's YAML files (scenarios, instance specs) safely and strictly.

:func:`load_yaml` wraps PyYAML's safe loader (no Python objects are ever built) and adds the
limits a configuration file never needs to exceed, so that a hostile or broken file gets a
one-line :class:`~kvsched.envs.sim.errors.ConfigError` instead of a hang, a memory blow-up or a
``RecursionError``:

* **aliases** (``*name``): at most :data:`MAX_YAML_ALIASES` uses, and the document expanded
  (every alias counted as a copy of its anchor's nodes) at most :data:`MAX_YAML_NODES` nodes.
  PyYAML shares an aliased node instead of copying it, so a "billion laughs" file of 600 bytes
  loads quickly, but anything that walks the value (an error message, a hash, a JSON dump)
  would visit 10**9 items. A recursive alias (an anchor used inside itself) is refused.
* **nesting**: at most :data:`MAX_YAML_DEPTH` levels of sequences and mappings (PyYAML's
  composer recurses once per level and would hit Python's recursion limit near 300 levels).
* **values PyYAML cannot build** (an integer of more than ``sys.get_int_max_str_digits()``
  digits, hex included; a timestamp ``2024-13-01``) are refused with their line and column
  instead of a ``ValueError`` traceback.
* **duplicate keys** in one mapping are refused (PyYAML silently keeps the last).
* **merge keys** (``<<: *base``, YAML 1.1's merge type, https://yaml.org/type/merge.html) are
  supported as PyYAML implements them: the mapping's own keys win over merged ones; a key given
  twice among the mapping's own keys (or in one merged mapping) is still refused.

Errors are one line: the source, the line and column, and PyYAML's problem.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent

from .errors import ConfigError, bounded_repr

#: Most alias uses (``*name``) in one YAML document.
MAX_YAML_ALIASES = 1_000
#: Most nodes of one YAML document once every alias is expanded (a scenario has about a hundred).
MAX_YAML_NODES = 100_000
#: Deepest nesting of sequences and mappings in one YAML document (scenarios need about five).
MAX_YAML_DEPTH = 64

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _LimitError(ComposerError):
    """A limit of :func:`load_yaml` exceeded (a :class:`yaml.YAMLError`, reported as one line)."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with kvsched's limits (see the module docstring).

    One instance reads one stream; the counters are per document.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._sizes: dict[int, int] = {}  # id(node) -> expanded node count, once the node is complete

    def compose_document(self):
        self._depth, self._aliases, self._sizes = 0, 0, {}
        return super().compose_document()

    def compose_node(self, parent, index):
        event = self.peek_event()
        if self.check_event(AliasEvent):
            node = super().compose_node(parent, index)  # the anchor's node (or "undefined alias")
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _LimitError(None, None, f"more than {MAX_YAML_ALIASES} alias uses (*name) in one document",
                                  event.start_mark)
            if id(node) not in self._sizes:
                raise _LimitError(None, None, f"alias *{event.anchor} is used inside its own anchor "
                                              "(a recursive structure)", event.start_mark)
            return node
        nested = self.check_event(SequenceStartEvent, MappingStartEvent)
        if nested:
            self._depth += 1
            if self._depth > MAX_YAML_DEPTH:
                raise _LimitError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels of lists and mappings",
                                  event.start_mark)
        node = super().compose_node(parent, index)
        if nested:
            self._depth -= 1
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            else:  # pragma: no cover - a collection start always composes a collection
                children = []
            size = 1 + sum(self._sizes[id(c)] for c in children)
            if size > MAX_YAML_NODES:
                raise _LimitError(None, None, f"expands to more than {MAX_YAML_NODES:,} values once its aliases "
                                              "are copied (an alias bomb?)", event.start_mark)
        else:
            size = 1
        self._sizes[id(node)] = size
        return node

    def construct_object(self, node, deep=False):
        """PyYAML's construction, a constructor's ``ValueError`` turned into a marked YAML error.

        PyYAML's constructors raise a bare ``ValueError`` for values they cannot build (an integer of
        more than ``sys.get_int_max_str_digits()`` digits, a timestamp ``2024-13-01``); here each
        becomes a :class:`yaml.constructor.ConstructorError` carrying the node's line and column.
        An integer written in hex, octal or binary that is too large to print in decimal is
        refused the same way (it would fail later, in any JSON dump or message).
        """
        try:
            value = super().construct_object(node, deep)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(None, None, _constructor_problem(node, e),
                                                    node.start_mark) from None
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * _MAX_DIGITS:
            try:
                str(value)
            except ValueError as e:
                raise yaml.constructor.ConstructorError(None, None, _constructor_problem(node, e),
                                                        node.start_mark) from None
        return value


_MAX_DIGITS = sys.get_int_max_str_digits() or 4300


def _constructor_problem(node: yaml.Node, e: ValueError) -> str:
    """One line for a constructor's ``ValueError`` on ``node`` (the value quoted, bounded)."""
    if "digits" in str(e) and node.tag.endswith(":int"):
        return f"a number with more than {_MAX_DIGITS:,} digits is not allowed"
    value = node.value if isinstance(node, yaml.ScalarNode) else node.tag
    return f"cannot read {bounded_repr(value)} as {node.tag.rsplit(':', 1)[-1]}: {bounded_repr(str(e))[1:-1]}"


def _check_unique_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    """Refuse a key given twice among ``node``'s own keys, or within one mapping it merges."""
    seen: set = set()
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG:
            merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for m in merged:
                if isinstance(m, yaml.MappingNode):
                    _check_unique_keys(loader, m)
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be text or a number, got a {type(key).__name__}",
                key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {bounded_repr(key)} appears twice in one mapping", key_node.start_mark)
        seen.add(key)


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    _check_unique_keys(loader, node)
    return loader.construct_mapping(node, deep)  # flattens merge keys (<<) first


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def one_line_yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line error as one line: ``line L, column C: problem`` (1-based)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    text = f"{context}; {problem}" if context else str(problem)
    text = " ".join(text.split())
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {text}"
    return text


def load_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (one YAML document) with :class:`StrictLoader`.

    Args:
        text: the YAML text.
        source: what errors name (usually the file).

    Raises:
        ConfigError: invalid YAML, a duplicate key, a value PyYAML cannot build, or a limit exceeded
            (aliases, expanded size,
            nesting), naming ``source``, the line and column.
    """
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 -- StrictLoader is a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {one_line_yaml_error(e)}") from None
    except RecursionError:  # pragma: no cover - the depth limit comes first
        raise ConfigError(f"{source}: invalid YAML: nested too deeply (limit {MAX_YAML_DEPTH} levels)") from None
