"""A full disk while a command writes its outputs: one clean error line (exit 2), never a
traceback, and no partial or empty output file left behind (kvsched.atomic_files writes a
temporary file and renames it).

The full disk is simulated in-process: every file opened for writing inside the output folder
raises ``OSError(ENOSPC)`` on its first write, as a real full disk does on write or flush.
"""

from __future__ import annotations

import builtins
import errno
import io
from pathlib import Path

import pytest

from kvsched.experiments.cli import main

SCENARIO = """\
name: tiny
synthetic: {rate_per_s: 4.0, duration_s: 12, long_fraction: 0.05, long_min_tokens: 8192, long_max_tokens: 9000}
instance: {model: Llama-3.1-8B, gpu: H100-SXM}
policy: fcfs
"""


class _FullDiskFile:
    """A file object whose writes fail with ENOSPC (everything else goes to the real file)."""

    def __init__(self, real) -> None:
        self._real = real

    def write(self, *_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    writelines = write

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()
        return False

    def __iter__(self):
        return iter(self._real)


@pytest.fixture
def disk_full(monkeypatch):
    """``disk_full(folder)``: from now on, writes to files under ``folder`` fail with ENOSPC."""

    def arm(folder: Path) -> None:
        real_open = builtins.open
        root = str(folder.resolve())

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            name = file if isinstance(file, (str, Path)) else None
            if name is not None and any(c in mode for c in "wax+") and str(Path(name).resolve()).startswith(root):
                return _FullDiskFile(f)
            return f

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)

    return arm


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _assert_clean_failure(rc: int, capsys, out: Path) -> None:
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err and "No space left on device (ENOSPC)" in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error:") and sum("error" in line for line in lines) == 1, err
    assert _files(out) == [], [p.name for p in _files(out)]  # no partial, empty or temporary file


@pytest.fixture
def scenario(tmp_path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(SCENARIO)
    return p


def test_simulate_on_a_full_disk_says_so_and_leaves_no_partial_file(tmp_path, scenario, disk_full, capsys):
    out = tmp_path / "out"
    out.mkdir()
    disk_full(out)
    rc = main(["simulate", "--scenario", str(scenario), "--out", str(out), "--json", "--no-progress"])
    _assert_clean_failure(rc, capsys, out)


def test_compare_on_a_full_disk_says_so_and_leaves_no_partial_file(tmp_path, scenario, disk_full, capsys):
    out = tmp_path / "out"
    out.mkdir()
    disk_full(out)
    rc = main(["compare", "--scenario", str(scenario), "--policies", "fcfs", "--seeds", "1", "--out", str(out),
               "--no-progress"])
    _assert_clean_failure(rc, capsys, out)


def test_tune_and_export_on_a_full_disk_say_so_and_leave_no_partial_file(tmp_path, scenario, disk_full, capsys):
    journal = tmp_path / "s.journal"
    out = tmp_path / "out"
    out.mkdir()
    base = ["--scenario", str(scenario), "--policy", "lars", "--trials", "1", "--windows", "1", "--window-s", "6",
            "--seeds", "1", "--pruner", "none", "--study", "s", "--storage", f"journal:{journal}"]
    assert main(["tune", *base, "--out", str(tmp_path / "tuned")]) == 0  # the study, on a healthy disk
    capsys.readouterr()
    disk_full(out)
    _assert_clean_failure(main(["tune", *base, "--out", str(out)]), capsys, out)
    target = out / "vllm.yaml"
    rc = main(["export", "--study", "s", "--storage", f"journal:{journal}", "--target", "vllm", "--out", str(target)])
    _assert_clean_failure(rc, capsys, out)


def test_a_full_disk_when_the_temporary_file_is_made_names_the_output_not_the_temporary(tmp_path, scenario,
                                                                                       monkeypatch, capsys):
    from kvsched import atomic_files

    def full(dest: Path) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(dest.with_name(f".{dest.name}.42-0a1b2c3d.tmp")))

    monkeypatch.setattr(atomic_files, "_create_temporary", full)
    out = tmp_path / "out"
    rc = main(["simulate", "--scenario", str(scenario), "--out", str(out), "--json", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{out / 'records.csv'}: No space left on device (ENOSPC); no file was left half-written" in err
    assert _files(out) == []
