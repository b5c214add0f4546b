"""Specs to and from plain dicts and YAML files, and the rows of the presets table.

:func:`instance_spec_from_dict` accepts preset names or inline mappings for the model, GPU,
links, PNM device and extra tiers, checks keys and types before construction, and names the
source and the key in every error; :func:`save_instance_spec` writes a self-contained YAML file
(every preset inlined) that :func:`load_instance_spec` reads back to an equal spec.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import yaml

from .calibration import default_cost_params
from .cost_params import CostParams
from .errors import MAX_PATH_CHARS, ConfigError, UnknownPresetError, bounded_repr, text_number_hint
from .hardware import (CXL_LINK, GPU_PRESETS, LINK_PRESETS, PNM_PRESETS, GPUSpec, LinkSpec, PNMSpec, get_gpu,
                       get_link, get_pnm)
from .instance_spec import InstanceSpec
from .model_spec import DTYPE_BYTES, MODEL_PRESETS, ModelSpec, get_model
from .parallelism import ParallelSpec
from .prefix_offload import PrefixOffloadSpec
from .spec_validation import as_float, is_int, known_keys
from .tiers import TierSpec
from kvsched import atomic_files

_INSTANCE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(InstanceSpec) if f.init)


def _plain(value: Any) -> Any:
    """NumPy scalars -> Python scalars (YAML-safe)."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def _spec_dict(spec: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init}


def _tier_dict(t: TierSpec) -> dict[str, Any]:
    d = _spec_dict(t)
    d["holds"] = list(t.holds)
    d["write_link"] = _spec_dict(t.write_link)
    d["read_link"] = _spec_dict(t.read_link)
    return d


def _tier_from(value: Any, where: str) -> TierSpec:
    """A :class:`TierSpec` from a mapping; links are link preset names or inline LinkSpec mappings.

    Raises:
        ConfigError: not a mapping, unknown or missing keys, bad values.
    """
    known_keys(value, [f.name for f in dataclasses.fields(TierSpec)], where, "TierSpec")
    missing = [k for k in ("name", "capacity_bytes", "write_link", "read_link") if k not in value]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    kw = dict(value)
    kw["capacity_bytes"] = as_float(kw["capacity_bytes"], f"{where}.capacity_bytes")
    for key in ("write_link", "read_link"):
        kw[key] = _preset_or_inline(kw[key], get_link, LinkSpec, f"{where}.{key}")
    if "holds" in kw:
        if not isinstance(kw["holds"], (list, tuple)):
            raise ConfigError(f"{where}.holds={bounded_repr(kw['holds'])} is not allowed: expected a list")
        kw["holds"] = tuple(kw["holds"])
    try:
        return TierSpec(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    """:class:`ModelSpec` fields; ``tied_embeddings`` only when true, so a model (and the scenario
    hashes, run.json and outputs holding it) written before the field existed stays as it was."""
    d = _spec_dict(m)
    if not m.tied_embeddings:
        del d["tied_embeddings"]
    return d


def instance_spec_to_dict(spec: InstanceSpec) -> dict[str, Any]:
    """Plain-type dict of ``spec``; model, gpu, links and cost are inline dicts (self-contained).

    A ``pcie`` link derived from the GPU is written as None so it stays tied to the GPU.
    """
    out: dict[str, Any] = {}
    for name in _INSTANCE_FIELDS:
        value = getattr(spec, name)
        if name == "pcie" and spec._pcie_auto:
            out[name] = None
        elif name == "pnm" and value is not None:
            out[name] = {**_spec_dict(value), "link": _spec_dict(value.link)}
        elif name == "model":
            out[name] = _model_dict(value)
        elif name == "extra_tiers":
            out[name] = [_tier_dict(t) for t in value]
        elif name == "prefix_offload":
            out[name] = None if value is None else value.to_dict()
        elif name == "parallel":
            out[name] = None if value is None else value.to_dict()
        elif dataclasses.is_dataclass(value):
            out[name] = _spec_dict(value)
        else:
            out[name] = _plain(value)
    return out


_INT_FIELDS = ("tp", "block_size_tokens", "long_prefill_token_threshold", "max_long_partial_prefills")
#: null allowed; ``max_num_partial_prefills: null`` (or left out) is no limit, an integer k a limit
#: of k (1 included: it meant no limit before the field took null, InstanceSpec docstring)
_OPT_INT_FIELDS = ("hbm_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                   "max_num_partial_prefills")
_FLOAT_FIELDS = ("gpu_memory_utilization", "activation_reserve_bytes", "dram_kv_bytes", "nvme_kv_bytes")
_STR_FIELDS = ("weight_dtype", "kv_dtype", "preemption_mode", "kv_free_order", "self_preemption",
               "unchunked_overflow", "long_prefill_threshold_alone")
_BOOL_FIELDS = ("enable_chunked_prefill", "enable_prefix_caching", "cache_decode_blocks", "expert_parallel")


def _build(cls: type, d: Any, where: str) -> Any:
    """Construct dataclass ``cls`` from mapping ``d`` with key and type checks."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise ConfigError(f"{where}: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(fields)}")
    missing = [n for n, f in fields.items()
               if n not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if fields[k].type in ("str", str):
            if not isinstance(v, str):
                raise ConfigError(f"{where}.{k}={bounded_repr(v)} is not allowed: expected a string")
            kw[k] = v
        elif fields[k].type in ("int", int):
            if not is_int(v):
                raise ConfigError(f"{where}.{k}={bounded_repr(v)} is not allowed: expected an integer")
            kw[k] = v
        elif fields[k].type in ("bool", bool):
            if not isinstance(v, bool):
                raise ConfigError(f"{where}.{k}={bounded_repr(v)} is not allowed: expected true or false")
            kw[k] = v
        else:
            kw[k] = as_float(v, f"{where}.{k}")
    try:
        return cls(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _preset_or_inline(value: Any, getter: Callable[[str], Any], cls: type, where: str) -> Any:
    if isinstance(value, str):
        try:
            return getter(value)
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    return _build(cls, value, where)


def _is_config_path(name: str) -> bool:
    """A model string naming a Hugging Face config.json rather than a preset: a ``.json`` file name,
    a path with a separator, or an existing directory."""
    return name.lower().endswith(".json") or "/" in name and Path(name).exists() or Path(name).is_dir()


def model_from(value: Any, where: str) -> ModelSpec:
    """The model of an instance spec (a scenario's ``model:``, ``--model``):

    - a preset name or Hugging Face id (:func:`~kvsched.envs.sim.model_spec.get_model`);
    - else a path to a Hugging Face ``config.json``, or to the directory holding one
      (:func:`~kvsched.envs.sim.hf_config.read_hf_config`; relative to the working directory);
    - a mapping ``{hf_config: PATH, name: NAME, <ModelSpec field>: value, ...}``: that config,
      named ``NAME`` (default: the directory's name), with the given fields overridden (e.g.
      ``routing_skew``, ``max_context_tokens``);
    - else an inline mapping of every :class:`ModelSpec` field.

    Raises:
        UnknownPresetError: a name that is neither a preset nor a config path.
        ConfigError: an unreadable or unsupported config.json, a bad override or inline field.
    """
    from .hf_config import read_hf_config

    if isinstance(value, str):
        if value not in MODEL_PRESETS and _is_config_path(value):
            try:
                preset: ModelSpec | None = get_model(value)  # an HF id ("Qwen/Qwen2.5-7B-Instruct") that is a folder
            except UnknownPresetError:
                preset = None
            try:
                read = read_hf_config(value)
            except ConfigError as e:
                if preset is not None:
                    return preset  # a folder without a config.json we can read: the id names the preset
                raise ConfigError(f"{where}: {e}") from None
            # vLLM (transformers) serves a local folder of that name before the hub id: its config wins
            # where it differs from the preset (an added rope_scaling block, another revision)
            if preset is not None and all(getattr(read, f.name) == getattr(preset, f.name)
                                          for f in dataclasses.fields(ModelSpec) if f.name not in ("name", "source")):
                return preset
            return read
        return _preset_or_inline(value, get_model, ModelSpec, where)
    if isinstance(value, Mapping) and "hf_config" in value:
        d = dict(value)
        path, name = d.pop("hf_config"), d.pop("name", None)
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.hf_config={bounded_repr(path)} is not allowed: expected the path of a "
                              "config.json or of the directory holding one")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{where}.name={bounded_repr(name)} is not allowed: expected a non-empty string")
        try:
            base = read_hf_config(path, name)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if not d:
            return base
        model = _build(ModelSpec, {**_spec_dict(base), **d}, where)
        changed = [f for f in sorted(d) if f != "source" and getattr(model, f) != getattr(base, f)]
        if "source" in d or not changed:
            return model
        # the config's source says what was read from the file: say what the scenario set instead
        return dataclasses.replace(model, source=f"{base.source}; overridden in the scenario: " + ", ".join(
            f"{f} {_shown(getattr(model, f))} (read: {_shown(getattr(base, f))})" for f in changed))
    return _build(ModelSpec, value, where)


def _shown(value: Any) -> str:
    """A field's value in a source note: a whole float as an integer (n_params)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _pnm_from(value: Any, where: str) -> PNMSpec:
    """A PNM tier from a preset name, or an inline mapping of :class:`PNMSpec` fields.

    An inline mapping may name a ``preset`` and override some of its fields (e.g.
    ``{preset: cxl-pnm-ocp2025, n_devices: 2}``); ``link`` is a link preset name or an inline
    LinkSpec mapping (default: the preset's link, else :data:`CXL_LINK`).
    """
    if isinstance(value, str):
        try:
            return get_pnm(value)
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a PNM preset name or a mapping, got {type(value).__name__}")
    d = dict(value)
    base: dict[str, Any] = {}
    if "preset" in d:
        try:
            base = _spec_dict(get_pnm(d.pop("preset")))
        except UnknownPresetError as e:
            raise UnknownPresetError(f"{where}: {e}") from None
    link = d.pop("link", base.pop("link", CXL_LINK))
    if not isinstance(link, LinkSpec):
        link = _preset_or_inline(link, get_link, LinkSpec, f"{where}.link")
    merged = {**base, **d}
    merged.pop("link", None)
    allowed = {f.name for f in dataclasses.fields(PNMSpec)} - {"link"}
    unknown = [k for k in merged if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {bounded_repr(unknown[0])}; allowed keys: preset, link, "
                          f"{', '.join(sorted(allowed))}")
    for k in ("capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s", "mbu", "rpc_latency_s"):
        if k in merged:
            merged[k] = as_float(merged[k], f"{where}.{k}")
    if "n_devices" in merged and not is_int(merged["n_devices"]):
        raise ConfigError(f"{where}.n_devices={bounded_repr(merged['n_devices'])} is not allowed: expected an integer")
    missing = [k for k in ("name", "capacity_bytes", "mem_bytes_per_s", "attn_flops_per_s") if k not in merged]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)} (or give a preset)")
    try:
        return PNMSpec(link=link, **merged)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def instance_spec_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> InstanceSpec:
    """Build an :class:`InstanceSpec` from a dict (e.g. parsed YAML).

    ``model``, ``gpu``, ``pcie``, ``nvme_read`` and ``nvme_write`` may be preset names or inline
    dicts of the spec's fields; ``extra_tiers`` is a list of :class:`TierSpec` mappings (links as
    preset names or inline); ``cost`` is a dict of :class:`CostParams` fields whose omitted keys
    take the GPU's default (:func:`default_cost_params`). Other omitted keys take the dataclass
    defaults; ``model`` and ``gpu`` are required.

    Raises:
        ConfigError: not a mapping, an unknown key (the message names the key, ``source`` and the
            allowed keys), a missing model/gpu, a value of the wrong type, or an invalid spec.
        UnknownPresetError: an unknown preset name.
    """
    _check_instance_keys(d, source)
    kw = _component_kwargs(d, source)
    if "cost" in d and d["cost"] is not None:
        kw["cost"] = _cost_from(d["cost"], kw["gpu"], source)
    kw.update(_scalar_kwargs(d, source))
    try:
        return InstanceSpec(**kw)
    except ConfigError as e:
        if isinstance(e, UnknownPresetError):
            raise
        raise ConfigError(f"{source}: {e}") from None


def _check_instance_keys(d: Any, source: str) -> None:
    """``d`` is a mapping of :class:`InstanceSpec` fields naming a model and a GPU.

    Raises:
        ConfigError: not a mapping, an unknown key, or no ``model`` / ``gpu``.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: an instance spec must be a mapping, got {type(d).__name__}")
    unknown = [k for k in d if k not in _INSTANCE_FIELDS]
    if unknown:
        raise ConfigError(f"{source}: unknown key {bounded_repr(unknown[0])}; "
                          f"allowed keys: {', '.join(_INSTANCE_FIELDS)}")
    for key in ("model", "gpu"):
        if key not in d:
            raise ConfigError(f"{source}: missing key {bounded_repr(key)} (a preset name or an inline dict)")


def _component_kwargs(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The spec objects of ``d``: model, gpu, links, PNM device and extra tiers (those given).

    ``pcie: null`` is left out (the link then follows the GPU), as are ``pnm``,
    ``prefix_offload``, ``parallel`` and ``extra_tiers`` when null.

    Raises:
        ConfigError: a malformed inline spec or tier list; UnknownPresetError: an unknown preset.
    """
    kw: dict[str, Any] = {
        "model": model_from(d["model"], f"{source}: model"),
        "gpu": _preset_or_inline(d["gpu"], get_gpu, GPUSpec, f"{source}: gpu"),
    }
    for key in ("pcie", "nvme_read", "nvme_write"):
        if key in d and not (key == "pcie" and d[key] is None):
            kw[key] = _preset_or_inline(d[key], get_link, LinkSpec, f"{source}: {key}")
    if "pnm" in d and d["pnm"] is not None:
        kw["pnm"] = _pnm_from(d["pnm"], f"{source}: pnm")
    if "prefix_offload" in d and d["prefix_offload"] is not None:
        kw["prefix_offload"] = PrefixOffloadSpec.from_dict(d["prefix_offload"], f"{source}: prefix_offload")
    if "parallel" in d and d["parallel"] is not None:
        from .disagg import get_disagg_link  # every link `kvsched presets` lists, host and between instances

        kw["parallel"] = ParallelSpec.from_dict(d["parallel"], f"{source}: parallel", get_disagg_link)
    if "extra_tiers" in d and d["extra_tiers"] is not None:
        tiers = d["extra_tiers"]
        if not isinstance(tiers, (list, tuple)):
            raise ConfigError(f"{source}: extra_tiers={bounded_repr(tiers)} is not allowed: "
                              "expected a list of tier mappings")
        kw["extra_tiers"] = tuple(_tier_from(t, f"{source}: extra_tiers[{i}]") for i, t in enumerate(tiers))
    return kw


def _cost_from(given: Any, gpu: GPUSpec, source: str) -> CostParams:
    """:class:`CostParams` from a mapping of some of its fields; omitted keys take the GPU's
    default (calibrated where a calibration file exists, :func:`default_cost_params`).

    Raises:
        ConfigError: not a mapping, an unknown key, or a bad value.
    """
    if not isinstance(given, Mapping):
        raise ConfigError(f"{source}: cost must be a mapping of CostParams fields, got {type(given).__name__}")
    base = _spec_dict(default_cost_params(gpu))
    unknown = [k for k in given if k not in base]
    if unknown:
        raise ConfigError(f"{source}: cost: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(base)}")
    return _build(CostParams, {**base, **given}, f"{source}: cost")


def _scalar_kwargs(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The integer, float, string and boolean fields of ``d`` that are given, type-checked.

    Integers become ``int`` (``null`` allowed for the optional ones), floats go through
    :func:`as_float`; strings and booleans are taken as they are.

    Raises:
        ConfigError: a value of the wrong type (the message names ``source`` and the key).
    """
    kw: dict[str, Any] = {}
    for key in _INT_FIELDS + _OPT_INT_FIELDS:
        if key in d:
            v = d[key]
            if v is None and key in _OPT_INT_FIELDS:
                kw[key] = None
            elif not is_int(v):
                raise ConfigError(f"{source}: {key}={bounded_repr(v)} is not allowed: expected an integer"
                                  + (" or null" if key in _OPT_INT_FIELDS else "") + text_number_hint(v, integer=True))
            else:
                kw[key] = int(v)
    for key in _FLOAT_FIELDS:
        if key in d:
            kw[key] = as_float(d[key], f"{source}: {key}")
    for key in _STR_FIELDS:
        if key in d:
            if not isinstance(d[key], str):
                raise ConfigError(f"{source}: {key}={bounded_repr(d[key])} is not allowed: expected a string")
            kw[key] = d[key]
    for key in _BOOL_FIELDS:
        if key in d:
            if not isinstance(d[key], bool):
                raise ConfigError(f"{source}: {key}={bounded_repr(d[key])} is not allowed: expected true or false")
            kw[key] = d[key]
    return kw


def load_instance_spec(path: str | Path) -> InstanceSpec:
    """Read an :class:`InstanceSpec` from a YAML file.

    Raises:
        ConfigError: invalid YAML or spec (the message names the file).
        OSError: the file cannot be read.
    """
    from .yaml_loading import load_yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = load_yaml(text, str(p))
    return instance_spec_from_dict(data, source=str(p))


def save_instance_spec(spec: InstanceSpec, path: str | Path) -> None:
    """Write ``spec`` as a self-contained YAML file (see :func:`instance_spec_to_dict`)."""
    text = yaml.safe_dump(instance_spec_to_dict(spec), sort_keys=False, default_flow_style=False,
                          allow_unicode=True)
    atomic_files.write_text(Path(path), text)


def presets_rows() -> dict[str, list[dict[str, Any]]]:
    """Rows for a presets table: ``{"models": [...], "gpus": [...], "links": [...], "pnm": [...]}``.

    Model rows carry KV bytes/token at bf16 (REFERENCE §5.1 column) and bf16 weights in GB.
    """
    models = [
        {
            "name": m.name,
            "layers": m.n_layers,
            "hidden": m.hidden_size,
            "heads": m.n_heads,
            "kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "params_B": round(m.n_params / 1e9, 2),
            "active_params_B": round(m.active_params / 1e9, 2),
            "experts": f"{m.n_experts} (top-{m.experts_per_token}" + (f" + {m.n_shared_experts} shared)"
                                                                     if m.n_shared_experts else ")")
            if m.is_moe else "-",
            "weights": m.weight_dtype + ({"mlp": " (MLP)", "linear": " (Linear)"}.get(m.quantized_weights, "")
                                         if m.weight_dtype != "bf16" else ""),
            "weights_GB_bf16": round(m.weight_bytes(2.0) / 1e9, 1),
            "weights_GB": round(m.weight_bytes(DTYPE_BYTES[m.weight_dtype]) / 1e9, 1),
            "kv_bytes_per_token_bf16": int(m.kv_bytes_per_token(2.0)),
            "attention": "MLA" if m.is_mla else ("MHA" if m.n_kv_heads == m.n_heads else "GQA"),
            "max_context_tokens": m.max_context_tokens,
        }
        for m in MODEL_PRESETS.values()
    ]
    gpus = [
        {
            "name": g.name,
            "hbm_GB": round(g.hbm_bytes / 1e9, 1),
            "hbm_TB_per_s": round(g.hbm_bytes_per_s / 1e12, 3),
            "bf16_TFLOPS": round(g.bf16_flops_per_s / 1e12, 1),
            "fp8_TFLOPS": round(g.fp8_flops_per_s / 1e12, 1),
            "fp4_TFLOPS": round(g.fp4_flops_per_s / 1e12, 1),
            "nvlink_GB_per_s": round(g.nvlink_bytes_per_s / 1e9, 1),
            "pcie_GB_per_s": round(g.pcie_bytes_per_s / 1e9, 1),
        }
        for g in GPU_PRESETS.values()
    ]
    links = [
        {"name": lk.name, "GB_per_s": round(lk.bytes_per_s / 1e9, 2), "latency_us": round(lk.latency_s * 1e6, 1)}
        for lk in LINK_PRESETS.values()
    ]
    pnm = [
        {"name": p.name, "devices": p.n_devices, "capacity_TB": round(p.total_capacity_bytes / 1e12, 2),
         "mem_TB_per_s": round(p.n_devices * p.mem_bytes_per_s / 1e12, 3),
         "attn_TFLOPS": round(p.n_devices * p.attn_flops_per_s / 1e12, 1),
         "link_GB_per_s": round(p.link.bytes_per_s / 1e9, 1)}
        for p in PNM_PRESETS.values()
    ]
    return {"models": models, "gpus": gpus, "links": links, "pnm": pnm}
