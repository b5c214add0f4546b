"""The suite's results file and the leaderboard built from it.

``experiments/suite/results/<suite>.json`` is committed: the command and versions that produced
it, and per task its definition, its tuning (best parameters per tuned heuristic, their studies'
journal files beside it in ``results/<suite>/<task>/``), its strata, and per stratum episode
every baseline's score and both bounds (with the hindsight schedule that reached the bound, so it
can be replayed). ``kvsched leaderboard --show`` prints it without recomputing; agents evaluated
later are compared with the stored tuned heuristic and bounds on the same episodes.

Files are written whole or not at all (a temporary file renamed over the target).
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any, Mapping

from kvsched.envs.sim import strict_json
from kvsched.envs.sim.errors import ConfigError, bounded_repr, require, MAX_PATH_CHARS

from .stats import Paired, headroom, paired
from kvsched import atomic_files

FORMAT = "kvsched-bench-results/1"
#: the label suffix of shipped agents' rows (:mod:`.shipped`)
SHIPPED_SUFFIX = " (shipped)"


def results_dir() -> Path:
    """Folder of the committed results (``experiments/suite/results``)."""
    return Path(__file__).resolve().parent / "results"


def results_path(suite: str, folder: Path | None = None) -> Path:
    """The results file of ``suite`` in ``folder`` (default :func:`results_dir`)."""
    return (folder or results_dir()) / f"{suite}.json"


def provenance(command: str) -> dict[str, Any]:
    """The command and the versions that produced a results file."""
    import numpy
    import optuna

    import kvsched
    from kvsched.provenance import git_commit

    out = {"command": command, "kvsched_version": kvsched.__version__, "python": platform.python_version(),
           "numpy": numpy.__version__, "optuna": optuna.__version__, "kvsched_commit": git_commit()}
    try:
        import gymnasium

        out["gymnasium"] = gymnasium.__version__
    except ImportError:  # pragma: no cover - the rl extra is needed to compute
        pass
    return out


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON (sorted keys, indent 1) whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write_text(path, json.dumps(data, sort_keys=True, indent=1, allow_nan=False, default=_plain) + "\n")


def _plain(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def load_results(suite: str, folder: Path | None = None) -> dict[str, Any]:
    """The results of ``suite``.

    Raises:
        ConfigError: no results file, or one of another format.
    """
    p = results_path(suite, folder)
    where = bounded_repr(str(p), MAX_PATH_CHARS)[1:-1]
    try:
        exists = p.is_file()
    except OSError as e:  # a name too long, no permission
        raise ConfigError(f"results {where}: cannot be read ({e.strerror})") from None
    if not exists:
        raise ConfigError(f"no results for suite {bounded_repr(suite)} at {where}; compute them with "
                          f"`kvsched leaderboard --suite {suite} --compute --out DIR` (hours), then read them "
                          f"with --results DIR")
    try:
        data = strict_json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: not a readable results file ({bounded_repr(str(e))[1:-1]})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a {FORMAT} results file")
    check_results(data, where)
    return data


def check_results(data: Mapping[str, Any], where: str) -> None:
    """Refuse a results file (hand-edited, truncated, of another layout) whose leaderboard could not
    be built or would mislead: per task its tuning's reference and parameters, its strata (episode
    keys ``<seed>:<window>``, each in ``episodes``), per episode every baseline's score (the same
    labels everywhere, the reference's among them) and its bounds, the hindsight bound >= every
    baseline.

    Raises:
        ConfigError: naming the file, the field, its value (bounded) and what is allowed.
    """
    def score_ok(x: Any) -> bool:
        return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1)

    def need(ok: bool, field: str, value: Any, allowed: str) -> None:
        require(ok, f"{where}: {field}", value, allowed)

    tasks = data.get("tasks")
    need(isinstance(tasks, dict), "tasks", tasks, "an object of task id -> task results")
    for tid, tr in tasks.items():
        need(isinstance(tr, dict) and all(isinstance(tr.get(k), dict) for k in ("tuning", "strata", "episodes")),
             f"tasks.{tid}", tr, "an object with tuning, strata and episodes objects")
        tuning, eps = tr["tuning"], tr["episodes"]
        ref = tuning.get("reference")
        need(isinstance(ref, str) and isinstance(tuning.get(ref), dict) and isinstance(tuning[ref].get("params"), dict),
             f"tasks.{tid}.tuning.reference", ref, "a heuristic of the tuning with its params")
        labels = None
        for key, ep in eps.items():
            sc = ep.get("scores") if isinstance(ep, dict) else None
            need(isinstance(sc, dict), f"tasks.{tid}.episodes.{key}.scores", sc, "an object of baseline -> score")
            for label, v in sc.items():
                need(score_ok(v), f"tasks.{tid}.episodes.{key}.scores.{label}", v,
                     "an SLO attainment in [0, 1] or null")
            labels = list(sc) if labels is None else labels
            need(list(sc) == labels, f"tasks.{tid}.episodes.{key}.scores", list(sc), f"the baselines {labels}")
            bound = ep.get("bound")
            need(isinstance(bound, dict) and score_ok(bound.get("score")), f"tasks.{tid}.episodes.{key}.bound",
                 bound, "an object with the hindsight bound's score in [0, 1] or null")
            need(score_ok(ep.get("isolation")), f"tasks.{tid}.episodes.{key}.isolation", ep.get("isolation"),
                 "an SLO attainment in [0, 1] or null")
            top = max((v for v in sc.values() if v is not None), default=None)
            need(top is None or (bound["score"] is not None and bound["score"] >= top),
                 f"tasks.{tid}.episodes.{key}.bound.score", bound["score"], f">= every baseline's score ({top})")
        need(labels is not None and reference_label(tr) in labels, f"tasks.{tid}.episodes", labels,
             f"scores of the reference {reference_label(tr)}")
        for name, keys in tr["strata"].items():
            need(isinstance(keys, list) and bool(keys) and all(isinstance(k, str) and k in eps for k in keys)
                 and all(len(k.split(":")) == 2 and all(x.isdigit() for x in k.split(":")) for k in keys)
                 and len(set(keys)) == len(keys), f"tasks.{tid}.strata.{name}", keys,
                 "a list of distinct episode keys <seed>:<window>, each in episodes")


def reference_label(task_result: Mapping[str, Any]) -> str:
    """The baseline label of a task's tuned best heuristic (its reference)."""
    tuning = task_result["tuning"]
    ref = tuning["reference"]
    return f"{ref} (tuned)" if tuning[ref].get("tuned", True) and "journal" in tuning[ref] else f"{ref} (default)"


def stratum_scores(task_result: Mapping[str, Any], stratum: str, label: str) -> list[float | None]:
    """Per-episode scores of baseline ``label`` on ``stratum`` (stratum order)."""
    eps = task_result["episodes"]
    return [eps[k]["scores"].get(label) for k in task_result["strata"][stratum]]


def stratum_bound(task_result: Mapping[str, Any], stratum: str, which: str = "bound") -> list[float | None]:
    """Per-episode hindsight (``"bound"``) or isolation (``"isolation"``) bound on ``stratum``."""
    eps = task_result["episodes"]
    keys = task_result["strata"][stratum]
    if which == "isolation":
        return [eps[k]["isolation"] for k in keys]
    return [eps[k]["bound"]["score"] for k in keys]


def compare(task_result: Mapping[str, Any], stratum: str, agent_scores: list[float | None]) -> Paired:
    """An agent's per-episode scores on ``stratum`` against the task's tuned heuristic and bound."""
    label = reference_label(task_result)
    return paired(agent_scores, stratum_scores(task_result, stratum, label), stratum_bound(task_result, stratum))


def baseline_labels(task_result: Mapping[str, Any]) -> list[str]:
    """Every baseline label of a task, in the order the scores hold them."""
    first = next(iter(task_result["episodes"].values()))
    return list(first["scores"])


def leaderboard(results: Mapping[str, Any], agents: Mapping[str, Mapping[str, Mapping[str, list]]] | None = None
                ) -> list[dict[str, Any]]:
    """Rows of the leaderboard: per task and stratum, the bounds, the tuned best heuristic, the
    headroom with its CI, and every baseline (and agent of ``agents``: name -> task -> stratum ->
    per-episode scores) with its paired comparison. An agent with scores on the first ``n`` episodes
    of a stratum only (``--episodes n``) is paired with the tuned heuristic and the bound on those
    ``n`` (``paired_episodes``). JSON-ready."""
    rows: list[dict[str, Any]] = []
    for task_id, tr in results["tasks"].items():
        ref = reference_label(tr)
        for stratum in tr["strata"]:
            tuned = stratum_scores(tr, stratum, ref)
            bound = stratum_bound(tr, stratum)
            iso = stratum_bound(tr, stratum, "isolation")
            h, hlo, hhi = headroom(tuned, bound)
            base = {"task": task_id, "stratum": stratum, "episodes": len(tuned), "tuned_best": ref,
                    "tuned_params": tr["tuning"][tr["tuning"]["reference"]]["params"],
                    "tuned_mean": _mean(tuned), "bound_mean": _mean(bound), "isolation_mean": _mean(iso),
                    "headroom": h, "headroom_lo": hlo, "headroom_hi": hhi}
            entries = [(label, stratum_scores(tr, stratum, label), "baseline") for label in baseline_labels(tr)]
            for name, per_task in (agents or {}).items():
                if task_id in per_task and stratum in per_task[task_id]:
                    entries.append((name, list(per_task[task_id][stratum]), "agent"))
            for label, scores, kind in entries:
                n = len(scores)  # an agent evaluated on the first n episodes (--episodes) is paired on those
                if n > len(tuned):
                    raise ConfigError(f"{label} has {n} scores on {task_id} {stratum}; the stratum has {len(tuned)}")
                p = paired(scores, tuned[:n], bound[:n])
                rows.append({**base, "agent": label, "kind": kind, "mean": p.agent_mean, "diff": p.diff_mean,
                             "diff_lo": p.diff_lo, "diff_hi": p.diff_hi, "normalised": p.normalised,
                             "norm_lo": p.norm_lo, "norm_hi": p.norm_hi, "worse": p.worse,
                             "paired_episodes": p.episodes})
    return rows


def suite_table(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One summary row per task and stratum from :func:`leaderboard` rows: the bounds, the tuned
    best heuristic, the headroom with its CI, the best heuristic with its defaults, the best
    constant action, the random agent and the behaviour clone (means), and each agent's
    normalised score."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["task"], r["stratum"])
        row = out.setdefault(key, {k: r[k] for k in ("task", "stratum", "episodes", "isolation_mean", "bound_mean",
                                                     "tuned_best", "tuned_mean", "headroom", "headroom_lo",
                                                     "headroom_hi")})
        label, mean = r["agent"], r["mean"]
        if r["kind"] == "agent" and label.endswith(SHIPPED_SUFFIX):  # one column for them all (each task has its own)
            row.setdefault("shipped", []).append((label[:-len(SHIPPED_SUFFIX)].removesuffix(".zip"), mean,
                                                  r["normalised"], r["norm_lo"], r["norm_hi"]))
            continue
        if r["kind"] == "agent":
            row[f"agent {label}"] = (mean, r["normalised"], r["norm_lo"], r["norm_hi"])
            continue
        for prefix, col in (("constant ", "best_constant"), ("", "best_default")):
            if (label.startswith(prefix) if prefix else label.endswith(" (default)")) and mean is not None:
                if col not in row or mean > row[col][1]:
                    row[col] = (label, mean)
        if label in ("random", "behaviour clone"):
            row[label] = mean
    return list(out.values())


def format_suite_markdown(table: list[Mapping[str, Any]], shipped_column: bool | None = None) -> str:
    """:func:`suite_table` as a Markdown table (SLO attainment; headroom in points with its 95 % CI).
    ``shipped_column``: whether it has the shipped agents' column (default: when a row has shipped
    agents); a task without one says "none shipped" there."""
    def f(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    def pts(x):
        return "-" if x is None else f"{100 * x:+.1f}"

    agents = sorted({k for r in table for k in r if k.startswith("agent ")})
    shipped = any("shipped" in r for r in table) if shipped_column is None else shipped_column
    head = ["task", "stratum", "episodes", "isolation bound", "hindsight bound", "tuned best",
            "headroom (pts, 95 % CI)", "best default", "best constant", "random", "behaviour clone",
            *(["shipped agents: mean (normalised [95 % CI])"] if shipped else []),
            *[a[6:] + " (normalised)" for a in agents]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        bd, bc = r.get("best_default"), r.get("best_constant")
        cells = [r["task"], r["stratum"], str(r["episodes"]), f(r["isolation_mean"]), f(r["bound_mean"]),
                 f"{r['tuned_best']} {f(r['tuned_mean'])}",
                 f"{pts(r['headroom'])} [{pts(r['headroom_lo'])}, {pts(r['headroom_hi'])}]",
                 f"{bd[0].removesuffix(' (default)')} {f(bd[1])}" if bd else "-",
                 f"{bc[0].removeprefix('constant ')} {f(bc[1])}" if bc else "-",
                 f(r.get("random")), f(r.get("behaviour clone"))]
        if shipped:  # a task no shipped agent covers says so (not "-", which reads as a missing number)
            cells.append("<br>".join(f"{name} {f(m)} ({f(n)} [{f(lo)}, {f(hi)}])"
                                     for name, m, n, lo, hi in r.get("shipped", [])) or "none shipped")
        for a in agents:
            v = r.get(a)
            cells.append("-" if v is None else f"{f(v[0])} ({f(v[1])} [{f(v[2])}, {f(v[3])}])")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean(values) -> float | None:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return sum(v) / len(v) if v else None
