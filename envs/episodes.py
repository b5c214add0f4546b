"""Episodes for the Gymnasium environments: windows of a scenario's workload.

An episode serves one *window* ``[start_s, start_s + window_s)`` of a scenario's requests
(arrivals rebased to 0, the instance starting empty), identified by ``(workload_seed,
window_index)``. For a trace scenario the seed changes nothing (the trace is fixed); for a
synthetic scenario it is the generator's seed, so every seed is a new workload.

Train / held-out split (no window is in both):

* windows: the first ``1 - heldout_fraction`` of the scenario's span are *train* windows, the
  rest *held-out* (a time split, the usual one for traces);
* synthetic seeds: training draws workload seeds in ``[0, HELDOUT_SEED_BASE)``, evaluation uses
  ``HELDOUT_SEED_BASE + s`` for its seeds ``s`` (never drawn in training).

No simulation logic lives here: only which requests an episode serves.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvsched.envs.sim.errors import ConfigError, require, bounded_repr
from kvsched.envs.sim.request import Workload
from kvsched.envs.workload import traces

#: held-out synthetic workloads use seeds from here on (training draws below it)
HELDOUT_SEED_BASE = 1 << 20

SPLITS = ("train", "heldout", "all")


@dataclass(frozen=True)
class EpisodeConfig:
    """Which windows of which scenario the episodes serve.

    Attributes:
        scenario: path of a scenario YAML file (``experiments/scenarios/*.yaml``).
        window_s: length of an episode's arrival window (s), > 0.
        split: ``"train"``, ``"heldout"`` or ``"all"`` windows (see the module docstring).
        heldout_fraction: share of the span (last windows) kept for evaluation, in [0, 1).
        max_requests: optional cap on the requests of one window (the first N), >= 1.
    """

    scenario: str
    window_s: float = 60.0
    split: str = "train"
    heldout_fraction: float = 0.25
    max_requests: int | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.scenario, (str, Path)) and str(self.scenario) != "", "EpisodeConfig.scenario",
                self.scenario, "a scenario YAML path")
        object.__setattr__(self, "scenario", str(self.scenario))
        require(isinstance(self.window_s, (int, float)) and not isinstance(self.window_s, bool)
                and math.isfinite(self.window_s) and self.window_s > 0, "EpisodeConfig.window_s", self.window_s,
                "a finite number of seconds > 0")
        require(self.split in SPLITS, "EpisodeConfig.split", self.split, f"one of {SPLITS}")
        require(isinstance(self.heldout_fraction, (int, float)) and not isinstance(self.heldout_fraction, bool)
                and 0 <= self.heldout_fraction < 1, "EpisodeConfig.heldout_fraction", self.heldout_fraction,
                "a number in [0, 1)")
        require(self.max_requests is None or (isinstance(self.max_requests, int)
                                              and not isinstance(self.max_requests, bool) and self.max_requests >= 1),
                "EpisodeConfig.max_requests", self.max_requests, "None or an integer >= 1")


def _file_key(path: str) -> str:
    """The cache key of a scenario file (a path or a bundled scenario's name): its path and a
    hash of its bytes, so that editing the file between two environments of one process (a
    notebook) is seen, not served stale. A file that cannot be found or read gets the path alone
    (``load_scenario`` then raises its error)."""
    from kvsched.runner.scenario import scenario_path

    try:
        return f"{path}\0{hashlib.sha256(scenario_path(path).read_bytes()).hexdigest()}"
    except (OSError, ConfigError):
        return path


def _trace_key(scenario) -> str:
    """The part of a workload's cache key that a scenario's trace *file* contributes: its path,
    device and inode, size, and modification and status-change times (``os.stat``, following
    symlinks; nanoseconds), so that a trace file rewritten between two environments of one
    process is read again -- also when a copy carried the old modification time over (``cp
    -p``, ``rsync -t``, ``touch -r``: the kernel sets ctime at every write and ``utime``) or a
    symlink now points to another file. Empty for a synthetic scenario and for a bundled trace
    (package data, checked against its SHA-256 when loaded). The file's bytes are not hashed: a
    trace can be hundreds of MB and the key is computed for every environment made (a rewrite
    within the file system's timestamp granularity, with the same size, stays unseen). A file
    that cannot be stat'ed gets its path alone (loading raises)."""
    trace = scenario.trace
    if trace is None or trace in traces.BUNDLED_TRACES:
        return ""
    try:
        st = os.stat(trace)
    except OSError:
        return f"\0{trace}"
    return f"\0{os.path.abspath(trace)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"


@lru_cache(maxsize=4)
def _scenario(path: str, key: str):
    """The scenario of ``path`` whose content has cache key ``key`` (:func:`_file_key`)."""
    from kvsched.runner.scenario import load_scenario

    return load_scenario(path)


class _ScenarioRef:
    """A loaded scenario, hashed and compared by its cache key -- its file's (equal keys: equal
    file content, so equal scenarios) and its trace file's (:func:`_trace_key`) -- so that
    :func:`_full_workload` can be cached by it."""

    __slots__ = ("key", "scenario")

    def __init__(self, key: str, scenario) -> None:
        self.key = key
        self.scenario = scenario

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ScenarioRef) and other.key == self.key


@lru_cache(maxsize=8)
def _full_workload(ref: _ScenarioRef, seed: int) -> Workload:
    """The scenario's whole workload for ``seed``, built from the scenario object the caller
    holds (never re-read from a file that may have changed since)."""
    sc = ref.scenario
    if sc.synthetic is not None:
        sc = sc.with_overrides(seed=int(seed))
    return sc.workload()


class EpisodeSource:
    """Builds the workload of an episode from a :class:`EpisodeConfig`.

    Raises:
        ConfigError: when the scenario's span holds no window of the requested split.
    """

    def __init__(self, config: EpisodeConfig) -> None:
        self.config = config
        key = _file_key(config.scenario)
        self.scenario = _scenario(config.scenario, key)
        self._ref = _ScenarioRef(key + _trace_key(self.scenario), self.scenario)
        self.synthetic = self.scenario.synthetic is not None
        base = _full_workload(self._ref, self.scenario.seed)
        # a trace scenario's requests stay with the source: reloaded after the cache evicted them,
        # a relative trace path would be read from the current working folder (and a rewritten
        # file read anew) under this source's key, for it and for later sources
        self._trace_workload = None if self.synthetic else base
        span_s = float(base.arrival_s[-1]) if len(base) else 0.0
        n = int(span_s // config.window_s)
        if n < 1:
            raise ConfigError(f"EpisodeConfig.window_s={bounded_repr(config.window_s)} is longer than the scenario's "
                              f"span ({span_s:.1f} s of arrivals in {config.scenario}); choose a shorter window")
        n_heldout = int(math.ceil(n * config.heldout_fraction)) if config.heldout_fraction > 0 else 0
        if n_heldout >= n:
            n_heldout = n - 1
        self.n_windows = n
        # ranges, not tuples: a tiny window_s makes billions of windows (a tuple of them was a
        # MemoryError when the source was made)
        self.train_windows = range(0, n - n_heldout)
        self.heldout_windows = range(n - n_heldout, n)
        self.windows = {"train": self.train_windows, "heldout": self.heldout_windows,
                        "all": range(n)}[config.split]
        if not self.windows:
            raise ConfigError(f"EpisodeConfig.split={bounded_repr(config.split)} has no windows: the span of "
                              f"{config.scenario} holds {n} windows of {config.window_s:g} s, {n_heldout} held out; "
                              "lower heldout_fraction or window_s")

    def draw(self, rng: np.random.Generator) -> tuple[int, int]:
        """A ``(workload_seed, window_index)`` for the split, drawn with ``rng``."""
        w = self.windows[int(rng.integers(len(self.windows)))]
        if not self.synthetic:
            return self.scenario.seed, w
        if self.config.split == "heldout":
            return HELDOUT_SEED_BASE + int(rng.integers(HELDOUT_SEED_BASE)), w
        return int(rng.integers(HELDOUT_SEED_BASE)), w

    def choose(self, rng: np.random.Generator, options: dict | None) -> tuple[Workload, dict]:
        """An environment's ``reset(options=...)``: the episode's requests and its description.

        ``options`` may fix ``workload_seed`` and/or ``window_index``; the rest is drawn with
        ``rng`` (:meth:`draw`). Returns ``(workload, {"workload_seed", "window_index", "requests"})``.

        Raises:
            ConfigError: an unknown option, or an invalid seed / window index.
        """
        options = dict(options or {})
        unknown = set(options) - {"workload_seed", "window_index"}
        require(not unknown, "reset options", sorted(unknown, key=str), "'workload_seed' and 'window_index'")
        wseed, widx = self.draw(rng)
        wseed = options.get("workload_seed", wseed)
        widx = options.get("window_index", widx)
        w = self.workload(wseed, widx)
        return w, {"workload_seed": int(wseed), "window_index": int(widx), "requests": len(w)}

    def workload(self, workload_seed: int, window_index: int) -> Workload:
        """The requests of window ``window_index`` of the workload generated with ``workload_seed``;
        an empty workload when the window holds none (the episode has nothing to serve; its
        summary's SLO attainment is None, and evaluations skip it).

        Raises:
            ConfigError: a window index or seed out of range.
        """
        require(isinstance(window_index, (int, np.integer)) and 0 <= window_index < self.n_windows,
                "window_index", window_index, f"an integer in [0, {self.n_windows})")
        require(isinstance(workload_seed, (int, np.integer)) and workload_seed >= 0, "workload_seed",
                workload_seed, "an integer >= 0")
        full = self._trace_workload
        if full is None:
            full = _full_workload(self._ref, int(workload_seed))
        lo = window_index * self.config.window_s
        w = traces.window(full, lo, lo + self.config.window_s, allow_empty=True)
        if self.config.max_requests is not None and len(w):
            w = traces.head(w, self.config.max_requests)
        return w
