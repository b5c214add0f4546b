"""Shared pieces of the Gymnasium adapters: the bundled default scenario, building a cluster
for an episode, the reference policy."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from kvsched.envs.episodes import EpisodeConfig, EpisodeSource
from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError, require
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.policies.base import make_policy

DEFAULT_SCENARIO = "experiments/scenarios/mixed-long-short.yaml"


def default_scenario_path() -> str:
    """The bundled mixed long/short scenario (installed with the package)."""
    from importlib.resources import files

    return str(files("kvsched.experiments") / "scenarios" / "mixed-long-short.yaml")


def build_cluster(source: EpisodeSource, policy_for: Callable[[int], object], n_instances: int | None = None,
                  seed: int | None = None, observer=None, spec=None) -> Cluster:
    """A cluster for one episode of ``source``'s scenario (its router, router parameters and
    delay, shared KV tier); ``policy_for(i)`` builds instance i's policy; ``observer`` is told of
    its events (:mod:`kvsched.envs.sim.observer`; the environments' ``timeline`` option);
    ``spec`` replaces the scenario's instance spec (an environment's override)."""
    sc = source.scenario
    n = sc.n_instances if n_instances is None else n_instances
    layout = sc.cluster_layout()  # prefill/decode roles (kvsched.envs.sim.disagg), or None
    if layout is not None and (n != sc.n_instances or spec is not None):
        raise ConfigError(f"scenario {sc.source} sets cluster roles ({sc.n_instances} instances): an environment "
                          f"cannot override its instance count (n_instances={n}) or instance spec")
    spec = sc.instance_spec() if spec is None else spec
    counter = iter(range(n))
    from kvsched.policies.routing import make_router

    roles: dict = {}
    if layout is not None:
        roles = {"disagg": layout.disagg_spec(),
                 "prefill_router": make_router(layout.prefill_router, dict(layout.prefill_router_params))}
    return Cluster([spec] * n if layout is None else sc.instance_specs(), lambda: policy_for(next(counter)),
                   metrics=sc.metrics_config(),
                   router=make_router(sc.router, dict(sc.router_params)), router_delay_s=sc.router_delay_s,
                   shared_kv=sc.shared_kv_spec(), seed=sc.seed if seed is None else seed,
                   options=InstanceOptions(oracle_lengths=sc.oracle_lengths), observer=observer, **roles)


class EpisodeTimelines:
    """The environments' ``timeline`` option: each episode's schedule as a Chrome/Perfetto trace
    (:class:`kvsched.runner.timeline.TimelineWriter`; docs/timeline.md).

    Args:
        template: ``None`` (no timeline) or a file name containing ``{episode}``, replaced by the
            episode's number (0, 1, ... per environment object; format specs allowed, e.g.
            ``"runs/tl/episode-{episode:04d}.json.gz"``); ``.json`` or ``.json.gz``.

    An episode's file is written when it ends (terminated or truncated); an episode left unfinished
    (``reset`` or ``close`` first) is written as far as it ran, with ``otherData.complete`` false.

    Raises:
        ConfigError: a template that is not text, has no ``{episode}`` field, does not format, or
            does not end in ``.json`` / ``.json.gz``.
    """

    def __init__(self, template) -> None:
        self.template = None if template is None else self._check(template)
        self.episodes = 0
        self._writer = None

    @staticmethod
    def _check(template) -> str:
        from kvsched.runner.timeline import timeline_path

        require(isinstance(template, (str, os.PathLike)) and "{episode" in str(template), "timeline", template,
                "None or a file name with an {episode} field, e.g. 'runs/tl/episode-{episode:04d}.json.gz'")
        text = str(template)
        try:
            name = text.format(episode=0)
        except (ValueError, KeyError, IndexError, AttributeError):
            require(False, "timeline", template, "a file name whose only field is {episode} (an integer; e.g. "
                    "{episode:04d}); double the braces of a literal { or }")
        timeline_path(name, "timeline")
        return text

    def begin(self, source: EpisodeSource, n_instances: int, episode: dict):
        """The writer of a new episode (the previous one, if unfinished, is written first), or
        None without a template."""
        self.end(None)
        if self.template is None:
            return None
        from kvsched.runner.timeline import TimelineWriter, instance_labels

        sc = source.scenario
        meta = {"scenario": sc.name, "episode": self.episodes, "window": dict(episode), "complete": True}
        path = self.template.format(episode=self.episodes)
        self.episodes += 1
        writer = TimelineWriter(path, instance_labels(n_instances, sc.instance_spec()), None, meta)
        writer.open()
        self._writer = writer
        return writer

    def end(self, cluster: Cluster | None) -> None:
        """Write the episode's file (its request events from ``cluster``'s records so far)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            if cluster is None or not cluster.done:
                writer.metadata["complete"] = False
            if cluster is not None:
                writer.add_records(cluster.recorder.records_frame())
        except BaseException:
            writer.abort()
            raise
        writer.close()


def queued_prefill_tokens(inst) -> int:
    """Prompt tokens ``inst`` still has to compute: its waiting requests' (prompt plus any
    generated tokens a recompute must redo) and its running partial prefills' rest
    (:func:`kvsched.envs.observation.is_partial_prefill`, inlined)."""
    q = 0
    for s in inst.waiting:
        q += s.prompt_tokens + s.generated - s.computed
    for s in inst.running:
        c = s.prompt_tokens + s.generated - s.computed
        if c > (1 if s.generated > 0 else 0):
            q += c
    return q


def check_steppable(env) -> None:
    """Raise ``RuntimeError`` unless ``env`` (any kvsched environment) has an episode to step."""
    if env.cluster is None:
        raise RuntimeError("call reset() before step()")
    if env._over:
        raise RuntimeError("the episode is over: call reset()")


def unfinished(cluster: Cluster) -> list:
    """Every instance's waiting, running and swapped-out requests (in that order, instance by
    instance): the requests a reward may still charge as certain misses."""
    return [st for inst in cluster.instances for q in (inst.waiting, inst.running, inst.swapped) for st in q]


def step_info(env, time_s: float, extra: dict) -> dict:
    """The ``info`` dict every kvsched environment returns: action mask, simulated time (s),
    decisions so far, the episode's window, plus ``extra`` (after a step: ``reward_components``
    and ``elapsed_s``, the simulated seconds from the decision the step acted on to the next one
    or the episode's end, which a semi-MDP learner discounts by: :mod:`kvsched.agents.semi_mdp`)."""
    return {"action_mask": env.action_masks(), "time_s": time_s, "decisions": env.decisions,
            "window": dict(env.episode), **extra}


def reference(name: str, params: dict | None, source: EpisodeSource):
    """The named policy with ``params`` (default: the scenario's parameters when it names the
    same policy)."""
    sc = source.scenario
    if params is None and make_policy(name).name == sc.policy:  # registered names ("LARS" is "lars")
        params = sc.policy_params
    return make_policy(name, dict(params or {}))


def episode_config(scenario: str | None, window_s: float, split: str, heldout_fraction: float,
                   max_requests: int | None) -> EpisodeConfig:
    return EpisodeConfig(scenario=scenario or default_scenario_path(), window_s=window_s, split=split,
                         heldout_fraction=heldout_fraction, max_requests=max_requests)


def integer_action(action, n_parts: int, allowed: str) -> list[int]:
    """The entries of a discrete action as Python ints, for any array-like that holds exactly
    ``n_parts`` whole numbers (integer or bool arrays, Python ints, floats with no fractional
    part; any shape, flattened).

    Raises:
        ConfigError: naming ``action``, its value and ``allowed`` when it is not numeric, has
            another number of entries, or an entry is not a whole number (1.7 is refused, not
            truncated to 1; NaN and infinities too). Range checks are the caller's.
    """
    try:
        a = np.asarray(action)
        ok = a.size == n_parts and a.dtype.kind in "biuf"
    except (TypeError, ValueError):
        ok = False
    if ok and a.dtype.kind == "f":  # whole numbers within int64 (1e30 would not cast)
        ok = bool(np.all(np.isfinite(a)) and np.all(a == np.floor(a)) and np.all(np.abs(a) < 2.0**63))
    require(ok, "action", action, allowed)
    return a.astype(np.int64).reshape(-1).tolist()
