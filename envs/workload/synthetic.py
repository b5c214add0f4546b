"""Synthetic workloads: seeded arrivals, length distributions, sessions and shared prefixes.

:func:`generate` turns a validated :class:`SyntheticConfig` and a seed into a columnar
:class:`~kvsched.envs.sim.request.Workload`. All randomness comes from one
``numpy.random.default_rng(seed)`` (never the global RNG), drawn in a fixed order, so the same
config and seed give identical columns on every machine and process.

Model (all lengths in tokens, times in seconds):

* **Arrivals** -- a renewal process with mean rate ``rate_per_s``:

  - ``"poisson"``: exponential inter-arrival times (coefficient of variation 1);
  - ``"bursty"``: Gamma inter-arrival times with coefficient of variation ``burstiness_cv > 1``
    (shape ``1/cv**2``, scale ``cv**2/rate``): same mean rate, clustered arrivals. (We chose a
    Gamma renewal process over an on/off MMPP: one parameter, and the form ServeGen/BurstGPT fit
    to production traces.)

  The workload stops at ``duration_s`` (arrivals in ``(0, duration_s)``) or after
  ``num_requests`` requests (exactly one of the two is given).
* **Request kinds** -- each request is independently *long-context* with probability
  ``long_fraction`` (SLO class ``"long"``), else *short interactive* (SLO class ``"short"``).
* **Priorities** -- every request of SLO class ``"short"`` has scheduling priority
  ``short_priority``, every ``"long"`` one ``long_priority`` (vLLM's per-request ``priority``,
  lower is served earlier under ``--scheduling-policy priority``; ``vllm/v1/request.py``). Both
  default to 0, vLLM's default, and draw no random numbers.
* **Parallel samples** -- every request asks for ``n_samples`` samples (vLLM's
  ``SamplingParams.n``; the front end fans it out into ``n`` child requests sharing the prompt,
  ``vllm/v1/engine/parallel_sampling.py`` ``ParentRequest``). Default 1, vLLM's default; draws no
  random numbers.
* **Short requests** belong to conversations (sessions). ``concurrent_sessions`` conversations
  are open at any time; each short arrival is given to one of them uniformly at random, so the
  mean gap between turns of a conversation is about ``concurrent_sessions / rate_per_s``. A
  conversation has at most ``turns_per_session`` turns; it is replaced by a new one after its
  last turn, or earlier if the next turn would exceed ``max_session_tokens`` (prompt + output).
  Each new conversation picks one of ``num_system_prompts`` system prompts uniformly; its turn 1
  prompt is ``system_prompt_tokens + question`` and turn ``t`` prompt is ``prompt(t-1) +
  output(t-1) + question`` (history growth). ``turns_per_session = 1`` gives independent
  single-turn requests (each still with a session id).
* **Lengths** -- new question tokens per turn and output tokens of every request follow
  *truncated* lognormal distributions (median, sigma; samples outside ``[min, max]`` are redrawn,
  not clipped, so there are no point masses at the bounds; then rounded to integers). Long
  prompts follow a *bounded* Pareto distribution on ``[long_min_tokens, long_max_tokens]`` with
  tail index ``long_pareto_alpha`` (heavy-tailed). Long requests are single-turn, have no
  session (``session_id = -1``) and no shared prefix; their outputs use the short output
  distribution.
* **Prefix hashes** -- one hash per ``hash_block_tokens`` prompt tokens
  (``ceil(prompt / hash_block_tokens)`` hashes, as in Mooncake traces). A hash stands for the
  content of all tokens up to the end of its block: blocks entirely inside the system prompt are
  shared by every conversation using it; blocks inside a conversation's history are shared by
  all its later turns (each turn shares every full block of the previous prompt); a trailing
  partial block and all blocks of long requests are unique. Hashes are non-negative int64 values
  from a fixed 64-bit mixing function (splitmix64) of (seed, kind, group/session/request id,
  block index) -- never Python's salted ``hash()``.

Provenance: the workload's ``name`` lists the seed and the non-default config fields;
``source_sha256`` is the SHA-256 of the canonical JSON of (generator version, full config, seed);
``notes`` holds the full config.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr, text_number_hint
from kvsched.envs.sim.request import DEFAULT_N, DEFAULT_PRIORITY, N_ALLOWED, N_MAX, PRIORITY_MAX, PRIORITY_MIN, Workload

__all__ = ["ARRIVAL_PROCESSES", "GENERATOR_VERSION", "SLO_CLASSES", "SyntheticConfig", "generate",
           "mixed_traffic_config"]

#: Version tag hashed into ``source_sha256``; bump when the generator's output changes.
GENERATOR_VERSION = "kvsched.envs.workload.synthetic/1"
ARRIVAL_PROCESSES = ("poisson", "bursty")
#: SLO class names of generated workloads (codes 0 and 1).
SLO_CLASSES = ("short", "long")
#: The per-class priority fields; left out of the provenance JSON at their default (0), so the
#: ``source_sha256`` of configs written before they existed is unchanged.
PRIORITY_FIELDS = ("short_priority", "long_priority")
#: Fields left out of the provenance JSON at their default value (the priority fields and
#: ``n_samples``), so the ``source_sha256`` of configs written before they existed is unchanged.
_OMITTED_AT_DEFAULT = {"short_priority": DEFAULT_PRIORITY, "long_priority": DEFAULT_PRIORITY,
                       "n_samples": DEFAULT_N}
#: Hard cap on the expected number of generated requests (memory guard).
MAX_REQUESTS = 20_000_000
_MIN_ACCEPT = 1e-3  # truncated distributions must keep at least this probability mass


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of :func:`generate` (validated at construction; see the module docstring).

    Attributes:
        rate_per_s: mean request rate (requests/s, > 0), long and short together.
        duration_s: generate arrivals in ``(0, duration_s)`` seconds; or
        num_requests: generate exactly this many requests. Give exactly one of the two.
        arrival: ``"poisson"`` or ``"bursty"`` (Gamma inter-arrivals).
        burstiness_cv: coefficient of variation of inter-arrival times, ``> 1``; required for
            ``"bursty"``, must be ``None`` for ``"poisson"``.
        prompt_median_tokens, prompt_sigma, prompt_min_tokens, prompt_max_tokens: truncated
            lognormal of the *new* prompt tokens of each short turn (the question; the system
            prompt and history are added on top).
        output_median_tokens, output_sigma, output_min_tokens, output_max_tokens: truncated
            lognormal of output tokens (all requests).
        long_fraction: probability in ``[0, 1)`` that a request is long-context.
        long_min_tokens, long_max_tokens, long_pareto_alpha: bounded Pareto of long prompts.
        system_prompt_tokens: tokens of the shared system prompt (>= 0; 0 = none).
        num_system_prompts: number of distinct system prompts (groups), >= 1.
        concurrent_sessions: conversations open at once (>= 1).
        turns_per_session: maximum turns per conversation (>= 1; 1 = single-turn).
        max_session_tokens: a conversation ends before a turn whose prompt + output would exceed
            this; must be >= system_prompt_tokens + prompt_max_tokens + output_max_tokens.
        hash_block_tokens: tokens per prefix hash, a positive multiple of 16 (default 16).
        short_priority, long_priority: scheduling priority of every request of SLO class
            ``"short"`` / ``"long"``, an integer in ``[PRIORITY_MIN, PRIORITY_MAX]``; lower is
            served earlier by vLLM's priority scheduler. Default 0 (vLLM's default priority).
        n_samples: parallel samples of every request (vLLM's ``SamplingParams.n``), an integer in
            ``[1, N_MAX]``; default 1 (vLLM's default). Each request is then served as
            ``n_samples`` child sequences sharing its prompt (:meth:`Request.children`).

    Raises:
        ConfigError: any field out of range (naming the field, the value and what is allowed).
    """

    rate_per_s: float
    duration_s: float | None = None
    num_requests: int | None = None
    arrival: str = "poisson"
    burstiness_cv: float | None = None
    prompt_median_tokens: float = 256.0
    prompt_sigma: float = 1.0
    prompt_min_tokens: int = 1
    prompt_max_tokens: int = 4096
    output_median_tokens: float = 128.0
    output_sigma: float = 0.8
    output_min_tokens: int = 1
    output_max_tokens: int = 1024
    long_fraction: float = 0.0
    long_min_tokens: int = 16384
    long_max_tokens: int = 131072
    long_pareto_alpha: float = 1.2
    system_prompt_tokens: int = 0
    num_system_prompts: int = 1
    concurrent_sessions: int = 64
    turns_per_session: int = 1
    max_session_tokens: int = 32768
    hash_block_tokens: int = 16
    short_priority: int = DEFAULT_PRIORITY
    long_priority: int = DEFAULT_PRIORITY
    n_samples: int = DEFAULT_N

    def __post_init__(self) -> None:
        # checked in field order; the first violation raises
        self._check_volume()
        self._check_arrival_process()
        for kind in ("prompt", "output"):
            self._check_lognormal(kind)
        self._check_long_requests()
        self._check_conversations()
        for name in PRIORITY_FIELDS:
            self._need(_is_int(getattr(self, name)) and PRIORITY_MIN <= getattr(self, name) <= PRIORITY_MAX, name,
                       f"an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (scheduling priority of the class; lower "
                       "is served earlier)")
        self._need(_is_int(self.n_samples) and 1 <= self.n_samples <= N_MAX, "n_samples", N_ALLOWED)
        self._canonicalize()

    def _need(self, ok: bool, field: str, allowed: str) -> None:
        """Raise ConfigError naming ``field``, its value (bounded repr) and ``allowed`` unless ``ok``."""
        if not ok:
            value = getattr(self, field)
            raise ConfigError(f"SyntheticConfig.{field}={bounded_repr(value)} is not "
                              f"allowed: expected {allowed}{text_number_hint(value)}")

    def _check_volume(self) -> None:
        """``rate_per_s`` (requests/s) and exactly one of ``duration_s`` (s) / ``num_requests``,
        with at most :data:`MAX_REQUESTS` requests expected.

        Raises:
            ConfigError: a value out of range, or both / neither of the two stop conditions.
        """
        need = self._need
        need(_is_num(self.rate_per_s) and self.rate_per_s > 0, "rate_per_s",
             "a finite number > 0 (requests per second)")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ConfigError(f"SyntheticConfig: give exactly one of duration_s and num_requests "
                              f"(duration_s={bounded_repr(self.duration_s)}, "
                              f"num_requests={bounded_repr(self.num_requests)})")
        if self.duration_s is not None:
            need(_is_num(self.duration_s) and self.duration_s > 0, "duration_s",
                 "a finite number of seconds > 0")
            need(self.rate_per_s * self.duration_s <= MAX_REQUESTS, "duration_s",
                 f"rate_per_s * duration_s <= {MAX_REQUESTS:,} expected requests")
        if self.num_requests is not None:
            need(_is_int(self.num_requests) and 1 <= self.num_requests <= MAX_REQUESTS,
                 "num_requests", f"an integer in [1, {MAX_REQUESTS:,}]")

    def _check_arrival_process(self) -> None:
        """``arrival`` in :data:`ARRIVAL_PROCESSES`; ``burstiness_cv`` in (1, 100] for
        ``"bursty"``, ``None`` for ``"poisson"``.

        Raises:
            ConfigError: either field out of range.
        """
        self._need(self.arrival in ARRIVAL_PROCESSES, "arrival", f"one of {list(ARRIVAL_PROCESSES)}")
        if self.arrival == "bursty":
            self._need(self.burstiness_cv is not None and _is_num(self.burstiness_cv)
                       and 1 < self.burstiness_cv <= 100, "burstiness_cv",
                       "a number in (1, 100] (coefficient of variation of inter-arrival times) for "
                       "arrival='bursty'")
        else:
            self._need(self.burstiness_cv is None, "burstiness_cv",
                       "None for arrival='poisson' (it only applies to arrival='bursty')")

    def _check_lognormal(self, kind: str) -> None:
        """The truncated lognormal of ``kind`` (``"prompt"`` or ``"output"``) tokens: median > 0,
        sigma >= 0, integer bounds ``1 <= min <= max`` holding at least :data:`_MIN_ACCEPT` of the
        distribution's mass (else rejection sampling would stall).

        Raises:
            ConfigError: a field out of range (median, sigma, min, max in that order), or too
                little mass inside the bounds (the message gives the mass).
        """
        med, sig = f"{kind}_median_tokens", f"{kind}_sigma"
        lo, hi = f"{kind}_min_tokens", f"{kind}_max_tokens"
        need = self._need
        need(_is_num(getattr(self, med)) and getattr(self, med) > 0, med, "a number > 0")
        need(_is_num(getattr(self, sig)) and getattr(self, sig) >= 0, sig,
             "a number >= 0 (lognormal sigma)")
        need(_is_int(getattr(self, lo)) and getattr(self, lo) >= 1, lo, "an integer >= 1")
        need(_is_int(getattr(self, hi)) and getattr(self, hi) >= getattr(self, lo), hi,
             f"an integer >= {lo}={getattr(self, lo)}")
        mass = _lognormal_mass(getattr(self, med), getattr(self, sig), getattr(self, lo),
                               getattr(self, hi))
        if mass < _MIN_ACCEPT:
            raise ConfigError(
                f"SyntheticConfig: the lognormal({med}={getattr(self, med)}, "
                f"{sig}={getattr(self, sig)}) puts only {mass:.2e} of its mass in "
                f"[{lo}={getattr(self, lo)}, {hi}={getattr(self, hi)}]; expected >= "
                f"{_MIN_ACCEPT:g} (move the median inside the bounds or widen them)")

    def _check_long_requests(self) -> None:
        """``long_fraction`` in [0, 1) and the bounded Pareto of long prompts: integer tokens
        ``1 <= long_min_tokens <= long_max_tokens``, tail index ``long_pareto_alpha > 0``.

        Raises:
            ConfigError: a field out of range (in that order).
        """
        need = self._need
        need(_is_num(self.long_fraction) and 0 <= self.long_fraction < 1, "long_fraction",
             "a number in [0, 1)")
        need(_is_int(self.long_min_tokens) and self.long_min_tokens >= 1, "long_min_tokens",
             "an integer >= 1")
        need(_is_int(self.long_max_tokens) and self.long_max_tokens >= self.long_min_tokens,
             "long_max_tokens", f"an integer >= long_min_tokens={self.long_min_tokens}")
        need(_is_num(self.long_pareto_alpha) and self.long_pareto_alpha > 0, "long_pareto_alpha",
             "a number > 0 (Pareto tail index; smaller = heavier tail)")

    def _check_conversations(self) -> None:
        """System prompts (tokens >= 0, count >= 1), open conversations and turns (>= 1), the
        conversation token cap (a first turn always fits) and ``hash_block_tokens`` (a positive
        multiple of the 16-token KV block).

        Raises:
            ConfigError: a field out of range (in that order).
        """
        need = self._need
        need(_is_int(self.system_prompt_tokens) and self.system_prompt_tokens >= 0,
             "system_prompt_tokens", "an integer >= 0")
        need(_is_int(self.num_system_prompts) and self.num_system_prompts >= 1,
             "num_system_prompts", "an integer >= 1")
        need(_is_int(self.concurrent_sessions) and self.concurrent_sessions >= 1,
             "concurrent_sessions", "an integer >= 1")
        need(_is_int(self.turns_per_session) and self.turns_per_session >= 1,
             "turns_per_session", "an integer >= 1")
        first_turn_max = self.system_prompt_tokens + self.prompt_max_tokens + self.output_max_tokens
        need(_is_int(self.max_session_tokens) and self.max_session_tokens >= first_turn_max,
             "max_session_tokens",
             f"an integer >= system_prompt_tokens + prompt_max_tokens + output_max_tokens = "
             f"{first_turn_max} (so that a first turn always fits)")
        need(_is_int(self.hash_block_tokens) and self.hash_block_tokens >= 16
             and self.hash_block_tokens % 16 == 0, "hash_block_tokens",
             "a positive multiple of 16 (tokens per prefix hash; KV blocks are 16 tokens)")

    def _canonicalize(self) -> None:
        """Store every numeric field as a plain ``float`` or ``int`` (by its annotation), so equal
        configs hash equally and NumPy scalars serialize to JSON; ``None`` and strings are kept."""
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or isinstance(v, str):
                continue
            object.__setattr__(self, f.name, float(v) if f.type.startswith("float") else int(v))

    def non_default_fields(self) -> dict[str, Any]:
        """Fields whose value differs from the default (required fields always included)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.default is MISSING or v != f.default:  # required or changed
                out[f.name] = v
        return out


def _lognormal_mass(median: float, sigma: float, lo: float, hi: float) -> float:
    """Probability that lognormal(ln median, sigma) lies in [lo, hi]."""
    if sigma == 0:
        return 1.0 if lo <= median <= hi else 0.0
    mu = math.log(median)
    return _phi((math.log(hi) - mu) / sigma) - _phi((math.log(lo) - mu) / sigma)


# =============================================================================================
# Sampling
# =============================================================================================
def _trunc_lognormal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int,
                     hi: int) -> np.ndarray:
    """``n`` integer samples of lognormal(ln median, sigma) truncated to [lo, hi] (rejection)."""
    out = np.empty(n, dtype=np.float64)
    todo = np.arange(n)
    mu = math.log(median)
    for _ in range(100_000):
        if not len(todo):
            break
        x = np.exp(mu + sigma * rng.standard_normal(len(todo)))
        ok = (x >= lo) & (x <= hi)
        out[todo[ok]] = x[ok]
        todo = todo[~ok]
    else:  # pragma: no cover - excluded by the mass check in SyntheticConfig
        raise ConfigError(f"truncated lognormal(median={median}, sigma={sigma}) on [{lo}, {hi}] "
                          "rejected too many samples")
    return np.clip(np.rint(out), lo, hi).astype(np.int64)


def _bounded_pareto(rng: np.random.Generator, n: int, lo: int, hi: int, alpha: float
                    ) -> np.ndarray:
    """``n`` integer samples of a Pareto(alpha) bounded to [lo, hi] (inverse CDF)."""
    u = rng.random(n)
    if hi == lo:
        return np.full(n, lo, dtype=np.int64)
    x = lo * (1.0 - u * (1.0 - (lo / hi) ** alpha)) ** (-1.0 / alpha)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _gaps(cfg: SyntheticConfig, rng: np.random.Generator, k: int) -> np.ndarray:
    if cfg.arrival == "poisson":
        return rng.exponential(1.0 / cfg.rate_per_s, k)
    assert cfg.burstiness_cv is not None  # SyntheticConfig requires it for gamma arrivals
    shape = 1.0 / cfg.burstiness_cv ** 2
    return rng.gamma(shape, 1.0 / (cfg.rate_per_s * shape), k)


def _arrivals(cfg: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    if cfg.num_requests is not None:
        return np.cumsum(_gaps(cfg, rng, cfg.num_requests))
    duration_s = cfg.duration_s
    assert duration_s is not None  # SyntheticConfig requires num_requests or duration_s
    m = cfg.rate_per_s * duration_s
    cv = cfg.burstiness_cv or 1.0
    chunk = int(m + 6.0 * cv * math.sqrt(m) + 64)
    parts, t = [], 0.0
    while t < duration_s:
        c = t + np.cumsum(_gaps(cfg, rng, chunk))
        parts.append(c)
        t = float(c[-1])
    arr = np.concatenate(parts)
    return arr[arr < duration_s]


# =============================================================================================
# Hashing
# =============================================================================================
_M64 = (1 << 64) - 1
_TAG_SYS, _TAG_SESSION, _TAG_PARTIAL, _TAG_LONG = 1, 2, 3, 4


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix(seed: int, tag: int, ids: np.ndarray) -> np.ndarray:
    """Deterministic uint64 hash of (seed, tag, id) per element of ``ids`` (small arrays)."""
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(len(ids), seed & _M64, dtype=np.uint64))
        h = _splitmix64(h ^ np.uint64(tag))
        return _splitmix64(h ^ np.asarray(ids, dtype=np.int64).view(np.uint64))


def _prefix_hashes(seed: int, prompt: np.ndarray, is_long: np.ndarray, session: np.ndarray,
                   group: np.ndarray, block: int, sys_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Hash offsets (n+1) and non-negative int64 hashes, ``ceil(prompt/block)`` per request.

    Block ``j`` of request ``i`` hashes ``splitmix64(base ^ j * K)`` where ``base`` identifies
    the content the block belongs to: the system prompt of ``group[i]`` (blocks ``j <
    sys_blocks`` of short requests), the conversation ``session[i]`` (other full blocks of short
    requests), the request itself (full blocks of long requests: tag LONG; a trailing partial
    block of any request: tag PARTIAL). Works in place on two large buffers: fresh large
    allocations (page faults) dominate the cost.
    """
    n = len(prompt)
    nblocks = -(-prompt // block)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nblocks, out=offsets[1:])
    total = int(offsets[-1])
    idx = np.arange(n, dtype=np.int64)
    short = ~is_long
    base_req = np.where(short, _mix(seed, _TAG_SESSION, session), _mix(seed, _TAG_LONG, idx))
    h = np.repeat(base_req, nblocks)  # buffer 1: per-block base
    if sys_blocks:
        rows = np.flatnonzero(short)  # short prompts are > system prompt, so these blocks exist
        pos = (np.repeat(offsets[rows], sys_blocks)
               + np.tile(np.arange(sys_blocks, dtype=np.int64), len(rows)))
        h[pos] = np.repeat(_mix(seed, _TAG_SYS, group[rows]), sys_blocks)
    part = np.flatnonzero(prompt % block)
    h[offsets[part + 1] - 1] = _mix(seed, _TAG_PARTIAL, part)
    j = np.ones(total, dtype=np.int64)  # buffer 2: block index within its request
    j[offsets[1:-1]] = 1 - nblocks[:-1]
    j[0] = 0
    np.cumsum(j, out=j)
    ju = j.view(np.uint64)
    with np.errstate(over="ignore"):
        np.multiply(ju, np.uint64(0xD6E8FEB86659FD93), out=ju)
        np.bitwise_xor(h, ju, out=h)
        # splitmix64 finalizer in place, using ju as scratch
        np.add(h, np.uint64(0x9E3779B97F4A7C15), out=h)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(h, np.uint64(shift), out=ju)
            np.bitwise_xor(h, ju, out=h)
            np.multiply(h, np.uint64(mult), out=h)
        np.right_shift(h, np.uint64(31), out=ju)
        np.bitwise_xor(h, ju, out=h)
    np.right_shift(h, np.uint64(1), out=h)  # non-negative as int64
    return offsets, h.view(np.int64)


# =============================================================================================
# Generation
# =============================================================================================
def _provenance(cfg: SyntheticConfig, seed: int) -> tuple[str, str, str]:
    config = asdict(cfg)
    for name, default in _OMITTED_AT_DEFAULT.items():  # see _OMITTED_AT_DEFAULT
        if config[name] == default:
            del config[name]
    full = json.dumps({"generator": GENERATOR_VERSION, "config": config, "seed": seed},
                      sort_keys=True)
    sha = hashlib.sha256(full.encode()).hexdigest()
    parts = ", ".join(f"{k}={v}" for k, v in cfg.non_default_fields().items())
    return f"synthetic(seed={seed}, {parts})", sha, full


class _Draws(NamedTuple):
    """The per-request random draws of :func:`generate`, each of shape ``(n,)``.

    Attributes:
        is_long: bool, the request is long-context.
        question: int64 new prompt tokens of a short turn (truncated lognormal).
        output: int64 output tokens (truncated lognormal).
        long_len: int64 prompt tokens of a long request (bounded Pareto).
        slot_of: int64 conversation slot a short request goes to, in ``[0, concurrent_sessions)``.
        group_of_new: int64 system prompt a conversation started by this request uses, in
            ``[0, num_system_prompts)``.
    """

    is_long: np.ndarray
    question: np.ndarray
    output: np.ndarray
    long_len: np.ndarray
    slot_of: np.ndarray
    group_of_new: np.ndarray


def _draw_requests(c: SyntheticConfig, rng: np.random.Generator, n: int) -> _Draws:
    """Draw every per-request random array for ``n`` requests, in a fixed order (each array is
    drawn for every request, used or not, so one field's value never shifts another's draws)."""
    is_long = rng.random(n) < c.long_fraction
    question = _trunc_lognormal(rng, n, c.prompt_median_tokens, c.prompt_sigma,
                                c.prompt_min_tokens, c.prompt_max_tokens)
    output = _trunc_lognormal(rng, n, c.output_median_tokens, c.output_sigma,
                              c.output_min_tokens, c.output_max_tokens)
    long_len = _bounded_pareto(rng, n, c.long_min_tokens, c.long_max_tokens, c.long_pareto_alpha)
    slot_of = rng.integers(0, c.concurrent_sessions, n)
    group_of_new = rng.integers(0, c.num_system_prompts, n)
    return _Draws(is_long, question, output, long_len, slot_of, group_of_new)


def _conversations(c: SyntheticConfig, d: _Draws) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Assign short requests to conversations and grow their prompts (sequential: each turn
    extends its conversation's history; see the module docstring).

    A slot opens a new conversation (next id, system prompt ``d.group_of_new[i]``, history
    ``system_prompt_tokens``) when it has none, has had ``turns_per_session`` turns, or the turn
    would exceed ``max_session_tokens``. A turn's prompt is the history + its question; the
    history then becomes that prompt + the turn's output.

    Returns:
        ``(prompt, session, group, n_conversations)``: int64 arrays of shape ``(n,)`` -- prompt
        tokens (``d.long_len`` for long requests), conversation id and system-prompt group (-1
        for long requests) -- and the number of conversations opened.
    """
    S, T, M = c.system_prompt_tokens, c.turns_per_session, c.max_session_tokens
    k_slots = c.concurrent_sessions
    slot_uid, slot_turns = [-1] * k_slots, [0] * k_slots
    slot_len, slot_group = [0] * k_slots, [0] * k_slots
    n = len(d.is_long)
    prompt_l = d.long_len.tolist()
    session_l = [-1] * n
    group_l = [-1] * n
    q_l, o_l, long_l = d.question.tolist(), d.output.tolist(), d.is_long.tolist()
    slots_l, newgrp_l = d.slot_of.tolist(), d.group_of_new.tolist()
    next_uid = 0
    for i in range(n):
        if long_l[i]:
            continue
        k = slots_l[i]
        q, o = q_l[i], o_l[i]
        if slot_uid[k] < 0 or slot_turns[k] >= T or slot_len[k] + q + o > M:
            slot_uid[k], slot_turns[k], slot_len[k] = next_uid, 0, S
            slot_group[k] = newgrp_l[i]
            next_uid += 1
        p = slot_len[k] + q
        prompt_l[i] = p
        slot_len[k] = p + o
        slot_turns[k] += 1
        session_l[i] = slot_uid[k]
        group_l[i] = slot_group[k]
    return (np.asarray(prompt_l, dtype=np.int64), np.asarray(session_l, dtype=np.int64),
            np.asarray(group_l, dtype=np.int64), next_uid)


def generate(config: SyntheticConfig, seed: int = 0) -> Workload:
    """Generate a workload from ``config`` with ``numpy.random.default_rng(seed)``.

    Args:
        config: a validated :class:`SyntheticConfig`.
        seed: integer >= 0. The same (config, seed) gives identical columns.

    Returns:
        A :class:`Workload` sorted by arrival (seconds); ``request_id`` 0..n-1 in arrival order;
        ``slo_class`` codes into ``("short", "long")``; ``priority`` ``config.short_priority`` /
        ``config.long_priority`` by class; ``session_id`` = conversation id for
        short requests, -1 for long ones; prefix hashes with ``config.hash_block_tokens`` tokens
        each (``ceil(prompt / hash_block_tokens)`` per request).

    Raises:
        ConfigError: ``config`` is not a SyntheticConfig, ``seed`` is not an integer >= 0, or the
            duration is so short that no request arrives.
    """
    if not isinstance(config, SyntheticConfig):
        raise ConfigError(f"config={bounded_repr(config)} is not allowed: expected a SyntheticConfig")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed={bounded_repr(seed)} is not allowed: expected an integer >= 0")
    seed = int(seed)
    c = config
    rng = np.random.default_rng(seed)
    arrival = _arrivals(c, rng)
    n = len(arrival)
    if n == 0:
        raise ConfigError(f"SyntheticConfig: no request arrived within duration_s={c.duration_s} at"
                          f" rate_per_s={c.rate_per_s}; lengthen duration_s or raise the rate")
    d = _draw_requests(c, rng, n)
    prompt, session, group, n_conversations = _conversations(c, d)
    # prefix hashes (vectorized): see the module docstring for what is shared
    offsets, hashes = _prefix_hashes(seed, prompt, d.is_long, session, group,
                                     c.hash_block_tokens, c.system_prompt_tokens // c.hash_block_tokens)

    name, sha, full_json = _provenance(c, seed)
    n_long = int(d.is_long.sum())
    notes = (
        f"synthetic workload: {n} requests ({n_long} long-context), {n_conversations} conversations, "
        f"{c.arrival} arrivals at {c.rate_per_s:g} req/s, seed {seed}",
        f"synthetic config: {full_json}",
    )
    return Workload(
        name=name, request_id=np.arange(n, dtype=np.int64), arrival_s=arrival.astype(np.float64),
        prompt_tokens=prompt, output_tokens=d.output, session_id=session,
        slo_class=d.is_long.astype(np.int16), hash_offsets=offsets, hashes=hashes,
        hash_block_tokens=c.hash_block_tokens, slo_class_names=SLO_CLASSES, source_sha256=sha, notes=notes,
        priority=np.where(d.is_long, c.long_priority, c.short_priority).astype(np.int64),
        n=np.full(n, c.n_samples, dtype=np.int64))


_UNSET: Any = object()


def mixed_traffic_config(rate_per_s: float = 5.0, duration_s: float | None = _UNSET,
                         long_fraction: float = 0.03, **overrides: Any) -> SyntheticConfig:
    """Short interactive multi-turn chat plus a small fraction of long-context requests.

    Defaults: Poisson arrivals; 4 system prompts of 512 tokens; 64 open conversations of up to 4
    turns; questions lognormal(median 200, sigma 1.0) on [8, 4096]; outputs lognormal(median
    150, sigma 0.8) on [8, 1024] (roughly the Azure 2023 conversation trace); ``long_fraction``
    of requests with bounded-Pareto(alpha 1.1) prompts on [16384, 131072] tokens.
    ``duration_s`` defaults to 600 s unless ``num_requests`` is given. Any
    :class:`SyntheticConfig` field can be overridden by keyword (e.g. ``num_requests=20000``, or
    ``arrival="bursty", burstiness_cv=3``).

    Raises:
        ConfigError: as :class:`SyntheticConfig` (including unknown keyword names).
    """
    if duration_s is _UNSET:
        duration_s = None if overrides.get("num_requests") is not None else 600.0
    params: dict[str, Any] = dict(
        rate_per_s=rate_per_s, duration_s=duration_s, long_fraction=long_fraction,
        arrival="poisson", prompt_median_tokens=200.0, prompt_sigma=1.0, prompt_min_tokens=8,
        prompt_max_tokens=4096, output_median_tokens=150.0, output_sigma=0.8,
        output_min_tokens=8, output_max_tokens=1024, long_min_tokens=16384,
        long_max_tokens=131072, long_pareto_alpha=1.1, system_prompt_tokens=512,
        num_system_prompts=4, concurrent_sessions=64, turns_per_session=4,
        max_session_tokens=16384, hash_block_tokens=16)
    allowed = {f.name for f in fields(SyntheticConfig)}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ConfigError(f"mixed_traffic_config: unknown field(s) {unknown}; allowed: "
                          f"{sorted(allowed)}")
    params.update(overrides)
    return SyntheticConfig(**params)
