"""The ``kvsched`` command line: builds the parser from the command table and dispatches.

``kvsched simulate`` is the main job: serve a bundled real trace (default: the Azure LLM
inference 2023 conversation trace) on a simulated vLLM-like instance (default Llama-3.1-8B on
one H100) and print TTFT/TPOT/ITL/E2E, SLO attainment and goodput per length class. The
subcommands are listed, with the module holding each one's options and handler, in
:data:`kvsched.experiments.commands.COMMANDS`.

How the table becomes a parser: every subcommand gets its argparse sub-parser and its help line
up front (``kvsched --help`` lists them all), but a sub-parser's options are added only when
argparse selects it (:class:`_CommandParser`), by importing the command's module then. So
``kvsched --help`` imports no command module, and ``kvsched simulate`` imports none of the
heavy ones (torch and Stable-Baselines3 behind ``train``/``evaluate``, Optuna behind
``tune``/``export``, Ray, pandas-heavy ``compare``/``validate``...). We chose this over keeping
every command's options in a light module apart from its heavy implementation because

* options stay beside their handler in the module that implements the command, including
  modules whose option help is computed from their own data (``bench`` lists its case table,
  ``calibrate`` its fit schedule), which a light options module would have to import anyway
  or duplicate;
* argparse itself picks the subcommand (the sub-parser is filled in from its own
  ``parse_known_args``, called by argparse with the subcommand's arguments), so there is no
  second, hand-written reading of ``argv`` that a future top-level option could fool;
* it uses only public argparse hooks (``add_subparsers(parser_class=...)``, ``set_defaults``).

Dispatch: the filled-in sub-parser sets ``func`` (the command's handler) by ``set_defaults``,
and :func:`main` calls ``args.func(args, console)`` under the command line's error handling.

Built on :mod:`argparse` (standard library) and :mod:`rich` (tables, progress bar).
"""

from __future__ import annotations


import argparse
import errno
import sys
from typing import Sequence

from rich.markup import escape

import kvsched

from .commands import COMMANDS, Command
from .consoles import stderr_console, stdout_console


#: longest argparse error message printed (argparse quotes the offending argument whole)
MAX_ERROR_CHARS = 400


class _BoundedErrors(argparse.ArgumentParser):
    """An argparse parser whose usage errors are cut to :data:`MAX_ERROR_CHARS` characters
    (``invalid choice: '<100 kB>'`` would otherwise print the whole argument)."""

    def error(self, message: str):  # type: ignore[override]
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS - 3] + f"... ({len(message)} characters)"
        super().error(message)


class _CommandParser(_BoundedErrors):
    """The sub-parser of one :class:`~kvsched.experiments.commands.Command`. Its options and its
    ``func`` default (the handler) are added the first time it parses or formats its help, which
    imports the command's module then and not before."""

    def __init__(self, *args, command: Command, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._command: Command | None = command

    def _fill(self) -> None:
        """Import the command's module, add its options and set ``func`` to its handler (once)."""
        if self._command is None:
            return
        command, self._command = self._command, None
        add_arguments, run = command.load()
        if add_arguments is not None:
            add_arguments(self)
        self.set_defaults(func=run)

    def parse_known_args(self, args=None, namespace=None):
        """Fill in the command (:meth:`_fill`), refuse empty values (:func:`_refuse_empty_values`),
        then parse as :class:`argparse.ArgumentParser`."""
        self._fill()
        if args is not None:
            _refuse_empty_values(self, list(args))
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        """The usage line, with the command's options."""
        self._fill()
        return super().format_usage()

    def format_help(self) -> str:
        """The help text, with the command's options."""
        self._fill()
        return super().format_help()


def _refuse_empty_values(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Exit with a usage error when an argument is empty (``--trace ''``, ``--out=``).

    No flag of kvsched takes an empty value: a path would be the current folder
    (``Path("")`` is ``.``) or, tested for truth, the default (``--trace ''`` ran the bundled
    trace), a name or JSON would be invalid. So an empty (or all-blank) value is refused here,
    for every command at once, naming the flag.
    """
    for i, tok in enumerate(args):
        if tok.startswith("--") and "=" in tok:
            flag, _, value = tok.partition("=")
        else:
            flag, value = None, tok
        if value.strip():
            continue
        if flag is None:
            flag = next((t.split("=")[0] for t in reversed(args[:i]) if t.startswith("-") and len(t) > 1),
                        "a positional argument")
        parser.error(f"argument {flag}: an empty{' (blank)' if value else ''} value is not allowed: give a path, name "
                     "or value")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvsched`` parser: one sub-parser per entry of
    :data:`~kvsched.experiments.commands.COMMANDS`, in its order, each filled in when selected."""
    p = _BoundedErrors(
        prog="kvsched",
        description="kvsched: LLM-serving scheduling as a KV-cache residency problem. "
                    "`kvsched simulate` serves a real trace on a simulated vLLM-like instance.")
    p.add_argument("--version", action="version", version=f"kvsched {kvsched.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for command in COMMANDS:
        sub.add_parser(command.name, help=command.help, command=command)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvsched`` console script. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    # after parsing: `kvsched --help` needs no simulator
    from kvsched.envs.sim.errors import MAX_PATH_CHARS, KvschedError, bounded_repr

    # to a file or pipe: wide enough that tables print at their full width (rich truncates a
    # cell that does not fit, and a saved comparison table would lose digits)
    console = stdout_console()
    from . import progress  # progress lines on stderr off a terminal (--no-progress: none)

    try:
        with progress.command_progress(args.command, enabled=not getattr(args, "no_progress", False)):
            return args.func(args, console)
    except KvschedError as e:
        stderr_console().print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        return 2
    except OSError as e:
        # a path given on the command line that the system refuses (a name too long, no
        # permission, a full disk) and no check above named: the path and the system's reason,
        # not a traceback. A write that fails without naming its file (a full disk seen by a
        # library's write or flush) is said as such: every output is written to a temporary
        # file and renamed (kvsched.atomic_files), so no file was left half-written.
        if e.filename is None:
            if e.errno not in _WRITE_ERRNOS:
                raise
            stderr_console().print(f"[bold red]error:[/] cannot write the output: {escape(_os_reason(e))}; no file "
                                   "was left half-written (outputs finished before it are complete)", highlight=False)
            return 2
        shown = _destination(str(e.filename))
        if len(shown) > MAX_PATH_CHARS:  # a path of thousands of characters (PATH_MAX is 4,096) is cut
            shown = bounded_repr(shown, MAX_PATH_CHARS)
        tail = "; no file was left half-written" if e.errno in _WRITE_ERRNOS else ""
        stderr_console().print(f"[bold red]error:[/] {escape(shown)}: {escape(_os_reason(e))}{tail}",
                               highlight=False)
        return 2
    except RecursionError:
        # an input nested thousands of levels deep that no loader's own limit caught (e.g. an --out
        # of ~1,500 folders: Path.mkdir recurses once per missing folder)
        stderr_console().print("[bold red]error:[/] an input is nested too deeply to handle (a path or a value "
                               f"with more than ~{sys.getrecursionlimit()} levels); give a shallower one",
                               highlight=False)
        return 2


#: ``errno`` values of a write the system refused for lack of room or a read-only or failing
#: device: reported in one line by :func:`main` even when the error names no file
_WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EIO")
                          if hasattr(errno, n))


def _destination(filename: str) -> str:
    """The file a user asked for, when ``filename`` is the temporary file
    :mod:`kvsched.atomic_files` writes first (``.NAME.PID-HEX.tmpSUFFIX`` beside ``NAME``)."""
    import os
    import re

    folder, base = os.path.split(filename)
    m = re.fullmatch(r"\.(.+)\.\d+-[0-9a-f]{8}\.tmp.*", base)
    return os.path.join(folder, m.group(1)) if m else filename


def _os_reason(e: OSError) -> str:
    """The system's reason for ``e``, with the errno's name (``No space left on device (ENOSPC)``)."""
    from .outputs import os_reason

    return os_reason(e)


if __name__ == "__main__":
    sys.exit(main())
