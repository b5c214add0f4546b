"""A v1 results file for tests: one real task of suite v1 with two of its held-out episodes per
stratum and planted baseline scores (valid for ``load_results``; nothing is computed)."""

from __future__ import annotations

import json
from pathlib import Path

from kvsched.experiments.suite.compute import task_record
from kvsched.experiments.suite.episodes import pool
from kvsched.experiments.suite.results import FORMAT
from kvsched.experiments.suite.tasks import get_task


def planted_results(folder: Path, task_id: str = "overload-burst", params: dict | None = None) -> Path:
    """Write ``folder/v1.json`` holding ``task_id``: tuned reference LARS with ``params``, scores
    0.8 (tuned), 0.6 (fcfs), bound 0.9, isolation 1.0; returns ``folder``."""
    task = get_task("v1", task_id)
    eps = [f"{e.workload_seed}:{e.window_index}" for e in pool(task)[:2]]
    episodes = {k: {"scores": {"lars (tuned)": 0.8, "fcfs (default)": 0.6, "constant reference": 0.8},
                    "bound": {"score": 0.9}, "isolation": 1.0} for k in eps}
    tuning = {"reference": "lars", "lars": {"params": dict(params or {"kappa": 3.0}), "journal": "lars.journal"}}
    data = {"format": FORMAT, "suite": "v1", "provenance": {"command": "planted", "kvsched_version": "test"},
            "tasks": {task_id: {"task": task_record(task), "strata": {"all": eps, "hard": eps[::-1]},
                                "episodes": episodes, "tuning": tuning}}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "v1.json").write_text(json.dumps(data))
    return folder
