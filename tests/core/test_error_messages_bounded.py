"""Error messages bound what they print.

A message that ``repr()``s a user's value whole can hang (a YAML alias bomb of 600 bytes
expands to 10**9 items) or flood the terminal; :func:`kvsched.envs.sim.errors.bounded_repr`
cuts the rendering instead. This test reads the source of every kvsched module and fails on a
``raise`` (or an argparse ``parser.error``) whose message uses ``{value!r}`` or ``repr(value)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvsched.envs.sim.errors import bounded_repr

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("envs", "experiments", "agents", "policies", "kvsched/runner")


def _unbounded_reprs(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        is_raise = isinstance(node, ast.Raise)
        is_usage_error = isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "error"
        if not (is_raise or is_usage_error):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.FormattedValue) and sub.conversion == ord("r"):
                found.append((sub.value.lineno, f"{{{ast.unparse(sub.value)}!r}}"))
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "repr":
                found.append((sub.lineno, f"repr({ast.unparse(sub.args[0]) if sub.args else ''})"))
    return found


def test_no_error_message_reprs_a_value_unbounded():
    offenders = []
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50  # the walk found the package
    for f in files:
        for line, text in _unbounded_reprs(ast.parse(f.read_text(encoding="utf-8"))):
            offenders.append(f"{f.relative_to(ROOT)}:{line}: {text}")
    assert not offenders, "use bounded_repr(...) in error messages:\n" + "\n".join(offenders)


def test_the_checker_finds_an_unbounded_repr():
    tree = ast.parse('def f(v):\n    raise ValueError(f"bad {v!r}")\n\ndef g(v):\n    raise ValueError(repr(v))\n')
    assert [t for _, t in _unbounded_reprs(tree)] == ["{v!r}", "repr(v)"]


def test_bounded_repr_of_an_alias_bomb_is_short_and_quick():
    layer: list = ["lol"] * 9
    for _ in range(8):  # 9**9 leaves, shared as a YAML alias bomb shares them
        layer = [layer] * 9
    text = bounded_repr(layer)
    assert len(text) <= 120 and text.startswith("[[")
