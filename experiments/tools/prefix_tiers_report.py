"""The tiered prefix cache on the Mooncake conversation trace: hit rate per tier, TTFT and bytes
moved for HBM only vs HBM + DRAM vs HBM + DRAM + NVMe under LRU, session-aware and the
clairvoyant bound (issue #21's report; docs/architecture.md "Prefix caches below HBM").

Every row serves the same requests (the trace's first ``--window-s`` seconds, ``--rate-scale``)
on ``n`` H100s (Llama-3.1-8B, ``gpu_memory_utilization`` as given), routed round-robin, with
write-through, cost-gated loads and the given eviction policy in every listed tier. Deterministic:
one run per row, no seed to vary.

Usage::

    python -m kvsched.experiments.tools.prefix_tiers_report --instances 4 16 --out prefix_tiers.md
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from kvsched.envs.sim.prefix_offload import PrefixOffloadSpec
from kvsched.envs.sim.specs import InstanceSpec, get_gpu, get_model
from kvsched.envs.workload.traces import load_trace, scale_rate, window
from kvsched.runner.simulate import simulate

GiB = 2**30
CONFIGS = (("HBM only", None, ()), ("HBM+DRAM", ("dram",), ()), ("HBM+DRAM+NVMe", ("dram", "nvme"), ()))


def rows(instances: int, window_s: float, rate_scale: float, util: float, dram_gib: float, nvme_gib: float) -> list:
    """One row per (tiers, eviction): the summary figures (JSON-ready)."""
    w = window(load_trace("mooncake-conversation"), 0.0, window_s)
    if rate_scale != 1.0:
        w = scale_rate(w, rate_scale)
    base = InstanceSpec(get_model("Llama-3.1-8B"), get_gpu("H100-SXM"), gpu_memory_utilization=util,
                        dram_kv_bytes=dram_gib * GiB, nvme_kv_bytes=nvme_gib * GiB)
    out = []
    for label, tiers, _ in CONFIGS:
        for ev in (("lru",) if tiers is None else ("lru", "session", "clairvoyant")):
            po = None if tiers is None else PrefixOffloadSpec(tiers=tiers, eviction=ev)
            spec = dataclasses.replace(base, prefix_offload=po)
            c0 = time.process_time()
            r = simulate(w, spec, n_instances=instances)
            a = r.summary["classes"]["all"]
            pt = r.summary.get("prefix_tiers", {}).get("tiers", {})
            moved = r.stats["link_bytes"]
            out.append({
                "instances": instances, "tiers": label, "eviction": "-" if tiers is None else ev,
                "requests": len(w), "hbm_hit_rate": a["prefix"]["hit_rate"],
                "dram_hit_rate": pt.get("dram", {}).get("hit_rate"),
                "nvme_hit_rate": pt.get("nvme", {}).get("hit_rate"),
                "ttft_p50_s": a["ttft_s"]["p50"], "ttft_p99_s": a["ttft_s"]["p99"],
                "bytes_written_gb": sum(t["bytes_written"] for t in pt.values()) / 1e9,
                "bytes_loaded_gb": sum(t["bytes_loaded"] for t in pt.values()) / 1e9,
                "link_bytes_gb": sum(moved.values()) / 1e9, "cpu_s": time.process_time() - c0,
            })
    return out


def markdown(table: list) -> str:
    """The rows as a markdown table (rates in %, times in s, bytes in GB)."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}"

    lines = ["| instances | tiers | eviction | HBM hit % | DRAM hit % | NVMe hit % | TTFT p50 (s) | TTFT p99 (s) "
             "| written (GB) | loaded (GB) | all links (GB) |", "|" + "---|" * 11]
    for r in table:
        lines.append(f"| {r['instances']} | {r['tiers']} | {r['eviction']} | {pct(r['hbm_hit_rate'])} | "
                     f"{pct(r['dram_hit_rate'])} | {pct(r['nvme_hit_rate'])} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['bytes_written_gb']:.0f} | {r['bytes_loaded_gb']:.0f} | "
                     f"{r['link_bytes_gb']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, nargs="+", default=[4, 16])
    p.add_argument("--window-s", type=float, default=600.0)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dram-gib", type=float, default=128.0)
    p.add_argument("--nvme-gib", type=float, default=1024.0)
    p.add_argument("--out", help="write the markdown table here (default: stdout)")
    a = p.parse_args(argv)
    table = [r for n in a.instances for r in rows(n, a.window_s, a.rate_scale, a.gpu_memory_utilization,
                                                  a.dram_gib, a.nvme_gib)]
    text = markdown(table)
    from kvsched.experiments.tools.residency_headroom import write_or_print

    write_or_print(a.out, text)


if __name__ == "__main__":
    main()
