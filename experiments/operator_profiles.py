"""Calibrate a GPU's kernel-side cost parameters from measured operator times (Vidur's profiles).

``kvsched calibrate --operator-profiles DIR`` fits the parameters of the roofline
(:mod:`kvsched.envs.sim.cost_model`) that belong to the GPU's kernels -- ``mfu_max``,
``mfu_half_tokens`` and ``mbu`` -- to operator times measured on that GPU, and takes every other
field from a calibration fitted on real vLLM runs (``--host-from``, default H100-SXM): the host
side (:data:`~kvsched.envs.sim.calibration.HOST_FIELDS`: the engine core's per-step and
per-sequence CPU work, the API front end) runs the same vLLM code whatever GPU serves, and the
TP all-reduce as vLLM runs it (its custom all-reduce below 8 MiB, ``csrc/custom_all_reduce.cuh``)
is not what a profile of NCCL measures.

The profiles are in the layout of Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation
Framework for LLM Inference", MLSys 2024, §4; ``microsoft/vidur`` ``data/profiling``)::

    DIR/compute/<device>/<org>/<model>/mlp.csv        per (num_tokens, num_tensor_parallel_workers):
                                                     time_stats.<op>.median, ms, of one layer's ops
    DIR/compute/<device>/<org>/<model>/attention.csv  decode (batch_size x kv_cache_size) and prefill
                                                     (prefill_chunk_size after kv_cache_size) attention
    DIR/network/<node>/all_reduce.csv                NCCL all-reduce of `size` bytes over num_workers

A measured step of ``n`` tokens is composed as Vidur's own predictor composes one: the token
embedding plus ``n_layers`` times the layer's operators at ``n`` tokens (norms, QKV and output
projections, rotary embedding, gated-MLP projections and activation, residual add) plus, for the
rows of ``attention.csv``, ``n_layers`` times the attention kernel. The model's prediction is the
roofline's ``max(FLOPs / (F·MFU(n)), bytes / (B·mbu))`` of that step (no step overhead: the
profiles are kernel times from the profiler, without launch gaps or host work; no all-reduce).
Each group of residuals (the layer operators at each TP degree, decode attention, prefill
attention) is weighted by ``1/sqrt(its rows)`` so each counts alike.

The NCCL all-reduce rows within one node (``devices_per_node == num_workers``, NVLink, TP 2/4/8)
are fitted too, as one all-reduce of the cost model's ring at that message size (fixed per-call
latency 0, as :data:`~kvsched.envs.sim.calibration.DEFAULT_FIT_BASE`); that fit is reported beside
the calibration (its notes), not applied, for the reason above.

Nothing here reads a clock or a random generator; pandas reads the CSV files.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from kvsched.envs.sim.calibration import FitParam, FitResult, fit_cost_params
from kvsched.envs.sim.cost_model import ACTIVATION_BYTES, CostModel
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from kvsched.envs.sim.specs import CostParams, GPUSpec, InstanceSpec, ModelSpec, get_model

__all__ = ["KERNEL_FIT_PARAMS", "LAYER_OPS", "ALLREDUCE_FIT_PARAMS", "OperatorProfiles",
           "ProfileFit", "check_device", "fit_operator_profiles", "load_operator_profiles"]

LAYER_OPS: tuple[str, ...] = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
                              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
"""The per-layer operators of Vidur's ``mlp.csv`` (``vidur/profiling/mlp/mlp_impl.py``) summed into
one layer's non-attention time; ``emb`` is added once per step."""

KERNEL_FIT_PARAMS: tuple[FitParam, ...] = (
    FitParam("mfu_max", 0.15, 1.0),
    FitParam("mfu_half_tokens", 1.0, 4096.0),
    FitParam("mbu", 0.3, 1.0),
)
"""What the operator profiles fit: the compute ceiling and its ramp and the bandwidth ceiling
(REFERENCE §5.2), anywhere in their physical range. Unlike ``kvsched calibrate`` on vLLM runs,
the MFU ramp is fitted: the profiles sweep a step from 1 to 4,096 tokens."""

ALLREDUCE_FIT_PARAMS: tuple[FitParam, ...] = (
    FitParam("allreduce_bw_efficiency", 0.05, 1.0),
    FitParam("allreduce_hop_latency_s", 1e-7, 50e-6),
)
"""The ring all-reduce's achieved link share and per-step latency (the bounds of
:data:`~kvsched.envs.sim.calibration.DEFAULT_FIT_PARAMS`, the latency up to 50 µs)."""

ALLREDUCE_TP_DEGREES: tuple[int, ...] = (2, 4, 8)
"""All-reduce group sizes fitted: the TP degrees of one node."""

_MLP_REQUIRED = ("num_tokens", "num_tensor_parallel_workers", "n_head", "n_kv_head", "n_embd", "n_expanded_embd",
                 "time_stats.emb.median") + tuple(f"time_stats.{op}.median" for op in LAYER_OPS)
_ATTN_REQUIRED = ("num_tensor_parallel_workers", "is_prefill", "batch_size", "kv_cache_size", "prefill_chunk_size",
                  "time_stats.attn_decode.median", "time_stats.attn_prefill.median")
_AR_REQUIRED = ("num_workers", "devices_per_node", "size", "time_stats.all_reduce.median")


@dataclass(frozen=True)
class OperatorProfiles:
    """Measured step times composed from one directory of operator profiles (module docstring).

    Attributes:
        root: the directory.
        device: the ``compute/<device>`` folder the profiles come from (e.g. ``"a100"``).
        model: the kvsched preset of the profiled model.
        layers: tp -> (num_tokens, step_s): the layer operators of a whole step (embedding + layers x
            operators), seconds, num_tokens ascending, shape ``(k,)`` each; duplicate rows averaged.
        decode: tp -> (batch_size, kv_cache_size, step_s) of decode steps (layer operators at
            ``batch_size`` tokens + layers x decode attention), or absent without attention.csv.
        prefill: tp -> (chunk_tokens, cached_tokens, step_s) of steps of one prefill chunk.
        all_reduce: tp -> (size_bytes, seconds) within one node, or empty without the network file.
        sources: the files read.
        skipped: human-readable lines on rows that could not be used (attention rows at a TP
            degree mlp.csv did not measure; a network profile without rows within one node).
    """

    root: Path
    device: str
    model: ModelSpec
    layers: Mapping[int, tuple[np.ndarray, np.ndarray]]
    decode: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    prefill: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    all_reduce: Mapping[int, tuple[np.ndarray, np.ndarray]]
    sources: tuple[str, ...]
    skipped: tuple[str, ...] = ()


def _where(path: Path) -> str:
    return bounded_repr(str(path), MAX_PATH_CHARS)


def _read_csv(path: Path, required: Sequence[str]):
    """The CSV at ``path`` as a DataFrame with the ``required`` columns, numeric where named.

    Raises:
        ConfigError: unreadable, not CSV, a required column missing, or a non-finite/negative time.
    """
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise ConfigError(f"{_where(path)}: cannot read as CSV: {bounded_repr(str(e))[1:-1]}") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ConfigError(f"{_where(path)}: missing column {bounded_repr(missing[0])}: expected a Vidur profile "
                          f"with columns {', '.join(required[:4])}, ...")
    if df.empty:
        raise ConfigError(f"{_where(path)}: no rows: expected at least one measured row")
    return df


def _plain(value: object) -> object:
    """A cell as the Python value it holds (``nan`` rather than ``np.float64(nan)`` in messages)."""
    return value.item() if isinstance(value, np.generic) else value


def _column(path: Path, df, column: str, kind: str) -> np.ndarray:
    """Column ``column`` of ``df`` as float64, every value checked: ``kind`` "time" a finite time
    >= 0 (ms), "positive time" a finite time > 0 (ms), "count" an integer >= 1, "size" an integer >= 0.

    Raises:
        ConfigError: the first value that is not a number (text, empty) or out of range; the
            message names the file, the column, the row (0-based, of the data rows) and the value.
    """
    import pandas as pd

    raw = df[column]
    values = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(values)
    if kind == "time":
        ok &= values >= 0
        what = "a finite time >= 0 (ms)"
    elif kind == "positive time":
        ok &= values > 0
        what = "a finite time > 0 (ms)"
    else:
        ok &= (values >= (1 if kind == "count" else 0)) & (np.floor(values) == values)
        what = "an integer >= 1" if kind == "count" else "an integer >= 0"
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ConfigError(f"{_where(path)}: {column} row {raw.index[i]} = {bounded_repr(_plain(raw.iloc[i]))} is not "
                          f"allowed: expected {what}")
    return values


def _flags(path: Path, df, column: str) -> np.ndarray:
    """Column ``column`` as booleans: each value True or False (any case), as Vidur writes them.

    Raises:
        ConfigError: the first other value (1/0, yes/no, empty), naming file, column, row and value.
    """
    text = df[column].astype(str).str.strip().str.lower()
    ok = text.isin(("true", "false")).to_numpy()
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        value = bounded_repr(_plain(df[column].iloc[i]))
        raise ConfigError(f"{_where(path)}: {column} row {df.index[i]} = {value} is not allowed: "
                          "expected True or False")
    return (text == "true").to_numpy()


def _in_layer_range(path: Path, column: str, tp: int, values: np.ndarray, n_lin: np.ndarray) -> None:
    """Every value lies within the num_tokens that mlp.csv measured at TP ``tp`` (the layer
    operators of a step are interpolated there, never extrapolated)."""
    bad = (values < n_lin[0]) | (values > n_lin[-1])
    if bad.any():
        v = float(values[np.flatnonzero(bad)[0]])
        raise ConfigError(f"{_where(path)}: {column} = {v:g} at num_tensor_parallel_workers {tp} is not allowed: "
                          f"expected {n_lin[0]:g}..{n_lin[-1]:g}, the num_tokens mlp.csv measured at that TP degree")


def _model_of(folder: Path) -> ModelSpec:
    """The preset of ``compute/<device>/<org>/<model>``, checked against the profile's shape later."""
    name = f"{folder.parent.name}/{folder.name}"
    try:
        model = get_model(name)
    except ConfigError:
        raise ConfigError(f"{_where(folder)}: model {bounded_repr(name)} is not a kvsched model preset or alias; "
                          "expected a profiled model kvsched knows (kvsched presets lists them)") from None
    if model.weight_dtype not in ("bf16", "fp16") or model.is_moe or model.is_mla:
        raise ConfigError(f"{_where(folder)}: model {bounded_repr(name)} is kvsched's {model.name} "
                          f"({model.weight_dtype} weights{', mixture of experts' if model.is_moe else ''}"
                          f"{', latent attention' if model.is_mla else ''}), not a model Vidur's operators "
                          "profile: expected a dense 16-bit model without latent attention")
    return model


def _check_shape(path: Path, df, model: ModelSpec) -> None:
    """The profile's model shape equals the preset's (heads, KV heads, hidden, MLP width)."""
    for column, want in (("n_head", model.n_heads), ("n_kv_head", model.n_kv_heads), ("n_embd", model.hidden_size),
                         ("n_expanded_embd", model.intermediate_size)):
        got = sorted(set(_column(path, df, column, "count").tolist()))
        if got != [want]:
            raise ConfigError(f"{_where(path)}: {column} = {bounded_repr([int(x) for x in got])} does not match preset "
                              f"{model.name}'s {want}: the profile is of another model shape")


def load_operator_profiles(root: str | Path) -> OperatorProfiles:
    """Read a Vidur profile directory (module docstring) holding one device and one model.

    Raises:
        ConfigError: no ``compute/<device>/<org>/<model>/mlp.csv``, more than one device, model or
            network folder, an unknown model, a shape that is not the preset's, or a bad file.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"--operator-profiles {_where(root)} is not a directory: expected a Vidur profile "
                          "directory with compute/<device>/<org>/<model>/mlp.csv")
    mlps = sorted(root.glob("compute/*/*/*/mlp.csv"))
    if not mlps:
        raise ConfigError(f"{_where(root)}: no compute/<device>/<org>/<model>/mlp.csv: expected a Vidur profile "
                          "directory")
    if len(mlps) > 1:
        raise ConfigError(f"{_where(root)}: {len(mlps)} mlp.csv profiles ({bounded_repr(str(mlps[0]))} ...): "
                          "expected one device and one model per calibration")
    mlp_path = mlps[0]
    folder = mlp_path.parent
    device = folder.parent.parent.name
    model = _model_of(folder)
    mlp = _read_csv(mlp_path, _MLP_REQUIRED)
    _check_shape(mlp_path, mlp, model)
    op_cols = [f"time_stats.{op}.median" for op in LAYER_OPS]
    mlp = mlp.assign(**{c: _column(mlp_path, mlp, c, "time") for c in op_cols + ["time_stats.emb.median"]},
                     num_tokens=_column(mlp_path, mlp, "num_tokens", "count"),
                     num_tensor_parallel_workers=_column(mlp_path, mlp, "num_tensor_parallel_workers", "count"))
    mlp = mlp.assign(step_ms=model.n_layers * mlp[op_cols].sum(axis=1) + mlp["time_stats.emb.median"])
    layers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for tp, g in mlp.groupby("num_tensor_parallel_workers"):
        mean = g.groupby("num_tokens")["step_ms"].mean().sort_index()
        layers[int(tp)] = (mean.index.to_numpy(dtype=float), mean.to_numpy(dtype=float) / 1e3)
    sources = [str(mlp_path)]
    skipped: list[str] = []

    decode: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    prefill: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    attn_path = folder / "attention.csv"
    if attn_path.exists():
        attn = _read_csv(attn_path, _ATTN_REQUIRED)
        sources.append(str(attn_path))
        is_prefill = _flags(attn_path, attn, "is_prefill")
        attn = attn.assign(num_tensor_parallel_workers=_column(attn_path, attn, "num_tensor_parallel_workers", "count"),
                           batch_size=_column(attn_path, attn, "batch_size", "count"),
                           kv_cache_size=_column(attn_path, attn, "kv_cache_size", "size"), is_prefill=is_prefill)
        for tp, g in attn.groupby("num_tensor_parallel_workers"):
            if int(tp) not in layers:  # no layer operators at this TP degree to complete the step
                skipped.append(f"attention tp{int(tp)}: mlp.csv has no rows at num_tensor_parallel_workers {int(tp)} "
                               "to complete its steps")
                continue
            n_lin, s_lin = layers[int(tp)]
            dec, pre = g[~g["is_prefill"]], g[g["is_prefill"]]
            if len(dec):
                b = dec["batch_size"].to_numpy(dtype=float)
                _in_layer_range(attn_path, "batch_size", int(tp), b, n_lin)
                ms = _column(attn_path, dec, "time_stats.attn_decode.median", "time")
                decode[int(tp)] = (b, dec["kv_cache_size"].to_numpy(dtype=float),
                                   np.interp(b, n_lin, s_lin) + model.n_layers * ms / 1e3)
            if len(pre):
                c = _column(attn_path, pre, "prefill_chunk_size", "count")
                _in_layer_range(attn_path, "prefill_chunk_size", int(tp), c, n_lin)
                ms = _column(attn_path, pre, "time_stats.attn_prefill.median", "time")
                prefill[int(tp)] = (c, pre["kv_cache_size"].to_numpy(dtype=float),
                                    np.interp(c, n_lin, s_lin) + model.n_layers * ms / 1e3)

    all_reduce: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    nets = sorted(root.glob("network/*/all_reduce.csv"))
    if len(nets) > 1:
        raise ConfigError(f"{_where(root)}: {len(nets)} network/*/all_reduce.csv profiles: expected at most one "
                          "(the node the device sits in)")
    if nets:
        ar = _read_csv(nets[0], _AR_REQUIRED)
        sources.append(str(nets[0]))
        ar = ar.assign(num_workers=_column(nets[0], ar, "num_workers", "count"),
                       devices_per_node=_column(nets[0], ar, "devices_per_node", "count"),
                       size=_column(nets[0], ar, "size", "count"),
                       s=_column(nets[0], ar, "time_stats.all_reduce.median", "positive time") / 1e3)
        one_node = ar[(ar["devices_per_node"] == ar["num_workers"]) & ar["num_workers"].isin(ALLREDUCE_TP_DEGREES)]
        for tp, g in one_node.groupby("num_workers"):
            mean = g.groupby("size")["s"].mean().sort_index()
            all_reduce[int(tp)] = (mean.index.to_numpy(dtype=float), mean.to_numpy(dtype=float))
        if not all_reduce:
            skipped.append(f"all-reduce: {os.path.basename(os.path.dirname(nets[0]))}/all_reduce.csv has no rows "
                           f"within one node (devices_per_node == num_workers) at TP "
                           f"{'/'.join(map(str, ALLREDUCE_TP_DEGREES))}")
    return OperatorProfiles(root=root, device=device, model=model, layers=layers, decode=decode, prefill=prefill,
                            all_reduce=all_reduce, sources=tuple(sources), skipped=tuple(skipped))


@dataclass(frozen=True)
class ProfileFit:
    """Outcome of :func:`fit_operator_profiles`.

    Attributes:
        cost: ``host`` with the fitted kernel-side fields.
        kernel: the fit of the compute and bandwidth ceilings.
        allreduce: the diagnostic fit of the ring to the NCCL rows (not in ``cost``; module
            docstring), or None without network profiles.
        group_mape: group name -> MAPE % of the fitted prediction (e.g. ``"layers tp4"``,
            ``"decode tp2"``, ``"all-reduce tp8"``).
        skipped: human-readable lines on what could not be used (e.g. a TP degree whose
            weights do not fit in the GPU's memory, where kvsched cannot build the instance).
    """

    cost: CostParams
    kernel: FitResult
    allreduce: FitResult | None
    group_mape: Mapping[str, float]
    skipped: tuple[str, ...]


def check_device(p: OperatorProfiles, gpu: GPUSpec) -> None:
    """The profiles' ``compute/<device>`` folder names the GPU being calibrated (a GPU preset or
    alias of it, e.g. ``a100`` for A100-80GB).

    Raises:
        ConfigError: the folder names another GPU, or no GPU kvsched has a preset for.
    """
    from kvsched.envs.sim.specs import get_gpu

    try:
        measured = get_gpu(p.device).name
    except ConfigError:
        raise ConfigError(f"{_where(p.root)}: device folder compute/{bounded_repr(p.device)[1:-1]} is not a kvsched "
                          f"GPU preset or alias: expected profiles measured on {gpu.name}, in a folder naming it "
                          "(a100, h100, ...: kvsched presets lists the GPUs)") from None
    if measured != gpu.name:
        raise ConfigError(f"{_where(p.root)}: device folder compute/{bounded_repr(p.device)[1:-1]} is {measured}, "
                          f"not the GPU being calibrated: expected profiles measured on {gpu.name} "
                          f"(or --gpu {measured})")


def _spec(model: ModelSpec, gpu: GPUSpec, tp: int, cost: CostParams) -> InstanceSpec:
    # the KV capacity does not enter a step's price; a fixed count skips the memory-derived one
    return InstanceSpec(model=model, gpu=gpu, tp=tp, hbm_kv_blocks=1024, cost=cost)


def _kernel_groups(p: OperatorProfiles, gpu: GPUSpec, base: CostParams, skipped: list[str]
                   ) -> list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, tp, n_tokens, attn_pairs, kv_tokens, measured_s) per residual group (cost model inputs
    as :meth:`CostModel.step_time_s` defines them); TP degrees kvsched cannot build are skipped."""
    groups = []
    for tp in sorted(p.layers):
        try:
            _spec(p.model, gpu, tp, base)
        except ConfigError as e:
            skipped.append(f"tp{tp}: {e}")
            continue
        n, s = p.layers[tp]
        groups.append((f"layers tp{tp}", tp, n, np.zeros_like(n), np.zeros_like(n), s))
        if tp in p.decode:
            b, ctx, s = p.decode[tp]
            groups.append((f"decode tp{tp}", tp, b, b * ctx, b * ctx, s))
        if tp in p.prefill:
            c, cached, s = p.prefill[tp]
            groups.append((f"prefill tp{tp}", tp, c, c * (cached + c / 2.0), cached + c, s))
    if not groups:
        raise ConfigError(f"{_where(p.root)}: no TP degree of the profile can be built on {gpu.name}: "
                          + "; ".join(skipped)[:300])
    return groups


def _kernel_prediction(model: ModelSpec, gpu: GPUSpec, tp: int, cost: CostParams, n: np.ndarray,
                       pairs: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """Kernel seconds of steps: the roofline's max(compute, memory), no overheads or all-reduce."""
    b = CostModel(_spec(model, gpu, tp, cost)).step_breakdown(n, pairs, kv)
    return np.maximum(b["compute_s"], b["memory_s"])


def _allreduce_prediction(model: ModelSpec, gpu: GPUSpec, tp: int, cost: CostParams, size_bytes: np.ndarray
                          ) -> np.ndarray:
    """Seconds of one all-reduce of ``size_bytes`` per rank under ``cost``, as the cost model prices it."""
    n = size_bytes / (model.hidden_size * ACTIVATION_BYTES)
    comm = CostModel(_spec(model, gpu, tp, cost)).step_breakdown(n, np.zeros_like(n), np.zeros_like(n))["comm_s"]
    return np.asarray(comm) / (2.0 * model.n_layers)


def _mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(100.0 * np.mean(np.abs(pred / meas - 1.0)))


def fit_operator_profiles(p: OperatorProfiles, gpu: GPUSpec, host: CostParams,
                          params: Sequence[FitParam] = KERNEL_FIT_PARAMS,
                          allreduce_params: Sequence[FitParam] = ALLREDUCE_FIT_PARAMS,
                          max_nfev: int = 200,
                          progress: Callable[[str], None] | None = None) -> ProfileFit:
    """Fit the kernel-side cost parameters of ``gpu`` to the profiles ``p`` (module docstring).

    Args:
        p: the profiles, from :func:`load_operator_profiles`.
        gpu: the GPU they were measured on.
        host: CostParams whose fields the result keeps, but the kernel ones fitted; its
            ``allreduce_algorithm`` prices the diagnostic all-reduce fit.
        params, allreduce_params: the kernel and all-reduce fields to fit, with bounds.
        max_nfev: scipy's evaluation cap of each fit.
        progress: called with a line after each fit.

    Returns:
        A :class:`ProfileFit`.

    Raises:
        ConfigError: the profiles' device is not ``gpu`` (:func:`check_device`), no usable group,
            or a measured time of 0 (a log residual needs > 0).
    """
    check_device(p, gpu)
    skipped = list(p.skipped)
    base = dataclasses.replace(host, step_overhead_s=0.0, seq_overhead_s=0.0, step_token_overhead_s=0.0)
    groups = _kernel_groups(p, gpu, base, skipped)
    for name, _, _, _, _, meas in groups:
        if not (meas > 0).all():
            raise ConfigError(f"{_where(p.root)}: {name}: a measured step of 0 s: expected > 0 for a log residual")

    def kernel_residuals(cost: CostParams) -> np.ndarray:
        out = []
        for _, tp, n, pairs, kv, meas in groups:
            r = np.log(_kernel_prediction(p.model, gpu, tp, cost, n, pairs, kv) / meas)
            out.append(r / math.sqrt(r.size))  # each group counts alike, whatever its rows
        return np.concatenate(out)

    kernel = fit_cost_params(kernel_residuals, base, params, max_nfev=max_nfev, loss="linear",
                             diff_step=1e-3, xtol=1e-8, ftol=1e-10)
    mape = {name: _mape(_kernel_prediction(p.model, gpu, tp, kernel.cost, n, pairs, kv), meas)
            for name, tp, n, pairs, kv, meas in groups}
    if progress:
        progress("kernel fit: " + ", ".join(f"{k} {v:.4g}" for k, v in kernel.values.items()))
    fitted = dataclasses.replace(host, **dict(kernel.values))
    ar_fit = None
    usable = {tp: v for tp, v in p.all_reduce.items() if not any(s.startswith(f"tp{tp}:") for s in skipped)}
    if usable:
        ar_base = dataclasses.replace(base, allreduce_latency_s=0.0)

        def ar_residuals(cost: CostParams) -> np.ndarray:
            out = []
            for tp, (size, meas) in sorted(usable.items()):
                r = np.log(_allreduce_prediction(p.model, gpu, tp, cost, size) / meas)
                out.append(r / math.sqrt(r.size))
            return np.concatenate(out)

        ar_fit = fit_cost_params(ar_residuals, ar_base, allreduce_params, max_nfev=max_nfev, loss="linear",
                                 diff_step=1e-3, xtol=1e-8, ftol=1e-10,
                                 x0={"allreduce_bw_efficiency": 0.5, "allreduce_hop_latency_s": 5e-6})
        for tp, (size, meas) in sorted(usable.items()):
            mape[f"all-reduce tp{tp}"] = _mape(_allreduce_prediction(p.model, gpu, tp, ar_fit.cost, size), meas)
        if progress:
            progress("all-reduce fit (NCCL ring; a diagnostic, not applied): "
                     + ", ".join(f"{k} {v:.4g}" for k, v in ar_fit.values.items()))
    elif p.all_reduce:
        skipped.append("all-reduce: no TP degree of the network profile can be built on " + gpu.name)
    return ProfileFit(cost=fitted, kernel=kernel, allreduce=ar_fit, group_mape=mape, skipped=tuple(skipped))

