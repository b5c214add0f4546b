"""The inference-perf ``shared_prefix`` workload family at ``constant`` load, as a generator.

kubernetes-sigs/inference-perf (Apache-2.0) is the client behind the real vLLM runs in
``shared/groundtruth`` (``profile.yaml`` of every experiment). Its ``shared_prefix`` data
generator (``inference_perf/datagen/shared_prefix_datagen.py``) and ``constant`` load type are
modelled here; nothing is copied from it. Lengths are in tokens, times in seconds.

**Users and groups.** ``num_groups`` system prompts (``num_unique_system_prompts``) of
``system_prompt_len`` random tokens each; ``users_per_group`` users per system prompt
(``num_users_per_system_prompt``), ``U = num_groups · users_per_group`` users in all. Each user
owns one question of ``question_len`` random tokens. inference-perf shuffles the user sessions
(which carry the system prompts) but not the questions, so which user slot gets which group is a
random permutation; we draw it from the seeded generator.

**Requests.** Request ``i`` (0-based, over all stages) goes to user ``i mod U`` (inference-perf
``load_lazy_data``: ``user_id = data_index % len(user_sessions)``) and decodes exactly
``output_len`` tokens (``max_tokens = output_len`` with ``ignore_eos``). Its prompt depends on
``history``:

- ``"fixed"``: the user's system prompt followed by its question, the same text every turn. This
  is what the measured runs show: with ``enable_multi_turn_chat: true`` the reported
  ``successes.prompt_len`` stays within ``system_prompt_len + question_len`` (x ~1.05 for
  re-tokenisation, below) for every request of a run, e.g. 559-592 tokens for the Llama-2-7B
  "general" run (100 + 447 nominal) over 16,800 requests and 20 minutes, never the > 1,000
  tokens a second turn with history would have. Every turn after the first therefore hits the
  prefix cache on all full blocks of its prompt.
- ``"append"``: the multi-turn chat the inference-perf source describes (``LocalUserSession``:
  the next turn's context is the previous prompt + response): turn ``t`` of a user sends
  ``prompt(t-1) + output_len + question``. When that would exceed ``max_context_tokens``
  (prompt + output), the user starts a new conversation from its system prompt (inference-perf
  itself would send it and get an HTTP 400 from vLLM; a new conversation is the closest request
  that vLLM accepts).

**Re-tokenisation.** inference-perf builds prompts by decoding random token ids to text; vLLM
re-encodes the text, which gives a few percent more tokens. ``prompt_scale`` multiplies the
nominal lengths (system prompt per group, question per user) and ``prompt_jitter`` adds a normal
term of standard deviation ``prompt_jitter · sqrt(nominal)`` tokens (per group / per user:
re-tokenisation noise grows like the square root of the text length). Both are 1.0 / 0.0 unless
the caller knows the tokenizer (see ``kvsched.experiments.groundtruth`` for measured values).

**Arrivals.** ``constant`` load: stage ``k`` sends ``round(rate_k · duration_k)`` requests at a
fixed interval ``1 / rate_k`` starting at the stage start ``Σ_{j<k} duration_j`` (inference-perf
``LoadType.CONSTANT``, not Poisson; groundtruth README "Replaying", step 2). The measured
``load_summary.schedule_delay`` (p99 <= 2 ms) shows the client kept to that schedule.

**Prefix hashes** (``hash_block_tokens`` tokens each, default the 16-token KV block): a block
entirely inside the system prompt hashes (group, block index) and is shared by the group's users;
other full blocks hash (conversation, block index) and are shared by every later turn of that
conversation; a trailing partial block is unique per request (vLLM hashes full blocks only).
Values come from splitmix64 of the seed and ids, never Python's salted ``hash()``.

All randomness comes from one ``numpy.random.default_rng(seed)``; the same config and seed give
identical columns.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.request import Workload

__all__ = ["GENERATOR_VERSION", "HISTORY_MODES", "LoadStage", "SharedPrefixConfig", "generate",
           "stage_of"]

GENERATOR_VERSION = "kvsched.envs.workload.inference_perf/1"
"""Version tag hashed into ``Workload.source_sha256``; bump when the output changes."""

HISTORY_MODES = ("fixed", "append")
PREFIX_SHARING = ("system+user", "system", "none")
MAX_REQUESTS = 5_000_000
"""Memory guard on the number of generated requests."""

_M64 = (1 << 64) - 1
_TAG_SYS, _TAG_CONV, _TAG_PARTIAL = 11, 12, 13


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


@dataclass(frozen=True)
class LoadStage:
    """One ``constant`` load stage of inference-perf (``load.stages[k]``).

    Attributes:
        rate_per_s: requests per second (> 0), sent at a fixed interval ``1 / rate_per_s``.
        duration_s: stage length in seconds (> 0).

    Raises:
        ConfigError: a non-positive or non-finite value, or fewer than one request in the stage.
    """

    rate_per_s: float
    duration_s: float

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "duration_s"):
            v = getattr(self, name)
            if not (_is_num(v) and v > 0):
                raise ConfigError(f"LoadStage.{name}={bounded_repr(v)} is not allowed: expected a finite number > 0")
            object.__setattr__(self, name, float(v))
        if self.n_requests < 1:
            raise ConfigError(f"LoadStage(rate_per_s={self.rate_per_s}, duration_s={self.duration_s}) "
                              "sends no request: expected rate_per_s * duration_s >= 0.5")

    @property
    def n_requests(self) -> int:
        """Requests the stage sends: ``round(rate_per_s · duration_s)`` (inference-perf count)."""
        return int(round(self.rate_per_s * self.duration_s))


@dataclass(frozen=True)
class SharedPrefixConfig:
    """inference-perf ``data.shared_prefix`` + ``load`` (see the module docstring).

    Attributes:
        num_groups: distinct system prompts (``num_unique_system_prompts``), >= 1.
        users_per_group: users per system prompt (``num_users_per_system_prompt``), >= 1.
        system_prompt_len: nominal system-prompt tokens, >= 0.
        question_len: nominal question tokens per user, >= 1.
        output_len: tokens every request decodes (``output_len``, ``ignore_eos``), >= 1.
        stages: one or more :class:`LoadStage` (or ``(rate, duration)`` pairs / dicts with
            ``rate`` and ``duration``), run back to back.
        history: ``"fixed"`` (default, as measured) or ``"append"``.
        prompt_scale: re-tokenisation factor on nominal lengths, in [0.5, 2] (default 1.0).
        prompt_jitter: re-tokenisation noise, standard deviation per sqrt(nominal token), in
            [0, 5] (default 0.0).
        max_context_tokens: ``"append"`` only: longest prompt + output of a turn before the
            conversation restarts (default 4096, the ``max_model_len`` of the GT runs). Must fit
            a first turn.
        hash_block_tokens: tokens per prefix hash, a positive multiple of 16 (default 16).

    Raises:
        ConfigError: any field out of range (naming the field, the value and what is allowed).
    """

    num_groups: int
    users_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    stages: tuple
    history: str = "fixed"
    prompt_scale: float = 1.0
    prompt_jitter: float = 0.0
    max_context_tokens: int = 4096
    hash_block_tokens: int = 16
    prefix_sharing: str = "system+user"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"SharedPrefixConfig.{name}={bounded_repr(getattr(self, name))} is not allowed: "
                                  f"expected {allowed}")

        need(_is_int(self.num_groups) and self.num_groups >= 1, "num_groups", "an integer >= 1")
        need(_is_int(self.users_per_group) and self.users_per_group >= 1, "users_per_group", "an integer >= 1")
        need(_is_int(self.system_prompt_len) and self.system_prompt_len >= 0, "system_prompt_len",
             "an integer >= 0 (tokens)")
        need(_is_int(self.question_len) and self.question_len >= 1, "question_len", "an integer >= 1 (tokens)")
        need(_is_int(self.output_len) and self.output_len >= 1, "output_len", "an integer >= 1 (tokens)")
        need(self.history in HISTORY_MODES, "history", f"one of {list(HISTORY_MODES)}")
        need(self.prefix_sharing in PREFIX_SHARING, "prefix_sharing", f"one of {list(PREFIX_SHARING)}")
        need(_is_num(self.prompt_scale) and 0.5 <= self.prompt_scale <= 2.0, "prompt_scale",
             "a number in [0.5, 2] (re-tokenisation factor)")
        need(_is_num(self.prompt_jitter) and 0.0 <= self.prompt_jitter <= 5.0, "prompt_jitter",
             "a number in [0, 5] (tokens of standard deviation per sqrt(nominal token))")
        need(_is_int(self.hash_block_tokens) and self.hash_block_tokens >= 16
             and self.hash_block_tokens % 16 == 0, "hash_block_tokens",
             "a positive multiple of 16 (KV blocks are 16 tokens)")
        first = self.system_prompt_len + self.question_len + self.output_len
        need(_is_int(self.max_context_tokens) and self.max_context_tokens >= first, "max_context_tokens",
             f"an integer >= system_prompt_len + question_len + output_len = {first}")
        stages = self.stages
        if isinstance(stages, (LoadStage, dict)) or not isinstance(stages, (list, tuple)) or not stages:
            raise ConfigError(f"SharedPrefixConfig.stages={bounded_repr(stages)} is not allowed: expected a non-empty "
                              "list of LoadStage, (rate, duration) pairs or {rate, duration} mappings")
        built = []
        for k, s in enumerate(stages):
            if isinstance(s, LoadStage):
                built.append(s)
            elif isinstance(s, dict) and set(s) == {"rate", "duration"}:
                built.append(LoadStage(s["rate"], s["duration"]))
            elif isinstance(s, (list, tuple)) and len(s) == 2:
                built.append(LoadStage(s[0], s[1]))
            else:
                raise ConfigError(f"SharedPrefixConfig.stages[{k}]={bounded_repr(s)} is not allowed: expected a "
                                  "LoadStage, a (rate, duration) pair or a {rate, duration} mapping")
        object.__setattr__(self, "stages", tuple(built))
        for name in ("num_groups", "users_per_group", "system_prompt_len", "question_len", "output_len",
                     "max_context_tokens", "hash_block_tokens"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "prompt_scale", float(self.prompt_scale))
        object.__setattr__(self, "prompt_jitter", float(self.prompt_jitter))
        if self.num_requests > MAX_REQUESTS:
            raise ConfigError(f"SharedPrefixConfig.stages send {self.num_requests:,} requests; at most "
                              f"{MAX_REQUESTS:,} are allowed")

    @property
    def num_users(self) -> int:
        """Users in all: ``num_groups · users_per_group``."""
        return self.num_groups * self.users_per_group

    @property
    def num_requests(self) -> int:
        """Requests over all stages (Σ ``stage.n_requests``)."""
        return sum(s.n_requests for s in self.stages)

    @property
    def stage_starts_s(self) -> tuple[float, ...]:
        """Start time of each stage, seconds (cumulative durations)."""
        out, t = [], 0.0
        for s in self.stages:
            out.append(t)
            t += s.duration_s
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (stages as ``{rate, duration}``), for provenance and hashing."""
        d = asdict(self)
        d["stages"] = [{"rate": s.rate_per_s, "duration": s.duration_s} for s in self.stages]
        return d


# =============================================================================================
def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _block_hashes(seed: int, tag: int, ids: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Non-negative int64 hash of (seed, tag, id, block index) per element."""
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(len(ids), seed & _M64, dtype=np.uint64) ^ np.uint64(tag))
        h = _splitmix64(h ^ np.asarray(ids, dtype=np.int64).view(np.uint64))
        h = _splitmix64(h ^ (np.asarray(blocks, dtype=np.int64).view(np.uint64) * np.uint64(0xD6E8FEB86659FD93)))
    return (h >> np.uint64(1)).view(np.int64)


def _arrivals(cfg: SharedPrefixConfig) -> np.ndarray:
    parts = []
    for start, s in zip(cfg.stage_starts_s, cfg.stages):
        parts.append(start + np.arange(s.n_requests, dtype=np.float64) / s.rate_per_s)
    return np.concatenate(parts)


def stage_of(config: SharedPrefixConfig, arrival_s: np.ndarray) -> np.ndarray:
    """Index of the load stage each arrival time (s) falls in (int64; the last stage is open-ended)."""
    starts = np.asarray(config.stage_starts_s[1:], dtype=np.float64)
    return np.searchsorted(starts, np.asarray(arrival_s, dtype=np.float64), side="right").astype(np.int64)


def _prompt_parts(c: SharedPrefixConfig, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each user's group and the re-tokenised system-prompt and question lengths (tokens).

    Drawn in a fixed order from ``rng``: the user -> group permutation, then the noise of the
    system prompts (per group), then of the questions (per user). A length is
    ``rint(nominal · prompt_scale + prompt_jitter · sqrt(nominal) · N(0, 1))``, floored at 0
    (system prompt; all 0 when ``system_prompt_len`` is 0) or 1 (question).

    Returns:
        ``(group_of_user, sys_len, q_len)``: int64 arrays of shapes ``(num_users,)``,
        ``(num_groups,)`` and ``(num_users,)``.
    """
    group_of_user = rng.permutation(np.repeat(np.arange(c.num_groups), c.users_per_group))
    sys_noise = rng.standard_normal(c.num_groups)
    q_noise = rng.standard_normal(c.num_users)
    sys_len = np.rint(c.system_prompt_len * c.prompt_scale
                      + c.prompt_jitter * math.sqrt(c.system_prompt_len) * sys_noise).astype(np.int64)
    sys_len = np.maximum(sys_len, 0) if c.system_prompt_len else np.zeros(c.num_groups, np.int64)
    q_len = np.rint(c.question_len * c.prompt_scale
                    + c.prompt_jitter * math.sqrt(c.question_len) * q_noise).astype(np.int64)
    q_len = np.maximum(q_len, 1)
    return group_of_user, sys_len, q_len


def _append_history(c: SharedPrefixConfig, fixed_prompt: np.ndarray, q_len: np.ndarray,
                    user: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prompts and conversations of ``history="append"`` (sequential over requests).

    A user's turn sends its previous prompt + ``output_len`` + its question; a user's first turn,
    or a turn whose prompt + ``output_len`` would exceed ``max_context_tokens``, starts a new
    conversation (next id) from the user's fixed prompt (system prompt + question).

    Args:
        fixed_prompt: int64 tokens of each request's first-turn prompt, shape ``(n,)``.
        q_len: int64 question tokens per user, shape ``(num_users,)``.
        user: int64 user of each request, shape ``(n,)``.

    Returns:
        ``(prompt, conversation)``: int64 prompt tokens and conversation ids, shape ``(n,)``.
    """
    n = len(fixed_prompt)
    prompt = np.empty(n, dtype=np.int64)
    conversation = np.empty(n, dtype=np.int64)
    cur_len = [0] * c.num_users   # prompt + output of the user's last turn (0: no conversation)
    cur_conv = [-1] * c.num_users
    next_conv = 0
    fp, ql, us = fixed_prompt.tolist(), q_len.tolist(), user.tolist()
    out, cap = c.output_len, c.max_context_tokens
    for i in range(n):
        u = us[i]
        p = cur_len[u] + ql[u] if cur_conv[u] >= 0 else fp[i]
        if cur_conv[u] < 0 or p + out > cap:
            p = fp[i]
            cur_conv[u] = next_conv
            next_conv += 1
        prompt[i] = p
        conversation[i] = cur_conv[u]
        cur_len[u] = p + out
    return prompt, conversation


def _prefix_hashes(c: SharedPrefixConfig, seed: int, prompt: np.ndarray, sys_tokens: np.ndarray,
                   group: np.ndarray, conversation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefix hashes, one per ``hash_block_tokens`` prompt tokens (``ceil(prompt / block)`` per
    request; see the module docstring).

    A block entirely inside the system prompt hashes (seed, group, block index), another block
    (seed, conversation, block index). Blocks that ``prefix_sharing`` does not share
    (``"system"``: those outside the system prompt; ``"none"``: all) and a trailing partial
    block hash (seed, request, block index) instead: unique to the request.

    Args:
        prompt, sys_tokens, group, conversation: int64 per request, shape ``(n,)``: prompt and
            system-prompt tokens, system-prompt group and conversation id.

    Returns:
        ``(offsets, hashes)``: int64 offsets of shape ``(n + 1,)`` and non-negative int64 hashes
        (request ``i`` owns ``hashes[offsets[i]:offsets[i + 1]]``).
    """
    b = c.hash_block_tokens
    n = len(prompt)
    nblocks = -(-prompt // b)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nblocks, out=offsets[1:])
    owner = np.repeat(np.arange(n, dtype=np.int64), nblocks)
    j = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[owner]
    in_sys = (j + 1) * b <= sys_tokens[owner]
    full = (j + 1) * b <= prompt[owner]
    hashes = np.where(in_sys, _block_hashes(seed, _TAG_SYS, group[owner], j),
                      _block_hashes(seed, _TAG_CONV, conversation[owner], j))
    if c.prefix_sharing != "system+user":
        own = ~in_sys if c.prefix_sharing == "system" else np.ones(len(j), dtype=bool)
        hashes[own] = _block_hashes(seed, _TAG_PARTIAL, owner[own], j[own])
    partial = ~full
    if partial.any():
        hashes[partial] = _block_hashes(seed, _TAG_PARTIAL, owner[partial], j[partial])
    return offsets, hashes


def _provenance(c: SharedPrefixConfig, seed: int, prompt: np.ndarray) -> tuple[str, str, tuple[str, str]]:
    """The workload's name, ``source_sha256`` (SHA-256 of the canonical JSON of generator
    version, config and seed) and notes (a summary, then that JSON), from the generated
    ``prompt`` tokens (shape ``(n,)``)."""
    full_json = json.dumps({"generator": GENERATOR_VERSION, "config": c.to_dict(), "seed": seed},
                           sort_keys=True)
    sha = hashlib.sha256(full_json.encode()).hexdigest()
    rates = "/".join(f"{s.rate_per_s:g}" for s in c.stages)
    name = (f"inference-perf shared_prefix({c.num_groups}x{c.users_per_group} users, sys {c.system_prompt_len}"
            f" + q {c.question_len} -> out {c.output_len}, {rates} req/s, history={c.history}, seed={seed})")
    notes = (f"inference-perf shared_prefix workload: {len(prompt)} requests, {c.num_users} users in "
             f"{c.num_groups} groups, {len(c.stages)} constant-rate stage(s), prompt tokens "
             f"{int(prompt.min())}-{int(prompt.max())} (mean {float(prompt.mean()):.1f})",
             f"inference-perf config: {full_json}")
    return name, sha, notes


def generate(config: SharedPrefixConfig, seed: int = 0) -> Workload:
    """Generate the requests of ``config`` (see the module docstring).

    Args:
        config: a validated :class:`SharedPrefixConfig`.
        seed: integer >= 0; seeds ``numpy.random.default_rng`` (group permutation and
            re-tokenisation noise) and the prefix hashes.

    Returns:
        A :class:`Workload` in arrival order: ``request_id`` 0..n-1, ``arrival_s`` (s),
        ``prompt_tokens``, ``output_tokens`` (= ``output_len``), ``session_id`` = the
        conversation id (the user for ``"fixed"``), ``slo_class`` all ``"default"``, prefix hashes
        of ``hash_block_tokens`` tokens.

    Raises:
        ConfigError: ``config`` is not a SharedPrefixConfig or ``seed`` is not an integer >= 0.
    """
    if not isinstance(config, SharedPrefixConfig):
        raise ConfigError(f"config={bounded_repr(config)} is not allowed: expected a SharedPrefixConfig")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed={bounded_repr(seed)} is not allowed: expected an integer >= 0")
    c, seed = config, int(seed)
    group_of_user, sys_len, q_len = _prompt_parts(c, np.random.default_rng(seed))
    arrival = _arrivals(c)
    n = len(arrival)
    user = np.arange(n, dtype=np.int64) % c.num_users
    group = group_of_user[user]
    sys_tokens = sys_len[group]
    fixed_prompt = sys_tokens + q_len[user]
    if c.history == "fixed":
        prompt, conversation = fixed_prompt, user.copy()
    else:
        prompt, conversation = _append_history(c, fixed_prompt, q_len, user)
    offsets, hashes = _prefix_hashes(c, seed, prompt, sys_tokens, group, conversation)
    name, sha, notes = _provenance(c, seed, prompt)
    return Workload(
        name=name, request_id=np.arange(n, dtype=np.int64), arrival_s=arrival,
        prompt_tokens=prompt.astype(np.int64), output_tokens=np.full(n, c.output_len, dtype=np.int64),
        session_id=conversation.astype(np.int64), slo_class=np.zeros(n, dtype=np.int16),
        hash_offsets=offsets, hashes=hashes.astype(np.int64), hash_block_tokens=c.hash_block_tokens,
        slo_class_names=("default",), source_sha256=sha, notes=notes)
