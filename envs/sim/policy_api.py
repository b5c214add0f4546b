"""The protocol the simulator core calls: scheduler policies and cluster routers are injected.

The core (:mod:`kvsched.envs.sim`) never imports a policy. An :class:`~.instance.Instance` is
given a policy object and a :class:`~.cluster.Cluster` a factory of them and a router object;
they only need the methods and attributes below (:class:`typing.Protocol`, checked structurally).
:class:`kvsched.policies.base.SchedulerPolicy` implements :class:`SchedulerPolicy` with vLLM's
defaults and every reference policy derives from it; :class:`kvsched.policies.routing.Router`
implements :class:`Router`.

What a policy reads is a :class:`~.features.FeatureTable` (never the hidden output length
unless the scenario shows oracle lengths), plus the served system's spec and cost model, handed
over once by :meth:`SchedulerPolicy.bind` as a :class:`PolicyContext`. The decisions, each at
the point of vLLM's ``Scheduler.schedule`` (REFERENCE §4.1) where it applies:

1. ``order_waiting(table)``: admission order of waiting requests (``None``: queue order, FCFS).
2. ``choose_preemption(table, costs_s, default_mode)``: victim row and mode when KV allocation
   fails (vLLM V1: the most recently admitted request, by recompute).
3. ``token_budget(default)``: tokens per step (``max_num_batched_tokens``).
4. ``stall_free`` and ``order_prefills(table)``: Sarathi-Serve's decodes-first batching with
   one order over running partial prefills and waiting requests.
5. ``chunk_limit(...)``: a cap on one prefill's chunk given the batch so far (adaptive chunking).
6. ``chunked_prefill``: ``False`` runs every prefill whole (non-preemptive baselines).
7. ``on_request_finished(...)``: feedback when a request completes.
8. ``choose_migrations`` / ``migration_free_steps`` (with ``uses_pnm`` and a PNM tier):
   processing-near-memory migrations (REFERENCE §3.2).
9. ``choose_admission_preemption(...)`` (``params.admission_preemption`` not ``"never"``): may
   the blocked head of the admission order preempt a running request.
10. ``choose_head_preemption(running, head, cause, costs_s, default_mode)`` (optional: only a
    policy whose ``preempts_for_head`` attribute is true needs it): which running request the
    head of the admission order, blocked for a seat (``max_num_seqs``, cause ``"seats"``) or for
    KV blocks (``"blocks"``), preempts, or ``None``; asked again after each preemption while the
    head stays blocked (the mechanism of vLLM V0's ``_schedule_priority_preemption``; V1 has none).

``order_is_static`` declares that the admission order cannot change while the batch is
unchanged; only then does the simulator fast-forward past a blocked waiting queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - type names only
    from .features import FeatureTable
    from .routing import RouterTable


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know about the system it schedules (handed over by ``bind``).

    Attributes:
        spec: the instance's :class:`~kvsched.envs.sim.instance_spec.InstanceSpec`.
        cost: its :class:`~kvsched.envs.sim.cost_model.CostModel` (for predicted prefill
            times, T-hat in Medha's LARS).
        instance_id: index of the instance in its cluster.
    """

    spec: Any
    cost: Any
    instance_id: int = 0


@runtime_checkable
class SchedulerPolicy(Protocol):
    """What an instance calls on its policy (see the module docstring for each decision).

    ``params`` may carry the options every policy takes (``PolicyParams`` fields the core reads
    with vLLM-like defaults when absent): ``tier_aware_preemption``, ``prefetch``,
    ``admit_while_swapped`` and ``admit_in_preemption_step`` (bool), ``admission_preemption``
    ("never", "always", "cost-gated").
    Optional too: ``preempts_for_head`` (bool, default false) and, when true,
    ``choose_head_preemption`` (decision 10 of the module docstring).
    """

    name: str
    params: Any
    order_is_static: bool
    stall_free: bool
    chunked_prefill: bool | None
    uses_pnm: bool

    def bind(self, ctx: PolicyContext) -> None:
        """Called once by the instance before the first decision."""

    def token_budget(self, default: int) -> int:
        """Tokens per step; ``default`` is the spec's ``max_num_batched_tokens``."""

    def order_waiting(self, table: FeatureTable) -> np.ndarray | None:
        """Admission order over ``table`` rows (waiting requests), or ``None`` for queue order."""

    def order_prefills(self, table: FeatureTable) -> np.ndarray | None:
        """With ``stall_free``: order over prefill candidates (``table.running`` marks partial ones)."""

    def choose_preemption(self, table: FeatureTable, costs_s: dict[str, np.ndarray],
                          default_mode: str) -> tuple[int, str]:
        """Victim row of ``table`` (running, admission order) and preemption mode (a key of
        ``costs_s``, the seconds each mode would cost each row)."""

    def choose_admission_preemption(self, running: FeatureTable, eligible: np.ndarray, freed_blocks: np.ndarray,
                                    waiting: FeatureTable, waiting_blocks: np.ndarray, available_blocks: int,
                                    seats: int, costs_s: dict[str, np.ndarray],
                                    default_mode: str) -> tuple[int, str] | None:
        """Victim row and mode to make room for the blocked head of ``waiting``, or ``None``."""

    def chunk_limit(self, prompt_tokens: int, computed_tokens: int, batch_tokens: int,
                    batch_attn_pairs: float, batch_kv_tokens: int) -> int | None:
        """Largest chunk for one prefill this step (``None``: no policy limit)."""

    def choose_migrations(self, table: FeatureTable, hbm_available_blocks: int, hbm_capacity_blocks: int,
                          pnm_available_blocks: int) -> np.ndarray | None:
        """Rows of ``table`` (GPU-resident decodes) to migrate to the PNM tier now, in order."""

    def migration_free_steps(self, ctx_tokens: np.ndarray, hbm_available_blocks: np.ndarray,
                             pnm_available_blocks: int, hbm_capacity_blocks: int, block_size_tokens: int) -> int:
        """How many of the next identical decode steps would migrate nobody (a lower bound)."""

    def on_request_finished(self, now_s: float, arrival_s: float, first_token_s: float,
                            prompt_tokens: int, generated_tokens: int) -> None:
        """Feedback when a request completes (times in s)."""


@runtime_checkable
class Router(Protocol):
    """What a cluster calls on its router.

    ``bind(n_instances, seed)`` once before the first request; ``route(table) -> row`` per
    arriving request (a row of the :class:`~kvsched.envs.sim.routing.RouterTable`). A router whose
    choice depends only on how many requests it routed may also expose
    ``arrivals_until(index, n_instances)`` (arrivals still to come before the one it sends to
    ``index``), which lets an instance fast-forward to its own next arrival.
    """

    def bind(self, n_instances: int, seed: int = 0) -> None:
        """Called once by the cluster before the first request."""

    def route(self, table: RouterTable) -> int:
        """Row of the instance that gets the arriving request."""


def check_router(router: object) -> None:
    """Raise :class:`~kvsched.envs.sim.errors.ConfigError` unless ``router`` has ``bind`` and ``route``."""
    from .errors import ConfigError, bounded_repr

    if not callable(getattr(router, "route", None)) or not callable(getattr(router, "bind", None)):
        raise ConfigError(f"router={bounded_repr(router)} is not allowed: expected an object with "
                          "bind(n_instances, seed) and route(table) -> row (e.g. "
                          "kvsched.policies.routing.make_router('least-loaded'))")
