"""``kvsched presets`` and ``kvsched traces``: list what ships with kvsched (model, GPU and link
presets; bundled traces). Neither command takes options."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def cmd_presets(a: argparse.Namespace, console: Console) -> int:
    """Print the model, GPU and link presets, one table each."""
    from kvsched.envs.sim.calibration import default_cost_source
    from kvsched.envs.sim.disagg import DISAGG_LINK_PRESETS
    from kvsched.envs.sim.shared_kv import CMX_400G
    from kvsched.envs.sim.specs import presets_rows

    tables = presets_rows()
    # the cluster KV tier's default network is a link name too (`shared_kv: {network: cmx-400g}`), and
    # so are the links between instances of prefill/decode roles (`cluster: {link: ib_ndr_400g}`)
    for lk in (CMX_400G, *DISAGG_LINK_PRESETS.values()):
        tables["links"].append({"name": lk.name, "GB_per_s": round(lk.bytes_per_s / 1e9, 2),
                                "latency_us": round(lk.latency_s * 1e6, 1)})
    from kvsched.envs.sim.hf_config import FAMILIES

    fitted = "its shipped calibration, fitted on real vLLM runs"
    captions = {
        "models": "Hugging Face ids of these are names too, and so are quantized checkpoints of a 16-bit one by their "
                  "id's suffix, e.g. RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8 -> Qwen2.5-7B-INT8 (-FP8-dynamic "
                  "fp8, -quantized.w8a8 int8, -quantized.w4a16 int4; docs/cli.md#presets-and-traces)\n"
                  "Any other model: --model (or a scenario's model:) takes the path of its Hugging Face config.json "
                  f"or of the directory holding one, model_type one of {', '.join(FAMILIES)}",
        "gpus": "\n".join(f"{g['name']} cost parameters: {default_cost_source(g['name']) or fitted}"
                          for g in tables.get("gpus", []))
                + "".join(f"\n{g['name']}: fp8 TFLOPS = bf16 TFLOPS (no FP8 tensor cores: fp8 weights run weight-only)"
                          for g in tables.get("gpus", []) if g["fp8_TFLOPS"] == g["bf16_TFLOPS"])
                + "\n(docs/fidelity.md#gpus-other-than-the-h100)",
        "links": "cmx-400g: only for the cluster KV tier's network (shared_kv.network)\n"
                 "nvlink4 ... ib_hdr_200g: between prefill/decode instances (cluster.link) or GPU groups "
                 "(instance.parallel.link, where nvlink4 has 8 us and ib-ndr400 is ib_ndr_400g)",
    }
    for title, rows in tables.items():
        if not rows:
            continue
        table = Table(title=title, caption=captions.get(title))
        for j, col in enumerate(rows[0]):
            # names never wrap; numeric headers may
            table.add_column(str(col).replace("_", " "), no_wrap=(j == 0), justify="left" if j == 0 else "right")
        for r in rows:
            table.add_row(*[str(v) for v in r.values()])
        console.print(table)
    return 0


def cmd_traces(a: argparse.Namespace, console: Console) -> int:
    """Print the bundled traces as a table."""
    from kvsched.envs.workload.traces import list_traces

    rows = list_traces()
    table = Table(title="bundled traces")
    for col in rows[0]:
        table.add_column(str(col))
    for r in rows:
        table.add_row(*[str(v) for v in r.values()])
    console.print(table)
    return 0
