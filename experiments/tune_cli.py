"""Command-line front end of ``kvsched tune`` (:mod:`.tune`) and ``kvsched export`` (:mod:`.export`)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvsched.envs.sim.errors import bounded_repr

from . import progress as progress_lines
from .cli_types import count, seed
from .consoles import stderr_console
from .outputs import file_name, inside, prepare_out_dir, prepare_out_file


def add_tune_arguments(t: argparse.ArgumentParser) -> None:
    which = t.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", help="registered policy whose SEARCH_SPACE is tuned")
    which.add_argument("--router", help="cluster router whose SEARCH_SPACE is tuned instead (cache-affinity, dynamo, "
                                        "least-loaded, llm-d, prefix, session-affinity); the scenario's policy and "
                                        "policy_params stay fixed; needs n_instances >= 2")
    t.add_argument("--scenario", required=True, help="scenario YAML file (the tuned policy or router replaces the "
                                                     "scenario's and its parameters)")
    t.add_argument("--objective", default="goodput_rps:all",
                   help="METRIC[:CLASS] to optimise, e.g. goodput_rps:all, slo_attainment:short, ttft_p99_s:short "
                        "(goodput/SLO attainment maximised, latencies minimised; default goodput_rps:all)")
    t.add_argument("--constraint", action="append", default=[],
                   help="METRIC[:CLASS]<=BOUND or >=BOUND on the mean over runs, e.g. 'ttft_p99_s:short<=1.0' "
                        "(repeatable)")
    t.add_argument("--trials", type=count, default=20,
                   help="COMPLETE trials the study should hold (pruned and failed ones do not count; every worker "
                        "stops there; default 20)")
    t.add_argument("--sampler", choices=("tpe", "gp", "cmaes"), default="tpe", help="Optuna sampler (default tpe)")
    t.add_argument("--study", help="study name (default <policy>-<scenario name>; with --router "
                                   "router-<router>-<scenario name>)")
    t.add_argument("--storage", help="journal:PATH, PATH.journal, sqlite:///FILE or postgresql://... "
                                     "(default: in memory)")
    t.add_argument("--workers", type=count, default=1, help="worker processes on this machine (default 1)")
    t.add_argument("--windows", type=count, default=3,
                   help="windows per trial, spread evenly over the scenario's arrivals (default 3; unlike "
                        "compare --windows they need not cover the whole workload)")
    t.add_argument("--window-s", type=float, default=60.0, help="length of each window, s (default 60)")
    t.add_argument("--seeds", type=count, default=2, help="seeds per window: scenario seed, +1, ... (default 2)")
    t.add_argument("--holdout-seeds", type=int, default=0,
                   help="re-evaluate baseline and best on this many unseen seeds (default 0)")
    t.add_argument("--tune-engine", action="store_true",
                   help="also tune max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold")
    t.add_argument("--tune-residency", action="store_true",
                   help="also tune the KV-residency knobs every policy has: tier_aware_preemption, prefetch, "
                        "admit_while_swapped, admission_preemption")
    t.add_argument("--pruner", choices=("median", "none"), default="median", help="pruner (default median)")
    t.add_argument("--penalty", type=float, default=10.0,
                   help="CMA-ES constraint penalty, objective units per 100%% violation (default 10)")
    t.add_argument("--seed", type=seed, default=0,
                   help="sampler seed (worker k's sampler is seeded from seed, k and the trials already in the study, "
                        "so a resume continues the sequence; default 0)")
    t.add_argument("--out", type=Path, help="write tune.json, trials.csv, history.png, importances.png here "
                                            "(default runs/tune/<study>)")


def add_export_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--study", required=True, help="study name")
    e.add_argument("--storage", required=True, help="the study's storage (as for kvsched tune)")
    e.add_argument("--target", required=True, choices=("vllm", "vllm-plugin", "sglang", "llm-d", "kvsched"))
    e.add_argument("--out", type=Path, required=True, help="file to write")
    e.add_argument("--trial", type=int, help="trial number (default: the best feasible trial)")


def cmd_tune(a: argparse.Namespace, console: Console) -> int:
    from kvsched.runner.scenario import load_scenario
    from .tune import (Constraint, MetricRef, TuneConfig, check_router_cluster, check_scenario, even_windows, tune,
                       write_results)

    sc = load_scenario(a.scenario)
    if a.router is not None:
        check_router_cluster(a.router, sc)  # before the workload is read for the windows
    # a router study keeps the scenario's policy (and its policy_params) fixed
    cfg = TuneConfig(policy=a.policy if a.router is None else sc.policy, objective=MetricRef.parse(a.objective),
                     constraints=tuple(Constraint.parse(c) for c in a.constraint),
                     windows_s=even_windows(sc, a.windows, a.window_s),
                     seeds=tuple(sc.seed + k for k in range(a.seeds)), tune_engine=a.tune_engine,
                     tune_residency=a.tune_residency, sampler=a.sampler, penalty=a.penalty, pruner=a.pruner,
                     sampler_seed=a.seed, router=a.router)
    check_scenario(cfg, sc)  # before the output folder is made
    name = a.study or (f"{a.policy}-{sc.name}" if cfg.router is None else f"router-{cfg.router}-{sc.name}")
    # the study's name becomes a folder (default --out) or a journal file name (--workers without
    # --storage): a hostile --study or scenario name must not write outside runs/tune or --out
    what = "--study" if a.study else f"the study name (from the scenario's name {bounded_repr(sc.name)})"
    if a.out is None or (a.workers > 1 and a.storage is None):
        file_name(name, what)
    out = a.out or inside(Path("runs") / "tune", name, what)
    prepare_out_dir(out)  # before the trials (minutes), not when their results are written
    err = stderr_console()
    fixed = f" (policy {cfg.policy} fixed)" if cfg.router is not None else ""
    err.print(f"tuning {cfg.tuned}{fixed} on {sc.name}: "
              f"{len(cfg.windows_s)} windows x {len(cfg.seeds)} seeds per trial, "
              f"objective {cfg.objective} ({cfg.direction}), {a.trials} trials, sampler {a.sampler}, "
              f"{a.workers} worker(s)", highlight=False)
    progress_lines.note(f"study {name}, {a.trials} trials")  # off a terminal: with the elapsed time
    res = tune(sc, cfg, name, a.storage, a.trials, a.workers, a.holdout_seeds, scenario_path=a.scenario, out=out)
    rep = res.report
    console.print(report_table(rep))
    try:
        files = write_results(res.study, rep, out)
    except OSError as e:  # e.g. no space left on device: the study itself is safe in its storage
        from kvsched.envs.sim.errors import KvschedError

        from .outputs import os_reason

        raise KvschedError(f"--out {bounded_repr(str(out))}: cannot write the results ({os_reason(e)}); the "
                           "trials are kept in the study's storage (with --storage, run the same command again "
                           "to write them)") from None
    console.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False, markup=False)
    if a.storage:
        console.print(f"dashboard: optuna-dashboard {_dashboard_arg(a.storage)}  (pip install optuna-dashboard)",
                      highlight=False)
    return 0


def _dashboard_arg(storage: str) -> str:
    from .tune import _redact, journal_path

    p = journal_path(storage)
    return p if p is not None else _redact(storage)


def _f(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4g}"


def report_table(rep: dict) -> Table:
    """Baseline vs best: objective mean ± std, constraints, parameters."""
    tuned = f" ({rep['tuned']})" if rep.get("tuned") else ""
    t = Table(title=f"study {rep['study']}{tuned}: {rep['objective']} ({rep['direction']}); trials "
                    + ", ".join(f"{k} {v}" for k, v in rep["trials"].items() if v))
    t.add_column("")
    t.add_column("baseline (published defaults)")
    t.add_column("best")
    b, x = rep.get("baseline") or {}, rep.get("best") or {}
    t.add_row("trial", str(b.get("trial", "-")), str(x.get("trial", "none feasible")))
    t.add_row("objective mean ± std", f"{_f(b.get('objective_mean'))} ± {_f(b.get('objective_std'))}",
              f"{_f(x.get('objective_mean'))} ± {_f(x.get('objective_std'))}")
    for c in rep["constraints"]:
        t.add_row(f"{c} (mean value)", _f((b.get("constraints") or {}).get(c)), _f((x.get("constraints") or {}).get(c)))
    for k in (b.get("params") or x.get("params") or {}):
        t.add_row(k, str(_p((b.get("params") or {}).get(k))), str(_p((x.get("params") or {}).get(k))))
    if "verdict" in rep:
        t.add_row("verdict", "", rep["verdict"])
    elif rep.get("best") is None:
        t.add_row("verdict", "", "no trial met the constraints")
    h = rep.get("holdout")
    if h:
        t.add_row(f"held-out seeds {h['seeds']}", f"{_f(h['baseline']['objective_mean'])} ± "
                  f"{_f(h['baseline']['objective_std'])}",
                  f"{_f(h['best']['objective_mean'])} ± {_f(h['best']['objective_std'])}")
    return t


def _p(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def cmd_export(a: argparse.Namespace, console: Console) -> int:
    from .export import export_study

    prepare_out_file(a.out)  # before the study is read and its target simulated
    res = export_study(a.study, a.storage, a.target, a.out, trial=a.trial)
    pv = res.provenance
    console.print(f"wrote {a.out} ({a.target}) from study {a.study} trial {pv['trial']}", highlight=False, markup=False)
    if pv.get("feasible") is False:
        stderr_console().print(f"warning: trial {pv['trial']} violates the study's constraints "
                                   f"{pv['constraints']} (feasible: false in the file)", highlight=False)
    if "target_objective_mean" in pv:
        behind = (f", behind the scenario's router {pv['target_router_simulated']}"
                  if "target_router_simulated" in pv else "")
        console.print(f"{pv['objective']}: tuned {_f(pv['objective_mean'])} "
                      f"(baseline {_f(pv['baseline_objective_mean'])}); "
                      f"this file alone ({pv['target_policy_simulated']} + its engine settings{behind}), simulated on "
                      f"the study's windows and seeds: {_f(pv['target_objective_mean'])}", highlight=False)
    if res.unexpressible:
        console.print(f"{len(res.unexpressible)} parameter(s) {a.target} cannot express (also listed in the file):",
                      highlight=False)
        for name, value, why in res.unexpressible:
            console.print(f"  {name} = {json.dumps(value, default=str)}: {why}", highlight=False)
    return 0
