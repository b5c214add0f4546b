"""Progress lines on stderr for the long commands when stderr is not a terminal.

On a terminal the commands show rich or tqdm progress bars. Off a terminal (a log file, CI, a
pipe, a job scheduler) those bars print nothing, and ``train``, ``compare``, ``tune``,
``evaluate``, ``bench`` or ``simulate`` of a big trace used to stay silent for minutes. There
:func:`command_progress` (entered by :func:`kvsched.experiments.cli.main` around every command)
runs a :class:`ProgressLines` reporter: one plain line every ``interval_s`` (default
:data:`DEFAULT_INTERVAL_S`, at most :data:`MAX_INTERVAL_S`; environment variable
:data:`INTERVAL_ENV`), such as::

    kvsched compare: 12/40 runs, 95 s elapsed
    kvsched tune: 130 s elapsed

It prints the latest state a command reported (:meth:`ProgressLines.update`, or the callbacks
:meth:`ProgressLines.counter` makes for the commands' ``progress`` parameters), or only the
elapsed time when a command reports nothing, so a line comes at least every interval whatever
the command is doing: a heartbeat thread (:meth:`ProgressLines.start`) prints when nothing was
printed for an interval, even while the command's own work holds the main thread for minutes.
Short commands finish before the first line. ``--no-progress`` turns the lines off too.

Wall-clock throttling lives here, in the command line's layer; the simulator core never reads
a clock (its progress callbacks count requests).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

from kvsched.envs.sim.errors import ConfigError, bounded_repr

#: environment variable: seconds between progress lines off a terminal (0 = at every update)
INTERVAL_ENV = "KVSCHED_PROGRESS_INTERVAL_S"
#: seconds between progress lines when :data:`INTERVAL_ENV` is not set
DEFAULT_INTERVAL_S = 15.0
#: the longest interval allowed (the promise: a line at least every 30 s)
MAX_INTERVAL_S = 30.0
#: the heartbeat thread's shortest sleep (s), so that an interval of 0 does not spin
_MIN_WAIT_S = 0.05

_current: ProgressLines | None = None


def interval_from_env(environ: dict | None = None) -> float:
    """Seconds between progress lines: :data:`INTERVAL_ENV` if set, else :data:`DEFAULT_INTERVAL_S`.

    Raises:
        ConfigError: a value that is not a number of seconds in [0, :data:`MAX_INTERVAL_S`]
            (named with the value and the allowed range; an empty value too).
    """
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_INTERVAL_S:  # NaN fails too
        raise ConfigError(f"{INTERVAL_ENV}={bounded_repr(raw)} is not allowed: expected a number of seconds "
                          f"from 0 to {MAX_INTERVAL_S:g}")
    return value


class ProgressLines:
    """A throttled reporter of one command's progress: a line on ``stream`` when ``interval_s``
    seconds of ``clock`` passed since the last one (or since the start), checked at every
    :meth:`update` and :meth:`poll` (and by the heartbeat thread of :meth:`start`).

    Args:
        command: the subcommand, first word of each line after ``kvsched``.
        stream: where lines go (stderr; flushed per line).
        interval_s: seconds between lines (>= 0).
        clock: seconds, monotonic (:func:`time.monotonic`; tests pass a fake one).
    """

    def __init__(self, command: str, stream: TextIO, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.command, self.stream, self.interval_s, self.clock = command, stream, float(interval_s), clock
        self._lock = threading.Lock()
        self._start = self._last = clock()
        self._done: float | None = None
        self._total: float | None = None
        self._unit = ""
        self._note = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, done: float | None = None, total: float | None = None, unit: str | None = None,
               note: str | None = None) -> None:
        """Record the command's state (each argument given replaces the last one), then print a
        line if one is due."""
        with self._lock:
            if done is not None:
                self._done = done
            if total is not None:
                self._total = total
            if unit is not None:
                self._unit = unit
            if note is not None:
                self._note = note
        self.poll()

    def counter(self, unit: str, total: float | None = None) -> Callable[..., None]:
        """A callback ``progress(done)`` or ``progress(done, total)`` (the commands' progress
        parameters) recording ``done`` ``unit`` of ``total``."""
        def progress(done: float, new_total: float | None = None) -> None:
            self.update(done, new_total, unit)

        with self._lock:  # a new count: nothing of an earlier one carries over
            self._done, self._total, self._unit = 0, total, unit
        self.poll()
        return progress

    def line(self, now: float) -> str:
        """The progress line at ``now`` (seconds of :attr:`clock`)."""
        parts = []
        if self._done is not None:
            done = f"{self._done:,}" if isinstance(self._done, int) else f"{self._done:,.4g}"
            total = "" if self._total is None else (f"/{self._total:,}" if isinstance(self._total, int)
                                                     else f"/{self._total:,.4g}")
            parts.append(f"{done}{total} {self._unit}".rstrip())
        if self._note:
            parts.append(self._note)
        parts.append(f"{now - self._start:,.0f} s elapsed")
        return f"kvsched {self.command}: " + ", ".join(parts)

    def poll(self) -> bool:
        """Print a line if ``interval_s`` passed since the last one; whether it printed."""
        with self._lock:
            now = self.clock()
            if now - self._last < self.interval_s:
                return False
            self._last = now
            text = self.line(now)
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is not worth an error
            pass
        return True

    def start(self) -> None:
        """Start the heartbeat thread (a daemon): it prints a line whenever one is due, so lines
        keep coming while the command's work holds the main thread."""
        def beat() -> None:
            while True:
                with self._lock:
                    wait = self._last + self.interval_s - self.clock()
                if self._stop.wait(max(wait, _MIN_WAIT_S)):
                    return
                self.poll()

        self._thread = threading.Thread(target=beat, name=f"kvsched-{self.command}-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat thread (waits for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def current() -> ProgressLines | None:
    """The running command's reporter (None on a terminal, with ``--no-progress``, or outside
    :func:`command_progress`)."""
    return _current


def counter(unit: str, total: float | None = None) -> Callable[..., None] | None:
    """:meth:`ProgressLines.counter` of the running command's reporter, or None without one."""
    lines = _current
    return None if lines is None else lines.counter(unit, total)


def note(message: str) -> None:
    """Show ``message`` in the running command's next progress lines (nothing without one)."""
    lines = _current
    if lines is not None:
        lines.update(note=message)


@contextlib.contextmanager
def command_progress(command: str, enabled: bool = True, stream: TextIO | None = None) -> Iterator[
        ProgressLines | None]:
    """Run a command with a :class:`ProgressLines` reporter (heartbeat started) when ``stream``
    (default stderr) is not a terminal and ``enabled``; yields it (or None), and makes it
    :func:`current` until the command returns.

    Raises:
        ConfigError: a bad :data:`INTERVAL_ENV` (see :func:`interval_from_env`).
    """
    global _current
    stream = sys.stderr if stream is None else stream
    interval = interval_from_env()
    tty = getattr(stream, "isatty", None)
    if not enabled or (tty is not None and tty()):
        yield None
        return
    lines = ProgressLines(command, stream, interval)
    outer, _current = _current, lines
    lines.start()
    try:
        yield lines
    finally:
        lines.stop()
        _current = outer
