"""Requests: the immutable input of one serving request, and a columnar workload of them.

A :class:`Request` is what a client sends: when it arrives, how many prompt tokens it carries,
how many output tokens it will decode (hidden from policies unless a scenario enables oracle
lengths; in the simulator it acts as the request's ``max_tokens`` with ``ignore_eos``), an
optional session, prefix hashes that identify reusable prompt blocks, an SLO class and a
scheduling priority (vLLM's per-request ``priority``: lower is served earlier under
``--scheduling-policy priority``; 0 unless given, as in vLLM) and ``n``, the number of parallel
samples (vLLM's ``SamplingParams.n``, 1 unless given).

Parallel sampling (n > 1) as vLLM V1 serves it: the front end fans the request out into ``n``
child requests (``vllm/v1/engine/async_llm.py`` ``AsyncLLM.add_request`` and
``vllm/v1/engine/llm_engine.py`` ``LLMEngine.add_request``: "Fan out child requests (for n>1)",
each a ``copy`` of the parent ``EngineCoreRequest`` -- same prompt, arrival time and priority --
with id ``f"{index}_{parent_id}"`` and ``SamplingParams.n = 1``, from
``vllm/v1/engine/parallel_sampling.py`` ``ParentRequest.get_child_info``). The engine core sees
``n`` independent requests whose full prompt blocks it shares through the prefix cache. In
kvsched the cluster does the fan-out at arrival (:meth:`Request.children`, used by
:class:`~kvsched.envs.sim.cluster.Cluster`).

A :class:`Workload` stores many requests as NumPy columns (memory grows with requests, not
with Python objects) and hands out :class:`Request` objects one at a time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .errors import ConfigError, bounded_repr, require

#: Inclusive bounds of a request's ``priority``. vLLM takes any Python int (``priority: int = 0``
#: in ``vllm/v1/request.py`` ``Request.__init__``); kvsched bounds it to the int32 range (its
#: choice: the column stays compact, and a trace cell parsed as a float is still exact).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: A request's priority when none is given: vLLM's default (``Request.__init__(priority=0)``,
#: ``vllm/v1/request.py``).
DEFAULT_PRIORITY = 0
#: A request's number of parallel samples when none is given: vLLM's default
#: (``SamplingParams.n: int = 1``, ``vllm/sampling_params.py``).
DEFAULT_N = 1
#: Largest ``n`` allowed: vLLM's default ``VLLM_MAX_N_SEQUENCES`` (16384; checked by
#: ``_verify_num_sequences`` in ``vllm/sampling_params.py``).
N_MAX = 16384
#: What :func:`~.errors.require` says is allowed for ``n``.
N_ALLOWED = f"an integer in [1, {N_MAX}] (parallel samples per request, vLLM's SamplingParams.n)"
#: Latest arrival time allowed (seconds from the start of the workload): 1e9 s, about 31.7
#: years. Simulated time is a float64 number of seconds; its resolution at magnitude ``t`` is
#: ``t * 2**-52`` (about 2.2e-16 ``t``), so up to 1e9 s a time is exact to 2.2e-7 s (0.22 us),
#: well below the shortest step (tens of microseconds) and the token times the metrics
#: difference. At 1e16 s the resolution is 2 s and a step's duration vanishes (TTFT and E2E
#: come out 0); no real trace spans more than a few weeks. Arrivals beyond this bound are
#: refused (a timestamp in the wrong unit, e.g. nanoseconds read as seconds, is the usual cause).
MAX_ARRIVAL_S = 1e9
#: ``parent_id`` of a request that is not a child of a parallel-sampling request.
NO_PARENT = -1
#: The default of :attr:`Workload.n` (a marker, replaced by a column of :data:`DEFAULT_N`).
_NO_N = np.zeros(0, dtype=np.int64)
#: The default of :attr:`Workload.priority` (a marker: ``__post_init__`` replaces it by a column of
#: :data:`DEFAULT_PRIORITY`, one per request).
_NO_PRIORITY = np.zeros(0, dtype=np.int64)


def hash_block_mismatch(hash_block_tokens: int, block_size_tokens: int) -> str:
    """The message when an instance's KV block size does not divide the workload's prefix-hash block.

    Names the key the user sets (the instance's ``block_size_tokens``) and the constraint; the
    hash block comes from the trace (Mooncake's ``hash_ids`` cover 512 tokens each), which the
    user did not choose.
    """
    divisors = [d for d in (16, 32, 64, 8, 128, 4, 2, 1) if hash_block_tokens % d == 0]
    return (f"instance block_size_tokens={block_size_tokens} is not allowed with this workload: its prefix "
            f"hashes cover {hash_block_tokens}-token blocks (set by the trace), and a KV block must divide "
            f"such a block; set block_size_tokens to a divisor of {hash_block_tokens}"
            + f" (e.g. {', '.join(map(str, divisors[:3]))})")


#: The array columns of a :class:`Workload` (read-only once it is built).
_COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "session_id", "slo_class",
            "hash_offsets", "hashes", "priority", "n")


@dataclass(frozen=True, slots=True)
class Request:
    """One serving request (immutable input).

    Attributes:
        request_id: unique non-negative integer within a workload.
        arrival_s: arrival time in seconds from the start of the workload (>= 0).
        prompt_tokens: prompt length in tokens (>= 1).
        output_tokens: tokens the request decodes before it finishes (>= 1). Hidden from
            policies unless oracle lengths are enabled.
        session_id: conversation/session identifier, ``-1`` when unknown.
        prefix_hashes: chained hashes of the prompt's leading blocks, one per
            ``hash_block_tokens`` tokens (Mooncake's ``hash_ids`` are 512-token blocks). Equal
            hashes at equal positions mean reusable KV. Empty when the trace has none.
        hash_block_tokens: tokens covered by each prefix hash (0 when there are no hashes).
        slo_class: name of the request's SLO class.
        priority: scheduling priority, an integer in ``[PRIORITY_MIN, PRIORITY_MAX]``; lower is
            served earlier by vLLM's priority scheduler (``vllm/v1/request.py`` ``Request.__lt__``:
            ``(priority, arrival_time)``). Default 0, vLLM's. Policies see it (a real scheduler
            does).
        n: number of parallel samples (vLLM's ``SamplingParams.n``), an integer in
            ``[1, N_MAX]``, default 1. With ``n > 1`` the cluster serves ``n`` child sequences
            (:meth:`children`), each decoding ``output_tokens`` tokens (kvsched does not sample
            tokens, so every child has the parent's output length).
        parent_id: for a child sequence of a parallel-sampling request, the parent's
            ``request_id``; ``NO_PARENT`` (-1) otherwise. Children are made by :meth:`children`,
            never read from a workload.

    Raises:
        ConfigError: on any negative or zero length, negative time, inconsistent hashes, a
            priority that is not an integer in range, or an ``n`` that is not an integer in
            ``[1, N_MAX]``.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session_id: int = -1
    prefix_hashes: tuple[int, ...] = ()
    hash_block_tokens: int = 0
    slo_class: str = "default"
    priority: int = DEFAULT_PRIORITY
    n: int = DEFAULT_N
    parent_id: int = NO_PARENT

    def __post_init__(self) -> None:
        require(not isinstance(self.n, bool) and isinstance(self.n, (int, np.integer)) and 1 <= self.n <= N_MAX,
                f"request {self.request_id!r}: n", self.n, N_ALLOWED)
        for name in ("request_id", "prompt_tokens", "output_tokens", "session_id", "hash_block_tokens", "priority",
                     "parent_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ConfigError(f"request {bounded_repr(self.request_id)}: {name}={bounded_repr(v)} "
                                  "must be an integer")
        if self.request_id < 0:
            raise ConfigError(f"request_id={self.request_id} must be >= 0")
        a = self.arrival_s
        if isinstance(a, bool) or not isinstance(a, (int, float, np.integer, np.floating)) or not (
                0 <= a <= MAX_ARRIVAL_S):
            raise ConfigError(
                f"request {self.request_id}: arrival_s={bounded_repr(a)} is not allowed: expected a number of "
                f"seconds in [0, {MAX_ARRIVAL_S:g}] (MAX_ARRIVAL_S: float64 times keep sub-microsecond resolution "
                "up to it)")
        if self.prompt_tokens < 1:
            raise ConfigError(
                f"request {self.request_id}: prompt_tokens={self.prompt_tokens} must be >= 1"
            )
        if self.output_tokens < 1:
            raise ConfigError(
                f"request {self.request_id}: output_tokens={self.output_tokens} must be >= 1"
            )
        if self.prefix_hashes and self.hash_block_tokens <= 0:
            raise ConfigError(
                f"request {self.request_id}: hash_block_tokens={self.hash_block_tokens} must be"
                " > 0 when prefix_hashes are given"
            )
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ConfigError(f"request {self.request_id}: priority={self.priority} is not allowed: expected an "
                              f"integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served earlier)")

    @classmethod
    def _from_validated(cls, request_id: int, arrival_s: float, prompt_tokens: int, output_tokens: int,
                        session_id: int, prefix_hashes: tuple[int, ...], hash_block_tokens: int,
                        slo_class: str, priority: int, n: int = DEFAULT_N,
                        parent_id: int = NO_PARENT) -> "Request":
        """A request from fields already checked column-wise by :class:`Workload` (no re-check).

        The simulator's per-arrival path: the same object as the constructor would build, without
        :meth:`__post_init__` (whose per-field checks cost more than the rest of an arrival).
        """
        r = object.__new__(cls)
        set_ = object.__setattr__
        set_(r, "request_id", request_id)
        set_(r, "arrival_s", arrival_s)
        set_(r, "prompt_tokens", prompt_tokens)
        set_(r, "output_tokens", output_tokens)
        set_(r, "session_id", session_id)
        set_(r, "prefix_hashes", prefix_hashes)
        set_(r, "hash_block_tokens", hash_block_tokens)
        set_(r, "slo_class", slo_class)
        set_(r, "priority", priority)
        set_(r, "n", n)
        set_(r, "parent_id", parent_id)
        return r

    def children(self, first_new_id: int) -> tuple["Request", ...]:
        """The ``n`` child sequences of a parallel-sampling request (``(self,)`` when ``n == 1``).

        As vLLM V1's front end (``ParentRequest.get_child_info`` in
        ``vllm/v1/engine/parallel_sampling.py``; ``AsyncLLM.add_request``): every child is a copy
        of the parent -- same arrival, prompt, prefix hashes, priority and SLO class -- with
        ``n = 1``. vLLM gives child ``index`` the id ``f"{index}_{parent_id}"``; kvsched's ids are
        integers, so child 0 keeps the parent's ``request_id`` (its records are those of an
        ``n = 1`` request but for ``parent_id``) and child ``k >= 1`` gets
        ``first_new_id + k - 1`` (the cluster hands out ids above every id of the workload, in
        arrival order, so runs are deterministic). Each child decodes ``output_tokens`` tokens:
        kvsched does not sample, so the children's outputs do not differ in length. With a
        seed, vLLM gives child ``index`` the seed ``seed + index``; kvsched has no seeds to give.
        """
        if self.n == 1:
            return (self,)
        mk = Request._from_validated
        base = (self.arrival_s, self.prompt_tokens, self.output_tokens, self.session_id, self.prefix_hashes,
                self.hash_block_tokens, self.slo_class, self.priority)
        rid = self.request_id
        return tuple(mk(rid if k == 0 else first_new_id + k - 1, *base, DEFAULT_N, rid) for k in range(self.n))

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens: the KV context the request holds when it finishes."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Workload:
    """A columnar, arrival-sorted set of requests.

    Columns (all of length ``n``): ``request_id`` (int64), ``arrival_s`` (float64, seconds,
    non-decreasing), ``prompt_tokens`` and ``output_tokens`` (int64, >= 1), ``session_id``
    (int64, -1 when unknown), ``slo_class`` (int16 codes into ``slo_class_names``),
    ``priority`` (int64 in ``[PRIORITY_MIN, PRIORITY_MAX]``, lower is served earlier by vLLM's
    priority scheduler; optional: left out (or ``None``) every request has vLLM's default 0,
    ``Request.__init__(priority=0)`` in ``vllm/v1/request.py``), ``n`` (int64 in ``[1, N_MAX]``,
    parallel samples per request, vLLM's ``SamplingParams.n``; optional: left out (or ``None``)
    every request has vLLM's default 1; see :meth:`Request.children`). Prefix
    hashes are ragged: request ``i`` owns ``hashes[hash_offsets[i]:hash_offsets[i+1]]``, each
    covering ``hash_block_tokens`` tokens.

    ``name`` and ``source_sha256`` give provenance (the trace file's content hash, or a
    description of the generator and its seed). ``notes`` records what loading changed
    (e.g. "sorted 3 rows by arrival"), so nothing is done silently.

    Every column is validated here, once, with what :class:`Request` checks per request
    (integer columns, ``request_id >= 0``, lengths >= 1, finite non-negative arrivals, hashes
    with a positive ``hash_block_tokens``, arrivals at most :data:`MAX_ARRIVAL_S`), so
    :meth:`request` hands out rows without re-checking them. The columns are then read-only
    (``flags.writeable`` is False; a writable array given is copied first), so what was
    validated stays what is simulated: derive a new workload (:meth:`subset`,
    :meth:`with_arrivals`) instead of editing one.

    Raises:
        ConfigError: a column of the wrong length or dtype, or a value out of range (the
            message names the column and the first offending row).
    """

    name: str
    request_id: np.ndarray
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    session_id: np.ndarray
    slo_class: np.ndarray
    hash_offsets: np.ndarray
    hashes: np.ndarray
    hash_block_tokens: int = 0
    slo_class_names: tuple[str, ...] = ("default",)
    source_sha256: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    priority: np.ndarray = field(default_factory=lambda: _NO_PRIORITY)
    n: np.ndarray = field(default_factory=lambda: _NO_N)

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if self.priority is _NO_PRIORITY or self.priority is None:
            # not given: vLLM's default priority for every request (see the class doc)
            object.__setattr__(self, "priority", np.full(n, DEFAULT_PRIORITY, dtype=np.int64))
        if self.n is _NO_N or self.n is None:
            # not given: vLLM's default n for every request (see the class doc)
            object.__setattr__(self, "n", np.full(n, DEFAULT_N, dtype=np.int64))
        # read-only columns, validated below as stored: a writable array given here is copied
        # (the caller keeps its own), a read-only one (another workload's) is shared
        for name in _COLUMNS:
            arr = np.asarray(getattr(self, name))
            if arr.flags.writeable:
                arr = arr.copy()
                arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        for name in ("request_id", "prompt_tokens", "output_tokens", "session_id", "slo_class", "priority", "n"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"Workload column {name} has {len(getattr(self, name))} rows, expected {n}")
        if len(self.hash_offsets) != n + 1:
            raise ConfigError(f"Workload hash_offsets has {len(self.hash_offsets)} entries, expected {n + 1}")
        if n and (np.any(np.diff(self.arrival_s) < 0)):
            raise ConfigError("Workload arrival_s must be non-decreasing (sort the requests first)")
        if n and (np.any(self.prompt_tokens < 1) or np.any(self.output_tokens < 1)):
            raise ConfigError("Workload prompt_tokens and output_tokens must all be >= 1")
        if n and (self.arrival_s[0] < 0 or not np.all(np.isfinite(self.arrival_s))):
            raise ConfigError("Workload arrival_s must be finite and >= 0")
        if n and self.arrival_s[-1] > MAX_ARRIVAL_S:
            i = int(np.flatnonzero(self.arrival_s > MAX_ARRIVAL_S)[0])
            raise ConfigError(
                f"Workload arrival_s={float(self.arrival_s[i]):g} s (row {i}, request_id {int(self.request_id[i])}) "
                f"is not allowed: expected at most {MAX_ARRIVAL_S:g} s (about 31.7 years; float64 seconds keep "
                "sub-microsecond resolution up to it, and lose the step times beyond; a timestamp in another "
                "unit, e.g. ns read as s?)")
        if len(self.hashes) and self.hash_block_tokens <= 0:
            raise ConfigError(f"hash_block_tokens={self.hash_block_tokens} must be > 0 when hashes are given")
        for name in ("request_id", "prompt_tokens", "output_tokens", "session_id", "slo_class",
                     "hash_offsets", "hashes", "priority", "n"):
            kind = np.asarray(getattr(self, name)).dtype.kind
            if kind not in "iu":
                raise ConfigError(f"Workload column {name} has dtype {np.asarray(getattr(self, name)).dtype}; "
                                  "expected an integer dtype")
        pr = self.priority
        if n and (pr.min() < PRIORITY_MIN or pr.max() > PRIORITY_MAX):
            i = int(np.flatnonzero((pr < PRIORITY_MIN) | (pr > PRIORITY_MAX))[0])
            raise ConfigError(f"Workload priority={int(pr[i])} (row {i}) is not allowed: expected an integer in "
                              f"[{PRIORITY_MIN}, {PRIORITY_MAX}]")
        ns = self.n
        if n and (ns.min() < 1 or ns.max() > N_MAX):
            i = int(np.flatnonzero((ns < 1) | (ns > N_MAX))[0])
            require(False, f"Workload n (row {i})", int(ns[i]), N_ALLOWED)
        if n and np.any(self.request_id < 0):
            i = int(np.flatnonzero(self.request_id < 0)[0])
            raise ConfigError(f"Workload request_id={int(self.request_id[i])} (row {i}) must be >= 0")
        if n and (np.any(self.slo_class < 0) or np.any(self.slo_class >= len(self.slo_class_names))):
            raise ConfigError(f"Workload slo_class codes must be in [0, {len(self.slo_class_names)}) "
                              f"(slo_class_names={self.slo_class_names})")
        off = self.hash_offsets
        if off[0] != 0 or off[-1] != len(self.hashes) or np.any(np.diff(off) < 0):
            raise ConfigError(f"Workload hash_offsets must start at 0, be non-decreasing and end at "
                              f"len(hashes)={len(self.hashes)}")

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def from_requests(
        requests: Sequence[Request], name: str = "requests", source_sha256: str = "",
        notes: Sequence[str] = (),
    ) -> "Workload":
        """Build a workload from :class:`Request` objects (sorted by arrival, stable).

        Raises:
            ConfigError: if requests use different ``hash_block_tokens`` or repeat an id.
        """
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        hb = {r.hash_block_tokens for r in reqs if r.prefix_hashes}
        if len(hb) > 1:
            raise ConfigError(f"requests mix hash_block_tokens values {sorted(hb)}; use one")
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise ConfigError("request_id values must be unique within a workload")
        classes: list[str] = []
        for r in reqs:
            if r.slo_class not in classes:
                classes.append(r.slo_class)
        if not classes:
            classes = ["default"]
        offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r.prefix_hashes) for r in reqs])
        hashes = np.fromiter((h for r in reqs for h in r.prefix_hashes), dtype=np.int64,
                             count=int(offsets[-1]))
        return Workload(
            name=name,
            request_id=np.asarray(ids, dtype=np.int64),
            arrival_s=np.asarray([r.arrival_s for r in reqs], dtype=np.float64),
            prompt_tokens=np.asarray([r.prompt_tokens for r in reqs], dtype=np.int64),
            output_tokens=np.asarray([r.output_tokens for r in reqs], dtype=np.int64),
            session_id=np.asarray([r.session_id for r in reqs], dtype=np.int64),
            slo_class=np.asarray([classes.index(r.slo_class) for r in reqs], dtype=np.int16),
            hash_offsets=offsets,
            hashes=hashes,
            hash_block_tokens=hb.pop() if hb else 0,
            slo_class_names=tuple(classes),
            source_sha256=source_sha256,
            notes=tuple(notes),
            priority=np.asarray([r.priority for r in reqs], dtype=np.int64),
            n=np.asarray([r.n for r in reqs], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.arrival_s)

    def request(self, i: int) -> Request:
        """The ``i``-th request (in arrival order) as a :class:`Request`."""
        lo, hi = int(self.hash_offsets[i]), int(self.hash_offsets[i + 1])
        return Request._from_validated(  # the columns were validated in __post_init__
            int(self.request_id[i]),
            float(self.arrival_s[i]),
            int(self.prompt_tokens[i]),
            int(self.output_tokens[i]),
            int(self.session_id[i]),
            tuple(self.hashes[lo:hi].tolist()) if hi > lo else (),
            self.hash_block_tokens if hi > lo else 0,
            self.slo_class_names[int(self.slo_class[i])],
            int(self.priority[i]),
            int(self.n[i]),
        )

    def __iter__(self) -> Iterator[Request]:
        for i in range(len(self)):
            yield self.request(i)

    def subset(self, mask_or_index: np.ndarray, name: str | None = None,
               note: str | None = None) -> "Workload":
        """A new workload holding the selected rows (boolean mask or sorted index array)."""
        idx = (np.flatnonzero(mask_or_index) if np.asarray(mask_or_index).dtype == bool
               else np.asarray(mask_or_index, dtype=np.int64))
        lens = self.hash_offsets[idx + 1] - self.hash_offsets[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lens)
        if len(idx):
            hashes = (np.concatenate([self.hashes[self.hash_offsets[i]:self.hash_offsets[i + 1]] for i in idx])
                      if offsets[-1] else np.zeros(0, np.int64))
        else:
            hashes = np.zeros(0, np.int64)
        return Workload(
            name=name or self.name,
            request_id=self.request_id[idx],
            arrival_s=self.arrival_s[idx],
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            session_id=self.session_id[idx],
            slo_class=self.slo_class[idx],
            hash_offsets=offsets,
            hashes=hashes.astype(np.int64),
            hash_block_tokens=self.hash_block_tokens,
            slo_class_names=self.slo_class_names,
            source_sha256=self.source_sha256,
            notes=self.notes + ((note,) if note else ()),
            priority=self.priority[idx],
            n=self.n[idx],
        )

    def with_arrivals(self, arrival_s: np.ndarray, note: str) -> "Workload":
        """A copy with new arrival times (same order); used by rate scaling and windows."""
        return Workload(
            name=self.name, request_id=self.request_id, arrival_s=np.asarray(arrival_s, dtype=np.float64),
            prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            session_id=self.session_id, slo_class=self.slo_class, hash_offsets=self.hash_offsets,
            hashes=self.hashes, hash_block_tokens=self.hash_block_tokens,
            slo_class_names=self.slo_class_names, source_sha256=self.source_sha256,
            notes=self.notes + (note,), priority=self.priority, n=self.n,
        )

    def content_sha256(self) -> str:
        """SHA-256 of the workload's columns: identifies exactly what was simulated.

        The ``priority`` column enters only when some request's priority is not 0: an all-zero
        column is the same workload as one without priorities (vLLM's default), so workloads
        hashed before the column existed keep their hash. Likewise ``n`` enters only when some
        request has ``n != 1``.
        """
        h = hashlib.sha256()
        for arr in (self.request_id, self.arrival_s, self.prompt_tokens, self.output_tokens,
                    self.session_id, self.slo_class, self.hash_offsets, self.hashes):
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update(repr((self.hash_block_tokens, self.slo_class_names)).encode())
        if self.priority.any():
            h.update(b"priority")
            h.update(np.ascontiguousarray(self.priority, dtype=np.int64).tobytes())
        if self.has_parallel_sampling:
            h.update(b"n")
            h.update(np.ascontiguousarray(self.n, dtype=np.int64).tobytes())
        return h.hexdigest()

    @property
    def has_parallel_sampling(self) -> bool:
        """Whether some request asks for more than one sample (``n > 1``)."""
        return bool(len(self.n)) and int(self.n.max()) > DEFAULT_N

    @property
    def num_sequences(self) -> int:
        """Sequences the engine serves: the sum of ``n`` (one per request when no ``n > 1``)."""
        return int(self.n.sum()) if self.has_parallel_sampling else len(self)


def _chain(hashes: tuple[int, ...]) -> tuple[int, ...]:
    """Chained cache keys: key_i = hash((key_{i-1}, hash_i)).

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so keys are the same in
    every process.
    """
    out = []
    prev = 0x6B7673636865  # any fixed root
    for h in hashes:
        prev = hash((prev, h))
        out.append(prev)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Per-request progress inside the simulator
# ---------------------------------------------------------------------------------------------
WAITING, RUNNING, SWAPPED, FINISHED, REJECTED = range(5)
STATUS_NAMES = ("waiting", "running", "swapped", "finished", "rejected")
NAN = float("nan")


class RequestState:
    """Mutable progress of one request inside an instance (one object per request in flight).

    Token accounting follows vLLM V1: ``computed`` tokens are in the KV cache; the request has
    ``prompt_tokens + generated`` tokens in all, so ``to_compute = prompt + generated -
    computed`` (1 while decoding). A step that brings ``computed`` up to ``prompt + generated``
    emits one output token. Recompute preemption resets ``computed`` to 0, so the request
    re-prefills its prompt and the tokens it already generated (vLLM issue #18115).

    KV holdings: ``shared`` lists the prefix-cache segments (hashes) it references in HBM,
    ``private_blocks`` counts its other blocks in ``tier``; ``lower_blocks`` are blocks it
    holds in ``lower_tier`` (a tier holding swapped blocks: DRAM, NVMe or an extra tier) while
    swapped out or being swapped back in;
    ``pnm_blocks`` are blocks it holds in the PNM tier (``on_pnm``: its KV lives there and its
    decode attention runs there; ``pnm_migrating``: a GPU->PNM copy is in flight).
    """

    __slots__ = (
        "req", "rid", "arrival_s", "prompt_tokens", "output_tokens", "hashes", "seg_tokens",
        "n_cacheable_segments", "length_class", "instance_id", "status", "computed", "generated",
        "tier", "shared", "shared_blocks", "private_blocks", "next_seg", "lower_tier",
        "lower_blocks", "ready_s", "first_scheduled_s", "first_token_s", "last_token_s",
        "finish_s", "preemptions", "recomputed_tokens", "lost_tokens", "prefix_hit_tokens",
        "self_hit_tokens", "max_itl_s", "tier_bytes", "reject_reason", "admissions",
        "pnm_blocks", "on_pnm", "pnm_migrating", "swap_in_end_s",
        "admission_preemptions", "priority",
    )

    def __init__(self, req: Request, block_size_tokens: int, length_class: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.arrival_s = req.arrival_s
        self.prompt_tokens = req.prompt_tokens
        self.output_tokens = req.output_tokens
        self.priority = req.priority  # vLLM Request.priority: lower is served earlier
        # Cache keys chain each segment's hash to its parent's, as vLLM chains block hashes:
        # a segment is reusable only after the same prefix (position and content).
        self.hashes = _chain(req.prefix_hashes) if req.prefix_hashes else ()
        self.seg_tokens = req.hash_block_tokens
        if self.hashes and self.seg_tokens % block_size_tokens:
            raise ConfigError(f"request {req.request_id}: {hash_block_mismatch(self.seg_tokens, block_size_tokens)}")
        # only segments fully inside the prompt are hashed (vLLM hashes full blocks only)
        self.n_cacheable_segments = (
            min(len(self.hashes), self.prompt_tokens // self.seg_tokens) if self.hashes else 0)
        self.length_class = length_class
        self.instance_id = -1
        self.status = WAITING
        self.computed = 0
        self.generated = 0
        self.tier = "hbm"
        self.shared: list[int] = []
        self.shared_blocks = 0
        self.private_blocks = 0
        self.next_seg = 0
        self.lower_tier = ""
        self.lower_blocks = 0
        self.ready_s = 0.0
        self.first_scheduled_s = NAN
        self.first_token_s = NAN
        self.last_token_s = NAN
        self.finish_s = NAN
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.lost_tokens = 0
        self.prefix_hit_tokens = 0
        self.self_hit_tokens = 0
        self.max_itl_s = NAN
        # KV bytes moved between HBM and other tiers, "hbm_to_<tier>" / "<tier>_to_hbm" -> bytes
        # (the records' bytes_* columns); None until the first move
        self.tier_bytes: dict[str, int] | None = None
        self.reject_reason = ""
        self.admissions = 0
        self.admission_preemptions = 0  # times preempted for a blocked waiting request
        # PNM tier (REFERENCE §3): blocks held there, whether its decode attention runs there,
        # whether a background GPU->PNM copy is in flight (HBM blocks still held until it lands)
        self.pnm_blocks = 0
        self.on_pnm = False
        self.pnm_migrating = False
        # when the swap-in copy in flight lands (s); a landing event at another time is stale
        # (the request was preempted again while loading)
        self.swap_in_end_s = -1.0

    @property
    def hbm_blocks(self) -> int:
        """KV blocks this request holds in HBM (shared prefix segments plus private)."""
        return self.shared_blocks + self.private_blocks

    @property
    def to_compute(self) -> int:
        """Tokens to process before the next output token (1 while decoding)."""
        return self.prompt_tokens + self.generated - self.computed

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"RequestState(rid={self.rid}, {STATUS_NAMES[self.status]}, computed={self.computed},"
                f" generated={self.generated}/{self.output_tokens}, blocks={self.hbm_blocks})")
