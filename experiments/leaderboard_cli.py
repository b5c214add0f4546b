"""``kvsched leaderboard``: kvsched bench's tasks, baselines, bounds and agents in one table.

- ``kvsched leaderboard`` (or ``--show``): print the committed results of the suite (no
  simulation): per task and stratum the isolation and hindsight bounds, the tuned best heuristic
  and its parameters, the headroom (bound - tuned, 95 % CI), every baseline's mean, paired
  difference with the tuned heuristic (95 % bootstrap CI), normalised score and episodes worse.
- ``--agents A,B,...``: also evaluate agents on every task's strata episodes and add their rows: a
  checkpoint (``.zip``, Stable-Baselines3 / sb3-contrib, trained on the task's environment), a
  heuristic name (a policy for a scheduling task, a router for a routing task; with its defaults),
  or ``random`` (refused, as any name of a baseline row, where the results hold it: the committed
  ones do). ``--episodes N`` evaluates the first N episodes of each stratum only; a progress bar
  (a terminal) or progress lines (off one; :mod:`kvsched.experiments.progress`) count the episodes.
- ``--compute``: recompute the suite's baselines and bounds (tuning on train episodes, the
  hindsight search: hours) into ``--out``; ``--jobs`` processes.
- ``--markdown`` prints one summary row per task and stratum as a Markdown table (the suite
  table of docs/bench.md);
- ``--json`` prints the rows as JSON; ``--out DIR`` writes ``leaderboard.json``, ``leaderboard.csv``
  and ``leaderboard.png`` (normalised scores with their intervals, one panel per task).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvsched.envs.sim.errors import bounded_repr

from . import cli_types
from . import progress as progress_lines
from kvsched import atomic_files


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvsched leaderboard`` options."""
    p.add_argument("--suite", default="v1", help="suite version (default v1)")
    p.add_argument("--tasks", help="comma-separated task ids (default: every task of the suite)")
    p.add_argument("--agents", help="comma-separated agents to evaluate: checkpoint .zip files, heuristic names "
                                    "(residency tasks: lru, lfu, session, session:<s>), random (not when the results "
                                    "hold a random baseline row, as the committed ones do)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load --agents checkpoints kvsched did not write (no valid .sha256 beside them); loading "
                        "unpickles them, which can run code: only for files you trust")
    p.add_argument("--episodes", type=cli_types.count, help="evaluate agents on the first N episodes of each "
                                                             "stratum only (default all)")
    p.add_argument("--show", action="store_true", help="print the committed results (the default without --agents "
                                                        "or --compute)")
    p.add_argument("--compute", action="store_true", help="recompute the suite's baselines and bounds into --out "
                                                           "(hours)")
    p.add_argument("--jobs", type=cli_types.count, help="processes for --compute (default 1)")
    p.add_argument("--datasets", action="store_true",
                   help="record each task's Minari dataset of its tuned best heuristic (train episodes; minutes) "
                        "into --out DIR/<suite>/<task>/minari from the results, without recomputing them")
    p.add_argument("--results", type=Path,
                   help="read results from this folder (or its <suite>.json) instead of the committed ones")
    p.add_argument("--save-agents", type=Path, metavar="FILE",
                   help="with --agents (checkpoints, every episode): add their per-episode scores, checkpoint paths "
                        "and training commands to this shipped-agents file (the committed one is "
                        "experiments/suite/results/<suite>-agents.json, shown by default)")
    p.add_argument("--no-shipped", action="store_true",
                   help="leave out the shipped agents (experiments/suite/results/<suite>-agents.json)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--markdown", action="store_true",
                   help="print one summary row per task and stratum as a Markdown table (bounds, tuned best, "
                        "headroom, best default, best constant, random, clone, agents)")
    p.add_argument("--out", type=Path, help="write leaderboard.json, leaderboard.csv and leaderboard.png here "
                                            "(with --compute: the results file too)")


def cmd_leaderboard(a: argparse.Namespace, console: Console) -> int:
    """``kvsched leaderboard``; returns the exit code."""
    from kvsched.envs.sim.errors import KvschedError

    from .outputs import prepare_out_dir
    from .suite.results import leaderboard, load_results
    from .suite.tasks import get_suite

    if a.json and a.markdown:
        raise KvschedError("--json and --markdown: give one output format")
    if a.datasets and (a.agents or a.compute):
        raise KvschedError("--datasets records datasets only: leave out --agents and --compute (--compute records "
                           "them too)")
    if a.save_agents is not None and (not a.agents or a.episodes is not None):
        raise KvschedError(f"--save-agents {bounded_repr(str(a.save_agents))}: keeps agents evaluated on every "
                           "episode: give --agents and leave out --episodes")
    given = cli_types.comma_list(a.agents, "--agents") if a.agents else []
    not_checkpoints = [x for x in given if not x.endswith(".zip")]
    if a.save_agents is not None and not_checkpoints:  # before minutes of evaluation, not after
        raise KvschedError(f"--save-agents keeps learned agents (checkpoints .zip); "
                           f"{bounded_repr(', '.join(not_checkpoints))} are not: evaluate them without --save-agents")
    if a.save_agents is not None and _is_file(a.save_agents):  # checked before minutes of evaluation
        from .suite.shipped import _read_agents

        _read_agents(a.save_agents)
    if a.episodes is not None and not a.agents:
        raise KvschedError(f"--episodes {a.episodes}: limits the agents' evaluation; give --agents too")
    if a.jobs is not None and not a.compute:
        raise KvschedError(f"--jobs {a.jobs}: processes of --compute; give --compute too")
    if a.results is not None and a.compute:
        raise KvschedError(f"--results {bounded_repr(str(a.results))}: --compute writes and reads its results in "
                           "--out; give one of them")
    tasks = get_suite(a.suite)
    ids = [t.task_id for t in tasks]
    chosen = ids if a.tasks is None else cli_types.comma_list(a.tasks, "--tasks")
    unknown = [x for x in chosen if x not in ids]
    if unknown or not chosen or len(set(chosen)) < len(chosen):
        why = (f"unknown {bounded_repr(', '.join(unknown))}" if unknown else "no task" if not chosen
               else "a task named twice")
        raise KvschedError(f"--tasks {bounded_repr(a.tasks)}: {why}; expected distinct task ids of suite "
                           f"{a.suite}: {', '.join(ids)}")
    if a.out is not None:
        prepare_out_dir(a.out)
    if a.compute:
        if a.out is None:
            raise KvschedError("--compute writes a results file: give --out DIR (the committed results are in "
                               "experiments/suite/results)")
        _compute(a, [t for t in tasks if t.task_id in chosen], console)
        folder = a.out
    else:
        folder = a.results
        if folder is not None and _is_file(folder):  # the results file itself, not its folder
            if folder.name != f"{a.suite}.json":
                raise KvschedError(f"--results {bounded_repr(str(folder))} is a file; expected the folder holding "
                                   f"{a.suite}.json (or that file)")
            folder = folder.parent
    results = load_results(a.suite, folder)
    missing = [x for x in chosen if x not in results["tasks"]]
    if missing and (a.tasks is not None or a.agents or a.datasets or len(missing) == len(chosen)):
        raise KvschedError(f"{'--tasks' if a.tasks is not None else 'task'} {bounded_repr(', '.join(missing))}: not "
                           f"in the results of suite {a.suite} (they hold: {', '.join(results['tasks']) or 'no task'}"
                           f"); compute with --compute --out DIR")
    if missing:
        console.print(f"not in the results (not computed): {', '.join(missing)}", highlight=False, markup=False)
    chosen = [x for x in chosen if x not in missing]
    results = {**results, "tasks": {k: v for k, v in results["tasks"].items() if k in chosen}}
    if a.datasets:
        return _datasets(a, [t for t in tasks if t.task_id in chosen], results, console)
    agents = _evaluate_agents(a, [t for t in tasks if t.task_id in chosen], results, console) if a.agents else {}
    if a.save_agents is not None:
        from .suite.shipped import save_shipped, shipped_path

        names = cli_types.comma_list(a.agents, "--agents")
        saved = save_shipped(a.save_agents, a.suite, agents, dict(zip(agents, names)),
                             " ".join(["kvsched", *sys.argv[1:]]) if sys.argv and "kvsched" in sys.argv[0] else "")
        shown = shipped_path(a.suite, folder).resolve() == a.save_agents.resolve()
        from .consoles import stderr_console

        # on stderr: stdout holds the rows (--json, --markdown), which must stay parseable
        stderr_console().print(f"saved {', '.join(saved)} to {a.save_agents}" + (
            "" if shown else f" (the leaderboard shows the shipped agents of <results folder>/{a.suite}-agents.json: "
            f"this file is shown when it is that file of the folder given to --results)"),
            highlight=False, markup=False)
    unshipped: list[str] = []
    every: dict = {}
    if not a.no_shipped:
        from .suite.shipped import load_shipped, shipped_scores

        every = load_shipped(a.suite, folder)
        if every:  # the suite ships agents: the tasks none of them covers are named, not left blank
            unshipped = [t for t in chosen if not any(t in e["scores"] for e in every.values())]
        agents = {**shipped_scores(every, chosen, results), **agents}
    rows = leaderboard(results, agents)
    if a.json:
        print(json.dumps(rows, indent=1, default=_jsonable))
    elif a.markdown:
        from .suite.results import format_suite_markdown, suite_table

        print(format_suite_markdown(suite_table(rows), shipped_column=True if every else None), end="")
    else:
        _print(rows, results, console, unshipped)
    if a.out is not None:
        _write(rows, a.out, console)
    return 0


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the system refuses (too long): load_results then
    reports it in one bounded line."""
    try:
        return path.is_file()
    except OSError:
        return False


def _jsonable(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x).__name__)


def _compute(a: argparse.Namespace, tasks, console: Console) -> None:
    from .suite.compute import compute_task
    from .suite.results import FORMAT, load_results, provenance, results_path, write_json

    out = a.out
    # add to an existing results file (tasks computed by separate runs); a corrupt one is an error
    data = load_results(a.suite, out) if results_path(a.suite, out).is_file() else \
        {"format": FORMAT, "suite": a.suite, "tasks": {}}
    for t in tasks:
        res = compute_task(t, out / a.suite / t.task_id, jobs=a.jobs or 1,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
        res["provenance"] = provenance("kvsched " + " ".join(sys.argv[1:]))
        data["tasks"][t.task_id] = res  # the other tasks' results stay as they were, byte for byte
        data["provenance"] = merged_provenance(data) if len(data["tasks"]) > 1 else res["provenance"]
        write_json(results_path(a.suite, out), data)  # after every task: a long run keeps what it finished
    console.print(f"wrote {results_path(a.suite, out)}", highlight=False, markup=False)


#: the command of a results file whose tasks were computed by separate runs
MERGED_COMMAND = ("kvsched leaderboard --suite v1 --compute, one run per task group (each task's own command, "
                  "versions and commit are in its provenance)")


def merged_provenance(data: dict) -> dict:
    """The top-level provenance of a results file holding tasks computed by separate runs (an
    ``--out`` that held results already): :data:`MERGED_COMMAND` and each task's own provenance.
    (It was the last run's alone, which named one task's command for all.)"""
    return {"command": MERGED_COMMAND.replace("--suite v1", f"--suite {data.get('suite', 'v1')}"),
            "tasks": {tid: tr["provenance"] for tid, tr in sorted(data["tasks"].items()) if "provenance" in tr}}


def _datasets(a: argparse.Namespace, tasks, results, console: Console) -> int:
    """``--datasets``: record each task's Minari dataset of its tuned best heuristic (from the
    results' tuned parameters, train episodes) into ``--out/<suite>/<task>/minari``."""
    from kvsched.envs.sim.errors import KvschedError

    from .suite.compute import CLONE_EPISODES
    from .suite.datasets import dataset_id, record

    if a.out is None:
        raise KvschedError("--datasets writes Minari datasets: give --out DIR")
    for t in tasks:
        tuning = results["tasks"][t.task_id]["tuning"]
        where = a.out / a.suite / t.task_id / "minari"
        record(t, {"tuning": tuning}, CLONE_EPISODES, path=where)
        console.print(f"{dataset_id(t, tuning['reference'])}: {CLONE_EPISODES} train episodes in {where} "
                      f"(MINARI_DATASETS_PATH={where.resolve()})", highlight=False, markup=False)
    return 0


def _evaluate_agents(a: argparse.Namespace, tasks, results, console: Console) -> dict:
    from kvsched.envs.sim.errors import KvschedError

    from .suite.agents import check_agent, evaluate_agent, stratum_episodes
    from .suite.results import baseline_labels

    names = cli_types.comma_list(a.agents, "--agents")
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice or not names:
        raise KvschedError(f"--agents {bounded_repr(a.agents)}: "
                           f"{'given twice: ' + ', '.join(twice) if twice else 'no agent'}"
                           "; expected distinct checkpoints (.zip), heuristic names or random")
    for name in names:  # a baseline row of that name (random: the same episodes and seeds) would show twice
        shown = [t.task_id for t in tasks if name in baseline_labels(results["tasks"][t.task_id])]
        if shown:
            raise KvschedError(f"--agents {bounded_repr(name)}: already a baseline row of {', '.join(shown)} (the "
                               "same episodes); leave it out")
    sizes = {len(keys) for t in tasks for keys in results["tasks"][t.task_id]["strata"].values()}
    if a.episodes is not None and a.episodes > min(sizes):
        raise KvschedError(f"--episodes {a.episodes}: more than a stratum holds; expected at most {min(sizes)} "
                           "(omit it for every episode)")
    # a checkpoint is labelled by its file name unless two share it (runs/a/final.zip, runs/b/final.zip)
    labels = [Path(n).name if n.endswith(".zip") and sum(Path(m).name == Path(n).name for m in names) == 1 else n
              for n in names]
    from kvsched.agents import trust

    for name in names:  # every name before the first episode: a typo in the last agent costs nothing
        for t in tasks:
            check_agent(t, name)
        if name.endswith(".zip"):  # loading unpickles: refused before any episode, not after minutes
            trust.check(Path(name), a.trust_checkpoint)
    total = len(names) * sum(len(stratum_episodes(results["tasks"][t.task_id], s, a.episodes))
                             for t in tasks for s in results["tasks"][t.task_id]["strata"])
    out: dict = {}

    def run(on_episode) -> None:
        for name, label in zip(names, labels):
            out[label] = {}
            for t in tasks:
                tr = results["tasks"][t.task_id]
                out[label][t.task_id] = evaluate_agent(t, tr, name, a.episodes,
                                                       progress=lambda m: print(m, file=sys.stderr, flush=True),
                                                       trust=a.trust_checkpoint, on_episode=on_episode)

    # the progress-lines policy (kvsched.experiments.progress): a bar on a terminal, off one a line
    # per interval counting episodes
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from .consoles import stderr_console

        with Progress(TextColumn("evaluating agents"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=stderr_console(), transient=True) as prog:
            bar = prog.add_task("episodes", total=total)
            run(lambda: prog.advance(bar))
    else:
        count = progress_lines.counter("episodes", total)
        done = [0]

        def tick() -> None:
            done[0] += 1
            if count is not None:
                count(done[0])

        run(tick)
    return out


def _fmt(x, digits: int = 3, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _print(rows: list[dict], results, console: Console, unshipped: list[str] | None = None) -> None:
    by_task: dict = {}
    for r in rows:
        by_task.setdefault((r["task"], r["stratum"]), []).append(r)
    for (task, stratum), rs in by_task.items():
        r0 = rs[0]
        title = (f"{task} [{stratum}, {r0['episodes']} episodes]: bound {_fmt(r0['bound_mean'])}, isolation "
                 f"{_fmt(r0['isolation_mean'])}, tuned best {r0['tuned_best']} {_fmt(r0['tuned_mean'])}, headroom "
                 f"{_fmt(r0['headroom'], signed=True)} [{_fmt(r0['headroom_lo'], signed=True)}, "
                 f"{_fmt(r0['headroom_hi'], signed=True)}]")
        table = Table(title=escape(title))  # "[hard, 24 episodes]" is not rich markup
        for col in ("agent", "SLO attainment", "diff vs tuned", "95 % CI", "normalised", "worse"):
            table.add_column(col, justify="left" if col == "agent" else "right")
        for r in sorted(rs, key=lambda r: (r["kind"] != "agent", -(r["mean"] if r["mean"] == r["mean"] else -9))):
            part = f" (first {r['paired_episodes']})" if r["kind"] == "agent" and r["paired_episodes"] < r["episodes"] \
                else ""  # --episodes: paired on the first N episodes only
            table.add_row(escape(("* " if r["kind"] == "agent" else "") + r["agent"] + part), _fmt(r["mean"]),
                          _fmt(r["diff"], signed=True), f"[{_fmt(r['diff_lo'], signed=True)}, "
                          f"{_fmt(r['diff_hi'], signed=True)}]", _fmt(r["normalised"], 2), str(r["worse"]))
        console.print(table)
    if unshipped:
        console.print(f"no shipped agent on {', '.join(unshipped)} (docs/bench.md says what was tried)",
                      highlight=False, markup=False)
    prov = results.get("provenance", {})
    if prov:
        version = prov.get("kvsched_version")  # the committed file's top level names none ("kvsched None")
        console.print(f"results: {prov.get('command')}" + (f" (kvsched {version})" if version else ""),
                      highlight=False, markup=False)


def _write(rows: list[dict], out: Path, console: Console) -> None:
    import pandas as pd

    from .suite.results import write_json

    write_json(out / "leaderboard.json", rows)
    with atomic_files.replacing(out / "leaderboard.csv") as tmp:
        pd.DataFrame([{k: v for k, v in r.items() if k != "tuned_params"} for r in rows]).to_csv(tmp, index=False)
    _plot(rows, out / "leaderboard.png")
    console.print(f"wrote {out}/leaderboard.json, leaderboard.csv, leaderboard.png", highlight=False, markup=False)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["stratum"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1,
                             figsize=(8, 1.2 + 0.28 * max(len([r for r in rows if (r["task"], r["stratum"]) == p])
                                                          for p in panels) * len(panels)),
                             squeeze=False)
    for ax, (task, stratum) in zip(axes[:, 0], panels):
        rs = [r for r in rows if (r["task"], r["stratum"]) == (task, stratum) and r["normalised"] is not None]
        rs.sort(key=lambda r: r["normalised"])
        y = range(len(rs))
        ax.errorbar([r["normalised"] for r in rs], list(y),
                    xerr=[[r["normalised"] - r["norm_lo"] for r in rs], [r["norm_hi"] - r["normalised"] for r in rs]],
                    fmt="o", ms=3, color="k")
        for i, r in enumerate(rs):
            if r["kind"] == "agent":
                ax.plot(r["normalised"], i, "o", color="tab:red")
        ax.set_yticks(list(y))
        ax.set_yticklabels([r["agent"] for r in rs], fontsize=6)
        ax.axvline(0, color="grey", lw=0.8)
        ax.axvline(1, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{task} ({stratum}): 0 = tuned best heuristic, 1 = hindsight bound", fontsize=8)
        ax.set_xlabel("normalised score (agent - tuned) / (bound - tuned), 95 % CI", fontsize=7)
    fig.tight_layout()
    with atomic_files.replacing(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
