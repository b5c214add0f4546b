"""The command line's rich consoles.

To a terminal they behave as rich's defaults (its width, wrapping). To a file or pipe (logs,
CI, ``> out.txt``) rich would assume 80 columns: it wraps messages there and truncates table
cells that do not fit, so a saved table loses digits and a logged error is split over lines.
These consoles do not: stdout tables get 400 columns, stderr messages are never wrapped, and a
table's title and caption, which rich wraps to the table's width, are printed as lines of their own.
"""

from __future__ import annotations

import copy
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text


class _FileConsole(Console):
    """A console for a file or pipe: a table's title goes on its own line above the table and its
    caption on its own line below it (rich would wrap them to the table's width, splitting a
    logged title or caption over lines). A ``str`` title or caption is console markup, as rich's
    ``Table`` renders it."""

    def print(self, *objects, **kwargs) -> None:
        table = objects[0] if len(objects) == 1 and isinstance(objects[0], Table) else None
        if table is None or (table.title is None and table.caption is None):
            super().print(*objects, **kwargs)
            return
        table = copy.copy(table)
        title, caption, table.title, table.caption = table.title, table.caption, None, None
        if title is not None:
            super().print(self._line(title), soft_wrap=True)
        super().print(table, **kwargs)
        if caption is not None:
            super().print(self._line(caption), soft_wrap=True)

    def _line(self, text: str | Text) -> Text:
        return self.render_str(text, highlight=False) if isinstance(text, str) else text


def stdout_console() -> Console:
    """Console for results on stdout (tables, summaries)."""
    return Console() if sys.stdout.isatty() else _FileConsole(width=400)


def stderr_console() -> Console:
    """Console for notes, warnings and errors on stderr (one line per message off a terminal)."""
    return Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=400, soft_wrap=True)
