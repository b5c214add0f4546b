"""The long-context comparison: Medha's layout (PP with stream pipelining, KV parallelism, LARS with
adaptive chunking) against LoongServe's non-preemptive elastic sequence parallelism on the same
GPUs and the same 1M-10M-token mixed workload (docs/long-context.md).

    python -m kvsched.experiments.long_context [--scenarios A,B] [--seeds N] [--rate-scales X,Y,...]
        [--attainment F] [--out DIR]

Runs each scenario (default ``long-context-medha`` and ``long-context-esp``, bundled names or
paths) on the same seeds and prints one row per scenario (short requests' TTFT and end-to-end
latency at p50/p99, the long requests' TTFT, throughput, goodput, makespan) and the ratio of the
baseline (the last scenario) to the first. With several ``--rate-scales`` (the scenarios'
arrivals compressed by each factor, the same requests) it also prints each scenario's capacity:
the highest scale at which at least ``--attainment`` of all requests meet their SLOs (DistServe's
goodput definition, REFERENCE §0), and the capacity ratio. ``--out`` writes ``long_context.csv`` and
``long_context.json`` (each whole or not at all).

Every request must fit the instance's KV: a longer one is refused before any run with a one-line
error naming the request, its tokens and the instance's limit.

Exit status: 0 on success, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.atomic_files import replacing
from kvsched.envs.sim.errors import ConfigError, KvschedError, bounded_repr
from kvsched.experiments.cli_types import comma_list
from kvsched.runner.scenario import load_scenario
from kvsched.runner.simulate import simulate

DEFAULT_SCENARIOS = ("long-context-medha", "long-context-esp")
COLUMNS = ("scenario", "seed", "rate_scale", "gpus", "layout", "policy", "requests", "long_requests",
           "short_ttft_p50_s",
           "short_ttft_p99_s", "short_e2e_p50_s", "short_e2e_p99_s", "short_tpot_p50_s", "long_ttft_p50_s",
           "requests_per_s", "goodput_rps", "slo_attainment", "makespan_s")


def check_capacity(name: str, spec: Any, prompt: np.ndarray, output: np.ndarray) -> None:
    """Refuse a workload whose longest request does not fit the instance's KV (one line).

    Raises:
        ConfigError: naming the request index, its tokens and the limit (``model_len_limit``:
            the KV capacity summed over KV groups and pipeline stages, or the model's context).
    """
    total = prompt.astype(np.int64) + output.astype(np.int64)
    i = int(np.argmax(total))
    if total[i] > spec.model_len_limit:
        raise ConfigError(
            f"{name}: request {i} needs {int(total[i]):,} tokens of KV (prompt + output) but the instance "
            f"holds at most {spec.model_len_limit:,} tokens ({spec.num_hbm_blocks:,} KV blocks over "
            f"{spec._gpus_text()}, model context {spec.model.max_context_tokens:,}); add KV groups or "
            "pipeline stages, or lower long_max_tokens")


def run_one(path: str, seed: int, rate_scale: float = 1.0) -> dict[str, Any]:
    """One scenario at ``seed`` with its arrivals compressed by ``rate_scale``: the comparison's row."""
    sc = load_scenario(path)
    sc = sc.with_overrides(seed=seed, rate_scale=sc.rate_scale * rate_scale)
    spec = sc.instance_spec()
    w = sc.workload()
    prompt = np.asarray(w.prompt_tokens)
    check_capacity(sc.name, spec, prompt, np.asarray(w.output_tokens))
    r = simulate(w, spec, sc.policy, metrics=sc.metrics_config(), policy_params=sc.policy_params, seed=seed)
    s = r.summary
    none = {"counts": {"arrived": 0}, "ttft_s": {"p50": float("nan")}}
    every = s["classes"]["all"]
    short, long_ = s["classes"].get("short", every), s["classes"].get("long", none)
    par = spec.parallel
    return {"scenario": sc.name, "seed": seed, "rate_scale": rate_scale, "gpus": spec.num_gpus,
            "layout": f"TP{spec.tp}" + ("" if par is None else " x " + par.describe()), "policy": sc.policy,
            "requests": int(len(prompt)), "long_requests": int(long_["counts"]["arrived"]),
            "short_ttft_p50_s": short["ttft_s"]["p50"], "short_ttft_p99_s": short["ttft_s"]["p99"],
            "short_e2e_p50_s": short["e2e_s"]["p50"], "short_e2e_p99_s": short["e2e_s"]["p99"],
            "short_tpot_p50_s": short["tpot_s"]["p50"], "long_ttft_p50_s": long_["ttft_s"]["p50"],
            "requests_per_s": every["throughput"]["requests_per_s"], "goodput_rps": every["goodput_rps"],
            "slo_attainment": every["slo"]["attainment"], "makespan_s": s["duration_s"]}


def check_scenarios(names: list[str]) -> None:
    """Load every scenario before any run: each one serves one instance (:func:`run_one` runs its
    ``instance`` alone), and no two share a name (rows and capacities are keyed by it).

    Raises:
        ConfigError: a scenario that does not load, has ``n_instances`` > 1, a ``cluster:`` section
            or a shared KV tier, or a name given twice (one line naming it).
    """
    seen: dict[str, str] = {}
    for given in names:
        sc = load_scenario(given)
        if sc.cluster is not None or sc.n_instances != 1 or sc.shared_kv is not None:
            raise ConfigError(f"--scenarios: {bounded_repr(given)} is not allowed: expected a scenario of one "
                              "instance (no n_instances > 1, cluster: roles or shared_kv; the comparison runs "
                              "the scenario's instance alone)")
        if sc.name in seen:
            raise ConfigError(f"--scenarios: {bounded_repr(given)} and {bounded_repr(seen[sc.name])} are both named "
                              f"{bounded_repr(sc.name)}: expected distinct scenarios (rows are keyed by name)")
        seen[sc.name] = given


def ratios(first: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Baseline over first for latencies (how many times lower the first's are), first over
    baseline for throughput and goodput (how many times higher)."""
    out = {}
    for k in ("short_ttft_p50_s", "short_ttft_p99_s", "short_e2e_p50_s", "short_e2e_p99_s", "long_ttft_p50_s"):
        out[k] = base[k] / first[k] if first[k] > 0 else float("nan")
    for k in ("requests_per_s", "goodput_rps"):
        out[k] = first[k] / base[k] if base[k] > 0 else float("inf")
    return out


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsched.experiments.long_context", description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                    help="comma-separated scenarios, the baseline last (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds: the scenarios' seed, +1, ... (default 1)")
    ap.add_argument("--rate-scales", default="1", help="comma-separated arrival-rate factors (default 1)")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="SLO attainment a rate must keep to count towards capacity (default 0.9)")
    ap.add_argument("--out", type=Path,
                    help="write long_context.csv and long_context.json into this folder (created if missing)")
    a = ap.parse_args(argv)
    try:
        names = comma_list(a.scenarios, "--scenarios")
        if len(names) < 2:
            raise ConfigError(f"--scenarios={bounded_repr(a.scenarios)} is not allowed: expected at least two "
                              "comma-separated scenarios (the baseline last)")
        check_scenarios(names)
        if a.seeds < 1:
            raise ConfigError(f"--seeds={a.seeds} is not allowed: expected an integer >= 1")
        if a.out is not None and a.out.exists() and not a.out.is_dir():
            raise ConfigError(f"--out={bounded_repr(str(a.out))} is not allowed: expected a folder (it is created "
                              "if missing), not a file")
        try:
            scales = [float(x) for x in comma_list(a.rate_scales, "--rate-scales")]
        except ValueError:
            scales = []
        if not scales or not all(0 < x < float("inf") for x in scales) or len(set(scales)) < len(scales):
            raise ConfigError(f"--rate-scales={bounded_repr(a.rate_scales)} is not allowed: expected comma-separated "
                              "distinct finite numbers > 0")
        if not 0 < a.attainment <= 1:
            raise ConfigError(f"--attainment={a.attainment} is not allowed: expected a number in (0, 1]")
        base_seed = load_scenario(names[0]).seed
        rows = [run_one(n, base_seed + k, x) for x in scales for k in range(a.seeds) for n in names]
    except KvschedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\t".join(COLUMNS))
    for r in rows:
        print("\t".join(_fmt(r[c]) for c in COLUMNS))
    per_seed = [rows[i:i + len(names)] for i in range(0, len(rows), len(names))]
    summary = []
    for group in per_seed:
        rt = ratios(group[0], group[-1])
        summary.append({"seed": group[0]["seed"], "first": group[0]["scenario"], "baseline": group[-1]["scenario"],
                        **rt})
        print(f"rate x{group[0]['rate_scale']:g} seed {group[0]['seed']}: {group[0]['scenario']} vs "
              f"{group[-1]['scenario']}: " + ", ".join(f"{k} x{v:.3g}" for k, v in rt.items()))
    capacity: dict[str, Any] = {}
    if len(scales) > 1:
        for n_i in range(len(names)):
            mine = rows[n_i::len(names)]
            best = None  # the highest scale up to which every scale (and seed) keeps the attainment
            for x in sorted(set(scales)):
                if any(r["slo_attainment"] < a.attainment for r in mine if r["rate_scale"] == x):
                    break
                best = x
            capacity[mine[0]["scenario"]] = best
        print(f"capacity (highest rate scale with >= {a.attainment:g} of requests within SLOs, every seed): "
              + ", ".join(f"{k}: {v if v is not None else 'none'}" for k, v in capacity.items()))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        with replacing(a.out / "long_context.csv") as tmp:
            lines = [",".join(COLUMNS)] + [",".join(str(r[c]) for c in COLUMNS) for r in rows]
            tmp.write_text("\n".join(lines) + "\n")
        with replacing(a.out / "long_context.json") as tmp:
            tmp.write_text(json.dumps({"rows": rows, "ratios": summary, "capacity": capacity}, indent=2,
                                      sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
