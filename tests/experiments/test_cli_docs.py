"""docs/cli.md documents every flag of every command, and no flag that does not exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvsched.experiments.cli import build_parser
from kvsched.experiments.commands import COMMANDS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")


def _section(name: str) -> str:
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^## (.+)$", DOC, flags=re.M)]
    for i, (start, title) in enumerate(heads):
        if name in title.split(" and ") or title == name:
            end = heads[i + 1][0] if i + 1 < len(heads) else len(DOC)
            return DOC[start:end]
    raise AssertionError(f"docs/cli.md has no section for `kvsched {name}`")


def _parser_flags(name: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    parser.format_help()  # fills the command's options in (they are added lazily)
    return {a.option_strings[-1] for a in parser._actions if a.option_strings and "-h" not in a.option_strings}


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_the_flag_table_of_each_command_matches_its_parser(name):
    rows = re.findall(r"^\| `(--[a-z0-9-]+)", _section(name), flags=re.M)
    assert len(rows) == len(set(rows)), f"{name}: a flag is documented twice"
    assert set(rows) == _parser_flags(name), name


def test_train_help_names_scheduling_v1_where_the_docs_do():
    """kvsched train --help said es and --env were Scheduling-v0 only; docs/cli.md (and the code)
    allow Scheduling-v1 too."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train"].format_help().split())
    assert "Scheduling-v0/v1" in text and "the same task with observation version 1" in text


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_the_choices_each_flag_table_lists_are_its_parsers(name):
    """A flag documented as `--flag {a,b}` lists exactly the parser's choices, in order (evaluate's
    --env once lacked kvsched/Scheduling-v1, train's kvsched/Residency-v0)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    parser.format_help()
    actions = {a.option_strings[-1]: a for a in parser._actions if a.option_strings}
    for flag, listed in re.findall(r"^\| `(--[a-z0-9-]+)[^`{]*\{([^}`]*)\}", _section(name), flags=re.M):
        choices = actions[flag].choices
        assert choices is not None and listed.split(",") == [str(c) for c in choices], (name, flag, listed)
