"""Calibration files of the cost model, and the least-squares fit that produces them.

A calibration file (JSON, ``format = "kvsched-calibration/1"``) holds the full
:class:`~kvsched.envs.sim.cost_params.CostParams` of one GPU preset, which of them were fitted and on
which experiments, the fit's loss and provenance. Files shipped in
``envs/sim/calibration/<GPU preset>.json`` are the GPU's default cost parameters
(:func:`default_cost_params`); ``kvsched calibrate`` writes them and
``kvsched validate`` reads them. Nothing here reads a clock or a global random generator.

:func:`fit_cost_params` keeps the roofline structure of :mod:`~kvsched.envs.sim.cost_model` and
only sets its parameters: it minimises a residual vector (typically ``log(predicted / measured)``
per experiment, stage and metric) over a few named :class:`CostParams` fields with
``scipy.optimize.least_squares`` (trust-region reflective, bounded, finite-difference
Jacobian). Each fitted field is searched in log space between its bounds, so efficiencies and
overheads of different magnitudes are scaled alike.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import strict_json
from .errors import MAX_PATH_CHARS, ConfigError, bounded_repr
from .spec_validation import is_int, is_real
from .cost_params import TAIL_FIELDS, CostParams
from kvsched import atomic_files

__all__ = ["CALIBRATION_FORMAT", "DEFAULT_FIT_PARAMS", "HOST_FIELDS", "HOST_REFERENCE_GPU", "SAME_CHIP",
           "CalibrationFile", "FitParam", "FitResult", "default_cost_origin", "default_cost_source",
           "calibrated_cost_params", "calibration_path", "default_cost_params", "fit_cost_params", "load_calibration",
           "save_calibration"]

CALIBRATION_FORMAT = "kvsched-calibration/1"
"""Format tag of calibration files; bump when the schema changes."""

_COST_FIELDS = tuple(f.name for f in dataclasses.fields(CostParams))
_COST_TEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(CostParams) if f.type in ("str", str))
"""CostParams fields holding a word, not a number (``allreduce_algorithm``; CostParams checks the value)."""


@dataclass(frozen=True)
class FitParam:
    """One :class:`CostParams` field to fit, searched in log space within ``[lo, hi]``.

    Attributes:
        name: the CostParams field.
        lo, hi: bounds, 0 < lo < hi (in the field's units: fraction, seconds, tokens).

    Raises:
        ConfigError: an unknown field or bounds that are not 0 < lo < hi.
    """

    name: str
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if self.name not in _COST_FIELDS or self.name in _COST_TEXT_FIELDS:
            raise ConfigError(f"FitParam.name={bounded_repr(self.name)} is not allowed: expected one of "
                              f"{', '.join(f for f in _COST_FIELDS if f not in _COST_TEXT_FIELDS)}")
        if not (isinstance(self.lo, (int, float)) and isinstance(self.hi, (int, float))
                and 0 < self.lo < self.hi and math.isfinite(self.hi)):
            raise ConfigError(f"FitParam({self.name}) bounds lo={bounded_repr(self.lo)}, hi={bounded_repr(self.hi)} "
                              "are not allowed: expected finite 0 < lo < hi")


DEFAULT_FIT_PARAMS: tuple[FitParam, ...] = (
    FitParam("mfu_max", 0.15, 1.0),
    FitParam("mbu", 0.3, 1.0),
    FitParam("step_overhead_s", 1e-5, 10e-3),
    FitParam("allreduce_bw_efficiency", 0.05, 1.0),
    FitParam("request_overhead_s", 1e-4, 50e-3),
    FitParam("first_chunk_delay_tokens", 0.01, 4.0),
    FitParam("allreduce_hop_latency_s", 1e-7, 20e-6),
    FitParam("seq_overhead_s", 1e-7, 100e-6),
)
"""What ``kvsched calibrate`` fits by default, with bounds: the utilisation ceilings of
REFERENCE §5.2 anywhere in their physical range; the step overhead between 10 µs and 10 ms (§5.2
quotes 0.5-2 ms); the achieved share of the GPU-GPU link in TP all-reduces down to 5 %; the
per-request front-end delay up to 50 ms (the groundtruth README quotes 10-15 ms); the first-chunk
delay up to 4 token gaps; the latency of one ring all-reduce step up to 20 µs (a TP4 all-reduce of
6 steps then costs up to 120 µs; NCCL's small-message all-reduce on NVLink is ~10-30 µs) with the
fixed per-call latency at 0 (:data:`DEFAULT_FIT_BASE`: the α-β ring puts all latency in its
``2(tp−1)`` steps, so TP2 pays a third of TP4's); the per-sequence host time of a step up to 100 µs
(issue #22 estimates 15-20 µs). The MFU ramp (``mfu_half_tokens``), the all-reduce latency and the
per-token front-end terms stay at their literature defaults: the published runs (prompts of
550-1,100 tokens, fixed outputs, TP 1/2/4) cannot tell them apart from ``mfu_max``,
``allreduce_bw_efficiency`` and ``request_overhead_s``."""


DEFAULT_FIT_BASE = CostParams(allreduce_latency_s=0.0)
"""The fixed parameters ``kvsched calibrate`` starts from: the literature defaults of
:class:`CostParams` with no fixed per-call all-reduce latency (the ring's per-step latency
``allreduce_hop_latency_s`` is fitted instead: with TP1 and TP4 runs only, a fixed latency and a
per-step one cannot be told apart, and the per-step form is the α-β ring model's)."""


@dataclass(frozen=True)
class CalibrationFile:
    """A calibration of one GPU preset.

    Attributes:
        gpu: GPU preset name (e.g. ``"H100-SXM"``).
        version: calibration version, an integer >= 1 (bumped by whoever re-calibrates).
        cost: the complete cost parameters.
        fitted: names of the fields the fit set; the others are literature defaults.
        train: experiment ids the fit used; everything else is held out.
        objective: how the residuals were formed (free text).
        loss: final value of the least-squares cost (0.5·Σ ρ(r²)); None when unknown.
        n_residuals: residuals in the fit.
        n_evaluations: objective evaluations the fit took.
        wall_s: wall-clock seconds of the fit (provenance only; never read by the simulator); None
            when unknown.
        kvsched_version: version that wrote the file.
        notes: free-text provenance lines.
        tail_params: fitted values of the stochastic tail's fields (:data:`TAIL_FIELDS`), kept
            apart from :attr:`cost` so that the GPU's default parameters stay deterministic:
            applied by :meth:`cost_with_tail` (``kvsched validate --tail``) or by setting the
            fields in a scenario's ``cost``. Empty when no tail was fitted.

    Raises:
        ConfigError: a bad GPU name, version, or ``fitted`` naming an unknown field.
    """

    gpu: str
    version: int
    cost: CostParams
    fitted: tuple[str, ...] = ()
    train: tuple[str, ...] = ()
    objective: str = ""
    loss: float | None = None
    n_residuals: int = 0
    n_evaluations: int = 0
    wall_s: float | None = None
    kvsched_version: str = ""
    notes: tuple[str, ...] = ()
    tail_params: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.gpu, str) and self.gpu):
            raise ConfigError(f"CalibrationFile.gpu={bounded_repr(self.gpu)} is not allowed: "
                              "expected a GPU preset name")
        if not (isinstance(self.version, int) and not isinstance(self.version, bool) and self.version >= 1):
            raise ConfigError(f"CalibrationFile.version={bounded_repr(self.version)} is not allowed: "
                              "expected an integer >= 1")
        if not isinstance(self.cost, CostParams):
            raise ConfigError(f"CalibrationFile.cost={bounded_repr(self.cost)} is not allowed: expected a CostParams")
        for name in self.fitted:
            if name not in _COST_FIELDS:
                raise ConfigError(f"CalibrationFile.fitted has {bounded_repr(name)}: expected CostParams fields "
                                  f"({', '.join(_COST_FIELDS)})")
        if not isinstance(self.tail_params, Mapping):
            raise ConfigError(f"CalibrationFile.tail_params={bounded_repr(self.tail_params)} is not allowed: "
                              "expected a mapping of tail fields")
        for name in self.tail_params:
            if name not in TAIL_FIELDS:
                raise ConfigError(f"CalibrationFile.tail_params has {bounded_repr(name)}: expected tail fields "
                                  f"({', '.join(TAIL_FIELDS)})")
        tail: dict[str, Any] = {k: _real(v, f"CalibrationFile.tail_params.{k}") for k, v in self.tail_params.items()}
        try:
            CostParams(**tail)  # validates the values
        except ConfigError as e:
            raise ConfigError(f"CalibrationFile.tail_params: {e}") from None
        object.__setattr__(self, "tail_params", tail)
        object.__setattr__(self, "fitted", tuple(self.fitted))
        object.__setattr__(self, "train", tuple(self.train))
        object.__setattr__(self, "notes", tuple(self.notes))

    def cost_with_tail(self) -> CostParams:
        """:attr:`cost` with the fitted stochastic tail (:attr:`tail_params`) turned on."""
        tail: dict[str, Any] = dict(self.tail_params)
        return dataclasses.replace(self.cost, **tail)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the file content; ``tail_params`` only when there are some)."""
        out = {
            "format": CALIBRATION_FORMAT, "gpu": self.gpu, "version": self.version,
            "cost_params": dataclasses.asdict(self.cost), "fitted": list(self.fitted),
            "train_experiments": list(self.train), "objective": self.objective,
            "loss": self.loss, "n_residuals": self.n_residuals, "n_evaluations": self.n_evaluations,
            "wall_s": self.wall_s, "kvsched_version": self.kvsched_version, "notes": list(self.notes),
        }
        if self.tail_params:
            out["tail_params"] = dict(self.tail_params)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any], source: str = "<dict>") -> "CalibrationFile":
        """Parse the file content.

        Raises:
            ConfigError: wrong format tag, missing or unknown keys, invalid cost parameters, or a
                field that ``fitted`` names missing from ``cost_params``.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: a calibration file must hold a JSON object")
        if d.get("format") != CALIBRATION_FORMAT:
            raise ConfigError(f"{source}: format={bounded_repr(d.get('format'))} is not allowed: "
                              f"expected {bounded_repr(CALIBRATION_FORMAT)}")
        allowed = {"format", "gpu", "version", "cost_params", "fitted", "train_experiments", "objective", "loss",
                   "n_residuals", "n_evaluations", "wall_s", "kvsched_version", "notes", "tail_params"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ConfigError(f"{source}: unknown key {bounded_repr(unknown[0])}; "
                              f"allowed keys: {', '.join(sorted(allowed))}")
        for key in ("gpu", "version", "cost_params"):
            if key not in d:
                raise ConfigError(f"{source}: missing key {bounded_repr(key)}")
        cp = d["cost_params"]
        if not isinstance(cp, Mapping):
            raise ConfigError(f"{source}: cost_params must be an object of CostParams fields")
        bad = sorted(set(cp) - set(_COST_FIELDS))
        if bad:
            raise ConfigError(f"{source}: cost_params has unknown field {bounded_repr(bad[0])}; "
                              f"allowed: {', '.join(_COST_FIELDS)}")
        cost_values: dict[str, Any] = {k: (v if k in _COST_TEXT_FIELDS else _real(v, f"{source}: cost_params.{k}"))
                       for k, v in cp.items()}
        fitted = d.get("fitted", [])
        if isinstance(fitted, (list, tuple)):
            absent = [f for f in fitted if isinstance(f, str) and f in _COST_FIELDS and f not in cp]
            if absent:  # a fitted value missing would load as the literature default, silently
                raise ConfigError(f"{source}: cost_params has no {bounded_repr(absent[0])}, which fitted names; "
                                  "expected every fitted field's value in cost_params")
        tail = d.get("tail_params", {})
        if isinstance(tail, Mapping):
            tail = {k: _real(v, f"{source}: tail_params.{k}") for k, v in tail.items()}
        try:
            cost = CostParams(**cost_values)
            return CalibrationFile(
                gpu=d["gpu"], version=d["version"], cost=cost,
                fitted=_strings(d.get("fitted", []), "fitted"),
                train=_strings(d.get("train_experiments", []), "train_experiments"),
                objective=_text(d.get("objective", ""), "objective"),
                loss=_real_or_none(d.get("loss"), "loss"),
                n_residuals=_count(d.get("n_residuals", 0), "n_residuals"),
                n_evaluations=_count(d.get("n_evaluations", 0), "n_evaluations"),
                wall_s=_real_or_none(d.get("wall_s"), "wall_s"),
                kvsched_version=_text(d.get("kvsched_version", ""), "kvsched_version"),
                notes=_strings(d.get("notes", []), "notes"),
                tail_params=tail)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def _real(value: Any, where: str) -> float:
    """A finite JSON number (not a bool, not text) as a float.

    Raises:
        ConfigError: anything else, naming ``where`` and the (bounded) value.
    """
    if not is_real(value):
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a finite number")
    return float(value)


def _real_or_none(value: Any, where: str) -> float | None:
    """:func:`_real`, or None for a JSON null."""
    return None if value is None else _real(value, where)


def _count(value: Any, where: str) -> int:
    """An integer >= 0 (not a bool, not a float such as 3.7)."""
    if not (is_int(value) and int(value) >= 0):
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected an integer >= 0")
    return int(value)


def _text(value: Any, where: str) -> str:
    """A JSON string."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a string")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    """A JSON list of strings (a lone string is not split into characters)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a list of strings")
    return tuple(value)


def load_calibration(path: str | Path) -> CalibrationFile:
    """Read a calibration file.

    Raises:
        ConfigError: invalid JSON or content (the message names the file).
        OSError: the file cannot be read.
    """
    p = Path(path)
    try:
        data = strict_json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # malformed, a key given twice, nested too deeply
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": invalid JSON: {bounded_repr(str(e) or 'nested too deeply')[1:-1]}") from None
    return CalibrationFile.from_dict(data, source=str(p))


def save_calibration(cal: CalibrationFile, path: str | Path) -> None:
    """Write ``cal`` as pretty-printed JSON with sorted keys (byte-identical for equal content)."""
    atomic_files.write_text(Path(path), json.dumps(cal.to_dict(), indent=2, sort_keys=True) + "\n")


def calibration_path(gpu: str) -> Path:
    """Where the shipped calibration of GPU preset ``gpu`` lives (it may not exist)."""
    return Path(str(importlib.resources.files("kvsched.envs.sim").joinpath("calibration", f"{gpu}.json")))


@functools.lru_cache(maxsize=None)
def calibrated_cost_params(gpu: str) -> CostParams | None:
    """The shipped calibration's CostParams for GPU preset ``gpu``, or None when none is shipped.

    Raises:
        ConfigError: the shipped file is invalid or calibrates another GPU.
    """
    p = calibration_path(gpu)
    if not p.is_file():
        return None
    cal = load_calibration(p)
    if cal.gpu != gpu:
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": calibrates gpu={bounded_repr(cal.gpu)}, expected {bounded_repr(gpu)}")
    return cal.cost


HOST_FIELDS: tuple[str, ...] = ("step_overhead_s", "seq_overhead_s", "step_token_overhead_s", "request_overhead_s",
                                "prompt_token_overhead_s", "output_token_overhead_s", "first_chunk_delay_tokens")
"""CostParams fields of host (CPU) and front-end work, not of the GPU: the engine core's per-step
and per-sequence work (vLLM V1 ``EngineCore.step``: schedule, input preparation, output
processing), the API server's per-request and per-token delays and the streaming client's
first-chunk delay. The same vLLM code runs them whatever GPU serves, so a GPU without a
calibration of its own takes them from :data:`HOST_REFERENCE_GPU`'s."""

HOST_REFERENCE_GPU = "H100-SXM"

SAME_CHIP: dict[str, str] = {"H200": "H100-SXM"}
"""GPU presets that share another's compute die, NVLink and kernels and differ only in HBM size and
bandwidth (which their :class:`~kvsched.envs.sim.hardware.GPUSpec` carries): without a calibration
of their own they take that GPU's whole calibration, its efficiencies being ratios to those
rates. H200: the GH100 die of the H100 SXM with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200
datasheet), NVLink 4."""
"""The GPU whose shipped calibration (fitted on real vLLM runs) lends its :data:`HOST_FIELDS` to
GPUs that have no calibration file."""


def default_cost_params(gpu: Any) -> CostParams:
    """The GPU's default :class:`CostParams`: its calibration file if kvsched ships one
    (``envs/sim/calibration/<GPU preset>.json``), else that of the GPU it shares a chip with
    (:data:`SAME_CHIP`), else the literature defaults of :class:`CostParams` for the GPU-side fields
    with the :data:`HOST_FIELDS` of :data:`HOST_REFERENCE_GPU`'s calibration (the literature
    defaults for all fields if that is not shipped either).

    Args:
        gpu: a :class:`~kvsched.envs.sim.hardware.GPUSpec` or a GPU preset name.

    Raises:
        ConfigError: a shipped calibration file that does not parse or validate.
    """
    kind, donor = default_cost_origin(gpu)
    if kind in ("calibration", "same chip"):
        cost = calibrated_cost_params(donor)
        assert cost is not None  # default_cost_origin found the file
        return cost
    return host_transferred_cost_params()


def default_cost_origin(gpu: Any) -> tuple[str, str]:
    """Where :func:`default_cost_params` takes the GPU's parameters from, as ``(kind, donor GPU)``:
    ``("calibration", gpu)`` its own shipped file, ``("same chip", twin)`` the file of the GPU it
    shares a chip with (:data:`SAME_CHIP`), ``("host terms", HOST_REFERENCE_GPU)`` literature
    GPU-side fields with that GPU's :data:`HOST_FIELDS`, or ``("literature", "")`` when no
    reference calibration is shipped either.

    Args:
        gpu: a :class:`~kvsched.envs.sim.hardware.GPUSpec` or a GPU preset name.

    Raises:
        ConfigError: a shipped calibration file that does not parse or validate.
    """
    name = getattr(gpu, "name", None) or str(gpu)
    if calibrated_cost_params(name) is not None:
        return "calibration", name
    twin = SAME_CHIP.get(name)
    if twin is not None and calibrated_cost_params(twin) is not None:
        return "same chip", twin
    if calibrated_cost_params(HOST_REFERENCE_GPU) is not None:
        return "host terms", HOST_REFERENCE_GPU
    return "literature", ""


def default_cost_source(gpu: Any) -> str | None:
    """Where the GPU's :func:`default_cost_params` come from, as one line for a run's notes; None for
    :data:`HOST_REFERENCE_GPU` when its calibration (fitted on real vLLM runs) is shipped. Every
    published vLLM run is on that GPU (docs/fidelity.md, "GPUs other than the H100"), so no other
    GPU's defaults are validated end to end.

    Args:
        gpu: a :class:`~kvsched.envs.sim.hardware.GPUSpec` or a GPU preset name.

    Raises:
        ConfigError: a shipped calibration file that does not parse or validate.
    """
    name = getattr(gpu, "name", None) or str(gpu)
    kind, donor = default_cost_origin(name)
    if kind == "calibration":
        if name == HOST_REFERENCE_GPU:
            return None
        cal = load_calibration(calibration_path(name))
        return (f"its shipped calibration (version {cal.version}; fitted: {', '.join(cal.fitted) or 'none'}), "
                f"not validated against vLLM runs on {name}")
    if kind == "same chip":
        return (f"the shipped {donor} calibration whole (the same chip), not validated against vLLM runs "
                f"on {name}")
    if kind == "literature":
        return "no calibration: the literature defaults of CostParams, not validated against vLLM runs"
    return (f"no calibration: literature defaults for the GPU-side fields, {donor}'s calibrated "
            f"host-side ones; not validated against vLLM runs on {name}")


@functools.lru_cache(maxsize=None)
def host_transferred_cost_params() -> CostParams:
    """The default CostParams of a GPU without a calibration file (:func:`default_cost_params`).

    Raises:
        ConfigError: the reference GPU's shipped calibration file does not parse or validate.
    """
    ref = calibrated_cost_params(HOST_REFERENCE_GPU)
    if ref is None:
        return CostParams()
    return dataclasses.replace(CostParams(), **{f: getattr(ref, f) for f in HOST_FIELDS})


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitResult:
    """Outcome of :func:`fit_cost_params`.

    Attributes:
        cost: the fitted CostParams (base with the fitted fields replaced).
        values: fitted field -> value.
        loss: final least-squares cost (scipy's ``cost``: 0.5·Σ ρ(r²)).
        residuals: final residual vector.
        n_evaluations: calls of ``residual_fn``, finite-difference Jacobian columns included.
        status, message: scipy's termination status and message.
        history: (values, loss) of every evaluation, in order.
    """

    cost: CostParams
    values: Mapping[str, float]
    loss: float
    residuals: np.ndarray
    n_evaluations: int
    status: int
    message: str
    history: tuple = field(default_factory=tuple)


def fit_cost_params(residual_fn: Callable[[CostParams], np.ndarray], base: CostParams,
                    params: Sequence[FitParam] = DEFAULT_FIT_PARAMS, max_nfev: int = 60,
                    loss: str = "soft_l1", f_scale: float = 0.1, diff_step: float = 0.02,
                    x0: Mapping[str, float] | None = None, xtol: float = 1e-3,
                    ftol: float = 1e-4) -> FitResult:
    """Fit ``params`` of ``base`` by bounded least squares on ``residual_fn``.

    Args:
        residual_fn: maps candidate CostParams to a 1-D residual vector of fixed length (e.g.
            ``log(predicted / measured)``); must be deterministic.
        base: CostParams whose other fields stay fixed; also the starting point unless ``x0``.
        params: the fields to fit and their bounds (log-space search).
        max_nfev: scipy's cap on function evaluations; it does not count the finite-difference
            Jacobian, so ``residual_fn`` runs up to about ``max_nfev · (1 + len(params))`` times.
        loss, f_scale: scipy robust loss and its scale (default soft-L1 at 0.1: residuals beyond
            ~10 % log error count linearly, so one saturated stage cannot dominate).
        diff_step: relative finite-difference step in log space (the simulator's outputs are
            piecewise smooth: a step of 2 % spans many event re-orderings).
        x0: starting values by name (default: ``base``'s values, clipped into the bounds).
        xtol, ftol: scipy termination tolerances.

    Returns:
        A :class:`FitResult`.

    Raises:
        ConfigError: no parameters, duplicate names, or a residual vector that is empty,
            changes length, or is not finite at the start.
    """
    from scipy.optimize import least_squares

    names, lo, hi, z0 = _log_space_start(params, base, x0)
    fun = _LoggedResiduals(residual_fn, base, names)
    sol = least_squares(fun, z0, bounds=(lo, hi), method="trf", loss=loss,  # type: ignore[arg-type]
                        f_scale=f_scale, diff_step=diff_step,  # type: ignore[arg-type]  # a scalar broadcasts
                        max_nfev=max_nfev, x_scale=1.0, xtol=xtol, ftol=ftol)
    return FitResult(cost=fun.cost_of(sol.x), values=fun.values_of(sol.x), loss=float(sol.cost),
                     residuals=np.asarray(sol.fun), n_evaluations=len(fun.history), status=int(sol.status),
                     message=str(sol.message), history=tuple(fun.history))


def _log_space_start(params: Sequence[FitParam], base: CostParams,
                     x0: Mapping[str, float] | None) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Names, log bounds and log starting point of the fitted fields, each array of shape ``(k,)``.

    The start is ``x0[name]`` where given, else ``base``'s value, clipped into the bounds and then
    nudged 1e-9 inside them (scipy needs a strictly feasible start).

    Raises:
        ConfigError: no parameters, or duplicate names.
    """
    names = [p.name for p in params]
    if not names:
        raise ConfigError("fit_cost_params: params is empty; expected at least one FitParam")
    if len(set(names)) != len(names):
        raise ConfigError(f"fit_cost_params: duplicate parameter names {names}")
    lo = np.log([p.lo for p in params])
    hi = np.log([p.hi for p in params])
    start = dict(x0 or {})
    z0 = np.array([math.log(min(max(float(start.get(p.name, getattr(base, p.name))), p.lo), p.hi))
                   for p in params])
    z0 = np.clip(z0, lo + 1e-9, hi - 1e-9)
    return names, lo, hi, z0


class _LoggedResiduals:
    """``residual_fn`` as a function of log parameters, logging every evaluation.

    Calling it with ``z`` (log values of ``names``, shape ``(k,)``) returns the residuals of
    ``base`` with those fields set to ``exp(z)``, non-finite entries replaced by 10 (a failed
    prediction counts as a large error), and appends ``(values, 0.5 * |r|^2)`` to ``history``.

    Raises (on call):
        ConfigError: the first residual vector is empty or not finite, or a later one changes
            length.
    """

    def __init__(self, residual_fn: Callable[[CostParams], np.ndarray], base: CostParams,
                 names: list[str]) -> None:
        self.residual_fn, self.base, self.names = residual_fn, base, names
        self.history: list[tuple[dict[str, float], float]] = []
        self.n_res: int | None = None  # residual length, fixed by the first call

    def values_of(self, z: np.ndarray) -> dict[str, float]:
        """Field name -> value (``exp`` of the log value)."""
        return {n: float(math.exp(v)) for n, v in zip(self.names, z)}

    def cost_of(self, z: np.ndarray) -> CostParams:
        """``base`` with the fitted fields set from log values ``z``."""
        values: dict[str, Any] = self.values_of(z)
        return dataclasses.replace(self.base, **values)

    def __call__(self, z: np.ndarray) -> np.ndarray:
        r = np.asarray(self.residual_fn(self.cost_of(z)), dtype=np.float64).ravel()
        if self.n_res is None:
            if r.size == 0 or not np.all(np.isfinite(r)):
                raise ConfigError(f"fit_cost_params: residuals at the start are empty or not finite: {r}")
            self.n_res = r.size
        elif r.size != self.n_res:
            raise ConfigError(f"fit_cost_params: residual length changed from {self.n_res} to {r.size}")
        r = np.where(np.isfinite(r), r, 10.0)  # a failed prediction counts as a large error
        self.history.append((self.values_of(z), 0.5 * float(r @ r)))
        return r
