"""Evaluating an agent on a task's strata: the same episodes as every baseline.

An agent is a heuristic name (a policy for a scheduling task, a router for a routing task, a
residency heuristic ``lru``, ``lfu``, ``session`` or ``session:<s>`` for a residency task -- not
``clairvoyant``, the task's bound; with its defaults; run in the simulator), ``random`` (the
uniform random agent over the masked actions, on the task's reference; seeded per episode), or a
checkpoint ``.zip`` written by ``kvsched train`` (Stable-Baselines3 / sb3-contrib; its metadata
``<stem>.json`` or ``train.json`` beside it names the environment it was trained on, which must be
the task's, with the same observation and action spaces). Learned agents act deterministically,
with their action masks when they are maskable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from kvsched.envs.sim.errors import ConfigError, bounded_repr, require, MAX_PATH_CHARS

from .episodes import Episode, episode_indices
from .runs import episode_seed, make_env, model_actor, random_actor, run_env, run_heuristic, score
from .tasks import BenchTask


def stratum_episodes(task_result: Mapping[str, Any], stratum: str, limit: int | None = None) -> list[Episode]:
    """The episodes of ``stratum`` of a task's results (the first ``limit`` when given)."""
    keys = task_result["strata"][stratum]
    if limit is not None:
        keys = keys[:limit]
    return [Episode(*(int(x) for x in k.split(":"))) for k in keys]


def _reference(task_result: Mapping[str, Any]) -> tuple[str, dict]:
    tuning = task_result["tuning"]
    ref = tuning["reference"]
    return ref, dict(tuning[ref]["params"])


def task_training(suite: str, task_id: str, results_folder: Path | None = None) -> tuple[str, dict[str, Any]]:
    """``(env_id, env keyword arguments)`` an agent of a task trains with (``kvsched train --task``):
    the task record's environment and window, its scenario, and (Scheduling-v0) the tuned best
    heuristic of the suite's results as the reference policy, so that action 0 is the tuned
    heuristic. ``split`` is left out: training sets it ("train"); the leaderboard serves held-out.

    Raises:
        ConfigError: an unknown suite or task, or results that do not hold the task (computed
            with ``kvsched leaderboard --compute``).
    """
    from .results import load_results
    from .tasks import get_task

    task = get_task(suite, task_id)
    results = load_results(suite, results_folder)
    if task_id not in results["tasks"]:
        raise ConfigError(f"the {suite} results hold no task {bounded_repr(task_id)} (they hold: "
                          f"{', '.join(results['tasks']) or 'none'}); compute it with kvsched leaderboard "
                          f"--suite {suite} --tasks {task_id} --compute --out DIR")
    ref, params = _reference(results["tasks"][task_id])
    kw = task.env_kwargs_for("train", ref, params)
    kw.pop("split")
    return task.env_id, kw


def task_headroom(suite: str, task_id: str, results_folder: Path | None = None) -> float | None:
    """The task's mean headroom on its hard stratum (hindsight bound - tuned best heuristic, SLO
    attainment, held-out episodes of the suite's results): the denominator of the normalised
    bench score. None when it is not positive (nothing to close) or undefined.

    Raises:
        ConfigError: as :func:`task_training`.
    """
    from .results import load_results, reference_label, stratum_bound, stratum_scores
    from .stats import headroom

    task_training(suite, task_id, results_folder)  # the same checks (suite, task, results)
    tr = load_results(suite, results_folder)["tasks"][task_id]
    h, _, _ = headroom(stratum_scores(tr, "hard", reference_label(tr)), stratum_bound(tr, "hard"))
    return h if h == h and h > 0 else None


def checkpoint_meta(path: Path) -> dict:
    """The metadata of a ``kvsched train`` checkpoint (``<stem>.json`` or ``train.json`` beside it).

    Raises:
        ConfigError: a missing checkpoint, or metadata missing, unreadable or without its
            ``env_id`` and ``algo``.
    """
    from kvsched.agents.evaluate import _sidecar

    if not path.is_file():
        raise ConfigError(f"checkpoint {bounded_repr(str(path), MAX_PATH_CHARS)} does not exist")
    try:
        meta = _sidecar(path, check=False)  # checked below, for the keys a task needs
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {bounded_repr(str(path), MAX_PATH_CHARS)}: its metadata is not readable JSON "
                          f"({bounded_repr(str(e))})") from None
    require(isinstance(meta, dict) and isinstance(meta.get("env_id"), str) and isinstance(meta.get("algo"), str),
            f"metadata of checkpoint {bounded_repr(str(path), MAX_PATH_CHARS)}", meta if not isinstance(meta, dict) else
            {k: meta.get(k) for k in ("env_id", "algo")}, "an object naming its env_id and algo (written by "
            "`kvsched train`)")
    return meta


def load_checkpoint(path: Path, meta: dict | None = None, trust: bool = False) -> tuple[Any, dict]:
    """The model of a ``kvsched train`` checkpoint and its metadata (:func:`checkpoint_meta`).
    Loading unpickles it: it must be one kvsched wrote or shipped unless ``trust``
    (:func:`kvsched.agents.trust.check`).

    Raises:
        ConfigError: a missing file, missing or bad metadata, a checkpoint kvsched did not write
            (without ``trust``), or a file the algorithm cannot load.
    """
    import zipfile

    from kvsched.agents import trust as trusted
    from kvsched.agents.evaluate import _load_model

    meta = checkpoint_meta(path) if meta is None else meta
    trusted.check(path, trust)
    try:
        return _load_model(path, meta), meta
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, EOFError, RuntimeError, zipfile.BadZipFile) as e:
        raise ConfigError(f"checkpoint {bounded_repr(str(path), MAX_PATH_CHARS)}: "
                          f"not a loadable {bounded_repr(meta['algo'])} "
                          f"checkpoint ({bounded_repr(str(e))})") from None


def evaluate_agent(task: BenchTask, task_result: Mapping[str, Any], agent: str, limit: int | None = None,
                   progress: Callable[[str], None] | None = None,
                   trust: bool = False, on_episode: Callable[[], None] | None = None
                   ) -> dict[str, list[float | None]]:
    """Per-stratum per-episode scores of ``agent`` on ``task`` (see the module docstring);
    ``trust``: load a checkpoint kvsched did not write (:func:`load_checkpoint`). ``progress``
    gets the notes on a checkpoint trained otherwise than the task; ``on_episode`` is called after
    each episode (a command's progress count).

    Raises:
        ConfigError: an unknown agent, a checkpoint of another environment or other spaces, or
            results computed for another definition of the task.
    """
    import json

    from .compute import task_record

    stored = task_result.get("task")
    if stored is not None and json.loads(json.dumps(stored)) != json.loads(json.dumps(task_record(task))):
        raise ConfigError(f"the results of {task.name} were computed for another definition of the task "
                          f"({bounded_repr(stored)}): their baselines and bounds are not this task's; recompute them")
    ref, ref_params = _reference(task_result)
    kind, act_for, env = _agent(task, agent, ref, ref_params, trust)
    if progress and agent.endswith(".zip"):
        for note in checkpoint_mismatches(task, checkpoint_meta(Path(agent)), ref, ref_params):
            progress(f"note: {agent}: {note}")
    index = episode_indices({s: stratum_episodes(task_result, s) for s in task_result["strata"]})
    out: dict[str, list[float | None]] = {}
    for stratum in task_result["strata"]:
        scores: list[float | None] = []
        for ep in stratum_episodes(task_result, stratum, limit):
            if kind == "heuristic":
                scores.append(score(run_heuristic(task, ep, *_heuristic_args(task, agent)).summary))
            else:
                j = index[ep.key()]  # the episode's seed, as the random baseline's
                scores.append(score(run_env(env, ep, act_for(j), seed=episode_seed(j))))
            if on_episode:
                on_episode()
        out[stratum] = scores
    if env is not None:
        env.close()
    return out


def _heuristic_args(task: BenchTask, agent: str) -> tuple[str, dict]:
    """``(heuristic, params)`` of a heuristic agent name (``session:<s>`` is ``session`` with
    ``keep_s``; other names have their defaults)."""
    if task.env_id == "kvsched/Residency-v0":
        from .residency import agent_heuristic

        parsed = agent_heuristic(agent)
        assert parsed is not None  # check_agent refused the others
        return parsed
    return agent, {}


def check_agent(task: BenchTask, agent: str) -> dict | None:
    """Check an agent name for ``task`` without running it (a command evaluating several agents
    checks them all before the first episode); returns a checkpoint's metadata (None otherwise).

    Raises:
        ConfigError: an unknown agent, a missing checkpoint or bad metadata, or a checkpoint of
            another environment.
    """
    from kvsched.policies.base import policy_names
    from kvsched.policies.routing import router_names

    if agent == "random":
        return None
    if agent.endswith(".zip"):
        meta = checkpoint_meta(Path(agent))
        if meta["env_id"] != task.env_id and not _same_task_other_observation(task, meta):  # before loading
            raise ConfigError(f"checkpoint {bounded_repr(agent)} was trained on {bounded_repr(meta['env_id'])}; task "
                              f"{task.name} is {task.env_id}")
        return meta
    if task.env_id == "kvsched/Residency-v0":
        from .residency import BOUND, agent_heuristic, keep_bins

        if agent == BOUND:
            raise ConfigError(f"agent '{BOUND}' is task {task.name}'s bound (it reads the episode's future), not an "
                              "agent; its scores are the bound's")
        parsed = agent_heuristic(agent)
        bins = keep_bins(task)
        if parsed is not None and parsed[1].get("keep_s", bins[0]) in bins:
            return None
        raise ConfigError(f"agent {bounded_repr(agent)} is not a checkpoint (.zip), 'random' or a residency heuristic "
                          f"(lru, lfu, session, or session:<seconds> with seconds one of the keep bins "
                          f"{', '.join(f'{b:g}' for b in bins)})")
    known = router_names() if task.env_id == "kvsched/Routing-v0" else policy_names()
    if agent in known:
        return None
    raise ConfigError(f"agent {bounded_repr(agent)} is not a checkpoint (.zip), 'random' or a "
                      f"{'router' if task.env_id == 'kvsched/Routing-v0' else 'policy'} ({', '.join(known)})")


def _same_task_other_observation(task: BenchTask, meta: Mapping[str, Any]) -> bool:
    """A checkpoint of another observation version of the task's scheduling environment (the
    same decisions, actions and reward; it observes more): evaluated in the task's environment
    with its own observation version."""
    from kvsched.envs import SCHEDULING_IDS

    return task.env_id in SCHEDULING_IDS and meta["env_id"] in SCHEDULING_IDS


def observation_overrides(task: BenchTask, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The environment arguments a checkpoint's observation needs in the task's environment:
    its ``observation_version`` (Scheduling-v1 or ``--env-kwargs``). An output-length signal is
    not carried over: an agent that saw oracle or predicted lengths is another track, and the
    task's environment gives none (the observation then holds 0 there; noted by
    :func:`checkpoint_mismatches`)."""
    if task.env_id != "kvsched/Scheduling-v0":
        return {}
    kw = dict(meta.get("env_kwargs") or {})
    version = kw.get("observation_version", 1 if meta["env_id"] == "kvsched/Scheduling-v1" else 0)
    return {"observation_version": version} if version else {}


def checkpoint_mismatches(task: BenchTask, meta: Mapping[str, Any], ref: str,
                          ref_params: Mapping[str, Any]) -> list[str]:
    """How the environment a checkpoint was trained in (its metadata's ``env_kwargs``) differs
    from the task's, which it is evaluated in: scenario, window, held-out share and, for
    Scheduling-v0, the reference policy and its tuned parameters. Empty when it was trained on
    the task's environment (``split`` aside). Such a checkpoint is still evaluated (a transfer
    experiment is legitimate); the leaderboard notes the differences."""
    import json

    from kvsched.envs.sim.errors import KvschedError
    from kvsched.runner.scenario import bundled_scenario_dir, scenario_path

    def where(x: Any) -> str:
        try:
            return str(scenario_path(x).resolve())
        except KvschedError:
            return str(x)

    trained = dict(meta.get("env_kwargs") or {})
    want = task.env_kwargs_for("heldout", ref if task.env_id == "kvsched/Scheduling-v0" else None, ref_params)
    out = []
    scenario = trained.get("scenario", str(bundled_scenario_dir() / "mixed-long-short.yaml"))
    if where(scenario) != where(want["scenario"]):
        out.append(f"trained on scenario {bounded_repr(scenario)}, the task's is {want['scenario']}")
    for name, default in (("window_s", 60.0), ("heldout_fraction", 0.25)):
        if trained.get(name, default) != want[name]:
            out.append(f"trained with {name}={bounded_repr(trained.get(name, default))}, the task's is {want[name]}")
    for name, value in task.env_kwargs:  # the task's own environment arguments (Residency-v0: its tier order)
        if name in trained and json.dumps(trained[name]) != json.dumps(value):  # a tuple is a list in train.json
            out.append(f"trained with {name}={bounded_repr(trained[name])}, the task's is {bounded_repr(value)}")
    if trained.get("output_signal") is not None:
        out.append(f"trained with output_signal={bounded_repr(trained['output_signal'])} (an oracle or predictor "
                   "track); the task's environment gives no output-length signal")
    if task.env_id == "kvsched/Scheduling-v0":
        got = (trained.get("reference_policy", "fcfs"), dict(trained.get("reference_params") or {}))
        if got != (ref, dict(ref_params)):
            out.append(f"trained on reference {bounded_repr(got[0])} {bounded_repr(got[1])}, the task's is its tuned "
                       f"best heuristic {ref} {dict(ref_params)} (kvsched train --task {task.task_id} trains on it)")
    return out


def _agent(task: BenchTask, agent: str, ref: str, ref_params: dict, trust: bool = False):
    """``(kind, act_for(episode index) -> actor, env)`` of an agent name."""
    meta = check_agent(task, agent)
    if agent == "random":
        return "env", random_actor_for, make_env(task, ref, ref_params)
    if meta is not None:
        model, meta = load_checkpoint(Path(agent), meta, trust)
        # the task's environment, never one the checkpoint picks (but with its observation version)
        env = make_env(task, ref, ref_params, **observation_overrides(task, meta))
        if model.observation_space.shape != env.observation_space.shape or model.action_space != env.action_space:
            env.close()
            raise ConfigError(f"checkpoint {bounded_repr(agent)} observes shape {model.observation_space.shape} and "
                              f"acts in {model.action_space}; task {task.name}'s environment gives "
                              f"{env.observation_space.shape} and {env.action_space}")
        from kvsched.agents.evaluate import MASKED_ALGOS

        masked = meta.get("algo") in MASKED_ALGOS
        return "env", (lambda i: model_actor(model, masked)), env
    return "heuristic", None, None


def random_actor_for(index: int):
    """The random agent of the ``index``-th episode of a stratum."""
    return random_actor(episode_seed(index))
