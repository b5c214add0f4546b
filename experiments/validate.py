"""``kvsched validate``: replay every measured experiment and score kvsched beside its peers.

For every replayable experiment of the ground truth (:mod:`kvsched.experiments.groundtruth`),
every load stage and every metric of the sim-to-real table (TTFT mean/p90/p99, ITL mean, E2E
mean/p90/p99, ms) this reports the measured value, kvsched's prediction, its absolute
percentage error ``APE = 100·|pred − meas| / meas``, and the APE of each peer simulator whose
prediction the sim-to-real csv holds for the same row. The summary gives the mean APE (MAPE)
per metric over the held-out experiments (those not in the calibration's ``train`` list), over
the training experiments, and -- for each peer -- over exactly the held-out rows the peer
predicted, beside kvsched's MAPE on those same rows. Experiments that cannot be replayed are
listed with the reason.

Rows are per load stage (``stage_index >= 0`` of the csv); the csv's whole-run rows
(``stage_index = -1``) repeat the single-stage runs and are not scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from kvsched.envs.sim.calibration import CalibrationFile
from kvsched.envs.sim.specs import CostParams
from kvsched.envs.sim.errors import MAX_PATH_CHARS, bounded_repr

from .calibrate import Objective
from .groundtruth import METRICS, PEERS, Experiment
from .replay import ape
from kvsched import atomic_files

__all__ = ["ValidationReport", "peer_comparison", "plot_predicted_vs_measured", "score", "summary_table"]


@dataclass(frozen=True)
class ValidationReport:
    """Outcome of :func:`score`.

    Attributes:
        rows: one row per (experiment, stage, metric): exp_id, label, split ("train" /
            "held-out"), stage, metric, measured_ms, kvsched_ms, kvsched_ape, and
            ``<peer>_ms`` / ``<peer>_ape`` per peer (NaN where the csv has no prediction).
        skipped: (exp_id, reason) of the experiments not replayed.
        cost: the cost parameters used.
        train: training experiment ids.
    """

    rows: pd.DataFrame
    skipped: tuple[tuple[str, str], ...]
    cost: CostParams
    train: tuple[str, ...]


def score(exps: Sequence[Experiment], cost: CostParams, train: Sequence[str] = (), jobs: int = 2,
          groundtruth: str | None = None, stage_cap_s: float | None = None) -> ValidationReport:
    """Replay every replayable experiment with ``cost`` and score it (see the module docstring).

    Args:
        exps: experiments (those with a skip reason are listed, not replayed).
        cost: cost parameters.
        train: ids of the experiments the calibration was fitted on.
        jobs: worker processes.
        groundtruth: ground-truth directory (for the workers).
        stage_cap_s: cut every stage to this many seconds (None: full runs; tests use a cap).
    """
    from kvsched.envs.sim.errors import ConfigError, KvschedError, UnknownPresetError

    from .replay import instance_spec_for

    ok, skipped_l = [], []
    for e in exps:
        if e.skip_reason:
            skipped_l.append((e.exp_id, str(e.skip_reason)))
            continue
        try:  # a run whose served system cannot be built (e.g. weights too big) is skipped, not fatal
            instance_spec_for(e, cost)
        except (ConfigError, UnknownPresetError) as err:
            skipped_l.append((e.exp_id, f"cannot build its served system: {err}"))
            continue
        ok.append(e)
    skipped = tuple(skipped_l)
    train_set = set(train)
    try:
        with Objective(ok, METRICS, stage_cap_s, jobs, groundtruth) as obj:
            results = obj.results(cost)
    except (RuntimeError, KvschedError):
        # one run failed in a worker (e.g. requests a configuration cannot serve): replay them one
        # by one here, skip the failing ones with their error, keep the others
        from .replay import replay

        kept, results = [], []
        for e in ok:
            try:
                results.append(replay(e, cost, stage_cap_s=stage_cap_s))
            except (RuntimeError, KvschedError) as err:
                skipped_l.append((e.exp_id, f"replay failed: {bounded_repr(str(err), 300)}"))
                continue
            kept.append(e)
        ok, skipped = kept, tuple(skipped_l)
    recs = []
    for e, r in zip(ok, results):
        for s in e.stages:
            for m in METRICS:
                meas, pred = s.values_ms[m], r.stages_ms[s.stage][m]
                row = {"exp_id": e.exp_id, "label": e.label, "split": "train" if e.exp_id in train_set else "held-out",
                       "stage": s.stage, "metric": m, "measured_ms": meas, "kvsched_ms": pred,
                       "kvsched_ape": ape(pred, meas)}
                for p in PEERS:
                    v = s.peers_ms.get(m, {}).get(p, float("nan"))
                    row[f"{p}_ms"] = v
                    row[f"{p}_ape"] = ape(v, meas) if np.isfinite(v) else float("nan")
                recs.append(row)
    return ValidationReport(pd.DataFrame.from_records(recs), skipped, cost, tuple(train))


def summary_table(report: ValidationReport) -> pd.DataFrame:
    """MAPE per metric: kvsched on held-out and on train rows, with the row counts."""
    rows = report.rows
    out = []
    for m in METRICS:
        r = rows[rows["metric"] == m]
        ho, tr = r[r["split"] == "held-out"], r[r["split"] == "train"]
        out.append({"metric": m, "held_out_mape": ho["kvsched_ape"].mean(), "held_out_rows": len(ho),
                    "held_out_max_ape": ho["kvsched_ape"].max(), "train_mape": tr["kvsched_ape"].mean(),
                    "train_rows": len(tr)})
    return pd.DataFrame(out)


def peer_comparison(report: ValidationReport, split: str = "held-out") -> pd.DataFrame:
    """For each peer and metric: the peer's MAPE and kvsched's MAPE on exactly the rows of
    ``split`` the peer predicted (NaN-free), with the row count."""
    rows = report.rows[report.rows["split"] == split]
    out = []
    for p in PEERS:
        for m in METRICS:
            r = rows[(rows["metric"] == m) & rows[f"{p}_ape"].notna()]
            if len(r):
                out.append({"peer": p, "metric": m, "rows": len(r), "peer_mape": r[f"{p}_ape"].mean(),
                            "kvsched_mape": r["kvsched_ape"].mean()})
    return pd.DataFrame(out, columns=["peer", "metric", "rows", "peer_mape", "kvsched_mape"])


def plot_predicted_vs_measured(report: ValidationReport, path: str | Path) -> Path:
    """Log-log scatter of predicted vs measured per metric group (TTFT, ITL, E2E), train and
    held-out marked, with y = x and a ±10 % band; kvsched and (hollow) Vidur / BLIS-evolved.
    Written with matplotlib's Agg backend to ``path`` (PNG/PDF/SVG by suffix)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    groups = {"TTFT": ("ttft_mean", "ttft_p90", "ttft_p99"), "ITL": ("itl_mean",),
              "E2E": ("e2e_mean", "e2e_p90", "e2e_p99")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for ax, (title, ms) in zip(axes, groups.items()):
        r = rows[rows["metric"].isin(ms)]
        lo = float(np.nanmin(r[["measured_ms", "kvsched_ms"]].to_numpy())) * 0.8
        hi = float(np.nanmax(r[["measured_ms", "kvsched_ms"]].to_numpy())) * 1.25
        xs = np.geomspace(lo, hi, 50)
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, xs * 0.9, xs * 1.1, color="0.85", label="±10 %")
        for split, marker in (("train", "s"), ("held-out", "o")):
            s = r[r["split"] == split]
            ax.scatter(s["measured_ms"], s["kvsched_ms"], marker=marker, s=22, label=f"kvsched ({split})", zorder=3)
        for peer, marker in (("vidur", "^"), ("blis-evolved", "D")):
            s = r[r[f"{peer}_ms"].notna()]
            if len(s):
                ax.scatter(s["measured_ms"], s[f"{peer}_ms"], marker=marker, s=22, facecolors="none",
                           edgecolors="C3" if peer == "vidur" else "C2", label=peer, zorder=2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(f"{title} ({', '.join(ms)})", fontsize=9)
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted (ms)")
        ax.legend(fontsize=7)
    fig.suptitle("kvsched vs real vLLM on H100 (sim-to-real experiments, per load stage)")
    fig.tight_layout()
    p = Path(path)
    with atomic_files.replacing(p) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return p


def cost_notes(exps: Sequence[Experiment]) -> list[str]:
    """One line per GPU other than the calibrated one among the replayable runs, saying which
    cost parameters its runs use (``replay.cost_source``: literature defaults where kvsched
    ships no calibration for that GPU)."""
    from kvsched.envs.sim.errors import UnknownPresetError

    from .replay import CALIBRATED_GPU, cost_source, gpu_preset_of

    lines: dict[str, str] = {}
    for e in exps:
        if e.skip_reason:
            continue
        try:
            gpu, src = gpu_preset_of(e.hardware), cost_source(e)
        except UnknownPresetError:
            continue
        if src != "given":
            what = ("literature defaults of CostParams (no calibration for this GPU)" if src == "literature defaults"
                    else "its shipped calibration")
            lines[gpu] = f"cost parameters for runs on {gpu}: {what}; the calibration above applies to {CALIBRATED_GPU}"
    return [lines[k] for k in sorted(lines)]


def calibration_or_default(path: str | Path | None, gpu: str = "H100-SXM") -> tuple[CostParams, tuple[str, ...], str]:
    """(cost, train ids, description) from a calibration file, else from the shipped one of
    ``gpu``, else the literature defaults (no training set)."""
    from kvsched.envs.sim.calibration import calibration_path, load_calibration

    p = Path(path) if path is not None else calibration_path(gpu)
    if p.is_file():
        cal: CalibrationFile = load_calibration(p)
        return cal.cost, cal.train, f"{p} (gpu {cal.gpu}, version {cal.version})"
    if path is not None:
        raise FileNotFoundError(f"calibration file {bounded_repr(str(p), MAX_PATH_CHARS)} not found")
    return CostParams(), (), "literature defaults (no calibration file)"


# ------------------------------------------------------------------------------------------------
# command line


def add_arguments(p) -> None:
    """Arguments of ``kvsched validate`` (an argparse sub-parser)."""
    p.add_argument("--groundtruth", help="ground-truth directory (default: $KVSCHED_GROUNDTRUTH or "
                                         "../shared/groundtruth)")
    p.add_argument("--calibration", type=Path, help="calibration file (default: the shipped H100-SXM one)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--plot", type=Path, help="write the predicted-vs-measured plot here (PNG, PDF or SVG)")
    p.add_argument("--out", type=Path, help="write rows.csv, summary.csv, peers.csv and plot.png into this directory")
    p.add_argument("--stage-cap-s", type=float, help="cut every stage to this many seconds (default: full runs)")
    p.add_argument("--json", action="store_true", help="print rows and summaries as JSON")


def _fmt(v: float, digits: int = 1) -> str:
    return "–" if not np.isfinite(v) else f"{v:.{digits}f}"


def cmd_validate(a, console) -> int:
    """Run ``kvsched validate`` (see the module docstring); returns the exit code."""
    import json

    from rich.table import Table

    from .groundtruth import find_groundtruth, load_experiments

    gt = str(find_groundtruth(a.groundtruth))
    exps = load_experiments(gt)
    cost, train, desc = calibration_or_default(a.calibration)
    report = score(exps, cost, train, a.jobs, gt, a.stage_cap_s)
    summ = summary_table(report)
    peers = peer_comparison(report)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        with atomic_files.replacing(a.out / "rows.csv") as tmp:
            report.rows.to_csv(tmp, index=False)
        with atomic_files.replacing(a.out / "summary.csv") as tmp:
            summ.to_csv(tmp, index=False)
        with atomic_files.replacing(a.out / "peers.csv") as tmp:
            peers.to_csv(tmp, index=False)
    plot_path = a.plot or (a.out / "plot.png" if a.out else None)
    if plot_path is not None:
        plot_predicted_vs_measured(report, plot_path)
    if a.json:
        print(json.dumps({"cost_params": dataclasses.asdict(cost), "calibration": desc, "train": list(train),
                          "cost_notes": cost_notes(exps), "skipped": [list(s) for s in report.skipped],
                          "rows": json.loads(report.rows.to_json(orient="records")),
                          "summary": json.loads(summ.to_json(orient="records")),
                          "peers": json.loads(peers.to_json(orient="records"))}, indent=1))
        return 0
    console.print(f"cost parameters: {desc}", highlight=False)
    for line in cost_notes(exps):
        console.print(line, highlight=False)
    shown_peers = [p for p in PEERS if report.rows[f"{p}_ape"].notna().any()]
    t = Table(title="kvsched vs real vLLM (H100), per experiment, load stage and metric; times in ms, errors in %")
    for col in ("experiment", "split", "stage", "metric", "measured", "kvsched", "APE"):
        t.add_column(col, justify="left" if col in ("experiment", "split", "metric") else "right")
    for p in shown_peers:
        t.add_column(f"{p} APE", justify="right")
    prev = None
    for r in report.rows.to_dict("records"):
        key = (r["exp_id"], r["stage"])
        name = r["label"] if key != prev else ""
        prev = key
        t.add_row(name, r["split"] if name else "", str(r["stage"]) if name else "", r["metric"],
                  _fmt(r["measured_ms"]), _fmt(r["kvsched_ms"]), _fmt(r["kvsched_ape"]),
                  *[_fmt(r[f"{p}_ape"]) for p in shown_peers])
    console.print(t)
    held = sorted(report.rows.loc[report.rows["split"] == "held-out", "label"].unique())
    t2 = Table(title="MAPE per metric (%): kvsched over held-out and training experiments")
    for col in ("metric", "held-out MAPE", "held-out rows", "held-out max APE", "train MAPE", "train rows"):
        t2.add_column(col, justify="left" if col == "metric" else "right")
    for r in summ.itertuples(index=False):
        t2.add_row(r.metric, _fmt(r.held_out_mape), str(r.held_out_rows), _fmt(r.held_out_max_ape), _fmt(r.train_mape),
                   str(r.train_rows))
    console.print(t2)
    if len(peers):
        t3 = Table(title="held-out rows a peer predicted: peer MAPE vs kvsched MAPE on the same rows (%)")
        for col in ("peer", "metric", "rows", "peer MAPE", "kvsched MAPE"):
            t3.add_column(col, justify="left" if col in ("peer", "metric") else "right")
        for r in peers.itertuples(index=False):
            t3.add_row(r.peer, r.metric, str(r.rows), _fmt(r.peer_mape), _fmt(r.kvsched_mape))
        console.print(t3)
    console.print("training experiments: " + (", ".join(train) or "none"), highlight=False)
    console.print("held-out experiments: " + ", ".join(held), highlight=False)
    for exp_id, reason in report.skipped:
        console.print(f"skipped {exp_id}: {reason}", highlight=False)
    if plot_path is not None:
        console.print(f"wrote {plot_path}", highlight=False)
    return 0
