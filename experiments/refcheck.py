"""Reference hashes of simulated results: the check that a speed-up changed nothing (issue #8).

``python -m kvsched.experiments.refcheck record OUT.json [RUN ...]`` runs reference simulations
and writes, per run, SHA-256 prefixes of the summary (``summary.json`` bytes), the records frame
and the occupancy frame (CSV bytes), and of the pooled ITL histograms' bin counts, count, min
and max; plus the run's counters (events, steps, stretches, preemptions: these may change, the
results may not). ``python -m kvsched.experiments.refcheck compare BEFORE.json AFTER.json``
lists every result hash that differs and exits 1 if any does. Record on the commit before an
optimisation (e.g. from a ``git archive`` of it) and after, then compare.

The runs (:data:`RUNS`, 36) cover: the bench cases (BLIS, Azure, Mooncake on 1/4/16 instances,
long contexts with swap), several also with fast-forward off; the NVMe tier with swap and
prefetch; every policy (``fcfs``, ``priority``, ``sarathi``, ``nonpreemptive``, ``lars``,
``ewsjf``, ``pnm``) incl. oracle lengths and admission preemption; partial prefills; vLLM V1's
single free queue (``cache_decode_blocks``); routers (``cache-affinity`` with the shared KV tier,
``llm-d``, ``least-loaded`` with a stale view). The whole set takes ~2.5 minutes on one core.

Not hashed: the ITL histograms' float sum (its last bits depend on the order samples are
added; no output uses it, the ITL mean comes from the records).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable
from kvsched import atomic_files

#: Result fields that must be identical (the counters in ``stats`` may change).
RESULT_FIELDS = ("summary", "records", "occupancy", "itl")

_SCENARIOS = Path(__file__).parent / "scenarios"


def _case(name: str, fast_forward: bool = True) -> Callable[[], tuple]:
    def build():
        from kvsched.experiments import bench

        p = bench.get_case(name).build()
        return (p.workload, p.spec, p.n_instances, p.policy, p.metrics, p.oracle_lengths, fast_forward,
                {"policy_params": p.policy_params})
    return build


def _scenario(stem: str, policy: str | None = None, params: dict | None = None, fast_forward: bool = True,
              spec_over: dict | None = None, **over) -> Callable[[], tuple]:
    def build():
        from kvsched.runner.simulate import scenario_cluster_kwargs as _cluster_kwargs
        from kvsched.runner.scenario import load_scenario

        kw = dict(over)
        if policy:
            kw["policy"], kw["policy_params"] = policy, params or {}
        sc = load_scenario(_SCENARIOS / f"{stem}.yaml")
        if kw:
            sc = sc.with_overrides(**kw)
        spec = sc.instance_spec()
        if spec_over:
            spec = replace(spec, **spec_over)
        return (sc.workload(), spec, sc.n_instances, sc.policy, sc.metrics_config(), sc.oracle_lengths, fast_forward,
                _cluster_kwargs(sc))
    return build


#: Reference runs: name -> builder of (workload, spec, n_instances, policy, metrics, oracle_lengths,
#: fast_forward, simulate keyword arguments).
RUNS: dict[str, Callable[[], tuple]] = {
    "blis-1k": _case("blis-1k"),
    "blis-1k-noff": _case("blis-1k", False),
    "blis-10k": _case("blis-10k"),
    "azure-conv": _case("azure-conv"),
    "mooncake-1i": _case("mooncake-1i"),
    "mooncake-4i": _case("mooncake-4i"),
    "mooncake-16i": _case("mooncake-16i"),
    "azure-1k": _case("azure-1k"),
    "azure-1k-noff": _case("azure-1k", False),
    "mooncake-4i-500-noff": _case("mooncake-4i-500", False),
    "mooncake-4i-500": _case("mooncake-4i-500"),
    "long-context-swap": _case("long-context-swap"),
    "swap-60s-noff": _case("swap-60s", False),
    "swap-60s": _case("swap-60s"),
    "nvme-tiered": _scenario("long-context-nvme-tiered"),
    "nvme-tiered-120-noff": _scenario("long-context-nvme-tiered", window_s=(0.0, 120.0), fast_forward=False),
    "nvme-tiered-120": _scenario("long-context-nvme-tiered", window_s=(0.0, 120.0)),
    "mixed-sarathi": _scenario("mixed-long-short", "sarathi"),
    "mixed-lars": _scenario("mixed-long-short", "lars"),
    "mixed-priority": _scenario("mixed-long-short", "priority"),
    "mixed-ewsjf": _scenario("mixed-long-short", "ewsjf"),
    "mixed-nonpreemptive": _scenario("mixed-long-short", "nonpreemptive"),
    "pnm-long": _scenario("long-context-pnm", window_s=(0.0, 300.0)),
    "pnm-long-noff": _scenario("long-context-pnm", window_s=(0.0, 120.0), fast_forward=False),
    "pnm-long-120": _scenario("long-context-pnm", window_s=(0.0, 120.0)),
    "mooncake-pnm": _scenario("mooncake-conversation-pnm", max_requests=3000),
    "router-sharedkv": _scenario("mooncake-conversation-shared-kv", max_requests=3000),
    "router-sharedkv-noff": _scenario("mooncake-conversation-shared-kv", max_requests=1000, fast_forward=False),
    "router-sharedkv-1k": _scenario("mooncake-conversation-shared-kv", max_requests=1000),
    "router-llmd": _scenario("mooncake-conversation", max_requests=3000, router="llm-d", n_instances=4),
    "router-leastloaded-delay": _scenario("mooncake-conversation", max_requests=3000, router="least-loaded",
                                          n_instances=4, router_delay_s=0.05),
    "mixed-lars-oracle": _scenario("mixed-long-short", "lars", oracle_lengths=True),
    "mooncake-2i-2k-v1cache": _scenario("mooncake-conversation", max_requests=2000, n_instances=2,
                                        spec_over={"cache_decode_blocks": True}),
    "mooncake-2i-2k-v1cache-noff": _scenario("mooncake-conversation", max_requests=2000, n_instances=2,
                                             fast_forward=False, spec_over={"cache_decode_blocks": True}),
    "mixed-admission-preempt": _scenario("mixed-long-short", "fcfs", {"admission_preemption": "always"}),
    "notier-partial4": _scenario("long-context-no-tier", spec_over={"max_num_partial_prefills": 4,
                                                                     "max_long_partial_prefills": 2}),
}


def _h(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def run(name: str) -> dict:
    """Simulate reference run ``name``; returns its result hashes, counters and wall seconds.

    Raises:
        KeyError: unknown run name.
    """
    from kvsched.envs.sim.instance import InstanceOptions
    from kvsched.envs.sim.metrics import MetricsConfig, summary_to_json
    from kvsched.policies.base import make_policy
    from kvsched.runner.simulate import build_cluster

    workload, spec, n, policy, metrics, oracle, ff, kw = RUNS[name]()
    kw = dict(kw)
    params = make_policy(policy, kw.pop("policy_params", None)).params  # as simulate() validates them once
    t0 = time.perf_counter()
    cluster = build_cluster([spec] * n, policy, params, metrics=metrics or MetricsConfig(),
                            options=InstanceOptions(fast_forward=ff, oracle_lengths=oracle), **kw)
    r = cluster.run(workload)
    wall = time.perf_counter() - t0
    itl = {k: {f: v for f, v in h.to_dict().items() if f not in ("sum_s", "mean_s")}
           for k, h in sorted(cluster.recorder.itl.items())}
    return {"summary": _h(summary_to_json(r.summary)), "records": _h(r.records.to_csv(index=False)),
            "occupancy": _h(r.occupancy.to_csv(index=False)), "itl": _h(json.dumps(itl, sort_keys=True)),
            "stats": {k: r.stats[k] for k in ("events", "steps", "fast_forward_stretches", "preemptions")},
            "wall_s": round(wall, 3)}


def compare(before: dict, after: dict) -> list[str]:
    """Lines naming each (run, field) whose result hash differs, or a run missing from ``after``."""
    out = []
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            out.append(f"{name}: missing")
            continue
        out += [f"{name}: {f} {b[f]} -> {a[f]}" for f in RESULT_FIELDS if b[f] != a[f]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsched.experiments.refcheck", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run reference simulations and write their hashes")
    rec.add_argument("out", type=Path)
    rec.add_argument("runs", nargs="*", help=f"run names (default: all {len(RUNS)})")
    cmp_ = sub.add_parser("compare", help="compare two recorded hash files")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "record":
        unknown = [n for n in a.runs if n not in RUNS]
        if unknown:
            p.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(RUNS)}")
        res = {}
        for name in a.runs or list(RUNS):
            res[name] = run(name)
            print(name, res[name], flush=True)
        atomic_files.write_text(a.out, json.dumps(res, indent=1) + "\n")
        return 0
    before, after = json.loads(a.before.read_text()), json.loads(a.after.read_text())
    diffs = compare(before, after)
    for line in diffs:
        print(line)
    for name in before:
        if name in after and before[name]["stats"] != after[name]["stats"]:
            print(f"{name}: counters {before[name]['stats']} -> {after[name]['stats']}")
    print(f"{len(before)} runs compared, {len(diffs)} result differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
