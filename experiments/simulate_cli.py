"""``kvsched simulate``: serve a trace on a simulated vLLM-like instance (or cluster) and report
TTFT/TPOT/ITL/E2E, SLO attainment and goodput per length class.

Holds the command's options (:func:`add_arguments`) beside its handler (:func:`cmd_simulate`);
:mod:`kvsched.experiments.cli` wires them in through :mod:`kvsched.experiments.commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import kvsched
from kvsched.envs.sim.errors import KvschedError, bounded_repr, MAX_PATH_CHARS
from kvsched.envs.sim.metrics import SUMMARY_ROW_HEADERS, format_summary_rows, summary_to_json
from kvsched.envs.sim.specs import TP_DEGREES
from kvsched.envs.sim.strict_json import parse_object

from . import progress as progress_lines
from . import cli_types
from .consoles import stderr_console
from .outputs import prepare_out_dir, prepare_out_file
from kvsched.runner.scenario import DEFAULT_GPU, DEFAULT_MODEL, DEFAULT_TRACE, Scenario, load_scenario
from kvsched.runner.simulate import scenario_cluster_kwargs
from kvsched import atomic_files


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The ``kvsched simulate`` options (flags override the ``--scenario`` file's fields)."""
    s.add_argument("--scenario", help="scenario YAML file (flags below override its fields)")
    s.add_argument("--trace", help=f"bundled trace name or path (default {DEFAULT_TRACE}); see `kvsched traces`")
    s.add_argument("--model", help=f"model preset or its Hugging Face id (default {DEFAULT_MODEL}; see `kvsched "
                   "presets`), or the path of another model's Hugging Face config.json or of the directory "
                   "holding one (docs/cli.md#presets-and-traces)")
    s.add_argument("--gpu", help=f"GPU preset (default {DEFAULT_GPU})")
    s.add_argument("--tp", type=int, choices=TP_DEGREES, help="tensor-parallel degree (1, 2, 4, 8)")
    s.add_argument("--policy", help="scheduler policy (default fcfs)")
    s.add_argument("--policy-params", metavar="JSON",
                   help='policy parameters, merged over the scenario\'s, e.g. '
                        '\'{"admission_preemption": "cost-gated", "prefetch": true}\'')
    s.add_argument("--instances", type=cli_types.instances, help="number of instances (default 1)")
    s.add_argument("--router", help="cluster router with several instances (default round-robin); one of "
                                    "round-robin (rr), least-loaded, session-affinity, cache-affinity, prefix, "
                                    "llm-d, dynamo")
    s.add_argument("--router-params", metavar="JSON", help='router parameters, e.g. \'{"cache_threshold": 0.5}\'')
    s.add_argument("--router-delay", type=cli_types.number(0.0, strict=False), metavar="S",
                   help="routers see instance state refreshed every S simulated seconds (default 0: live)")
    s.add_argument("--window", nargs=2, type=cli_types.number(0.0, strict=False), action=cli_types.Window,
                   metavar=("START_S", "END_S"),
                   help="serve only requests arriving in [START_S, END_S) of the trace's own seconds "
                        "(cut before --rate-scale; rebased to 0)")
    s.add_argument("--rate-scale", type=cli_types.number(0.0, strict=True),
                   help="multiply the request rate (compress arrivals; > 0; after --window)")
    s.add_argument("--max-requests", type=cli_types.count,
                   help="serve only the first N requests (after --window and --rate-scale)")
    s.add_argument("--seed", type=cli_types.seed, help="seed for synthetic workloads (default 0)")
    s.add_argument("--out", type=Path, help="write records, summary.json, occupancy and run.json here")
    s.add_argument("--format", choices=("csv", "parquet"), default="csv", help="per-request records format")
    s.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    s.add_argument("--no-fast-forward", action="store_true",
                   help="advance every step one by one (same results, slower; for checking)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--timeline", type=cli_types.timeline_file, metavar="FILE",
                   help="write the schedule as a Chrome/Perfetto trace (FILE.json or FILE.json.gz; open it in "
                        "ui.perfetto.dev); see docs/timeline.md")
    s.add_argument("--timeline-window", type=cli_types.timeline_window, metavar="START:END",
                   help="only the timeline's events in [START, END] simulated seconds (END may be empty)")
    s.add_argument("--policy-file", type=Path,
                   help="policy, parameters and engine settings from a `kvsched export --target kvsched` JSON "
                        "(and the router with its parameters, from a router study)")


def _registered(registry, name: str) -> str:
    """The registered name ``name`` refers to in ``registry`` (any case, aliases), or ``name``
    itself when unknown (the scenario's validation then names it)."""
    from kvsched.envs.sim.errors import UnknownPresetError

    try:
        return registry.canonical(name)
    except UnknownPresetError:
        return name


def _check_role_overrides(sc: Scenario, given: dict) -> None:
    """A flag that sets an instance field a ``cluster:`` role sets too would reach only the other
    roles (a role's own fields win over ``instance``): refused rather than half applied.

    Raises:
        KvschedError: ``given`` (``flag -> (field, value)``) names a field a role overrides.
    """
    roles = sc.cluster if isinstance(sc.cluster, dict) else {}
    for flag, (key, val) in given.items():
        for role in ("prefill", "decode", "mixed"):
            sec = roles.get(role)
            inst = sec.get("instance") if isinstance(sec, dict) else None
            if isinstance(inst, dict) and key in inst and inst[key] != val:
                raise KvschedError(f"{flag}={bounded_repr(val)} is not allowed: the scenario's "
                                   f"cluster.{role}.instance sets {key}={bounded_repr(inst[key])}, which a flag does "
                                   f"not override; edit the scenario's {role} role or drop the flag")


def _scenario_from_args(a: argparse.Namespace) -> Scenario:
    """The scenario to run: the ``--scenario`` file (or the defaults) with the flags given applied over it."""
    sc = load_scenario(a.scenario) if a.scenario else Scenario(source="command line")
    over: dict = {}
    if a.trace:
        over["trace"], over["synthetic"] = a.trace, None
    inst = dict(sc.instance)
    for key, val in (("model", a.model), ("gpu", a.gpu), ("tp", a.tp)):
        if val is not None:
            inst[key] = val
    over["instance"] = inst
    _check_role_overrides(sc, {f"--{k}": (k, v) for k, v in (("model", a.model), ("gpu", a.gpu), ("tp", a.tp))
                               if v is not None})
    from kvsched.policies.base import POLICIES
    from kvsched.policies.routing import ROUTERS

    if a.policy is not None and _registered(POLICIES, a.policy) != sc.policy:
        over["policy_params"] = {}  # the scenario's parameters belong to its own policy
    if a.router is not None and _registered(ROUTERS, a.router) != sc.router:
        over["router"], over["router_params"] = a.router, {}  # the scenario's parameters belong to its router
    if a.router_params is not None:
        over["router_params"] = parse_object(a.router_params, "--router-params", "the router's parameters")
    if a.router_delay is not None:
        over["router_delay_s"] = a.router_delay
    for key, val in (("policy", a.policy), ("n_instances", a.instances), ("rate_scale", a.rate_scale),
                     ("max_requests", a.max_requests), ("seed", a.seed)):
        if val is not None:
            over[key] = val
    if a.window:
        over["window_s"] = tuple(a.window)
    if getattr(a, "policy_file", None) is not None:
        from .export import load_policy_file

        pf = load_policy_file(a.policy_file)
        if a.policy is not None and a.policy != pf["policy"]:
            raise KvschedError(f"--policy {a.policy} contradicts --policy-file "
                               f"{bounded_repr(str(a.policy_file), MAX_PATH_CHARS)} "
                               f"(policy {bounded_repr(pf['policy'])}); give one of them")
        over["policy"], over["policy_params"] = pf["policy"], pf["policy_params"]
        over["instance"] = {**over["instance"], **pf["engine"]}
        _check_role_overrides(sc, {f"--policy-file engine field {k}": (k, v) for k, v in pf["engine"].items()})
        if pf["router"] is not None:  # a router study's file: its tuned router and every parameter
            from kvsched.policies.routing import ROUTERS

            if a.router is not None and ROUTERS.canonical(a.router) != pf["router"]:
                raise KvschedError(f"--router {a.router} contradicts --policy-file "
                                   f"{bounded_repr(str(a.policy_file), MAX_PATH_CHARS)} "
                                   f"(router {bounded_repr(pf['router'])}); give one of them")
            over["router"] = pf["router"]
            over["router_params"] = {**pf["router_params"], **over.get("router_params", {})} \
                if a.router_params is not None else pf["router_params"]
    if getattr(a, "policy_params", None) is not None:
        pp = parse_object(a.policy_params, "--policy-params", "the policy's parameters")
        over["policy_params"] = {**over.get("policy_params", sc.policy_params), **pp}
    return sc.with_overrides(**over)


def _layout(spec) -> str:
    """The long-context layout beyond TP for the headers (docs/long-context.md), "" without one."""
    par = spec.parallel
    return "" if par is None else f" x {par.describe()} ({spec.num_gpus} GPUs)"


def _instances(sc, spec) -> str:
    """The served instances for the header: ``N x model / GPU TPn (blocks, budget, seats)``, or with
    prefill/decode roles one such part per role, each with its merged spec (docs/disaggregation.md)."""
    def one(n: int, s, role: str = "") -> str:
        return (f"{n} x {role}{s.model.name} / {s.gpu.name} TP{s.tp}{_layout(s)} ({s.num_hbm_blocks:,} KV blocks of "
                f"{s.block_size_tokens} tokens, budget {s.token_budget} tokens, max {s.max_seqs} seqs)")

    layout = sc.cluster_layout()
    if layout is None:
        return one(sc.n_instances, spec)
    specs = iter(sc.instance_specs())
    parts = []
    for role in ("prefill", "decode", "mixed"):
        n = layout.counts[role]
        if n:
            role_spec = next(specs)
            for _ in range(n - 1):
                next(specs)
            parts.append(one(n, role_spec, f"{role} "))
    return " + ".join(parts)


def model_notes(specs) -> list[str]:
    """One line per distinct model among ``specs`` read from a Hugging Face config.json (not a
    preset): what was read and derived from it -- parameters (active ones and the experts of a
    mixture of experts), the weight dtype in force and which weights it covers, the context (after
    RoPE scaling or a sliding-window cap) -- then the spec's ``source`` with the file."""
    from kvsched.envs.sim.hf_config import HF_CONFIG_SOURCE

    notes, seen = [], set()
    for s in specs:
        m = s.model
        if not m.source.startswith(HF_CONFIG_SOURCE) or (m, s.effective_weight_dtype) in seen:
            continue
        seen.add((m, s.effective_weight_dtype))
        moe = ""
        if m.is_moe:
            shared = f" + {m.n_shared_experts} shared" if m.n_shared_experts else ""
            moe = (f" ({m.active_params / 1e9:.2f} B active; {m.n_experts} experts, top-{m.experts_per_token}"
                   f"{shared}, routing_skew {m.routing_skew})")
        which = {"all": "", "mlp": " on the MLP/expert weights", "linear": " on the decoder Linear layers"}
        dtype = s.effective_weight_dtype
        notes.append(f"model {m.name}: {m.n_params / 1e9:.2f} B parameters{moe}, {dtype} weights"
                     f"{which.get(m.quantized_weights, '') if dtype not in ('bf16', 'fp16') else ''}, context "
                     f"{m.max_context_tokens:,} tokens; {m.source}")
    return notes


def default_cost_notes(specs) -> list[str]:
    """One line per GPU among ``specs`` some of whose cost parameters are the GPU's defaults and
    those are not the calibration fitted on real vLLM runs
    (:func:`~kvsched.envs.sim.calibration.default_cost_source`). A partial ``cost:`` mapping takes
    its other fields from those defaults (``spec_io``), so it gets the note too, naming the fields
    set away from the defaults (a few, then a count); a spec whose every field differs gets none."""
    import dataclasses

    from kvsched.envs.sim.calibration import default_cost_params, default_cost_source
    from kvsched.envs.sim.specs import CostParams

    names = [f.name for f in dataclasses.fields(CostParams)]
    sources: dict[str, str | None] = {}
    set_by_gpu: dict[str, list[str]] = {}
    for s in specs:
        gpu = s.gpu.name
        if gpu not in sources:
            sources[gpu] = default_cost_source(s.gpu)
        if sources[gpu] is None:
            continue
        default = default_cost_params(s.gpu)
        own = [] if s.cost_is_default else [f for f in names if getattr(s.cost_params, f) != getattr(default, f)]
        if len(own) < len(names) and (gpu not in set_by_gpu or len(own) < len(set_by_gpu[gpu])):
            set_by_gpu[gpu] = own  # the instance that takes the most fields from the defaults
    notes = []
    for gpu, own in set_by_gpu.items():
        but = ""
        if own:
            shown = ", ".join(own[:3]) + (f" and {len(own) - 3} more" if len(own) > 3 else "")
            but = f" other than {shown} (set away from the defaults)"
        notes.append(f"cost parameters for {gpu}{but}: {sources[gpu]} (docs/fidelity.md#gpus-other-than-the-h100)")
    return notes


def cmd_simulate(a: argparse.Namespace, console: Console) -> int:
    """``kvsched simulate``: run the scenario, print its summary (table or ``--json``) and write
    ``--out``; returns the exit code."""
    from kvsched.runner.simulate import simulate
    from kvsched.envs.sim.instance import InstanceOptions

    if a.format == "parquet" and not a.out:
        raise KvschedError("--format parquet needs --out DIR (records are only written with --out)")
    if getattr(a, "timeline_window", None) is not None and getattr(a, "timeline", None) is None:
        raise KvschedError("--timeline-window needs --timeline FILE")
    prepare_out_file(getattr(a, "timeline", None), "--timeline")
    if a.out:
        prepare_out_dir(a.out)
    sc = _scenario_from_args(a)
    spec = sc.instance_spec()
    workload = sc.workload()
    sc.check_slo_classes(workload)
    err = stderr_console()
    if not a.json:
        for note in workload.notes:
            first = note.splitlines()[0]
            err.print(f"[yellow]note:[/] {first[:240]}{' ...' if len(first) > 240 or chr(10) in note else ''}",
                      highlight=False)
    options = InstanceOptions(fast_forward=not a.no_fast_forward, oracle_lengths=sc.oracle_lengths)
    routing_flags = [f for f, v in (("--router", a.router), ("--router-params", a.router_params),
                                    ("--router-delay", a.router_delay)) if v is not None]
    if sc.n_instances == 1 and routing_flags and not a.json:
        err.print(f"[yellow]note:[/] {', '.join(routing_flags)} has no effect on 1 instance (a router picks among "
                  "instances; give --instances N)", highlight=False)
    if not a.json:
        for note in model_notes(sc.instance_specs()) + default_cost_notes(sc.instance_specs()):
            err.print(f"[yellow]note:[/] {escape(note)}", highlight=False)  # a path or name may hold [brackets]
        err.print(
        f"kvsched {kvsched.__version__}: {len(workload):,} requests of [bold]{escape(workload.name)}[/] on "
        f"{escape(_instances(sc, spec))}, policy {sc.policy}"
        + (f", router {sc.router}" + (f" (state {sc.router_delay_s:g} s old)" if sc.router_delay_s else "")
           + (", shared KV tier" if sc.shared_kv else "") if sc.n_instances > 1 else ""),
        highlight=False)
    t0 = time.perf_counter()
    show = not (a.no_progress or a.json) and sys.stderr.isatty()
    with _timeline(a, sc, workload, spec) as observer:
        if show:
            with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=Console(stderr=True), transient=True) as prog:
                task = prog.add_task("sim", total=len(workload))
                result = simulate(workload, spec, sc.policy, sc.metrics_config(), options, sc.n_instances,
                                  progress=lambda n: prog.update(task, completed=n), observer=observer,
                                  **scenario_cluster_kwargs(sc))
        else:  # off a terminal: a progress line at least every 30 s (kvsched.experiments.progress)
            result = simulate(workload, spec, sc.policy, sc.metrics_config(), options, sc.n_instances,
                              progress=progress_lines.counter("requests", len(workload)), observer=observer,
                              **scenario_cluster_kwargs(sc))
        if observer is not None:
            observer.add_records(result.records)
    if observer is not None and not a.json:
        err.print(f"wrote timeline {a.timeline} ({observer.events_written:,} events; open it in "
                  "https://ui.perfetto.dev)", highlight=False, markup=False)
    run_end_s = _last_finish_s(result.records)
    if observer is not None and a.timeline_window is not None and a.timeline_window[0] > run_end_s:
        err.print(f"note: --timeline-window starts at {a.timeline_window[0]:g} s, after the run's end "
                  f"({run_end_s:.3f} s simulated): the timeline holds no events of the run", highlight=False)
    wall_s = time.perf_counter() - t0
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    summary = result.summary
    summary["run"] = _run_identity(sc, workload, spec)
    if a.json:
        print(summary_to_json(summary))
    else:
        rows = format_summary_rows(summary)
        table = Table(title=escape(f"{sc.name}: {sc.policy} on {sc.n_instances} x {spec.model.name} / "
                                   f"{spec.gpu.name} TP{spec.tp}{_layout(spec)}"))  # the title is markup
        table.add_column("metric")
        for r in rows:  # one column per class (all, short, long): fits a narrow terminal
            table.add_column(r[0], justify="right")
        for j, header in enumerate(SUMMARY_ROW_HEADERS[1:], start=1):
            table.add_row(header, *[r[j] for r in rows])
        console.print(table)
        _print_routing(summary, console)
        st = result.stats
        console.print(
            f"simulated {summary['duration_s'] or 0.0:.1f} s in {wall_s:.2f} s wall "
            f"({len(workload) / max(wall_s, 1e-9):,.0f} requests/s, {st['events']:,} events, "
            f"{st['steps']:,} steps of which {st['fast_forward_steps']:,} fast-forwarded in "
            f"{st['fast_forward_stretches']:,} stretches; peak RSS {peak_rss_mib:,.0f} MiB)",
            highlight=False)
    if a.out:
        _write_outputs(a, sc, workload, spec, result, wall_s, peak_rss_mib, console)
    return 0




def _last_finish_s(records) -> float:
    """The run's last request finish (simulated seconds; 0 when none finished): a
    ``--timeline-window`` starting after it keeps no event of the run."""
    import numpy as np

    finish = records["finish_s"].to_numpy(dtype=np.float64) if len(records) else np.zeros(0)
    finish = finish[np.isfinite(finish)]
    return float(finish.max()) if finish.size else 0.0


@contextlib.contextmanager
def _timeline(a: argparse.Namespace, sc: Scenario, workload, spec):
    """The ``--timeline`` writer (:class:`kvsched.runner.timeline.TimelineWriter`), or None; its
    file is put in place when the run ends without an error."""
    if getattr(a, "timeline", None) is None:
        yield None
        return
    from kvsched.runner.timeline import TimelineWriter, instance_labels

    meta = {"kvsched_version": kvsched.__version__, "scenario": sc.name, "workload": workload.name,
            "policy": sc.policy, "seed": sc.seed, "n_instances": sc.n_instances,
            "fast_forward": not a.no_fast_forward}
    if sc.n_instances > 1:
        meta["router"] = sc.router
    with TimelineWriter(a.timeline, instance_labels(sc.n_instances, spec), a.timeline_window, meta) as tl:
        yield tl


def _print_routing(summary: dict, console: Console) -> None:
    """A line on prefix caching (HBM's hit rate; one per lower tier caching prefixes), one on
    routing (load share, prefix hits) and one on the shared KV tier, when present."""
    pt = summary.get("prefix_tiers")
    prefix = summary["classes"]["all"].get("prefix") or {}
    if pt or (prefix.get("hit_tokens") or 0) > 0:
        console.print(f"prefix cache: HBM hit rate {100 * (prefix.get('hit_rate') or 0):.1f} % of prompt tokens",
                      highlight=False)
    if pt:
        for name, t in pt["tiers"].items():
            # the hit rate counts other requests' prefixes; a load may also be a preempted request's own
            # work (self hits), printed beside it so that loads with a 0 % hit rate read right
            console.print(f"  {name} ({t['eviction']}): hit rate {100 * (t['hit_rate'] or 0):.2f} % "
                          f"(+{t['self_hit_tokens']:,} self-hit tokens), "
                          f"{t['loads']:,} loads ({t['bytes_loaded'] / 1e9:,.1f} GB), "
                          f"{t['bytes_written'] / 1e9:,.1f} GB written in {t['writes']:,} writes "
                          f"({t['skipped_writes']:,} skipped), {t['evicted_segments']:,} segments evicted",
                          highlight=False)
    r = summary.get("routing")
    if r:
        hit = summary["classes"]["all"]["prefix"]["hit_rate"]
        ls = r["load_share"]  # bounded: a cluster may have thousands of instances
        shown = ls if len(ls) <= 16 else [*ls[:8], None, *ls[-4:]]
        share = ", ".join("..." if x is None else f"{100 * x:.0f}" for x in shown) \
            + ("" if len(ls) <= 16 else f" ({len(ls):,} instances)")
        console.print(f"router {r['router']}: prefix hit rate {100 * (hit or 0):.1f} %, load share % per instance "
                      f"[{share}], imbalance (max/mean) {r['load_imbalance']:.2f}", highlight=False)
    k = summary.get("shared_kv")
    if k:
        console.print(f"shared KV tier: {k['fetches']:,} fetches, {k['bytes_fetched'] / 1e9:,.1f} GB fetched, "
                      f"{k['hit_tokens']:,} hit tokens, {k['recompute_chosen']:,} recomputed instead, "
                      f"{k['bytes_written'] / 1e9:,.1f} GB written, {k['evicted_segments']:,} segments evicted",
                      highlight=False)
    d = summary.get("disaggregation")
    if d:  # prefill/decode roles (docs/disaggregation.md)
        roles = d["roles"]
        t = d["transfer_s"]["mean"]
        console.print(f"prefill/decode: {roles.count('prefill')}P{roles.count('decode')}D"
                      + (f"{roles.count('mixed')}M" if "mixed" in roles else "")
                      + f", {d['remote_prefills']:,} remote / {d['local_prefills']:,} local prefills, "
                      f"{d['bytes_moved'] / 1e9:,.1f} GB over {d['link']['name']} ({d['transfer']}), mean transfer "
                      f"{1e3 * (t or 0):.2f} ms, busiest port {100 * d['link_utilisation_max']:.1f} % busy; "
                      f"no room: {d['waits_for_room']:,} waited, {d['recomputed']:,} recomputed, "
                      f"{d['rejected']:,} rejected", highlight=False)


def _run_identity(sc: Scenario, workload, spec) -> dict:
    """What was simulated (deterministic: no wall time), included in summary.json and --json."""
    ident = {
        "kvsched_version": kvsched.__version__,
        "scenario": sc.name,
        "scenario_sha256": sc.sha256(),
        "workload": workload.name,
        "workload_sha256": workload.content_sha256(),
        "requests": len(workload),
        "model": spec.model.name,
        "gpu": spec.gpu.name,
        "tp": spec.tp,
        "n_instances": sc.n_instances,
        "policy": sc.policy,
        "seed": sc.seed,
    }
    if sc.n_instances > 1:  # the router only acts with several instances
        ident.update(router=sc.router, router_delay_s=sc.router_delay_s, shared_kv=sc.shared_kv is not None)
    return ident


def _write_outputs(a, sc, workload, spec, result, wall_s, peak_rss_mib, console) -> None:
    """Write the records (CSV or Parquet), summary.json, occupancy.csv and run.json into ``--out``."""
    from kvsched.envs.sim.specs import instance_spec_to_dict

    out: Path = a.out
    if a.format == "parquet":
        try:
            with atomic_files.replacing(out / "records.parquet") as tmp:
                result.records.to_parquet(tmp, index=False)
        except ImportError as e:
            raise KvschedError(f"--format parquet needs pyarrow ({e}); pip install -e '.[parquet]' in the kvsched "
                               "checkout") from None
    else:
        with atomic_files.replacing(out / "records.csv") as tmp:
            result.records.to_csv(tmp, index=False)
    stale = out / ("records.csv" if a.format == "parquet" else "records.parquet")
    if stale.is_file():  # an earlier run's records in the other format would pass for this run's
        stale.unlink()
    atomic_files.write_text(out / "summary.json", summary_to_json(result.summary) + "\n")
    with atomic_files.replacing(out / "occupancy.csv") as tmp:
        result.occupancy.to_csv(tmp, index=False)
    run = {
        "kvsched_version": kvsched.__version__,
        "records": f"records.{a.format}",
        "scenario": sc.to_dict(),
        "scenario_sha256": sc.sha256(),
        "workload": {"name": workload.name, "requests": len(workload),
                     "source_sha256": workload.source_sha256,
                     "content_sha256": workload.content_sha256(), "notes": list(workload.notes)},
        "instance": instance_spec_to_dict(spec),
        "stats": result.stats,
        "wall_s": wall_s,
        "peak_rss_mib": peak_rss_mib,
        "python": platform.python_version(),
    }
    atomic_files.write_text(out / "run.json", json.dumps(run, indent=2, sort_keys=True, default=str) + "\n")
    if not a.json:
        console.print(f"wrote {out}/records.{a.format}, summary.json, occupancy.csv, run.json",
                      highlight=False, markup=False)
