"""Export a tuned trial to production configurations (``kvsched export``).

Targets (REFERENCE §7 "Mapping tuned heuristic parameters to production configs"):

* ``vllm``: YAML for ``vllm serve MODEL --config FILE``. Keys are vLLM engine flags
  (kebab-case), each checked against the ``EngineArgs`` fields of a released vLLM
  (``experiments/engine_args/vllm.json``, written by ``experiments/tools/extract_engine_args.py``)
  and values against its ``Literal`` choices where extracted (``kv-cache-dtype``,
  ``scheduling-policy``).
* ``sglang``: YAML of SGLang server arguments (``python -m sglang.launch_server --config
  FILE``; SGLang 0.5.23 registers ``--config``), checked against
  ``experiments/engine_args/sglang.json``. The mapping is approximate where the engines
  differ (commented in the file).
* ``llm-d``: an ``EndpointPickerConfig`` (llm-d inference scheduler / Gateway API inference
  extension) with scorer weights. ``kvsched tune`` tunes engine-side policies only, not the
  scenario's router (kvsched.policies.routing), so the file configures ``random-picker``
  (a stateless spread, which the file says) and lists every tuned parameter as not
  expressible there.
* ``kvsched``: JSON with the policy name, every field of its parameter dataclass and the
  engine settings the trial changed; ``kvsched simulate --policy-file FILE`` loads it back
  (same scenario and seed -> identical metrics).

Engine values come from the scenario's instance spec resolved with the trial's ``engine.*``
parameters (defaults resolved the way the simulator resolves them, e.g. ``token_budget``).
Parameters a target cannot express (policy heuristics vLLM/SGLang have no flag for, a tier
they cannot model, partial-prefill limits a release no longer has) are returned in
:attr:`ExportResult.unexpressible`, printed by the command and written as a commented list
(and, in JSON, a ``not_expressible`` key); nothing is dropped silently. Every file carries
provenance: kvsched version, study, storage, trial, objective value, scenario name/path/hash,
workload hashes per window and seed, seeds and windows; for vllm and sglang also the
objective of the engine's own scheduler with the exported settings (:func:`target_objective`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

import kvsched
from kvsched.envs.sim.errors import ConfigError
from kvsched.policies.base import make_policy
from kvsched import atomic_files

ENGINE_ARGS_DIR = Path(__file__).resolve().parent / "engine_args"
TARGETS = ("vllm", "sglang", "llm-d", "kvsched")
POLICY_FILE_FORMAT = "kvsched-policy/1"
GB = 1e9
GiB = 1024 ** 3


@dataclass
class ExportResult:
    """What an exporter produced.

    Attributes:
        text: the file's content.
        config: the mapping written (engine keys -> values), without comments.
        unexpressible: ``(name, value, reason)`` for every parameter the target cannot express.
        provenance: where the values come from.
    """

    text: str
    config: dict
    unexpressible: list[tuple[str, Any, str]] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)


def engine_args(engine: str) -> dict:
    """The committed argument list of ``engine`` ("vllm" or "sglang"): flags, version, choices."""
    return json.loads((ENGINE_ARGS_DIR / f"{engine}.json").read_text())


def check_keys(engine: str, config: Mapping[str, Any]) -> None:
    """Every key must be a flag of the committed release, every checked value one of its choices.

    Raises:
        ConfigError: naming the unknown key or value and the engine version.
    """
    info = engine_args(engine)
    flags = set(info["flags"])
    for k, v in config.items():
        if k not in flags:
            raise ConfigError(f"export {engine}: {k!r} is not a flag of {engine} {info['version']} "
                              f"({info['source']}); the exporter's mapping is stale")
        choices = info.get("choices", {}).get(k)
        if choices is not None and v not in choices:
            raise ConfigError(f"export {engine}: {k}={v!r} is not one of {engine} {info['version']}'s choices {choices}")


# ----------------------------------------------------------------------------- loading a trial
def _sqlite_file(storage_url: str) -> str | None:
    """The database file of a ``sqlite://`` storage URL (SQLAlchemy's ``make_url``), ``None`` for
    any other URL and for an in-memory SQLite database."""
    if not storage_url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    try:
        db = make_url(storage_url).database
    except Exception:  # not a URL: make_storage names the form
        return None
    return db if db and db != ":memory:" else None


def trial_config(study_name: str, storage_url: str, trial: int | None = None) -> dict:
    """Policy, full parameters, engine overrides, resolved spec and provenance of one trial.

    Raises:
        ConfigError: unknown study, a trial that did not complete, or no feasible trial.
    """
    from optuna.trial import TrialState

    from .tune import (TuneConfig, _redact, best_trial, full_policy_params, journal_path, open_study, scenario_for,
                       scenario_of_study, split_params)

    jp = journal_path(storage_url)
    if jp is not None and not Path(jp).is_file():  # opening it would create an empty journal
        raise ConfigError(f"--storage {storage_url}: no such journal file {jp!r}")
    db = _sqlite_file(storage_url)
    if db is not None and not Path(db).is_file():  # opening it would create an empty database
        raise ConfigError(f"--storage {_redact(storage_url)}: no such SQLite database file {db!r}")
    study = open_study(study_name, storage_url)
    if "tune_config" not in study.user_attrs:
        raise ConfigError(f"study {study_name!r} was not created by kvsched tune (no tune_config)")
    cfg = TuneConfig.from_dict(study.user_attrs["tune_config"])
    if trial is None:
        t = best_trial(study, cfg)
        if t is None:
            raise ConfigError(f"study {study_name!r} has no complete feasible trial; give --trial N")
    else:
        matches = [x for x in study.get_trials(deepcopy=False) if x.number == trial]
        if not matches or matches[0].state != TrialState.COMPLETE:
            raise ConfigError(f"study {study_name!r}: trial {trial} does not exist or did not complete")
        t = matches[0]
    policy_given, engine = split_params(t.params)
    seed = cfg.seeds[0]
    params = full_policy_params(cfg.policy, policy_given, seed)
    sc = scenario_of_study(study)
    spec = scenario_for(sc, cfg.windows_s[0], seed, engine).instance_spec()
    base = next((x for x in study.get_trials(deepcopy=False) if x.user_attrs.get("baseline")
                 and x.state == TrialState.COMPLETE), None)
    ua = study.user_attrs
    prov = {
        "kvsched_version": kvsched.__version__, "study": study_name, "storage": _redact(storage_url),
        "trial": t.number, "objective": str(cfg.objective), "direction": cfg.direction,
        "objective_mean": t.user_attrs.get("objective_mean"), "objective_std": t.user_attrs.get("objective_std"),
        "baseline_objective_mean": base.user_attrs.get("objective_mean") if base else None,
        "constraints": [str(c) for c in cfg.constraints], "feasible": t.user_attrs.get("feasible"),
        "scenario": sc.name, "scenario_path": ua.get("scenario_path"), "scenario_sha256": ua.get("scenario_sha256"),
        "workload_sha256": ua.get("workload_sha256"), "seeds": list(cfg.seeds),
        "windows_s": [list(w) for w in cfg.windows_s], "tuned_by": f"kvsched tune, optuna {ua.get('optuna_version')}",
    }
    return {"policy": cfg.policy, "params": params, "engine": engine, "spec": spec, "provenance": prov}


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether the paths ``a`` and ``b`` are one existing file (also through a symlink or a
    hard link)."""
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).samefile(b)
    except OSError:
        return False


def export_study(study_name: str, storage_url: str, target: str, out: Path, trial: int | None = None,
                 simulate_target: bool = True) -> ExportResult:
    """Write the ``target`` configuration of a trial (default the best feasible) to ``out``.

    For vllm and sglang (``simulate_target``) the provenance also gets
    :func:`target_objective`: what the exported file alone is expected to achieve.

    Raises:
        ConfigError: an unknown target, ``out`` being the study's own journal or SQLite file
            (writing it would destroy the study), or a study :func:`trial_config` refuses.
    """
    if target not in TARGETS:
        raise ConfigError(f"--target={target!r}: allowed {', '.join(TARGETS)}")
    from .tune import _redact, journal_path

    store = journal_path(storage_url) or _sqlite_file(storage_url)
    if store is not None and _same_file(out, store):
        raise ConfigError(f"--out {str(out)!r} is not allowed: it is the study's storage ({_redact(storage_url)}); "
                          "writing the export there would destroy the study; give another file name")
    tc = trial_config(study_name, storage_url, trial)
    if target in ("vllm", "sglang") and simulate_target:
        tc["provenance"].update(target_objective(study_name, storage_url, tc))
    fn = {"vllm": export_vllm, "sglang": export_sglang, "llm-d": export_llmd, "kvsched": export_kvsched}[target]
    res = fn(tc["policy"], tc["params"], tc["engine"], tc["spec"], tc["provenance"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write_text(out, res.text)
    return res


def target_objective(study_name: str, storage_url: str, tc: Mapping[str, Any]) -> dict:
    """The study's objective when only what an engine can express is kept: the engine's native
    scheduler (fcfs, or priority for kvsched's priority policy) with the trial's engine settings,
    simulated on the study's windows and seeds. Shows how much of the tuned gain the exported
    file carries (all of it when the gain came from engine knobs; none of a heuristic's own).
    """
    from .tune import TuneConfig, _nanmean, metric_value, open_study, run_scenario, scenario_of_study

    study = open_study(study_name, storage_url)
    cfg = TuneConfig.from_dict(study.user_attrs["tune_config"])
    sc = scenario_of_study(study)
    native = "priority" if tc["policy"] == "priority" else "fcfs"
    vals = [metric_value(run_scenario(sc, w, s, native, {}, tc["engine"]), cfg.objective)
            for w in cfg.windows_s for s in cfg.seeds]
    return {"target_policy_simulated": native, "target_objective_mean": _nanmean(vals)}


# ----------------------------------------------------------------------------- shared pieces
def _policy_unexpressible(engine: str, policy: str, params: Mapping[str, Any]) -> tuple[str | None, list]:
    """(the engine's scheduling-policy value or None, unexpressible policy parameters)."""
    native = {"fcfs": "fcfs", "priority": "priority"}.get(policy)
    out = []
    base_flags = ("tier_aware_preemption", "prefetch", "admit_while_swapped")
    if native is None:
        out.append(("policy", policy, f"{engine} has no {policy} scheduler (REFERENCE §7: needs a scheduler plugin); "
                                      "the engine runs its FCFS scheduler"))
        for k, v in params.items():
            out.append((f"policy_params.{k}", v, f"parameter of kvsched's {policy}, no {engine} flag"))
    else:
        for k in base_flags:  # vLLM/SGLang behave as if these were False
            if params.get(k):
                out.append((f"policy_params.{k}", True, f"{engine} has no flag for it"))
        mode = params.get("admission_preemption", "never")
        if mode != "never":  # V1 engines never preempt for a waiting request
            out.append(("policy_params.admission_preemption", mode, f"{engine} has no flag for it"))
    return native, out


def _spec_unexpressible(engine: str, spec, partial_flags: bool) -> list:
    out = []
    if spec.max_num_partial_prefills != 1 or spec.max_long_partial_prefills != 1:
        if not partial_flags:
            out.append(("max_num_partial_prefills", [spec.max_num_partial_prefills, spec.max_long_partial_prefills],
                        f"no partial-prefill limit flags in {engine} {engine_args(engine)['version']}"))
    if spec.preemption_mode != "recompute":
        v1 = " (V1)" if engine == "vllm" else ""
        out.append(("preemption_mode", spec.preemption_mode, f"{engine} preempts by recompute only{v1}"))
    if spec.nvme_kv_bytes > 0:
        out.append(("nvme_kv_bytes", spec.nvme_kv_bytes, "NVMe KV tier: configure LMCache/HiCache storage by hand"))
    return out


def _header(title: str, prov: Mapping[str, Any], unexpressible: list, notes: list[str]) -> str:
    lines = [f"# {title}", "# provenance:"]
    for k, v in prov.items():
        lines.append(f"#   {k}: {json.dumps(v, default=str)}")
    for n in notes:
        lines.append(f"# note: {n}")
    if unexpressible:
        lines.append("# NOT EXPRESSIBLE in this target (tuned values, not applied by this file):")
        for name, value, why in unexpressible:
            lines.append(f"#   {name} = {json.dumps(value, default=str)}  # {why}")
    return "\n".join(lines) + "\n"


def _dump(config: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)


def _kv_dtype_vllm(spec) -> str | None:
    return {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp8": "fp8"}.get(spec.kv_dtype)


# ----------------------------------------------------------------------------- targets
def export_vllm(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                prov: Mapping[str, Any]) -> ExportResult:
    """``vllm serve --config`` YAML (vLLM engine flags; REFERENCE §4.1 and §7)."""
    native, unexp = _policy_unexpressible("vllm", policy, params)
    flags = set(engine_args("vllm")["flags"])
    cfg: dict[str, Any] = {
        "tensor-parallel-size": spec.tp,
        "max-num-batched-tokens": spec.token_budget,
        "max-num-seqs": spec.max_seqs,
        "max-model-len": spec.model_len_limit,
        "long-prefill-token-threshold": spec.long_prefill_token_threshold,
        "enable-chunked-prefill": spec.enable_chunked_prefill,
        "enable-prefix-caching": spec.enable_prefix_caching,
        "block-size": spec.block_size_tokens,
        "gpu-memory-utilization": spec.gpu_memory_utilization,
        "kv-cache-dtype": _kv_dtype_vllm(spec),
        "scheduling-policy": native or "fcfs",
    }
    if spec.hbm_kv_blocks is not None:
        cfg["num-gpu-blocks-override"] = spec.hbm_kv_blocks
    partial = "max-num-partial-prefills" in flags
    if partial:
        cfg["max-num-partial-prefills"] = spec.max_num_partial_prefills
        cfg["max-long-partial-prefills"] = spec.max_long_partial_prefills
    if spec.dram_kv_bytes > 0:  # native CPU offload, size in GiB (REFERENCE §4.1)
        cfg["kv-offloading-size"] = round(spec.dram_kv_bytes / GiB, 3)
        cfg["kv-offloading-backend"] = "native"
    unexp += _spec_unexpressible("vllm", spec, partial)
    check_keys("vllm", cfg)
    notes = [f"serve with: vllm serve <HF id of {spec.model.name}> --config THIS_FILE "
             f"(keys checked against vLLM {engine_args('vllm')['version']} EngineArgs)"]
    if native == "priority":
        notes.append("clients must send priority = prompt tokens per request (kvsched's priority policy)")
    text = _header(f"vLLM engine arguments exported by kvsched from study {prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_sglang(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                  prov: Mapping[str, Any]) -> ExportResult:
    """SGLang server arguments (REFERENCE §4.2 and §7; approximate where the engines differ)."""
    native, unexp = _policy_unexpressible("sglang", policy, params)
    chunk = (spec.long_prefill_token_threshold or spec.token_budget) if spec.enable_chunked_prefill else -1
    cfg: dict[str, Any] = {
        "tp-size": spec.tp,
        "chunked-prefill-size": chunk,
        "max-prefill-tokens": spec.token_budget,
        "max-running-requests": spec.max_seqs,
        "context-length": spec.model_len_limit,
        "page-size": spec.block_size_tokens,
        "mem-fraction-static": spec.gpu_memory_utilization,
        "disable-radix-cache": not spec.enable_prefix_caching,
        "schedule-policy": native or "fcfs",
    }
    if native == "priority":
        cfg["enable-priority-scheduling"] = True
        cfg["schedule-low-priority-values-first"] = True
    kv = {"auto": "auto", "fp8": "fp8_e4m3"}.get(spec.kv_dtype)
    if kv is None:
        unexp.append(("kv_dtype", spec.kv_dtype, "kvsched exports only auto and fp8 (fp8_e4m3) to SGLang"))
    else:
        cfg["kv-cache-dtype"] = kv
    hicache_gb = spec.dram_kv_bytes / GB / spec.tp  # SGLang: host pool per rank, whole GB (int flag)
    hicache_rounded = False
    if spec.dram_kv_bytes > 0 and math.floor(hicache_gb) >= 1:
        cfg["enable-hierarchical-cache"] = True
        cfg["hicache-size"] = int(math.floor(hicache_gb))
        hicache_rounded = cfg["hicache-size"] != hicache_gb
    elif spec.dram_kv_bytes > 0:
        unexp.append(("dram_kv_bytes", spec.dram_kv_bytes, f"{hicache_gb:.3g} GB per rank: SGLang's hicache-size "
                                                           "takes whole GB (>= 1; 0 means 'use hicache-ratio')"))
    unexp += _spec_unexpressible("sglang", spec, partial_flags=False)
    check_keys("sglang", cfg)
    notes = [f"serve with: python -m sglang.launch_server --model-path <HF id of {spec.model.name}> --config THIS_FILE "
             f"(keys checked against SGLang {engine_args('sglang')['version']} server arguments)",
             "chunked-prefill-size = vLLM long-prefill threshold if set, else the token budget; max-prefill-tokens = "
             "token budget (SGLang does not count decodes in it); mem-fraction-static covers weights + KV pool, "
             "vLLM's gpu-memory-utilization everything: approximate",
             "schedule-conservativeness has no kvsched counterpart and is left at SGLang's default"]
    if "hicache-size" in cfg:
        notes.append("hicache-size (GB per rank) is a host prefix cache, not vLLM-V0-style swap space")
    if hicache_rounded:
        notes.append(f"hicache-size rounded down from {hicache_gb:.6g} GB per rank (SGLang takes whole GB)")
    text = _header(f"SGLang server arguments exported by kvsched from study {prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_llmd(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                prov: Mapping[str, Any]) -> ExportResult:
    """llm-d ``EndpointPickerConfig``: router scorer weights (``schedulingProfiles[].plugins[].weight``)."""
    router = {k[len("router."):]: v for k, v in params.items() if k.startswith("router.")}
    unexp = [(f"policy_params.{k}", v, "an engine-side scheduling parameter; llm-d configures routing only "
                                       "(export --target vllm/sglang for the engine)")
             for k, v in params.items() if not k.startswith("router.")]
    unexp.insert(0, ("policy", policy, "engine-side policy; not a router setting"))
    for k, v in engine.items():
        unexp.append((f"engine.{k}", v, "engine argument; see --target vllm/sglang"))
    if router:
        plugins = [{"type": "single-profile-handler"}] + [{"type": s} for s in router] + [{"type": "max-score-picker"}]
        refs = [{"pluginRef": s, "weight": w} for s, w in router.items()] + [{"pluginRef": "max-score-picker"}]
        notes = []
    else:
        plugins = [{"type": "single-profile-handler"}, {"type": "random-picker"}]
        refs = [{"pluginRef": "random-picker"}]
        notes = ["the study tuned no router weights (kvsched tune tunes engine-side policies, not the scenario's "
                 "router); random-picker is a stateless llm-d spread, not the scenario's router"]
    cfg = {"apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]}
    text = _header(f"llm-d EndpointPickerConfig exported by kvsched from study {prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_kvsched(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                   prov: Mapping[str, Any]) -> ExportResult:
    """The full policy parameters as JSON (``kvsched simulate --policy-file``); nothing unexpressible."""
    cfg = {"format": POLICY_FILE_FORMAT, "policy": policy, "policy_params": dict(params), "engine": dict(engine),
           "not_expressible": [], "provenance": dict(prov)}
    return ExportResult(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n", cfg, [], dict(prov))


def load_policy_file(path: str | Path) -> dict:
    """Read a ``--target kvsched`` file: ``{"policy", "policy_params", "engine"}`` (validated).

    Raises:
        ConfigError: unreadable JSON, another format, an unknown policy or invalid parameters.
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--policy-file {p}: cannot read JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != POLICY_FILE_FORMAT:
        raise ConfigError(f"--policy-file {p}: not a kvsched policy file (format must be {POLICY_FILE_FORMAT!r}; "
                          "write one with kvsched export --target kvsched)")
    for k in ("policy", "policy_params", "engine"):
        if k not in d:
            raise ConfigError(f"--policy-file {p}: missing key {k!r}")
    if not isinstance(d["policy_params"], dict) or not isinstance(d["engine"], dict):
        raise ConfigError(f"--policy-file {p}: policy_params and engine must be mappings")
    make_policy(d["policy"], dict(d["policy_params"]))  # validates name, fields and values
    return {"policy": d["policy"], "policy_params": dict(d["policy_params"]), "engine": dict(d["engine"])}
