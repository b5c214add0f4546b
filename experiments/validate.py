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

**Generalisation tables** (:func:`breakdown_table`): the MAPE per metric over held-out and over
training rows, per model family, TP degree and GPU. **Sim-to-real csv** (:func:`csv_coverage`,
:func:`peer_comparison`): which csv experiments kvsched replays (and why not the others), and per
peer its MAPE beside kvsched's on exactly the rows the peer predicted.

**Seeds** (``seeds`` > 1): every experiment is replayed with seeds 0..N-1 (workload generator,
step-time noise when the cost parameters turn it on, the client's send jitter when asked). A
row's prediction is the mean over seeds, with its standard deviation; the summary gives the
MAPE of the mean prediction and the mean and standard deviation over seeds of each seed's MAPE.
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
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr

from .calibrate import Objective
from .groundtruth import METRICS, PEERS, Experiment
from .replay import ape
from kvsched import atomic_files

__all__ = ["BREAKDOWNS", "ValidationReport", "breakdown_table", "csv_coverage", "gpus_scored", "peer_comparison",
           "plot_predicted_vs_measured", "runs_table", "score", "summary_table"]

BREAKDOWNS = (("model_family", "model family"), ("tp", "TP degree"), ("gpu", "GPU"))
"""Row columns the generalisation tables group by, with their display names."""


@dataclass(frozen=True)
class ValidationReport:
    """Outcome of :func:`score`.

    Attributes:
        rows: one row per (experiment, stage, metric): exp_id, label, split ("train" /
            "held-out"), source, model_family, tp, gpu, stage, metric, measured_ms, kvsched_ms
            (mean over seeds), kvsched_ape (of that mean), kvsched_ms_sd, kvsched_ape_seed_mean,
            kvsched_ape_seed_sd (over seeds; NaN sd with one seed), and ``<peer>_ms`` /
            ``<peer>_ape`` per peer (NaN where the csv has no prediction).
        skipped: (exp_id, reason) of the experiments not replayed.
        cost: the cost parameters used.
        train: training experiment ids.
        per_seed: one row per (exp_id, stage, metric, seed): kvsched_ms, kvsched_ape.
        runs: one row per experiment (replayed or not): :func:`runs_table`.
        seeds: replay seeds 0..seeds-1.
        client_jitter: whether the client's send jitter was replayed.
    """

    rows: pd.DataFrame
    skipped: tuple[tuple[str, str], ...]
    cost: CostParams
    train: tuple[str, ...]
    per_seed: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    runs: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    seeds: int = 1
    client_jitter: bool = False


def runs_table(exps: Sequence[Experiment], train: Sequence[str],
               skipped: Sequence[tuple[str, str]] = ()) -> pd.DataFrame:
    """One row per experiment: exp_id, label, source, model_family, model_id, the model spec it was
    replayed with (``model``: a preset's name or the config-read model's, empty when none;
    ``model_source``: the spec's source, for a config.json its path and what was read), the prompt
    re-tokenisation factor (``prompt_scale``, 1.0 = nominal lengths: no measurement for the tokenizer),
    tp, gpu, split ("train" / "held-out" / "not replayed"), vllm_version and where it was looked
    for, whether the sim-to-real csv scores it, skip reason (the ground truth's, or ``skipped``'s:
    the runs :func:`score` could not build or replay, which are "not replayed" too), the vLLM
    serving flags it was replayed with (dp, max_num_batched_tokens, max_num_seqs, max_model_len,
    gpu_memory_utilization, cpu_offload, kv_offloading_gib (None: the default size), precision,
    weight_dtype, enable_prefix_caching,
    enable_chunked_prefill, kv_cache_dtype, block_size) and its notes (joined by " | ")."""
    train_set = set(train)
    reasons = {e.exp_id: str(e.skip_reason) for e in exps if e.skip_reason}
    for exp_id, reason in skipped:
        reasons.setdefault(exp_id, reason)
    return pd.DataFrame.from_records([
        {"exp_id": e.exp_id, "label": e.label, "source": e.source, "model_family": e.model_family,
         "model_id": e.model_id, "model": e.model.name if e.model is not None else "",
         "model_source": e.model.source if e.model is not None else "",
         "prompt_scale": e.workload.prompt_scale,
         "tp": e.tp, "gpu": e.hardware,
         "split": "not replayed" if e.exp_id in reasons else ("train" if e.exp_id in train_set else "held-out"),
         "vllm_version": e.vllm_version, "vllm_version_source": e.vllm_version_source,
         "in_sim_to_real_csv": e.source == "sim_to_real" or any(bool(st.peers_ms) for st in e.stages),
         "skip_reason": reasons.get(e.exp_id, ""), "dp": e.dp, "max_num_batched_tokens": e.max_num_batched_tokens,
         "max_num_seqs": e.max_num_seqs, "max_model_len": e.max_model_len,
         "gpu_memory_utilization": e.gpu_memory_utilization, "cpu_offload": e.cpu_offload,
         "kv_offloading_gib": e.kv_offloading_gib, "precision": e.precision, "weight_dtype": e.weight_dtype,
         "enable_prefix_caching": e.enable_prefix_caching,
         "enable_chunked_prefill": e.enable_chunked_prefill, "kv_cache_dtype": e.kv_cache_dtype,
         "block_size": e.block_size, "notes": " | ".join(e.notes)} for e in exps])


def score(exps: Sequence[Experiment], cost: CostParams, train: Sequence[str] = (), jobs: int = 2,
          stage_cap_s: float | None = None, seeds: int = 1,
          client_jitter: bool = False, only: Sequence[str] | None = None) -> ValidationReport:
    """Replay every replayable experiment with ``cost`` and score it (see the module docstring).

    Args:
        exps: experiments (those with a skip reason are listed, not replayed).
        cost: cost parameters.
        train: ids of the experiments the calibration was fitted on.
        jobs: worker processes.
        stage_cap_s: cut every stage to this many seconds (None: full runs; tests use a cap).
        seeds: replay every experiment with seeds 0..seeds-1 (>= 1).
        client_jitter: replay the client's measured send lateness
            (:func:`~kvsched.experiments.replay.replay`).
        only: replay only these experiment ids (None: all); the others are not listed.

    Raises:
        ConfigError: ``seeds`` below 1, or an id of ``only`` that is not an experiment.
    """
    from kvsched.envs.sim.errors import ConfigError, KvschedError, UnknownPresetError

    from .replay import instance_spec_for

    if isinstance(seeds, bool) or not isinstance(seeds, (int, np.integer)) or seeds < 1:
        raise ConfigError(f"validate: seeds={bounded_repr(seeds)}; expected an integer >= 1")
    if only is not None:
        known = {e.exp_id for e in exps}
        unknown = [i for i in only if i not in known]
        if unknown:
            # the ids are long and dated: name those containing what was given (e.g. `--only mixtral`),
            # else all of them, bounded either way
            hint = sorted(k for k in known if str(unknown[0]).lower() in k.lower())
            raise ConfigError(f"validate: unknown experiment id {bounded_repr(unknown[0])}; "
                              + (f"ids containing it: {bounded_repr(hint, 600)}" if hint else
                                 f"known ({len(known)}): {bounded_repr(sorted(known), 600)}")
                              + " (runs.csv of --out lists every id)")
        exps = [e for e in exps if e.exp_id in set(only)]
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
    _require_replayable(ok, skipped_l)
    skipped = tuple(skipped_l)
    train_set = set(train)
    try:
        with Objective(ok, METRICS, stage_cap_s, jobs, client_jitter=client_jitter) as obj:
            by_seed = [obj.results(cost, seed=k) for k in range(int(seeds))]
    except (RuntimeError, KvschedError):
        # one run failed in a worker (e.g. requests a configuration cannot serve): replay them one
        # by one here, skip the failing ones with their error, keep the others
        from .replay import replay

        kept, per_exp = [], []
        for e in ok:
            try:
                per_exp.append([replay(e, cost, stage_cap_s=stage_cap_s, seed=k, client_jitter=client_jitter)
                                for k in range(int(seeds))])
            except (RuntimeError, KvschedError) as err:
                skipped_l.append((e.exp_id, f"replay failed: {bounded_repr(str(err), 300)}"))
                continue
            kept.append(e)
        _require_replayable(kept, skipped_l)
        ok, skipped = kept, tuple(skipped_l)
        by_seed = [[r[k] for r in per_exp] for k in range(int(seeds))]
    recs, seed_recs = [], []
    for i, e in enumerate(ok):
        for s in e.stages:
            for m in METRICS:
                meas = s.values_ms[m]
                preds = np.array([res[i].stages_ms[s.stage][m] for res in by_seed])
                apes = np.array([ape(float(p), meas) for p in preds])
                for k, (p, a) in enumerate(zip(preds, apes)):
                    seed_recs.append({"exp_id": e.exp_id, "stage": s.stage, "metric": m, "seed": k,
                                      "kvsched_ms": float(p), "kvsched_ape": float(a)})
                pred = float(preds.mean())
                row = {"exp_id": e.exp_id, "label": e.label, "split": "train" if e.exp_id in train_set else "held-out",
                       "source": e.source, "model_family": e.model_family, "tp": e.tp, "gpu": e.hardware,
                       "stage": s.stage, "metric": m, "measured_ms": meas, "kvsched_ms": pred,
                       "kvsched_ape": ape(pred, meas),
                       "kvsched_ms_sd": float(preds.std(ddof=1)) if len(preds) > 1 else float("nan"),
                       "kvsched_ape_seed_mean": float(apes.mean()),
                       "kvsched_ape_seed_sd": float(apes.std(ddof=1)) if len(apes) > 1 else float("nan")}
                for p in PEERS:
                    v = s.peers_ms.get(m, {}).get(p, float("nan"))
                    row[f"{p}_ms"] = v
                    row[f"{p}_ape"] = ape(v, meas) if np.isfinite(v) else float("nan")
                recs.append(row)
    return ValidationReport(pd.DataFrame.from_records(recs), skipped, cost, tuple(train),
                            pd.DataFrame.from_records(seed_recs), runs_table(exps, train, skipped), int(seeds),
                            bool(client_jitter))


def _require_replayable(ok: list, skipped: list[tuple[str, str]]) -> None:
    """Raise a one-line ConfigError when no experiment is left to replay (every selected one was
    skipped): there is nothing to score, and the tables would have no rows.

    Raises:
        ConfigError: naming how many were skipped and the first one's reason (bounded).
    """
    if ok:
        return
    first = f"; first: {skipped[0][0]}: {bounded_repr(skipped[0][1], 300)[1:-1]}" if skipped else ""
    raise ConfigError(f"validate: no experiment to replay: all {len(skipped)} selected were skipped{first}")


def _seed_mapes(report: ValidationReport, rows: pd.DataFrame) -> np.ndarray:
    """Per seed, the MAPE of kvsched over ``rows`` (keys exp_id, stage, metric)."""
    ps = report.per_seed
    if not len(ps) or not len(rows):
        return np.array([])
    keyed = ps.merge(rows[["exp_id", "stage", "metric"]], on=["exp_id", "stage", "metric"])
    return keyed.groupby("seed")["kvsched_ape"].mean().to_numpy()


def summary_table(report: ValidationReport) -> pd.DataFrame:
    """MAPE per metric: kvsched on held-out and on train rows, with the row counts; with several
    seeds also the mean and standard deviation over seeds of each seed's held-out and train MAPE."""
    rows = report.rows
    out = []
    for m in METRICS:
        r = rows[rows["metric"] == m]
        ho, tr = r[r["split"] == "held-out"], r[r["split"] == "train"]
        row = {"metric": m, "held_out_mape": ho["kvsched_ape"].mean(), "held_out_rows": len(ho),
               "held_out_max_ape": ho["kvsched_ape"].max(), "train_mape": tr["kvsched_ape"].mean(),
               "train_rows": len(tr)}
        for name, part in (("held_out", ho), ("train", tr)):
            per = _seed_mapes(report, part)
            row[f"{name}_mape_seed_mean"] = float(per.mean()) if len(per) else float("nan")
            row[f"{name}_mape_seed_sd"] = float(per.std(ddof=1)) if len(per) > 1 else float("nan")
        out.append(row)
    return pd.DataFrame(out)


def breakdown_table(report: ValidationReport, by: str) -> pd.DataFrame:
    """kvsched's MAPE per metric for each value of row column ``by`` (:data:`BREAKDOWNS`) and
    split: one row per (value, split) with the number of load stages, the experiments, and a
    column per metric."""
    rows = report.rows
    out = []
    for (value, split), g in rows.groupby([by, "split"], sort=True):
        row = {by: value, "split": split, "stages": int(g[["exp_id", "stage"]].drop_duplicates().shape[0]),
               "experiments": int(g["exp_id"].nunique())}
        for m in METRICS:
            row[m] = g.loc[g["metric"] == m, "kvsched_ape"].mean()
        out.append(row)
    return pd.DataFrame(out, columns=[by, "split", "stages", "experiments", *METRICS])


def peer_comparison(report: ValidationReport, split: str | None = "held-out") -> pd.DataFrame:
    """For each peer and metric: the peer's MAPE and kvsched's MAPE on exactly the rows of
    ``split`` (None: every split) the peer predicted (NaN-free), with the row count."""
    rows = report.rows if split is None else report.rows[report.rows["split"] == split]
    out = []
    for p in PEERS:
        for m in METRICS:
            r = rows[(rows["metric"] == m) & rows[f"{p}_ape"].notna()]
            if len(r):
                out.append({"peer": p, "metric": m, "rows": len(r), "peer_mape": r[f"{p}_ape"].mean(),
                            "kvsched_mape": r["kvsched_ape"].mean()})
    return pd.DataFrame(out, columns=["peer", "metric", "rows", "peer_mape", "kvsched_mape"])


def csv_coverage(report: ValidationReport) -> pd.DataFrame:
    """The experiments of the sim-to-real csv: replayed (with the split and the load stages
    scored) or not (with the reason), and how many of the csv's per-stage peer predictions fall
    on the replayed rows."""
    runs = report.runs
    if not len(runs):
        return pd.DataFrame(columns=["exp_id", "label", "split", "stages_scored", "peer_rows", "reason"])
    rows = report.rows
    out = []
    for r in runs.itertuples(index=False):
        if not r.in_sim_to_real_csv:
            continue
        mine = rows[rows["exp_id"] == r.exp_id] if len(rows) else rows
        out.append({"exp_id": r.exp_id, "label": r.label, "split": r.split,
                    "stages_scored": int(mine["stage"].nunique()) if len(mine) else 0,
                    "peer_rows": int(sum(mine[f"{p}_ms"].notna().sum() for p in PEERS)) if len(mine) else 0,
                    "reason": r.skip_reason})
    return pd.DataFrame(out, columns=["exp_id", "label", "split", "stages_scored", "peer_rows", "reason"])


def gpus_scored(report: ValidationReport) -> str:
    """The GPUs of the scored rows as logged (e.g. ``"H100"``, ``"A100, H100"``), sorted; "no GPU"
    without rows."""
    return ", ".join(sorted({str(g) for g in report.rows["gpu"]})) if len(report.rows) else "no GPU"


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
    fig.suptitle(f"kvsched vs real vLLM on {gpus_scored(report)} (per load stage)")
    fig.tight_layout()
    p = Path(path)
    with atomic_files.replacing(p) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return p


def cost_notes(exps: Sequence[Experiment]) -> list[str]:
    """One line per GPU other than the calibrated one among the replayable runs, saying which
    cost parameters its runs use (``replay.cost_source``: where kvsched ships no calibration for
    that GPU, literature defaults for the GPU-side fields and the reference GPU's host-side ones)."""
    from kvsched.envs.sim.calibration import HOST_FIELDS, HOST_REFERENCE_GPU, SAME_CHIP
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
        if gpu == CALIBRATED_GPU:
            continue
        if src == "given":
            lines[gpu] = (f"cost parameters for runs on {gpu}: the calibration above ({gpu} shares "
                          f"{CALIBRATED_GPU}'s chip)")
            continue
        if src == "host terms transferred":
            what = (f"literature defaults of CostParams for the GPU-side fields, the host-side fields "
                    f"({', '.join(HOST_FIELDS)}) of {HOST_REFERENCE_GPU}'s calibration (no calibration for this GPU)")
        elif src == "same-chip calibration":
            what = f"the shipped calibration of {SAME_CHIP[gpu]} (same chip)"
        else:
            what = "its shipped calibration"
        lines[gpu] = f"cost parameters for runs on {gpu}: {what}; the calibration above applies to {CALIBRATED_GPU}"
    return [lines[k] for k in sorted(lines)]


def calibration_or_default(path: str | Path | None, gpu: str = "H100-SXM") -> tuple[CostParams, tuple[str, ...], str]:
    """(cost, train ids, description) from a calibration file, else from the shipped one of
    ``gpu``, else the literature defaults (no training set).

    Raises:
        ConfigError: ``path`` given but not a file (one line naming ``--calibration``), a
            calibration file that does not parse (:func:`~kvsched.envs.sim.calibration.load_calibration`),
            or one of another GPU than ``gpu`` (its cost would be applied to ``gpu``'s runs).
    """
    from kvsched.envs.sim.calibration import calibration_path, load_calibration

    p = Path(path) if path is not None else calibration_path(gpu)
    if p.is_file():
        cal: CalibrationFile = load_calibration(p)
        if cal.gpu != gpu:
            raise ConfigError(f"--calibration {bounded_repr(str(p), MAX_PATH_CHARS)} is not allowed: it calibrates "
                              f"{bounded_repr(cal.gpu)}, and validate applies --calibration to the runs on {gpu} "
                              f"(runs on another GPU take that GPU's default cost parameters, "
                              "docs/fidelity.md#gpus-other-than-the-h100); expected a calibration of " + gpu)
        return cal.cost, cal.train, f"{p} (gpu {cal.gpu}, version {cal.version})"
    if path is not None:
        raise ConfigError(f"--calibration {bounded_repr(str(p), MAX_PATH_CHARS)} is not allowed: expected an existing "
                          "calibration file (kvsched calibrate --out writes one)")
    return CostParams(), (), "literature defaults (no calibration file)"


def _with_tail(path: str | Path | None, cost: CostParams, gpu: str = "H100-SXM") -> tuple[CostParams, str]:
    """``cost`` with the fitted tail of the calibration file (``path`` or the GPU's shipped one).

    Raises:
        ConfigError: no calibration file, or one without ``tail_params``.
    """
    from kvsched.envs.sim.calibration import calibration_path, load_calibration
    from kvsched.envs.sim.errors import ConfigError

    p = Path(path) if path is not None else calibration_path(gpu)
    if not p.is_file():
        raise ConfigError(f"--tail: no calibration file {bounded_repr(str(p), MAX_PATH_CHARS)} to take the tail from")
    cal = load_calibration(p)
    if not cal.tail_params:
        raise ConfigError(f"--tail: {bounded_repr(str(p), MAX_PATH_CHARS)} has no tail_params; fit them with "
                          "kvsched calibrate --tail-only")
    return (dataclasses.replace(cost, **cal.tail_params),
            "tail on: " + ", ".join(f"{k} {v:g}" for k, v in cal.tail_params.items()))


# ------------------------------------------------------------------------------------------------
# command line


def add_arguments(p) -> None:
    """Arguments of ``kvsched validate`` (an argparse sub-parser)."""
    from .cli_types import count, number
    p.add_argument("--groundtruth", help="ground-truth directory (default: $KVSCHED_GROUNDTRUTH or "
                                         "../shared/groundtruth)")
    p.add_argument("--model-configs", type=Path, metavar="DIR",
                   help="Hugging Face config.json of models that are no preset, as DIR/<model>/config.json (the "
                        "layout of inference-sim's model_configs/; <model> is the id's repo name, as given or "
                        "lower-cased) (default: the ground truth's model_configs/ when it has one)")
    p.add_argument("--calibration", type=Path,
                   help="calibration file of the H100-SXM, applied to the runs on it and on the H200 (its chip) "
                        "(default: the shipped one); runs on another GPU use that GPU's default cost parameters: "
                        "its shipped calibration (A100-80GB), else literature GPU-side fields with the H100-SXM's "
                        "host-side ones")
    p.add_argument("--jobs", type=count, default=2, help="worker processes (default 2)")
    p.add_argument("--plot", type=Path, help="write the predicted-vs-measured plot here, in the format of its suffix "
                                             "(.png, .pdf, .svg, ...: one matplotlib writes; checked before the "
                                             "replays, its folder made)")
    p.add_argument("--out", type=Path, help="write rows.csv, summary.csv, peers.csv, breakdown.csv, runs.csv, "
                                            "csv_coverage.csv, per_seed.csv and plot.png into this directory")
    p.add_argument("--stage-cap-s", type=number(0, True),
                   help="cut every stage to this many seconds (default: full runs)")
    p.add_argument("--seeds", type=count, default=1, help="replay every run with seeds 0..N-1 and report the mean "
                                                          "prediction and its spread over seeds (default 1)")
    p.add_argument("--tail", action="store_true",
                   help="turn on the calibration's fitted stochastic tail (its tail_params: step-time noise, "
                        "front-end hiccups); use with --seeds")
    p.add_argument("--client-jitter", action="store_true",
                   help="send each request late by a draw from the client's measured schedule_delay")
    p.add_argument("--only", nargs="+", metavar="EXP_ID",
                   help="replay only these experiments, by full id (runs.csv's exp_id; part of an id is refused "
                        "with the ids containing it) (default: all)")
    p.add_argument("--json", action="store_true", help="print rows and summaries as JSON")


def _fmt(v: float, digits: int = 1) -> str:
    return "–" if not np.isfinite(v) else f"{v:.{digits}f}"


def cmd_validate(a, console) -> int:
    """Run ``kvsched validate`` (see the module docstring); returns the exit code."""
    import json

    from rich.markup import escape
    from rich.table import Table

    from .groundtruth import find_groundtruth, load_experiments

    from .plot_files import prepare_plot_file

    prepare_plot_file(a.plot)  # a suffix matplotlib cannot write fails now, not after the replays
    gt = str(find_groundtruth(a.groundtruth))
    exps = load_experiments(gt, a.model_configs)
    cost, train, desc = calibration_or_default(a.calibration)
    if a.tail:
        cost, tail_desc = _with_tail(a.calibration, cost)
        desc += f"; {tail_desc}"
    report = score(exps, cost, train, a.jobs, a.stage_cap_s, a.seeds, a.client_jitter, a.only)
    selected = exps if a.only is None else [e for e in exps if e.exp_id in set(a.only)]
    gpus = gpus_scored(report)
    summ = summary_table(report)
    peers = peer_comparison(report)
    breakdown = pd.concat([breakdown_table(report, col).rename(columns={col: "value"}).assign(by=col)
                           for col, _ in BREAKDOWNS], ignore_index=True)
    coverage = csv_coverage(report)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        for name, frame in (("rows", report.rows), ("summary", summ), ("peers", peers), ("breakdown", breakdown),
                            ("runs", report.runs), ("csv_coverage", coverage), ("per_seed", report.per_seed)):
            with atomic_files.replacing(a.out / f"{name}.csv") as tmp:
                frame.to_csv(tmp, index=False)
    plot_path = a.plot or (a.out / "plot.png" if a.out else None)
    if plot_path is not None:
        plot_predicted_vs_measured(report, plot_path)
    if a.json:
        print(json.dumps({"cost_params": dataclasses.asdict(cost), "calibration": desc, "train": list(train),
                          "cost_notes": cost_notes(selected), "skipped": [list(s) for s in report.skipped],
                          "rows": json.loads(report.rows.to_json(orient="records")),
                          "summary": json.loads(summ.to_json(orient="records")),
                          "peers": json.loads(peers.to_json(orient="records")),
                          "breakdown": json.loads(breakdown.to_json(orient="records")),
                          "runs": json.loads(report.runs.to_json(orient="records")),
                          "csv_coverage": json.loads(coverage.to_json(orient="records")),
                          "seeds": report.seeds, "client_jitter": report.client_jitter}, indent=1))
        return 0
    console.print(f"cost parameters: {desc}", highlight=False, markup=False)  # paths may hold [brackets]
    for line in cost_notes(selected):
        console.print(line, highlight=False, markup=False)
    shown_peers = [p for p in PEERS if report.rows[f"{p}_ape"].notna().any()]
    t = Table(title=f"kvsched vs real vLLM ({gpus}), per experiment, load stage and metric; times in ms, errors in %")
    for col in ("experiment", "split", "stage", "metric", "measured", "kvsched", "APE"):
        t.add_column(col, justify="left" if col in ("experiment", "split", "metric") else "right")
    for p in shown_peers:
        t.add_column(f"{p} APE", justify="right")
    prev = None
    for r in report.rows.to_dict("records"):
        key = (r["exp_id"], r["stage"])
        name = r["label"] if key != prev else ""
        prev = key
        t.add_row(escape(name), r["split"] if name else "", str(r["stage"]) if name else "", r["metric"],
                  _fmt(r["measured_ms"]), _fmt(r["kvsched_ms"]), _fmt(r["kvsched_ape"]),
                  *[_fmt(r[f"{p}_ape"]) for p in shown_peers])
    console.print(t)
    held = sorted(report.rows.loc[report.rows["split"] == "held-out", "label"].unique())
    t2 = Table(title="MAPE per metric (%): kvsched over held-out and training experiments")
    for col in ("metric", "held-out MAPE", "held-out rows", "held-out max APE", "train MAPE", "train rows"):
        t2.add_column(col, justify="left" if col == "metric" else "right")
    multi = report.seeds > 1
    if multi:
        t2.title += f"; {report.seeds} seeds: per-seed MAPE mean ± sd"
        t2.add_column("held-out per seed", justify="right")
        t2.add_column("train per seed", justify="right")
    for r in summ.itertuples(index=False):
        extra = ([f"{_fmt(r.held_out_mape_seed_mean)} ± {_fmt(r.held_out_mape_seed_sd)}",
                  f"{_fmt(r.train_mape_seed_mean)} ± {_fmt(r.train_mape_seed_sd)}"] if multi else [])
        t2.add_row(r.metric, _fmt(r.held_out_mape), str(r.held_out_rows), _fmt(r.held_out_max_ape), _fmt(r.train_mape),
                   str(r.train_rows), *extra)
    console.print(t2)
    for col, title in BREAKDOWNS:
        bt = breakdown_table(report, col)
        tb = Table(title=f"MAPE per metric (%) per {title} and split (generalisation)")
        for c in (title, "split", "stages", *METRICS):
            tb.add_column(c, justify="left" if c in (title, "split") else "right")
        for r in bt.to_dict("records"):
            tb.add_row(str(r[col]), r["split"], str(r["stages"]), *[_fmt(r[m]) for m in METRICS])
        console.print(tb)
    if len(peers):
        t3 = Table(title="held-out rows a peer predicted: peer MAPE vs kvsched MAPE on the same rows (%)")
        for col in ("peer", "metric", "rows", "peer MAPE", "kvsched MAPE"):
            t3.add_column(col, justify="left" if col in ("peer", "metric") else "right")
        for r in peers.itertuples(index=False):
            t3.add_row(r.peer, r.metric, str(r.rows), _fmt(r.peer_mape), _fmt(r.kvsched_mape))
        console.print(t3)
    if len(coverage):
        t4 = Table(title="sim-to-real csv experiments: replayed (split, stages scored, peer predictions "
                         "on them) or not")
        for c in ("experiment", "split", "stages", "peer rows", "reason"):
            t4.add_column(c, justify="right" if c in ("stages", "peer rows") else "left")
        for r in coverage.itertuples(index=False):
            t4.add_row(escape(r.label), r.split, str(r.stages_scored), str(r.peer_rows), escape(r.reason))
        console.print(t4)
    versions = sorted(set(report.runs["vllm_version"])) if len(report.runs) else []
    if versions:
        console.print("vLLM version of the runs: " + ", ".join(versions) + " (runs.csv says where it was looked for)",
                      highlight=False)
    console.print("training experiments: " + (", ".join(train) or "none"), highlight=False)
    console.print("held-out experiments: " + ", ".join(held), highlight=False)
    for exp_id, reason in report.skipped:
        console.print(f"skipped {exp_id}: {reason}", highlight=False, markup=False)  # --model-configs path
    written = [str(a.out / f"{n}.csv") for n in ("rows", "summary", "peers", "breakdown", "runs", "csv_coverage",
                                                  "per_seed")] if a.out else []
    if plot_path is not None:
        written.append(str(plot_path))
    if written:
        console.print("wrote " + ", ".join(written), highlight=False, markup=False)
    return 0
