"""``kvsched compare``: run several policies (or cluster routers) on the same workload and seeds,
and print a table with CSV, JSON and plots (the work is in :mod:`kvsched.experiments.compare`).

Holds the command's options (:func:`add_arguments`) beside its handler (:func:`cmd_compare`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvsched.envs.sim.errors import KvschedError

from . import progress as progress_lines
from . import cli_types
from .consoles import stderr_console
from .simulate_cli import default_cost_notes, model_notes
from .outputs import prepare_out_dir
from kvsched.runner.scenario import load_scenario


def add_arguments(c: argparse.ArgumentParser) -> None:
    """The ``kvsched compare`` options."""
    c.add_argument("--scenario", required=True,
                   help="scenario YAML file (its `policy` is ignored, or its `router` with --routers)")
    c.add_argument("--policies", help="comma-separated policy names (default: every registered policy)")
    c.add_argument("--routers", help="compare these cluster routers instead (comma-separated, e.g. "
                                     "rr,least-loaded,cache-affinity), each with the scenario's policy")
    c.add_argument("--clusters", help="compare these cluster layouts instead (comma-separated xPyD labels, e.g. "
                                      "2P2D,4M,1P3D: prefill, decode, mixed instance counts), each with the scenario's "
                                      "policy, router and `cluster:` role specs (docs/disaggregation.md)")
    c.add_argument("--instances", type=cli_types.instances, help="override the scenario's n_instances")
    c.add_argument("--max-requests", type=cli_types.count, help="serve only the first N requests of the workload "
                                                    "(overrides the scenario's max_requests)")
    c.add_argument("--router-params", metavar="JSON",
                   help='per-router parameters, e.g. \'{"cache-affinity": {"cache_threshold": 0.5}}\'')
    c.add_argument("--seeds", type=cli_types.repeats, default=1,
                   help="number of seeds: scenario seed, +1, ... (they regenerate synthetic workloads; "
                        "a trace is the same for every seed) (default 1)")
    c.add_argument("--out", type=Path,
                   help="write compare.csv, compare_runs.csv, compare_paired.csv, compare.json and plots here")
    c.add_argument("--policy-params", metavar="JSON",
                   help='per-policy parameters, e.g. \'{"ewsjf": {"meta_window_s": 10}}\'')
    c.add_argument("--windows", type=cli_types.repeats, default=1,
                   help="cut the workload into this many consecutive windows of equal time, each served "
                        "separately from a cold start (default 1)")
    c.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="run the grid here, one run after another, or as Ray tasks (needs the ray extra); "
                        "results are identical (default local)")
    c.add_argument("--address", help="Ray cluster address (HOST:PORT or auto; with --backend ray; default: "
                                     "start a local Ray)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--timeline", type=cli_types.timeline_dir, metavar="DIR",
                   help="write each run's schedule as a Chrome/Perfetto trace into DIR "
                        "(timeline-<policy or router>-seed<seed>[-window<k>].json.gz); see docs/timeline.md")
    c.add_argument("--timeline-window", type=cli_types.timeline_window, metavar="START:END",
                   help="only the timelines' events in [START, END] simulated seconds (END may be empty)")


def cmd_compare(a: argparse.Namespace, console: Console) -> int:
    """``kvsched compare``: run the policy (or router) x seed x window grid, print the table and
    write ``--out``; returns the exit code."""
    from kvsched.policies.base import policy_names

    from .compare import (aggregate, paired, paired_rich_table, parse_clusters, parse_policies, parse_policy_params,
                          parse_router_params, parse_routers, rich_table, run_compare, write_outputs)

    routers = None
    clusters = None
    rparams: dict = {}
    if a.clusters is not None:
        if a.policies is not None or a.policy_params is not None or a.routers is not None \
                or a.router_params is not None or a.instances is not None:
            raise KvschedError("--clusters compares cluster layouts under the scenario's policy and router; drop "
                               "--policies / --policy-params / --routers / --router-params / --instances")
        clusters = parse_clusters(a.clusters)
        policies = None
        params = {}
        names = clusters
    elif a.routers is not None:
        if a.policies is not None or a.policy_params is not None:
            raise KvschedError("--routers compares routers under the scenario's policy; drop --policies / "
                               "--policy-params (set `policy:` in the scenario)")
        routers = parse_routers(a.routers)
        rparams = parse_router_params(a.router_params, routers)
        policies = None
        params: dict = {}
        names = routers
    else:
        if a.router_params is not None:
            raise KvschedError("--router-params needs --routers")
        policies = parse_policies(a.policies if a.policies is not None else policy_names())
        params = parse_policy_params(a.policy_params, policies)
        names = policies
    if a.timeline_window is not None and a.timeline is None:
        raise KvschedError("--timeline-window needs --timeline DIR")
    if a.timeline is not None:
        prepare_out_dir(a.timeline, "--timeline")
    if a.out:
        prepare_out_dir(a.out)
    sc = load_scenario(a.scenario)
    if a.instances is not None:
        sc = sc.with_overrides(n_instances=a.instances)
    if a.max_requests is not None:
        sc = sc.with_overrides(max_requests=a.max_requests)
    err = stderr_console()
    for note in model_notes(sc.instance_specs()) + default_cost_notes(sc.instance_specs()):
        err.print(f"note: {note}", highlight=False, markup=False)  # a path or name may hold [brackets]
    show = not a.no_progress and sys.stderr.isatty()
    n_runs = len(names) * max(a.seeds, 1) * max(a.windows, 1)
    t0 = time.perf_counter()
    run = lambda progress=None: run_compare(sc, policies, a.seeds, params, progress=progress,  # noqa: E731
                                            windows=a.windows, backend=a.backend, address=a.address,
                                            routers=routers, router_params=rparams, timeline_dir=a.timeline,
                                            timeline_window_s=a.timeline_window, clusters=clusters)
    if show:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as prog:
            task = prog.add_task(f"comparing ({a.backend})", total=n_runs)
            result = run(lambda done, total: prog.update(task, completed=done))
    else:  # off a terminal: a progress line at least every 30 s (kvsched.experiments.progress)
        result = run(progress_lines.counter("runs", n_runs))
    agg = aggregate(result.runs, result.policies)
    seeds = result.seeds
    what = ((f"routers on {sc.n_instances} instances, policy {sc.policy}: " if routers else
             f"cluster layouts, policy {sc.policy}, router {sc.router}: " if clusters else "") + ", ".join(names))
    per = len(seeds) * max(a.windows, 1)  # runs per policy (or router), which the ± is over
    where = f"seeds {seeds[0]}..{seeds[-1]}" + (f" x {a.windows} windows" if a.windows > 1 else "")
    console.print(rich_table(agg, f"{sc.name}: {what}; {where} "
                                  f"({f'mean ± std over {per} runs' if per > 1 else 'one run'})"))
    if len(names) > 1 and per > 1:
        table = paired(result.runs, result.policies)
        console.print(paired_rich_table(table, f"each against {result.policies[0]}, run by run over the same {per} "
                                               "runs (class all): mean difference [95 % bootstrap CI], runs worse"))
    if clusters is not None:
        gpus = {str(r["cluster"]): r["gpus"] for _, r in agg.iterrows() if r["class"] == "all"}
        if len(set(gpus.values())) > 1:
            err.print("note: the layouts use different GPU counts ("
                      + ", ".join(f"{k}: {v:.0f}" for k, v in gpus.items()) + "); compare at equal GPU count",
                      highlight=False)
    if sc.trace is not None and len(seeds) > 1:
        err.print("note: a trace scenario serves the same requests for every seed; seeds only change seeded "
                  "policy internals (e.g. EWSJF's Optuna sampler)", highlight=False)
    def count(n: int, one: str, many: str) -> str:
        return f"{n} {one if n == 1 else many}"

    what = ("router", "routers") if routers else ("layout", "layouts") if clusters else ("policy", "policies")
    console.print(f"{count(n_runs, 'run', 'runs')} ({count(len(names), *what)} x {count(len(seeds), 'seed', 'seeds')}"
                  f" x {count(a.windows, 'window', 'windows')}, backend {a.backend})"
                  f" in {time.perf_counter() - t0:.1f} s wall", highlight=False)
    if a.timeline is not None:
        console.print(f"wrote {n_runs} timeline{'s' if n_runs > 1 else ''} into {a.timeline} (open them in "
                      "https://ui.perfetto.dev)", highlight=False, markup=False)
    if a.out:
        files = write_outputs(result, agg, sc, a.out)
        console.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False, markup=False)
    return 0
