"""Error messages bound what they print.

A message that ``repr()``s a user's value whole can hang (a YAML alias bomb of 600 bytes
expands to 10**9 items) or flood the terminal; :func:`kvsched.envs.sim.errors.bounded_repr`
cuts the rendering instead. This test reads the source of every kvsched module and fails on a
``raise`` (or an argparse ``parser.error``) whose message uses ``{value!r}`` or ``repr(value)``,
or interpolates whole (``{path}``) a name that by its identifier holds a user-given path, URL or
text (``p``, ``path``, ``file``, ``out``, ``ckpt``, ``*_path``, ``*_file``, ``*_url``, ...): those
go through ``bounded_repr(str(path), MAX_PATH_CHARS)``. A call or slice around the name
(``bounded_repr(p)``, ``len(text)``) is not flagged; ``name``/``source`` are not listed, as they
mostly hold short field names or already-bounded labels.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvsched.envs.sim.errors import bounded_repr

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("envs", "experiments", "agents", "policies", "kvsched/runner", "kvsched/deploy")
# identifiers (of a bare name or an attribute such as ``args.policy_file``) that hold a user's path/URL/text
PATH_LIKE = re.compile(r"(path|p|file|filename|fname|out|url|storage|ckpt|checkpoint|resume|dest|target"
                       r"|study_name|text|trace|.*_(path|file|dir|url))")


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
            elif isinstance(sub, ast.FormattedValue):
                v = sub.value
                ident = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""
                if PATH_LIKE.fullmatch(ident):
                    found.append((v.lineno, f"{{{ast.unparse(v)}}}"))
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


def test_the_checker_finds_a_path_printed_whole():
    tree = ast.parse('def f(p, a, name):\n    raise ValueError(f"{p}: bad; {a.policy_file}; {name}; "\n'
                     '                     f"{bounded_repr(str(p), 320)} {len(p)}")\n')
    assert [t for _, t in _unbounded_reprs(tree)] == ["{p}", "{a.policy_file}"]


def test_bounded_repr_of_an_alias_bomb_is_short_and_quick():
    layer: list = ["lol"] * 9
    for _ in range(8):  # 9**9 leaves, shared as a YAML alias bomb shares them
        layer = [layer] * 9
    text = bounded_repr(layer)
    assert len(text) <= 120 and text.startswith("[[")
