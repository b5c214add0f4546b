"""The command line's rich consoles.

To a terminal they behave as rich's defaults (its width, wrapping). To a file or pipe (logs,
CI, ``> out.txt``) rich would assume 80 columns: it wraps messages there and truncates table
cells that do not fit, so a saved table loses digits and a logged error is split over lines.
These consoles do not: stdout tables get 400 columns, stderr messages are never wrapped, and a
table's title, which rich wraps to the table's width, is printed as its own line.
"""

from __future__ import annotations

import copy
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text


class _FileConsole(Console):
    """A console for a file or pipe: a table's title goes on its own line above the table (rich
    would wrap it to the table's width, splitting a logged title over lines)."""

    def print(self, *objects, **kwargs) -> None:
        if len(objects) == 1 and isinstance(objects[0], Table) and objects[0].title is not None:
            table = copy.copy(objects[0])
            title, table.title = table.title, None
            super().print(Text(title) if isinstance(title, str) else title, soft_wrap=True)
            objects = (table,)
        super().print(*objects, **kwargs)


def stdout_console() -> Console:
    """Console for results on stdout (tables, summaries)."""
    return Console() if sys.stdout.isatty() else _FileConsole(width=400)


def stderr_console() -> Console:
    """Console for notes, warnings and errors on stderr (one line per message off a terminal)."""
    return Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=400, soft_wrap=True)
