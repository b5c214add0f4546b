"""``kvsched train`` and ``kvsched evaluate`` (argument parsing and output; the work is in
:mod:`kvsched.agents.train` and :mod:`kvsched.agents.evaluate`). Needs the ``rl`` extra."""

from __future__ import annotations

import argparse
import sys
import json
import os
from pathlib import Path

from rich.table import Table

from kvsched.envs import SCHEDULING_IDS
from kvsched.envs.sim.errors import ConfigError, bounded_repr

from . import progress as progress_lines
from .cli_types import comma_list, count, integer, number, seed
from .outputs import prepare_out_dir


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    from kvsched.agents.train import ALGOS
    from kvsched.envs import ENV_IDS

    t.add_argument("--env", choices=ENV_IDS, help="environment id (required unless --task; with a scheduling --task "
                                                  "it may name kvsched/Scheduling-v1, the same task with observation "
                                                  "version 1)")
    t.add_argument("--task", help="a kvsched bench task id (docs/bench.md): sets --env, --scenario, --window-s and "
                                  "the environment's reference to the task's tuned best heuristic; evaluations "
                                  "during training use train windows (the held-out ones are the leaderboard's)")
    t.add_argument("--suite", default="v1", help="the bench suite of --task (default v1)")
    t.add_argument("--suite-results", type=Path,
                   help="with --task: read the suite's results from this folder (default: the committed ones)")
    t.add_argument("--algo", required=True, choices=(*ALGOS, "es"),
                   help="SB3 / sb3-contrib algorithm, or es: evolution strategies on paired windows "
                        "(kvsched.agents.es; Scheduling-v0/v1; docs/training.md)")
    t.add_argument("--timesteps", type=count, required=True,
                   help="environment steps to train (es: stops after the generation that reaches it)")
    t.add_argument("--scenario", help="scenario YAML (default: the environment's bundled one: mixed-long-short.yaml; "
                   "Residency-v0 residency-mooncake.yaml; PDRouting-v0 mixed-long-short-pd.yaml)")
    t.add_argument("--out", type=Path, default=Path("runs/train"), help="output folder (default runs/train)")
    t.add_argument("--window-s", type=number(0.0, strict=True),
                   help="episode window length (s; default the environment's: 60; Residency-v0 300)")
    t.add_argument("--env-kwargs", default="{}", help="JSON of further environment arguments")
    t.add_argument("--hyperparameters", default="{}", help="JSON of algorithm hyper-parameters")
    t.add_argument("--policy-net", choices=("mlp", "candidate-set"), default="mlp",
                   help="the network: mlp (SB3's MlpPolicy, default) or candidate-set (one network shared by "
                        "the candidate rows; ppo / maskable_ppo on Scheduling-v0; docs/training.md)")
    t.add_argument("--reference-bias", type=number(0.0, strict=False), default=0.0,
                   help="start near the reference: add this to the initial logit of action 0 of every action part "
                        "(Scheduling-v0; e.g. 5; default 0: uniform)")
    t.add_argument("--discount-time-s", type=number(0.0, strict=True),
                   help="semi-MDP discount: gamma per this many seconds of simulated time instead of per decision "
                        "(ppo / maskable_ppo; default: per decision)")
    t.add_argument("--bc-dataset",
                   help="warm start: fit the new policy to Minari demonstrations before RL: a dataset id, or a "
                        "folder of Minari datasets (with --task: the task's tuned-heuristic dataset there, as "
                        "kvsched leaderboard --datasets writes it)")
    t.add_argument("--bc-epochs", type=count, default=5, help="behaviour-cloning epochs of --bc-dataset (default 5)")
    t.add_argument("--seed", type=seed, default=0,
                   help="seed of the agent and the training environments (+10,000 for evaluation; default 0)")
    t.add_argument("--n-envs", type=count, default=None,
                   help="environments stepped together, one policy call for all (default 8 for ppo and "
                        "maskable_ppo: batching is most of the training speed; 1 for dqn and sac)")
    t.add_argument("--subprocess", action="store_true", help="SubprocVecEnv instead of DummyVecEnv")
    t.add_argument("--checkpoint-every", type=count,
                   help="steps between checkpoints (default 10,000, or a fifth of the steps a shorter run takes)")
    t.add_argument("--eval-every", type=count,
                   help="steps between evaluations (default 10,000, or a fifth of the steps a shorter run takes)")
    t.add_argument("--eval-episodes", type=count, default=4, help="held-out episodes per evaluation (default 4)")
    t.add_argument("--resume", type=Path, help="continue training from this checkpoint .zip")
    t.add_argument("--trust-checkpoint", action="store_true",
                   help="load a --resume checkpoint kvsched did not write (no valid .sha256 beside it); loading "
                        "unpickles it, which can run code: only for files you trust")
    t.add_argument("--threads", type=integer(1, os.cpu_count() or 1), default=1,
                   help="torch threads, at most this machine's CPUs (default 1; far more crashed torch)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--max-cpu-s", type=number(0.0, strict=True),
                   help="stop after this many CPU seconds of the training process (final.zip is saved)")
    t.add_argument("--max-wall-s", type=number(0.0, strict=True),
                   help="stop after this many wall-clock seconds (final.zip is saved; so does SIGINT/SIGTERM)")
    t.add_argument("--backend", choices=("sb3", "rllib"), default="sb3",
                   help="Stable-Baselines3 here (default) or Ray RLlib PPO (needs the ray extra; --algo ppo)")
    t.add_argument("--num-env-runners", type=integer(0), default=0,
                   help="RLlib sampling workers (default 0: sample in the driver)")
    t.add_argument("--address", help="RLlib: a running Ray cluster (HOST:PORT or auto; default: a local Ray)")


def add_evaluate_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--agents", required=True,
                   help="comma-separated: checkpoint .zip files, policy (or, for Routing-v0, router; for "
                        "Residency-v0, lru, lfu, clairvoyant, session, session:<s>, session-hbm[:<s>], each "
                        "optionally +prefetch) names and/or 'random', e.g. ckpt.zip,lars,fcfs")
    from kvsched.envs import ENV_IDS

    e.add_argument("--env", choices=ENV_IDS,
                   help="environment when no checkpoint is given (default kvsched/Scheduling-v0; with checkpoints: "
                        "theirs)")
    e.add_argument("--scenario", help="scenario YAML (default: the checkpoint's training scenario; without "
                   "checkpoints the environment's bundled one, as train's --scenario)")
    e.add_argument("--windows", type=count,
                   help="held-out windows (default 4, or all of them when the scenario holds fewer)")
    e.add_argument("--seeds", type=count, default=3, help="seeds per window (default 3)")
    e.add_argument("--window-s", type=number(0.0, strict=True),
                   help="window length (s; default: the checkpoint's; without checkpoints 60, Residency-v0 300)")
    e.add_argument("--out", type=Path, default=Path("runs/evaluate"),
                   help="output folder (default runs/evaluate)")
    e.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="run the episodes here or as Ray tasks (needs the ray extra); same table (default local)")
    e.add_argument("--address", help="Ray cluster address (HOST:PORT or auto; with --backend ray)")
    e.add_argument("--trust-checkpoint", action="store_true",
                   help="load checkpoints kvsched did not write (no valid .sha256 beside them); loading unpickles "
                        "them, which can run code: only for files you trust")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("--stochastic", action="store_true",
                   help="also run learned agents with sampled (not argmax) actions")


def _json_arg(text: str, flag: str) -> dict:
    from kvsched.envs.sim.strict_json import parse_object

    return parse_object(text, flag, "keyword arguments")


def _bc_dataset_id(args) -> str | None:
    """With ``--task`` and a ``--bc-dataset`` folder: the id of the task's dataset of its tuned
    best heuristic (``kvsched/<task>/<heuristic>-v1``); else None (the folder's only dataset, or
    ``--bc-dataset`` is itself an id)."""
    if args.task is None or args.bc_dataset is None or not Path(args.bc_dataset).is_dir():
        return None
    from .suite.datasets import dataset_id
    from .suite.results import load_results
    from .suite.tasks import get_task

    task = get_task(args.suite, args.task)
    ref = load_results(args.suite, args.suite_results)["tasks"][args.task]["tuning"]["reference"]
    return dataset_id(task, ref)


def _bench_headroom(args) -> float | None:
    """With ``--task``: the task's hard-stratum headroom (the evaluations log
    ``eval/bench_score_estimate`` with it); else None."""
    if args.task is None:
        return None
    from .suite.agents import task_headroom

    return task_headroom(args.suite, args.task, args.suite_results)


def _task_args(args) -> str:
    """With ``--task``: fill ``args.env`` and ``args.env_kwargs`` from the bench task (the
    options it sets may not be given too) and return the evaluation split ("train"); without it,
    require ``--env`` and return "heldout"."""
    if args.task is None:
        given = [f for f, v in (("--suite", args.suite != "v1"), ("--suite-results", args.suite_results)) if v]
        if given:
            raise ConfigError(f"{', '.join(given)} need --task")
        if args.env is None:
            raise ConfigError("--env or --task is required (--env: an environment id; --task: a bench task id)")
        return "heldout"
    from .suite.agents import task_training

    env_id, task_kw = task_training(args.suite, args.task, args.suite_results)
    # another observation version of the task's scheduling environment is allowed (it observes more)
    other_version = args.env in SCHEDULING_IDS and env_id in SCHEDULING_IDS and args.env != env_id
    clash = [f for f, v in (("--env", args.env and not other_version), ("--scenario", args.scenario),
                            ("--window-s", args.window_s)) if v]
    if clash:
        raise ConfigError(f"{', '.join(clash)}: set by --task {bounded_repr(args.task)}; leave them out"
                          + (" (--env may name another version of its environment: "
                             f"{', '.join(SCHEDULING_IDS)})" if "--env" in clash and env_id in SCHEDULING_IDS else ""))
    env_id = args.env if other_version else env_id
    mine = _json_arg(args.env_kwargs, "--env-kwargs")
    fixed = sorted(set(mine) & set(task_kw))
    if fixed:
        raise ConfigError(f"--env-kwargs: {fixed} set by --task {bounded_repr(args.task)}; an agent of the task "
                          "may set only other arguments (those that change the observation or action space, such "
                          "as k, make a checkpoint the leaderboard refuses)")
    args.env = env_id
    args.env_kwargs = json.dumps({**task_kw, **mine})
    return "train"


def cmd_train(args, console) -> int:
    eval_split = _task_args(args)
    prepare_out_dir(args.out)  # an --out that cannot be written was an OSError traceback
    if args.backend == "rllib":
        return _train_rllib(args, console)
    if args.num_env_runners or args.address:
        raise ConfigError("--num-env-runners and --address are for --backend rllib")
    if args.algo == "es":
        return _train_es(args, console)
    from kvsched.agents.train import default_n_envs, train

    meta = train(args.env, args.algo, args.timesteps, args.out, scenario=args.scenario, window_s=args.window_s,
                 env_kwargs=_json_arg(args.env_kwargs, "--env-kwargs"), seed=args.seed,
                 n_envs=args.n_envs if args.n_envs is not None else default_n_envs(args.algo),
                 subprocess=args.subprocess, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                 eval_episodes=args.eval_episodes, resume=args.resume, threads=args.threads,
                 progress_bar=not args.no_progress and sys.stderr.isatty(),  # off a terminal: progress lines
                 hyperparameters=_json_arg(args.hyperparameters, "--hyperparameters"), max_cpu_s=args.max_cpu_s,
                 eval_split=eval_split, max_wall_s=args.max_wall_s, policy_net=args.policy_net,
                 reference_bias=args.reference_bias, bc_dataset=args.bc_dataset, bc_dataset_id=_bc_dataset_id(args),
                 bc_epochs=args.bc_epochs, discount_time_s=args.discount_time_s,
                 trust_checkpoint=args.trust_checkpoint,
                 bench_headroom=_bench_headroom(args), progress=progress_lines.counter("env steps", args.timesteps))
    stopped = "" if meta["status"] == "finished" else f" ({meta['status']})"
    console.print(f"trained {meta['timesteps']} steps in {meta['wall_s']:.1f} s "
                  f"({meta['env_steps_per_s']:.1f} env steps/s){stopped}; model: {args.out / 'final.zip'}",
                  highlight=False, markup=False)
    return 0


def _train_es(args, console) -> int:
    """``kvsched train --algo es`` (:func:`kvsched.agents.es.train_es`)."""
    from kvsched.agents.es import ESConfig, train_es
    from kvsched.agents.train import env_kwargs_for

    unused = [f for f, v in (("--n-envs", args.n_envs is not None), ("--subprocess", args.subprocess),
                             ("--policy-net", args.policy_net != "mlp"),
                             ("--reference-bias", args.reference_bias != 0.0),
                             ("--bc-dataset", args.bc_dataset is not None), ("--resume", args.resume is not None),
                             ("--checkpoint-every", args.checkpoint_every is not None),
                             ("--eval-every", args.eval_every is not None)) if v]
    if args.discount_time_s is not None:
        raise ConfigError("--discount-time-s: --algo es has no discount (its fitness is each episode's SLO "
                          "attainment); it is for --algo ppo or maskable_ppo")
    if "reward" in _json_arg(args.env_kwargs, "--env-kwargs"):
        raise ConfigError("--env-kwargs reward: --algo es ignores the environment's reward (its fitness is each "
                          "episode's SLO attainment); leave it out")
    if unused:
        raise ConfigError(f"{', '.join(unused)}: not options of --algo es (it starts at the reference, checkpoints "
                          "every generation and validates on train windows; set it with --hyperparameters)")
    if args.env not in SCHEDULING_IDS:
        raise ConfigError(f"--algo es acts in {' or '.join(SCHEDULING_IDS)}; got {args.env}")
    config = ESConfig.from_mapping(_json_arg(args.hyperparameters, "--hyperparameters"))
    kw = env_kwargs_for(args.env, "es", args.scenario, args.window_s, _json_arg(args.env_kwargs, "--env-kwargs"))
    # one line per generation (train_es's progress); off a terminal the progress lines count the
    # generations and do not repeat the line (kvsched.experiments.progress)
    generations = progress_lines.counter("generations", config.generations)
    finished = [0]

    def say(message: str) -> None:
        if not args.no_progress:
            console.print(message, highlight=False, markup=False)
            finished[0] += 1
            if generations is not None:
                generations(finished[0])

    meta = train_es(args.env, kw, args.out, config, seed=args.seed, max_cpu_s=args.max_cpu_s,
                    max_wall_s=args.max_wall_s, max_steps=args.timesteps, progress=say,
                    command=" ".join(["kvsched", *sys.argv[1:]]) if sys.argv and "kvsched" in sys.argv[0] else None)
    console.print(f"trained {meta['generations']} generations ({meta['timesteps']} env steps) in {meta['cpu_s']:.1f} "
                  f"CPU s ({meta['status']}); final: {meta['final']}; model: {args.out / 'final.zip'}",
                  highlight=False, markup=False)
    return 0


def _train_rllib(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvsched.agents.rllib import train_rllib

    if args.algo != "ppo":
        raise ConfigError(f"--backend rllib trains PPO; --algo {bounded_repr(args.algo)} is not allowed there "
                          "(use --algo ppo)")
    unused = [f for f, v in (("--n-envs", args.n_envs is not None), ("--subprocess", args.subprocess),
                             ("--max-cpu-s", args.max_cpu_s is not None),
                             ("--max-wall-s", args.max_wall_s is not None),
                             ("--policy-net", args.policy_net != "mlp"),
                             ("--reference-bias", args.reference_bias != 0.0),
                             ("--bc-dataset", args.bc_dataset is not None)) if v]
    if args.discount_time_s is not None:
        raise ConfigError("--discount-time-s is a Stable-Baselines3 option (a rollout buffer discounting by "
                          "simulated time); --backend rllib discounts per decision")
    if unused:
        raise ConfigError(f"{', '.join(unused)}: Stable-Baselines3 options; with --backend rllib use "
                          "--num-env-runners")
    kw = dict(env_kwargs=_json_arg(args.env_kwargs, "--env-kwargs"), seed=args.seed,
              num_env_runners=args.num_env_runners, address=args.address, resume=args.resume,
              trust_checkpoint=args.trust_checkpoint,
              hyperparameters=_json_arg(args.hyperparameters, "--hyperparameters"))
    if args.no_progress or not sys.stderr.isatty():  # off a terminal: progress lines (kvsched.experiments.progress)
        meta = train_rllib(args.env, args.timesteps, args.out, args.scenario, args.window_s,
                           progress=progress_lines.counter("env steps", args.timesteps), **kw)
    else:
        with Progress(TextColumn("RLlib PPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as prog:
            task = prog.add_task("train", total=args.timesteps)
            meta = train_rllib(args.env, args.timesteps, args.out, args.scenario, args.window_s,
                               progress=lambda done, total: prog.update(task, completed=done), **kw)
    console.print(f"trained {meta['timesteps']} env steps in {meta['iterations']} iterations, {meta['wall_s']:.1f} s "
                  f"({meta['env_steps_per_s']:.1f} env steps/s); checkpoint: {meta['checkpoint']}")
    return 0


def _paired_against_first(out, console) -> None:
    """Each agent against the first of ``--agents`` on the same episodes (window x seed):
    ``paired.csv`` in ``out`` and a table (mean difference, 95 % bootstrap CI, episodes worse;
    :func:`kvsched.experiments.compare.paired`). Nothing with one agent."""
    import pandas as pd

    from kvsched import atomic_files

    from .compare import paired, paired_rich_table

    episodes = pd.read_csv(Path(out) / "episodes.csv")
    agents = list(dict.fromkeys(episodes["agent"]))
    if len(agents) < 2:
        return
    table = paired(episodes, agents, key="agent",
                   metrics=(("slo_attainment", False), ("goodput_rps", False), ("ttft_p99_s", True)))
    with atomic_files.replacing(Path(out) / "paired.csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.17g")
    n = int(table["runs"].max()) if len(table) else 0
    console.print(paired_rich_table(table, f"each against {agents[0]}, episode by episode over the same {n} "
                                           "episodes (class all): mean difference [95 % bootstrap CI], episodes "
                                           "worse"))


def cmd_evaluate(args, console) -> int:
    from kvsched.agents.evaluate import METRICS, evaluate, format_cell

    prepare_out_dir(args.out)  # an --out that cannot be written was an OSError traceback

    agents = comma_list(args.agents, "--agents")
    run = lambda progress=None: evaluate(  # noqa: E731
        agents, args.scenario, args.windows, args.seeds, args.out, window_s=args.window_s,
        stochastic=args.stochastic, backend=args.backend, address=args.address, progress=progress,
        env_id=args.env, trust_checkpoint=args.trust_checkpoint)
    if args.no_progress or not sys.stderr.isatty():  # off a terminal: progress lines (kvsched.experiments.progress)
        table = run(progress_lines.counter("episodes"))
    else:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn(f"evaluating ({args.backend})"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True), transient=True) as prog:
            task = prog.add_task("episodes", total=None)
            table = run(lambda done, total: prog.update(task, completed=done, total=total))
    nw, ns = table.attrs["windows"], args.seeds
    t = Table(title=f"held-out evaluation ({nw} window{'s' if nw != 1 else ''} x {ns} seed{'s' if ns != 1 else ''}; "
                    "mean ± 95% CI)")
    for c in ("agent", "class", "episodes", "SLO attainment", "goodput req/s", "TTFT p99 s"):
        t.add_column(c)
    for _, r in table.iterrows():
        t.add_row(str(r["agent"]), str(r["class"]), str(r["episodes"]),
                  *[format_cell(r[m], r[m + "_ci95"]) for m in METRICS])
    console.print(t)
    _paired_against_first(args.out, console)
    written = [n for n in ("table.csv", "table.md", "episodes.csv", "paired.csv", "ttft_cdf.png",
                           "learning_curve.png") if (Path(args.out) / n).is_file()]
    console.print(f"written: {args.out}/" + ", ".join(written))
    return 0
