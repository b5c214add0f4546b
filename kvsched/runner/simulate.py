"""A cluster from policy and router names, and :func:`simulate`, the one-call run.

The core's :class:`~kvsched.envs.sim.cluster.Cluster` takes a policy factory and a router object
(the core knows no policy by name); here names are resolved in :mod:`kvsched.policies`
(:func:`~kvsched.policies.base.make_policy`, :func:`~kvsched.policies.routing.make_router`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvsched.envs.sim.cluster import Cluster, SimulationResult
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.instance_spec import InstanceSpec
from kvsched.envs.sim.metrics import MetricsConfig
from kvsched.envs.sim.observer import SimObserver
from kvsched.envs.sim.request import Workload
from kvsched.envs.sim.shared_kv import SharedKVSpec
from kvsched.envs.sim.disagg import DisaggSpec

if TYPE_CHECKING:  # pragma: no cover
    from .scenario import Scenario


def build_cluster(specs: Sequence[InstanceSpec], policy: str = "fcfs", policy_params: Any = None,
                  metrics: MetricsConfig = MetricsConfig(), options: InstanceOptions = InstanceOptions(),
                  router: str | object = "round-robin", router_params: dict | None = None,
                  router_delay_s: float = 0.0, shared_kv: SharedKVSpec | None = None, seed: int = 0,
                  progress: Callable[[int], None] | None = None, observer: SimObserver | None = None,
                  disagg: DisaggSpec | None = None, prefill_router: str = "round-robin",
                  prefill_router_params: dict | None = None) -> Cluster:
    """A :class:`Cluster` of ``specs`` running the named policy, routed by the named router.

    ``policy_params`` (a dict of the policy's parameter fields, or its params dataclass) is
    validated once and each instance gets its own policy object. ``router`` is a router name
    (``router_params`` its parameters) or a router object (then ``router_params`` must be None).
    ``observer`` is told of the run's events (:mod:`kvsched.envs.sim.observer`; e.g. a
    :class:`~kvsched.runner.timeline.TimelineWriter`). ``disagg`` gives the instances prefill /
    decode roles (:mod:`kvsched.envs.sim.disagg`); ``router`` then picks the decode instance and
    ``prefill_router`` (with ``prefill_router_params``) the prefill instance.

    Raises:
        UnknownPresetError: unknown policy or router name.
        ConfigError: invalid spec, policy or router parameters.
    """
    from kvsched.policies.base import make_policy
    from kvsched.policies.routing import make_router

    params = make_policy(policy, policy_params).params  # fail early on an unknown name or field
    if isinstance(router, str):
        router = make_router(router, router_params)
    elif router_params is not None:
        from kvsched.envs.sim.errors import ConfigError

        raise ConfigError("router_params only apply to a router given by name; got a router object")
    prouter = None
    if disagg is not None:
        prouter = make_router(prefill_router, prefill_router_params)
    return Cluster(list(specs), lambda: make_policy(policy, params), metrics=metrics, options=options,
                   progress=progress, router=router, router_delay_s=router_delay_s, shared_kv=shared_kv,
                   seed=seed, observer=observer, disagg=disagg, prefill_router=prouter)


def simulate(workload: Workload, spec: InstanceSpec, policy: str = "fcfs",
             metrics: MetricsConfig = MetricsConfig(), options: InstanceOptions = InstanceOptions(),
             n_instances: int = 1, progress: Callable[[int], None] | None = None,
             policy_params: dict | None = None, router: str | object = "round-robin",
             router_params: dict | None = None, router_delay_s: float = 0.0,
             shared_kv: SharedKVSpec | None = None, seed: int = 0,
             observer: SimObserver | None = None, specs: Sequence[InstanceSpec] | None = None,
             disagg: DisaggSpec | None = None, prefill_router: str = "round-robin",
             prefill_router_params: dict | None = None) -> SimulationResult:
    """Run ``workload`` on ``n_instances`` copies of ``spec`` with the named policy and router.

    Arguments as :func:`build_cluster`; ``n_instances`` >= 1 copies of ``spec``, or ``specs`` (one
    per instance, e.g. a scenario's roles; then ``n_instances`` must equal their number).

    Raises:
        UnknownPresetError: unknown policy or router name.
        ConfigError: invalid spec, policy or router parameters, or request fields.
    """
    if specs is not None and len(specs) != n_instances:
        from kvsched.envs.sim.errors import ConfigError

        raise ConfigError(f"specs holds {len(specs)} instance specs but n_instances={n_instances}")
    cluster = build_cluster(list(specs) if specs is not None else [spec] * n_instances, policy, policy_params,
                            metrics, options, router, router_params, router_delay_s, shared_kv, seed, progress,
                            observer, disagg, prefill_router, prefill_router_params)
    return cluster.run(workload)


def scenario_cluster_kwargs(sc: Scenario) -> dict:
    """The policy, router and shared-tier keyword arguments of :func:`simulate` / :func:`build_cluster`
    that a scenario sets."""
    out = {"policy_params": sc.policy_params, "router": sc.router, "router_params": sc.router_params,
           "router_delay_s": sc.router_delay_s, "shared_kv": sc.shared_kv_spec(), "seed": sc.seed}
    layout = sc.cluster_layout()
    if layout is not None:  # prefill/decode roles: per-role specs, the roles, the prefill side's router
        out.update(specs=sc.instance_specs(), disagg=layout.disagg_spec(), prefill_router=layout.prefill_router,
                   prefill_router_params=dict(layout.prefill_router_params))
    return out
