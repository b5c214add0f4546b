"""kvsched tune durability: a journal cut short by a full disk, resume without replaying the
sampler, concurrent workers stopping at --trials complete trials; and output paths derived from
user-given names (a study, a scenario's name, calibrate's --gpu) confined to their folder."""

from __future__ import annotations

import json
import os
import threading

import optuna
import pytest

from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.journal import check_journal, scan_journal
from kvsched.experiments.tune import _worker, make_storage, open_study, sampler_seed, tune
from kvsched.experiments.tune_gate import OWNER_ATTR, TrialGate

from test_tune import WINDOWS, cfg, small_scenario


def one_window(**kw):
    return cfg(seeds=(0,), windows_s=(WINDOWS[0],), pruner="none", **kw)


def _complete(url: str, name: str) -> dict[int, dict]:
    return {t.number: t.params for t in open_study(name, url).trials if t.state.name == "COMPLETE"}


def test_a_journal_cut_short_by_a_full_disk_resumes_with_every_finished_trial(tmp_path, capsys):
    path = tmp_path / "s.journal"
    url = f"journal:{path}"
    c = one_window()
    tune(small_scenario(), c, "s", url, n_trials=3)
    before = _complete(url, "s")
    original = path.read_bytes()
    last = original.splitlines(keepends=True)[-1]
    torn = original + last[: len(last) // 2]  # an append cut short: half a record, no line end
    path.write_bytes(torn)
    capsys.readouterr()
    study = tune(small_scenario(), c, "s", url, n_trials=4).study
    err = capsys.readouterr().err
    assert err.count("recovered the study up to its last complete record") == 1
    assert f"1 line(s) ({len(last) // 2} bytes)" in err and "s.journal.torn-1.bak" in err
    assert (tmp_path / "s.journal.torn-1.bak").read_bytes() == torn  # the original, kept whole
    after = {t.number: t.params for t in study.trials if t.state.name == "COMPLETE"}
    assert len(after) == 4 and {k: after[k] for k in before} == before
    assert scan_journal(path).sound


@pytest.mark.parametrize("damage", ["fragment_then_record", "junk_line", "zeros", "cut_line"])
def test_a_journal_damaged_in_the_middle_is_refused_in_one_line_and_left_untouched(tmp_path, damage):
    """Complete records after a bad line: cutting the file there would drop them (finished
    trials), skipping the line would renumber trials; the file is left for a person to restore."""
    path = tmp_path / "m.journal"
    url = f"journal:{path}"
    tune(small_scenario(), one_window(), "m", url, n_trials=2)
    lines = path.read_bytes().splitlines(keepends=True)
    bad = {"fragment_then_record": lines[-1][:25] + lines[-1], "junk_line": b"garbage\n",
           "zeros": b"\x00" * 40 + b"\n", "cut_line": lines[-1][:30] + b"\n"}[damage]
    damaged = b"".join(lines[:3]) + bad + b"".join(lines[3:])
    path.write_bytes(damaged)
    with pytest.raises(ConfigError, match=r"line 4 of the journal is damaged .* complete record\(s\) follow it; "
                                          r"the file was left untouched") as e:
        make_storage(url, notify=pytest.fail)
    assert len(str(e.value).splitlines()) == 1 and len(str(e.value)) < 600
    assert path.read_bytes() == damaged and not list(tmp_path.glob("*.bak"))  # no repair, no backup


def test_a_torn_tail_that_ended_a_trial_leaves_no_trial_running_for_good(tmp_path):
    """The lost record was a trial's end: the trial would stay RUNNING (no worker) forever."""
    path = tmp_path / "z.journal"
    url = f"journal:{path}"
    c = one_window()
    tune(small_scenario(), c, "z", url, n_trials=2)
    before = _complete(url, "z")
    lines = path.read_bytes().splitlines(keepends=True)
    ends = [i for i, line in enumerate(lines) if json.loads(line)["op_code"] == 6]  # SET_TRIAL_STATE_VALUES
    last_end = ends[-1]
    path.write_bytes(b"".join(lines[:last_end]) + lines[last_end][:20])  # its end record cut short
    messages: list[str] = []
    storage = make_storage(url, notify=messages.append)
    assert len(messages) == 1 and "1 trial(s) the lost records left running" in messages[0] and "FAIL" in messages[0]
    states = [t.state.name for t in optuna.load_study(study_name="z", storage=storage).trials]
    assert "RUNNING" not in states and states.count("FAIL") == 1
    study = tune(small_scenario(), c, "z", url, n_trials=2).study  # the lost trial runs again
    after = {t.number: t.params for t in study.trials if t.state.name == "COMPLETE"}
    assert len(after) == 2 and "RUNNING" not in [t.state.name for t in study.trials]
    assert max(before) not in after and {k: before[k] for k in before if k in after} == \
        {k: after[k] for k in before if k in after}


def test_a_torn_tail_leaves_a_trial_of_a_live_worker_running(tmp_path):
    path = tmp_path / "l.journal"
    url = f"journal:{path}"
    c = one_window()
    tune(small_scenario(), c, "l", url, n_trials=1)
    study = open_study("l", url, c)
    with TrialGate(study, 3, journal=str(path)) as other:  # another command, alive, runs a trial
        live = study.ask()
        live.set_user_attr(OWNER_ATTR, other.token)
        dead = study.ask()  # a killed worker's, never tagged
        with open(path, "ab") as f:
            f.write(b'{"op_code":6,"worker_id"')  # a write cut short
        messages: list[str] = []
        storage = make_storage(url, notify=messages.append)
        assert "1 trial(s) the lost records left running" in messages[0]
        states = {t.number: t.state.name for t in optuna.load_study(study_name="l", storage=storage).trials}
        assert states[live.number] == "RUNNING" and states[dead.number] == "FAIL"


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00binary", b"hello\nworld\n", b"[1, 2]\n",
                                     b'{"a": 1}\n', b"no line end"])
def test_a_file_that_is_not_a_journal_is_refused_in_one_line_and_left_alone(tmp_path, capsys, content):
    from kvsched.experiments.cli import main

    path = tmp_path / "x.journal"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="is not an Optuna journal file"):
        check_journal(path)
    scen = tmp_path / "s.yaml"
    scen.write_text("name: tiny\nsynthetic: {rate_per_s: 4.0, duration_s: 30}\npolicy: lars\nseed: 0\n")
    code = main(["tune", "--policy", "lars", "--scenario", str(scen), "--windows", "1", "--window-s", "10",
                 "--seeds", "1", "--trials", "1", "--storage", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "is not an Optuna journal file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # the "tuning ..." line and the error
    assert path.read_bytes() == content and not list(tmp_path.glob("*.bak"))


def test_a_resumed_study_continues_the_sampler_instead_of_replaying_it(tmp_path):
    sc, c = small_scenario(), one_window()
    url = f"journal:{tmp_path / 'r.journal'}"
    tune(sc, c, "r", url, n_trials=3)
    first = _complete(url, "r")
    (tmp_path / "copy.journal").write_bytes((tmp_path / "r.journal").read_bytes())
    tune(sc, c, "r", url, n_trials=6)
    resumed = _complete(url, "r")
    new = [resumed[k] for k in resumed if k not in first]
    assert len(new) == 3 and not any(p in first.values() for p in new)  # no finished set proposed again
    # deterministic given --seed and the stored history: the same resume of a copy runs the same trials
    again = tune(sc, c, "r", f"journal:{tmp_path / 'copy.journal'}", n_trials=6).study
    assert {t.number: t.params for t in again.trials if t.state.name == "COMPLETE"} == resumed
    assert sampler_seed(0, 0, 4) != sampler_seed(0, 0, 1) and sampler_seed(0, 1, 1) != sampler_seed(0, 0, 1)


@pytest.mark.parametrize("storage", ["journal", "memory"])
def test_two_workers_on_one_study_stop_at_trials_complete_trials(tmp_path, storage):
    sc, c = small_scenario(), one_window()
    url = f"journal:{tmp_path / 'w.journal'}" if storage == "journal" else None
    shared = None if url else make_storage(None)
    tune(sc, c, "w", url, n_trials=1) if url else None
    if shared is not None:  # an in-memory study: create it in the shared storage first
        st = open_study("w", None, c, storage=shared)
        st.enqueue_trial({}, user_attrs={"baseline": True})
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            _worker("w", url, c.to_dict(), sc, 5, k, storage=shared)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    study = open_study("w", url, storage=shared)
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 5 and "RUNNING" not in states


def test_a_trial_left_running_by_a_dead_worker_is_not_waited_for_and_a_live_one_is(tmp_path):
    sc, c = small_scenario(), one_window()
    url = f"journal:{tmp_path / 'd.journal'}"
    tune(sc, c, "d", url, n_trials=1)
    study = open_study("d", url, c)
    dead = study.ask()  # killed before tagging: RUNNING forever in a journal
    tagged = study.ask()
    tagged.set_user_attr(OWNER_ATTR, "0123abcd")  # a worker whose liveness lock nobody holds
    with TrialGate(study, 3, journal=str(tmp_path / "d.journal")) as gate:
        assert gate.counts() == (1, 0)
        with TrialGate(study, 3, journal=str(tmp_path / "d.journal")) as other:
            assert other.next()  # the other worker reserves the slot of trial 2 of 3 ...
            live = study.ask()
            live.set_user_attr(OWNER_ATTR, other.token)
            other.release()
            gate.n_complete = 2
            waited: list[float] = []

            def finish_live(seconds: float) -> None:  # ... and finishes it while this one waits
                waited.append(seconds)
                study.tell(live, 1.0)

            assert gate.next(sleep=finish_live) is False  # 2 complete: nothing left to run
            assert len(waited) == 1
    assert dead.number < tagged.number < live.number


def test_a_worker_whose_every_trial_fails_stops_with_one_error(monkeypatch):
    import kvsched.experiments.tune as tune_mod

    def undefined(self, trial):
        raise ValueError("objective goodput_rps:all undefined in every run")

    monkeypatch.setattr(tune_mod.Objective, "__call__", undefined)
    with pytest.raises(ConfigError, match=r"5 trials in a row failed; the last: 'objective goodput_rps:all"):
        tune(small_scenario(), one_window(), "f", None, n_trials=2)


# ----------------------------------------------------------------------------- path confinement
HOSTILE_NAMES = ["../escaped", "../../tmp/escaped", "/tmp/abs-escaped", "a/b", "a\\b", "..", ".", "x\ny", "n" * 300]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_study_or_scenario_name_never_writes_outside_the_output_folder(tmp_path, monkeypatch, capsys,
                                                                                 name):
    import json

    import kvsched.experiments.tune as tune_mod
    from kvsched.experiments.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(tune_mod, "tune", lambda *a, **k: pytest.fail("trials ran"))
    scen = tmp_path / "work" / "s.yaml"
    common = ["tune", "--policy", "lars", "--windows", "1", "--window-s", "10", "--seeds", "1", "--trials", "1"]
    scen.write_text("name: tiny\nsynthetic: {rate_per_s: 4.0, duration_s: 30}\npolicy: lars\nseed: 0\n")
    assert main([*common, "--scenario", str(scen), "--study", name]) == 2  # default --out runs/tune/<study>
    assert "--study=" in capsys.readouterr().err
    if name in (".", ".."):  # the study name "lars-.." is an ordinary file name
        return
    scen.write_text(f"name: {json.dumps(name)}\nsynthetic: {{rate_per_s: 4.0, duration_s: 30}}\npolicy: lars\n")
    assert main([*common, "--scenario", str(scen)]) == 2
    err = capsys.readouterr().err
    assert "the study name (from the scenario's name" in err and "is not allowed" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # --workers without --storage puts a journal named after the study in --out
    assert main([*common, "--scenario", str(scen), "--out", str(tmp_path / "work" / "o"), "--workers", "2"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing written beside the working folder
    assert not any(p.is_file() and p.name != "s.yaml" for p in (tmp_path / "work").rglob("*"))


def test_file_name_accepts_ordinary_names_and_every_bundled_scenarios_study_name():
    from kvsched.experiments.outputs import file_name
    from kvsched.runner.scenario import bundled_scenarios, load_scenario

    for name in ("lars-mixed-long-short", "router-llm-d-x", "v1.2_test", "été"):
        assert file_name(name, "--study") == name
    for s in bundled_scenarios():
        file_name(f"lars-{load_scenario(s).name}", "study name")


def test_a_full_disk_mid_study_is_one_error_and_the_next_run_resumes_every_finished_trial(tmp_path, monkeypatch,
                                                                                        capsys):
    import errno

    from optuna.storages.journal import JournalFileBackend

    path = tmp_path / "f.journal"
    url = f"journal:{path}"
    c = one_window()
    tune(small_scenario(), c, "f", url, n_trials=2)
    before = _complete(url, "f")
    real = JournalFileBackend.append_logs

    def full_disk(self, logs):  # the write stops half-way through its bytes, as ENOSPC leaves it
        text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
        with open(self._file_path, "ab") as f:
            f.write(text.encode()[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JournalFileBackend, "append_logs", full_disk)
    with pytest.raises(ConfigError, match=r"the study's storage could not be written \(No space left on device "
                                          r"\(ENOSPC\)\); finished trials are kept; free space and run the same"):
        tune(small_scenario(), c, "f", url, n_trials=4)
    monkeypatch.setattr(JournalFileBackend, "append_logs", real)  # space freed
    capsys.readouterr()
    study = tune(small_scenario(), c, "f", url, n_trials=4).study
    assert "recovered the study up to its last complete record" in capsys.readouterr().err
    after = {t.number: t.params for t in study.trials if t.state.name == "COMPLETE"}
    assert len(after) == 4 and {k: after[k] for k in before} == before


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EIO"])
def test_a_full_disk_while_optuna_records_a_result_is_one_line_not_its_assertion(tmp_path, monkeypatch, code):
    """Optuna's _run_trial turns a storage write failing in its result bookkeeping into
    ``AssertionError: Should not reach.`` (the OSError is its __context__)."""
    import errno

    from optuna.storages.journal import JournalFileBackend

    path = tmp_path / "a.journal"
    url = f"journal:{path}"
    c = one_window()
    tune(small_scenario(), c, "a", url, n_trials=1)
    real = JournalFileBackend.append_logs

    def full_on_result(self, logs):  # the disk fills when the trial's result is written
        if any(log.get("op_code") == 6 for log in logs):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(self, logs)

    monkeypatch.setattr(JournalFileBackend, "append_logs", full_on_result)
    with pytest.raises(ConfigError, match=rf"the study's storage could not be written \(.*\({code}\)\); finished "
                                          r"trials are kept; free space and run the same command again") as e:
        _worker("a", url, c.to_dict(), small_scenario(), 3, 0)
    assert e.value.__cause__ is None and len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=r"could not be written"):
        tune(small_scenario(), c, "a", url, n_trials=3)


def test_an_assertion_without_a_write_failure_behind_it_is_not_disguised(tmp_path, monkeypatch):
    import kvsched.experiments.tune as tune_mod

    def broken(self, trial):
        raise AssertionError("a bug")

    monkeypatch.setattr(tune_mod.Objective, "__call__", broken)
    with pytest.raises(AssertionError, match="a bug"):
        tune(small_scenario(), one_window(), "b", None, n_trials=1)


def test_concurrent_workers_on_one_journal_hold_different_slots_and_sampler_seeds(tmp_path):
    """Several kvsched tune commands on one journal are all worker 0 and see the same trial count:
    their samplers must still differ; a worker alone is in slot 0 (the same command on a copy of
    the journal proposes the same trials)."""
    path = str(tmp_path / "c.journal")
    url = f"journal:{path}"
    tune(small_scenario(), one_window(), "c", url, n_trials=1)
    study = open_study("c", url)
    with TrialGate(study, 3, journal=path) as a, TrialGate(study, 3, journal=path, worker=0) as b:
        assert {a.slot, b.slot} == {0, 1}
        with TrialGate(study, 3, journal=path) as third:
            assert third.slot == 2
        assert sampler_seed(0, a.slot, 5) != sampler_seed(0, b.slot, 5)
    with TrialGate(study, 3, journal=path) as alone:
        assert alone.slot == 0
    shared = make_storage(None)
    with TrialGate(study, 3, storage=shared) as a, TrialGate(study, 3, storage=shared) as b:
        assert {a.slot, b.slot} == {0, 1}  # threads on one in-memory study


def test_a_worker_in_another_process_takes_another_slot(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "p.journal")
    tune(small_scenario(), one_window(), "p", f"journal:{path}", n_trials=1)
    study = open_study("p", f"journal:{path}")
    code = ("import sys, optuna; from kvsched.experiments.tune_gate import TrialGate\n"
            "g = TrialGate(None, 1, journal=sys.argv[1]).__enter__(); print(g.slot)")
    with TrialGate(study, 3, journal=path) as mine:
        out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
        assert mine.slot == 0 and out.stdout.strip() == "1"


def test_calibrate_refuses_a_gpu_name_that_would_write_outside_the_calibration_folder(capsys):
    from kvsched.experiments.cli import main

    assert main(["calibrate", "--gpu", "../../../escaped"]) == 2  # the default --out is <gpu>.json in the package
    assert "--gpu='../../../escaped' is not allowed: it holds a path separator" in capsys.readouterr().err
