"""The command line's rich consoles.

To a terminal they behave as rich's defaults (its width, wrapping). To a file or pipe (logs,
CI, ``> out.txt``) rich would assume 80 columns: it wraps messages there and truncates table
cells that do not fit, so a saved table loses digits and a logged error is split over lines.
These consoles do not: stdout tables get 400 columns, stderr messages are never wrapped.
"""

from __future__ import annotations

import sys

from rich.console import Console


def stdout_console() -> Console:
    """Console for results on stdout (tables, summaries)."""
    return Console() if sys.stdout.isatty() else Console(width=400)


def stderr_console() -> Console:
    """Console for notes, warnings and errors on stderr (one line per message off a terminal)."""
    return Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=400, soft_wrap=True)
