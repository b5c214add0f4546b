"""Learned agents shipped with a suite: their checkpoints, the exact commands that trained them,
and their per-episode scores, so the leaderboard shows them beside the baselines.

``experiments/suite/results/<suite>-agents.json`` (format :data:`FORMAT`) holds, per agent label::

    {"checkpoint": "<path relative to the repository>", "training": {<train.json of the run>},
     "evaluated_with": {<provenance: command, versions, commit>},
     "scores": {"<task>": {"<stratum>": [score per episode, in the stratum's order]}}}

It is written by ``kvsched leaderboard --agents CKPT,... --save-agents FILE`` (every episode of
every stratum: no ``--episodes``) and read by ``kvsched leaderboard`` (shown with the label
suffix ``(shipped)``). A test re-evaluates each shipped checkpoint on the first episodes of each
stratum and requires the recorded scores, so a change of the environment that moves them fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from kvsched.envs.sim import strict_json
from kvsched.envs.sim.errors import ConfigError, bounded_repr, MAX_PATH_CHARS

from .results import SHIPPED_SUFFIX, provenance, results_dir, write_json

FORMAT = "kvsched-bench-agents/1"
SUFFIX = SHIPPED_SUFFIX


def shipped_path(suite: str, folder: Path | None = None) -> Path:
    """The shipped-agents file of ``suite`` in ``folder`` (default: the committed results')."""
    return (folder or results_dir()) / f"{suite}-agents.json"


def repository_root() -> Path:
    """The repository (this file resolved is ``<repository>/experiments/suite/shipped.py``):
    shipped checkpoint paths are written relative to it (``agents/checkpoints/...``)."""
    return Path(__file__).resolve().parents[2]


def checkpoint_file(entry: Mapping[str, Any]) -> Path:
    """The checkpoint of a shipped agent: its path read against :func:`repository_root`, the
    folder :func:`save_shipped` wrote it relative to (the checkout, or the installed package
    folder, which holds ``agents/`` too), or as written when absolute. (Read against the
    package folder, a checkpoint saved from the checkout's ``runs/`` was not found.)"""
    p = Path(entry["checkpoint"])
    return p if p.is_absolute() else repository_root() / p


def load_shipped(suite: str, folder: Path | None = None) -> dict[str, Any]:
    """The shipped agents of ``suite`` (``{}`` when there is no file).

    Raises:
        ConfigError: a file that is not readable or not of :data:`FORMAT`.
    """
    p = shipped_path(suite, folder)
    if not p.is_file():
        return {}
    return _read_agents(p)


def _is_score(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def _read_agents(p: Path) -> dict[str, Any]:
    """The ``agents`` of the shipped-agents file ``p``, each with ``scores`` of task -> stratum ->
    list of numbers (None: an episode without a score).

    Raises:
        ConfigError: a file that is not readable or not of :data:`FORMAT`, or bad scores (they
            reached the leaderboard's statistics as a ValueError or TypeError traceback).
    """
    try:
        data = strict_json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: not a readable shipped-agents file "
                          f"({bounded_repr(str(e))})") \
            from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("agents"), dict):
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: not a {FORMAT} file")
    for label, entry in data["agents"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("scores"), dict):
            raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: agent {bounded_repr(label)} has no scores")
        for task, per_stratum in entry["scores"].items():
            ok = isinstance(per_stratum, dict) and all(isinstance(v, list) and all(_is_score(x) for x in v)
                                                       for v in per_stratum.values())
            if not ok:
                raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: agent {bounded_repr(label)}'s scores on "
                                  f"{bounded_repr(task)} are {bounded_repr(per_stratum)}; expected an object of "
                                  "stratum -> list of finite numbers or null")
    return data["agents"]


def shipped_scores(agents: Mapping[str, Any], tasks: list[str], results: Mapping[str, Any] | None = None
                   ) -> dict[str, dict[str, dict[str, list]]]:
    """``label (shipped) -> task -> stratum -> scores`` of the shipped agents, for ``tasks``.

    Raises:
        ConfigError: with ``results`` (the suite's): scores of a stratum the results do not hold,
            or not one per episode of it (a shipped agent is scored on every episode; fewer were
            silently paired on the first ones as if evaluated with ``--episodes``).
    """
    out: dict[str, dict[str, dict[str, list]]] = {}
    for label, entry in agents.items():
        per_task = {t: s for t, s in entry["scores"].items() if t in tasks}
        for t, per_stratum in per_task.items():
            strata = results["tasks"].get(t, {}).get("strata") if results is not None else None
            if strata is None:
                continue
            for stratum, scores in per_stratum.items():
                if stratum not in strata or len(scores) != len(strata[stratum]):
                    raise ConfigError(
                        f"shipped agent {bounded_repr(label)} has {len(scores)} scores on {bounded_repr(t)} "
                        f"{bounded_repr(stratum)}; the results hold "
                        + (f"{len(strata[stratum])} episodes there" if stratum in strata else
                           f"no such stratum (they hold {', '.join(map(str, strata))})")
                        + " (re-save it with kvsched leaderboard --agents CKPT --save-agents FILE)")
        if per_task:
            out[label + SUFFIX] = per_task
    return out


def save_shipped(path: Path, suite: str, evaluated: Mapping[str, Mapping[str, Mapping[str, list]]],
                 checkpoints: Mapping[str, str], command: str) -> dict[str, str]:
    """Add (or replace) the agents of ``evaluated`` (label -> task -> stratum -> scores) in the
    shipped-agents file ``path``, with each checkpoint's path (relative to the repository when
    inside it) and its training metadata (non-finite numbers as strings: :func:`finite_json`).
    An agent whose label (its checkpoint's file name) already names another checkpoint in the
    file is saved under its checkpoint's path instead; the same checkpoint saved again keeps its
    scores on the tasks not evaluated this time.

    Returns:
        label -> checkpoint path, of the agents saved.

    Raises:
        ConfigError: an existing file of another format, or an agent that is not a checkpoint.
    """
    from .agents import checkpoint_meta

    data: dict[str, Any] = {"format": FORMAT, "suite": suite, "agents": {}}
    if path.is_file():  # any existing file must be a shipped-agents one (a results file was overwritten)
        data["agents"] = _read_agents(path)
    root = repository_root()
    saved = {}
    for label, per_task in evaluated.items():
        ckpt = checkpoints[label]
        if not ckpt.endswith(".zip"):
            raise ConfigError(f"--save-agents keeps learned agents (checkpoints); {bounded_repr(ckpt)} is not one")
        p = Path(ckpt).resolve()
        rel = str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
        old = data["agents"].get(label)
        if old is not None and old.get("checkpoint") != rel:
            # another checkpoint of the same file name (runs/a/final.zip, then runs/b/final.zip):
            # keep both, this one under its path
            label = rel
        # the same checkpoint saved again keeps its scores on the tasks not evaluated this time
        kept = dict(old["scores"]) if old is not None and old.get("checkpoint") == rel else {}
        data["agents"][label] = {"checkpoint": rel, "training": finite_json(checkpoint_meta(p)), "evaluated_with":
                                 provenance(command), "scores": {**kept, **{t: dict(s) for t, s in per_task.items()}}}
        saved[label] = rel
    write_json(path, data)
    return saved


def finite_json(x: Any) -> Any:
    """``x`` with every non-finite float written as a string (``"inf"``, ``"-inf"``, ``"nan"``):
    a training run's metadata holds ``horizon_s = inf`` (every ``kvsched train --task`` run), which
    strict JSON cannot hold."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x
