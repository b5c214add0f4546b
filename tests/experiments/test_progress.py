"""Long commands print a progress line to stderr at least every 30 s off a terminal
(kvsched.experiments.progress): the reporter's throttling on a fake clock, its interval setting,
and the commands that wire it (run tiny, with the interval set to 0)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments import progress
from kvsched.experiments.cli import main
from kvsched.experiments.progress import INTERVAL_ENV, ProgressLines

SCENARIO = str(Path(__file__).parents[2] / "experiments" / "scenarios" / "mixed-long-short.yaml")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_comes_once_per_interval_with_the_latest_state():
    clock, out = FakeClock(), io.StringIO()
    lines = ProgressLines("compare", out, 30.0, clock=clock)
    tick = lines.counter("runs", 40)
    for t, done in ((10, 1), (29.9, 2)):
        clock.now = 100.0 + t
        tick(done)
    assert out.getvalue() == ""  # nothing before the interval
    clock.now = 130.0
    tick(3)
    assert out.getvalue() == "kvsched compare: 3/40 runs, 30 s elapsed\n"
    clock.now = 159.0
    assert not lines.poll()
    clock.now = 160.0
    assert lines.poll()  # the heartbeat's check: a line even without a new update
    assert out.getvalue().splitlines()[-1] == "kvsched compare: 3/40 runs, 60 s elapsed"


def test_a_command_that_reports_nothing_still_gets_elapsed_time_lines_and_notes():
    clock, out = FakeClock(), io.StringIO()
    lines = ProgressLines("tune", out, 15.0, clock=clock)
    clock.now = 115.0
    assert lines.poll()
    lines.update(note="study s, 20 trials")
    clock.now = 130.0
    lines.poll()
    assert out.getvalue().splitlines() == ["kvsched tune: 15 s elapsed",
                                           "kvsched tune: study s, 20 trials, 30 s elapsed"]


def test_the_heartbeat_thread_prints_while_the_command_holds_the_main_thread():
    import threading

    wrote = threading.Event()

    class Stream(io.StringIO):
        def write(self, text: str) -> int:
            wrote.set()
            return super().write(text)

    clock, out = FakeClock(), Stream()
    lines = ProgressLines("train", out, 30.0, clock=clock)
    lines.update(5, 100, "env steps")
    clock.now += 30.0  # the main thread reports nothing more: the heartbeat must print
    lines.start()
    try:
        assert wrote.wait(timeout=60)
    finally:
        lines.stop()
    assert out.getvalue().startswith("kvsched train: 5/100 env steps, 30 s elapsed\n")


@pytest.mark.parametrize("raw", ["", "abc", "-1", "31", "nan", "inf"])
def test_an_interval_outside_0_to_30_seconds_is_refused_naming_the_variable(raw):
    with pytest.raises(ConfigError, match=f"{INTERVAL_ENV}=.* from 0 to 30"):
        progress.interval_from_env({INTERVAL_ENV: raw})
    assert progress.interval_from_env({}) == progress.DEFAULT_INTERVAL_S <= progress.MAX_INTERVAL_S
    assert progress.interval_from_env({INTERVAL_ENV: "0"}) == 0.0


def test_no_reporter_on_a_terminal_or_with_no_progress():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    with progress.command_progress("simulate", stream=Tty()) as lines:
        assert lines is None and progress.current() is None and progress.counter("requests") is None
    with progress.command_progress("simulate", enabled=False, stream=io.StringIO()) as lines:
        assert lines is None
    with progress.command_progress("simulate", stream=io.StringIO()) as lines:
        assert progress.current() is lines is not None
    assert progress.current() is None


@pytest.mark.parametrize("argv, expected", [
    (["simulate", "--max-requests", "30"], "kvsched simulate: 30/30 requests"),
    (["compare", "--scenario", SCENARIO, "--policies", "fcfs,lars", "--max-requests", "20", "--seeds", "1"],
     "kvsched compare: 2/2 runs"),
])
def test_commands_print_progress_lines_off_a_terminal(argv, expected, monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    assert main(argv) == 0
    err = capsys.readouterr().err  # captured: not a terminal
    assert expected in err, err
    assert main([*argv, "--no-progress"]) == 0
    assert "kvsched " + argv[0] + ":" not in capsys.readouterr().err


def test_a_bad_interval_is_a_clean_error_of_any_command(monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "40")
    assert main(["simulate", "--max-requests", "5"]) == 2
    assert f"{INTERVAL_ENV}='40'" in capsys.readouterr().err
