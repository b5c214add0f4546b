"""The table of ``kvsched`` subcommands.

Each subcommand is a :class:`Command`: its name, its one-line help (shown by ``kvsched
--help``), and the module that holds, side by side, the function adding its options to an
argparse parser and its handler ``(args, console) -> exit code``. The table names the module
instead of importing it, so that reading the table costs nothing: :mod:`kvsched.experiments.cli`
imports a command's module only when that command is the one being run (see its docstring).

The order of :data:`COMMANDS` is the order of ``kvsched --help``.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """One ``kvsched`` subcommand.

    Attributes:
        name: the subcommand (``kvsched NAME``).
        help: its line in ``kvsched --help`` (an argparse help string: ``%`` is written ``%%``).
        module: absolute name of the module holding its options and its handler.
        run: name of the handler in ``module``, called as ``run(args, console)`` and returning
            the exit code.
        add_arguments: name of the function in ``module`` that adds the command's options to its
            argparse sub-parser; None for a command without options.
    """

    name: str
    help: str
    module: str
    run: str
    add_arguments: str | None = None

    def load(self) -> tuple[Callable[[argparse.ArgumentParser], None] | None, Callable[..., int]]:
        """Import :attr:`module` and return (its options function or None, its handler)."""
        mod = importlib.import_module(self.module)
        add = getattr(mod, self.add_arguments) if self.add_arguments is not None else None
        return add, getattr(mod, self.run)


#: Every ``kvsched`` subcommand, in the order ``kvsched --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("simulate", help="serve a trace on a simulated instance and report latency metrics",
            module="kvsched.experiments.simulate_cli", add_arguments="add_arguments", run="cmd_simulate"),
    Command("tune", help="Bayesian tuning of a policy's parameters (Optuna); see docs/tuning-and-export.md",
            module="kvsched.experiments.tune_cli", add_arguments="add_tune_arguments", run="cmd_tune"),
    Command("export", help="export a tuned trial as vLLM / SGLang / llm-d / kvsched configuration",
            module="kvsched.experiments.tune_cli", add_arguments="add_export_arguments", run="cmd_export"),
    Command("parity", help="step-by-step decision parity with vLLM's real V1 scheduler (needs the vllm extra)",
            module="kvsched.experiments.parity_cli", add_arguments="add_arguments", run="cmd_parity"),
    Command("bench", help="measure simulator speed and memory on reference cases (see --list)",
            module="kvsched.experiments.bench", add_arguments="add_arguments", run="cmd_bench"),
    Command("compare", help="run several policies on the same workload and seeds; table, CSV and plots",
            module="kvsched.experiments.compare_cli", add_arguments="add_arguments", run="cmd_compare"),
    Command("train", help="train an RL agent (SB3 / sb3-contrib) on a kvsched environment (needs the rl extra)",
            module="kvsched.experiments.rl_cli", add_arguments="add_train_arguments", run="cmd_train"),
    Command("evaluate", help="learned vs heuristic agents on held-out windows: table with 95%% CIs, plots",
            module="kvsched.experiments.rl_cli", add_arguments="add_evaluate_arguments", run="cmd_evaluate"),
    Command("leaderboard", help="kvsched bench: tasks with headroom, baselines, bounds and agents (paired CIs)",
            module="kvsched.experiments.leaderboard_cli", add_arguments="add_arguments", run="cmd_leaderboard"),
    Command("presets", help="list model, GPU and link presets",
            module="kvsched.experiments.catalog_cli", run="cmd_presets"),
    Command("traces", help="list bundled traces",
            module="kvsched.experiments.catalog_cli", run="cmd_traces"),
    Command("calibrate", help="fit the cost model's efficiency and overhead parameters to real vLLM runs",
            module="kvsched.experiments.calibrate", add_arguments="add_arguments", run="cmd_calibrate"),
    Command("validate", help="replay the real vLLM runs and score kvsched beside its peers",
            module="kvsched.experiments.validate", add_arguments="add_arguments", run="cmd_validate"),
)
