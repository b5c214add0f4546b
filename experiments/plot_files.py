"""Check a plot's output path (``--plot`` of ``kvsched validate`` and ``kvsched bench``) before the
work that fills it: matplotlib picks the format from the file's suffix and refuses one it does
not write only when the figure is saved, minutes later and after the other results.
"""

from __future__ import annotations

from pathlib import Path

from kvsched.envs.sim.errors import MAX_PATH_CHARS, KvschedError, bounded_repr

__all__ = ["check_plot_suffix", "plot_formats", "prepare_plot_file"]


def plot_formats() -> tuple[str, ...]:
    """The file suffixes (without the dot, lower case) matplotlib's Agg canvas writes, sorted."""
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def prepare_plot_file(path: Path | None, flag: str = "--plot") -> None:
    """Refuse a suffix matplotlib cannot write (:func:`check_plot_suffix`), then make the plot's
    folder and check it can be written (:func:`~kvsched.experiments.outputs.prepare_out_file`;
    a refused path leaves no folder behind); nothing to do for ``None``.

    Raises:
        KvschedError: one line naming the flag, the path (bounded) and why its folder cannot be
            used, or the allowed suffixes.
    """
    from .outputs import prepare_out_file

    check_plot_suffix(path, flag)
    prepare_out_file(path, flag)


def check_plot_suffix(path: Path | None, flag: str = "--plot") -> None:
    """Refuse a plot path whose suffix matplotlib cannot write, or that has none (matplotlib
    would fail on the temporary file's ``.tmp``); nothing to do for ``None``.

    Raises:
        KvschedError: one line naming the flag, the path (bounded) and the allowed suffixes.
    """
    if path is None:
        return
    formats = plot_formats()
    suffix = path.suffix[1:].lower()
    if suffix not in formats:
        raise KvschedError(f"{flag} {bounded_repr(str(path), MAX_PATH_CHARS)} is not allowed: "
                           + (f"matplotlib writes no {bounded_repr(path.suffix)} files" if suffix
                              else "it has no suffix")
                           + f"; expected a file name ending in one of {', '.join('.' + f for f in formats)}")
