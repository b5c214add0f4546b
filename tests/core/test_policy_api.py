"""The protocols the core calls (envs/sim/policy_api.py): policies and routers are injected and
checked structurally; the core runs with a policy that derives from nothing of kvsched's."""

from __future__ import annotations

import dataclasses

import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.policy_api import PolicyContext, Router, SchedulerPolicy, check_router
from kvsched.envs.sim.routing import RoundRobinPlacement
from kvsched.policies.base import make_policy
from kvsched.policies.routing import make_router
from simkit import assert_identical, build_workload, make_spec


class Minimal:
    """vLLM V1's decisions written against the protocol only (no kvsched base class)."""

    name = "minimal"
    params = None
    order_is_static = True
    stall_free = False
    chunked_prefill = None
    uses_pnm = False

    def __init__(self) -> None:
        self.bound: list[PolicyContext] = []
        self.finished = 0

    def bind(self, ctx):
        self.bound.append(ctx)

    def token_budget(self, default):
        return default

    def order_waiting(self, table):
        return None

    def order_prefills(self, table):
        return None

    def choose_preemption(self, table, costs_s, default_mode):
        return len(table) - 1, default_mode

    def choose_admission_preemption(self, *args):
        return None

    def chunk_limit(self, *args):
        return None

    def choose_migrations(self, *args):
        return None

    def migration_free_steps(self, ctx_tokens, hbm_available_blocks, *args):
        return len(hbm_available_blocks)

    def on_request_finished(self, *args):
        self.finished += 1


def test_reference_policies_and_routers_satisfy_the_protocols():
    assert isinstance(make_policy("fcfs"), SchedulerPolicy) and isinstance(Minimal(), SchedulerPolicy)
    assert isinstance(make_router("least-loaded"), Router) and isinstance(RoundRobinPlacement(), Router)
    assert not isinstance(object(), SchedulerPolicy) and not isinstance(object(), Router)


def test_a_structural_policy_runs_the_core_exactly_as_the_fcfs_base_policy():
    rows = [(0.01 * i, 100 + 37 * i, 20 + 5 * i, i % 3) for i in range(12)]
    w = build_workload(rows)
    spec = make_spec(hbm_kv_blocks=60, max_num_batched_tokens=256)
    pols = []

    def minimal():
        pols.append(Minimal())
        return pols[-1]

    mine = Cluster([spec], minimal, options=InstanceOptions(check_invariants=True)).run(w)
    ref = Cluster([spec], lambda: make_policy("fcfs")).run(w)
    assert mine.stats["preemptions"] > 0  # the preemption decision was asked
    assert_identical(mine, ref)
    ctx = pols[0].bound[0]
    assert len(pols[0].bound) == 1 and ctx.spec is spec and ctx.instance_id == 0 and ctx.cost is not None
    assert pols[0].finished == len(w)


def test_policy_context_is_frozen():
    ctx = PolicyContext(spec=None, cost=None)
    assert ctx.instance_id == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.instance_id = 1  # type: ignore[misc]


@pytest.mark.parametrize("router", [object(), "round-robin", type("OnlyRoute", (), {"route": lambda s, t: 0})()])
def test_check_router_refuses_objects_without_bind_and_route(router):
    with pytest.raises(ConfigError, match="expected an object with bind"):
        check_router(router)
    check_router(RoundRobinPlacement())
