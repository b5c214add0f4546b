"""How the workers of one study stop at ``--trials`` complete trials (``kvsched tune``).

``--trials N`` is the number of ``COMPLETE`` trials the study should hold (Optuna's
:class:`~optuna.study.MaxTrialsCallback` counts the same state by default); pruned and failed
trials do not count. Several workers (``--workers``, or several ``kvsched tune`` commands on one
storage) run one trial at a time, and before each one a worker asks the :class:`TrialGate`:

- ``complete >= N``: stop;
- ``complete + in_flight >= N``: wait (poll every :data:`POLL_S`) -- a trial another worker is
  running may still be pruned or fail, and then one more is needed;
- otherwise: start a trial.

*In flight* means ``RUNNING`` and owned by a worker that is alive. Each worker tags the trials it
runs with a random token (user attribute :data:`OWNER_ATTR`; left out of ``trials.csv``) and,
for a journal, holds an exclusive
``flock`` on the file ``<journal>.workers/<token>`` for its life; the kernel drops that lock
when the process dies, so a ``RUNNING`` trial left by a killed worker is not waited for. The
check and the tagging of the new trial happen under one lock (``flock`` on
``<journal>.gate``), so two workers on one machine cannot both take the last slot: a journal
study ends with exactly ``N`` complete trials.

Each worker also holds a *slot*: the smallest ``k`` whose ``<journal>.workers/slot-<k>`` it can
``flock`` (the lock is dropped when the process dies; the files stay, so two workers can never
lock two different files of one name). Concurrent workers hold different slots and a worker
alone holds slot 0, so the slot, folded into the sampler's seed
(:func:`kvsched.experiments.tune.sampler_seed`), keeps workers that open the study at the same
moment (same trial count) from proposing the same parameter sets, while one command on a copy of
a journal still proposes the same trials. In memory the slot is the smallest one free among the
threads on the storage; an RDB study cannot share a lock between machines and uses the worker
index (``--workers``) as its slot.

An in-memory study (one process; the workers are threads) uses a thread lock and an in-process
set of live tokens the same way. An RDB study (PostgreSQL, workers on several machines) has no
shared lock: every ``RUNNING`` trial counts as in flight once Optuna's heartbeat check
(:func:`optuna.storages.fail_stale_trials`, grace period 30 s) has failed the trials of dead
workers, and two workers that check at the same instant may both start the last trial, so an
RDB study can end with up to ``workers - 1`` complete trials more than ``N``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

#: Trial user attribute naming the worker that runs the trial.
OWNER_ATTR = "kvsched:worker"
#: Seconds between two looks at the study while waiting for in-flight trials.
POLL_S = 0.25

_LOCAL_LOCKS: dict[int, threading.Lock] = {}
_LOCAL_LIVE: set[str] = set()
_LOCAL_GUARD = threading.Lock()
_LOCAL_SLOTS: dict[int, set[int]] = {}


class TrialGate:
    """Decides, one trial at a time, whether a worker starts a trial, waits or stops (module doc).

    Use as a context manager (it registers the worker as alive and unregisters it on exit)::

        with TrialGate(study, n_complete, journal=path) as gate:
            while gate.next():          # True: a slot is reserved, the gate lock held
                study.optimize(gate.wrap(objective), n_trials=1)  # wrap tags the trial, then unlocks
                gate.release()
    """

    def __init__(self, study: Any, n_complete: int, journal: str | None = None, rdb: bool = False,
                 storage: Any = None, worker: int = 0) -> None:
        """``journal``: the study's journal file; ``rdb``: an RDB storage; neither: in memory
        (``storage``, the storage object the threads share, keys their lock); ``worker``: the
        worker index, the slot of an RDB worker (module doc)."""
        self.study, self.n_complete, self.rdb = study, n_complete, rdb
        #: this worker's slot while registered (module doc)
        self.slot = worker
        self._storage_key = id(storage)
        self._slot_fd: int | None = None
        self.token = uuid.uuid4().hex
        self.journal = Path(journal) if journal else None
        self._held = False
        self._gate_fd: int | None = None
        self._live_fd: int | None = None
        if self.journal is None:
            with _LOCAL_GUARD:
                self._thread_lock = _LOCAL_LOCKS.setdefault(id(storage), threading.Lock())  # one per storage

    # -------------------------------------------------------------- liveness
    @property
    def _workers_dir(self) -> Path:
        assert self.journal is not None
        return self.journal.with_name(self.journal.name + ".workers")

    def __enter__(self) -> "TrialGate":
        if self.journal is None:
            with _LOCAL_GUARD:
                _LOCAL_LIVE.add(self.token)
                if not self.rdb:
                    taken = _LOCAL_SLOTS.setdefault(self._storage_key, set())
                    self.slot = min(set(range(len(taken) + 1)) - taken)
                    taken.add(self.slot)
            return self
        import fcntl

        self._workers_dir.mkdir(exist_ok=True)
        self._live_fd = os.open(self._workers_dir / self.token, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self._live_fd, fcntl.LOCK_EX)
        self.slot, self._slot_fd = _claim_slot(self._workers_dir)
        self._gate_fd = os.open(self.journal.with_name(self.journal.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o666)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        if self.journal is None:
            with _LOCAL_GUARD:
                _LOCAL_LIVE.discard(self.token)
                if not self.rdb:
                    _LOCAL_SLOTS.get(self._storage_key, set()).discard(self.slot)
            return
        with contextlib.suppress(OSError):
            os.unlink(self._workers_dir / self.token)
        for fd in (self._gate_fd, self._live_fd, self._slot_fd):
            if fd is not None:
                os.close(fd)

    def _alive(self, token: object) -> bool:
        """Whether the worker of ``token`` still runs (an untagged trial's owner died before tagging)."""
        if token == self.token:
            return True
        return worker_alive(self.journal, token)

    # -------------------------------------------------------------- the gate lock
    def _acquire(self) -> None:
        if self.rdb:
            return
        if self.journal is None:
            self._thread_lock.acquire()
        else:
            import fcntl

            assert self._gate_fd is not None
            fcntl.flock(self._gate_fd, fcntl.LOCK_EX)
        self._held = True

    def release(self) -> None:
        """Release the gate lock if held (idempotent)."""
        if not self._held:
            return
        self._held = False
        if self.journal is None:
            self._thread_lock.release()
        else:
            import fcntl

            assert self._gate_fd is not None
            fcntl.flock(self._gate_fd, fcntl.LOCK_UN)

    # -------------------------------------------------------------- counting
    def counts(self) -> tuple[int, int]:
        """``(complete trials, trials in flight)`` in the study now."""
        from optuna.storages import fail_stale_trials
        from optuna.trial import TrialState

        if self.rdb:
            fail_stale_trials(self.study)
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
        complete = sum(t.state == TrialState.COMPLETE for t in trials)
        running = [t for t in trials if t.state == TrialState.RUNNING]
        if self.rdb:
            return complete, len(running)
        return complete, sum(self._alive(t.user_attrs.get(OWNER_ATTR)) for t in running)

    def next(self, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Wait until a trial may start (True, the gate lock held until :meth:`wrap`'s objective
        tags it) or the study holds ``n_complete`` complete trials (False)."""
        while True:
            self._acquire()
            complete, in_flight = self.counts()
            if complete >= self.n_complete:
                self.release()
                return False
            if complete + in_flight < self.n_complete:
                return True
            self.release()
            sleep(POLL_S)

    def wrap(self, objective: Callable[[Any], float]) -> Callable[[Any], float]:
        """``objective`` that first tags its trial with this worker's token, then releases the gate."""

        def run(trial: Any) -> float:
            trial.set_user_attr(OWNER_ATTR, self.token)
            self.release()
            return objective(trial)

        return run


def _claim_slot(workers_dir: Path) -> tuple[int, int]:
    """Lock the smallest free ``slot-<k>`` file of ``workers_dir``; returns ``(k, its fd)``
    (closing the fd, or the process dying, frees the slot). The files are never removed: a
    removed file could be locked by one worker through its old name and by another through a new
    file of the same name."""
    import fcntl

    k = 0
    while True:
        fd = os.open(workers_dir / f"slot-{k}", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            k += 1
            continue
        return k, fd


def worker_alive(journal: Path | None, token: object) -> bool:
    """Whether the worker that tagged a trial with ``token`` (:data:`OWNER_ATTR`) still runs: it
    holds the ``flock`` of ``<journal>.workers/<token>`` (in memory, ``journal=None``: its token is
    registered in this process). A trial without a token belongs to no live worker."""
    if not isinstance(token, str) or not token.isalnum():
        return False
    if journal is None:
        return token in _LOCAL_LIVE
    import fcntl

    path = journal.with_name(journal.name + ".workers") / token
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:  # nobody holds it: its worker died; tidy up
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)


def fail_dead_trials(storage: Any, journal: str | Path) -> int:
    """Mark ``FAIL`` every ``RUNNING`` trial of every study in the journal ``storage`` whose
    worker no longer runs (:func:`worker_alive`), as Optuna's
    :func:`~optuna.storages.fail_stale_trials` does for an RDB study's heartbeat; returns how
    many. Used after a torn tail was cut off a journal: the lost records may have been a trial's
    end, which would otherwise stay ``RUNNING`` for good (counted in reports, never finished).
    Holds the gate lock (``<journal>.gate``), so a trial a live worker has asked for but not yet
    tagged is not failed.

    Raises:
        OSError: the gate lock or the journal cannot be written.
    """
    import fcntl

    from optuna.trial import TrialState

    journal = Path(journal)
    failed = 0
    fd = os.open(journal.with_name(journal.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for study in storage.get_all_studies():
            for t in storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                if not worker_alive(journal, t.user_attrs.get(OWNER_ATTR)):
                    storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                    failed += 1
    finally:
        os.close(fd)  # closing drops the flock
    return failed
