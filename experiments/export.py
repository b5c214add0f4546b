"""Export a tuned trial to production configurations (``kvsched export``).

Targets (REFERENCE §7 "Mapping tuned heuristic parameters to production configs"):

* ``vllm``: YAML for ``vllm serve MODEL --config FILE``. Keys are vLLM engine flags
  (kebab-case), each checked against the ``EngineArgs`` fields of a released vLLM
  (``experiments/engine_args/vllm.json``, written by ``experiments/tools/extract_engine_args.py``)
  and values against its ``Literal`` choices where extracted (``kv-cache-dtype``,
  ``scheduling-policy``). Where vLLM is installed (the ``vllm`` extra), the file is also parsed
  by vLLM's own argument parser and ``EngineArgs`` before it is written (:func:`check_with_vllm`);
  the extracted list stays the check for the GPU wheel's version.
* ``sglang``: YAML of SGLang server arguments (``python -m sglang.launch_server --config
  FILE``; SGLang 0.5.23 registers ``--config``), checked against
  ``experiments/engine_args/sglang.json``. The mapping is approximate where the engines
  differ (commented in the file).
* ``llm-d``: an ``EndpointPickerConfig`` (llm-d inference scheduler / Gateway API inference
  extension) with scorer weights. A study of kvsched's ``llm-d`` router (``kvsched tune
  --router llm-d``) maps its three weights onto the scorers they mirror (``queue-scorer``,
  ``kv-cache-utilization-scorer``, ``prefix-cache-scorer``, picked by ``max-score-picker``;
  REFERENCE §4.3); its routed-prefix index settings are listed as not expressible. Any other
  study (a policy study, or another router) configures ``random-picker`` (a stateless spread,
  which the file says) and lists every tuned parameter as not expressible there.
* ``kvsched``: JSON with the policy name, every field of its parameter dataclass and the
  engine settings the trial changed, and for a router study the router and every field of its
  parameters; ``kvsched simulate --policy-file FILE`` loads it back (same scenario and seed ->
  identical metrics).

Router studies and engine targets: a router runs in front of the engines, so for ``vllm`` and
``sglang`` the router and each of its parameters are listed as not expressible, naming the
gateway flag the parameter mirrors where :mod:`kvsched.policies.routing` cites one (SGLang
Model Gateway, Dynamo); the policy there is the scenario's, fixed during the study.

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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

import kvsched
from kvsched.envs.sim import strict_json
from kvsched.envs.sim.errors import ConfigError, bounded_repr, MAX_PATH_CHARS
from kvsched.policies.base import make_policy
from kvsched.policies.lpm import LPMParams
from kvsched import atomic_files

ENGINE_ARGS_DIR = Path(__file__).resolve().parent / "engine_args"
TARGETS = ("vllm", "vllm-plugin", "sglang", "llm-d", "kvsched")
#: kvsched policies with a vLLM scheduler plugin (:mod:`kvsched.deploy.vllm`): policy -> class
VLLM_PLUGINS = {"lars": "kvsched.deploy.vllm.LARSScheduler", "ewsjf": "kvsched.deploy.vllm.EWSJFScheduler"}
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
            raise ConfigError(f"export {engine}: {bounded_repr(k)} is not a flag of {engine} {info['version']} "
                              f"({info['source']}); the exporter's mapping is stale")
        choices = info.get("choices", {}).get(k)
        if choices is not None and v not in choices:
            raise ConfigError(f"export {engine}: {k}={bounded_repr(v)} is not one of "
                              f"{engine} {info['version']}'s choices {choices}")


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (the ``vllm`` extra), without importing it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def check_with_vllm(text: str) -> Any:
    """Parse a ``vllm serve --config`` file's ``text`` with the installed vLLM's own parser.

    ``EngineArgs.add_cli_args(FlexibleArgumentParser())`` reads the file through ``--config``
    as ``vllm serve`` does (every key must be a flag of this vLLM, every value of its type and
    among its choices), ``EngineArgs.from_cli_args`` builds the engine arguments, and vLLM's
    pydantic ``SchedulerConfig`` and ``CacheConfig`` are built from them (ranges, e.g. a
    negative budget or a utilisation above 1). Needs the ``vllm`` extra; imports vLLM (seconds),
    its warnings quieted first (:func:`kvsched.deploy.quiet_vllm_logging`).

    Returns:
        vLLM's ``EngineArgs``.

    Raises:
        ConfigError: naming vLLM's version and its own message (one line, bounded).
    """
    import contextlib
    import io
    import tempfile

    from kvsched.deploy import quiet_vllm_logging

    quiet_vllm_logging()
    import vllm
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with tempfile.TemporaryDirectory(prefix="kvsched-vllm-check-") as d:
        path = Path(d) / "engine.yaml"
        path.write_text(text)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(["--config", str(path)])
        except SystemExit:  # argparse reports and exits; its last line is the reason
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            why = lines[-1] if lines else "refused"
            raise ConfigError(f"export vllm: vLLM {vllm.__version__}'s own parser refuses the file: "
                              f"{bounded_repr(why, 300)}") from None
    try:
        ea = EngineArgs.from_cli_args(args)
        SchedulerConfig(max_num_batched_tokens=ea.max_num_batched_tokens, max_num_seqs=ea.max_num_seqs,
                        max_model_len=ea.max_model_len or 8192, enable_chunked_prefill=ea.enable_chunked_prefill,
                        long_prefill_token_threshold=ea.long_prefill_token_threshold, policy=ea.scheduling_policy,
                        is_encoder_decoder=False)
        CacheConfig(block_size=ea.block_size, gpu_memory_utilization=ea.gpu_memory_utilization,
                    cache_dtype=ea.kv_cache_dtype, enable_prefix_caching=ea.enable_prefix_caching)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        why = " ".join(str(e).split())
        raise ConfigError(f"export vllm: vLLM {vllm.__version__} refuses a value: {bounded_repr(why, 300)}") from None
    return ea


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
    """Policy, full parameters, engine overrides, resolved spec and provenance of one trial;
    ``router`` and ``router_params`` (every field) for a router study, else ``None``.

    In a router study the policy parameters are the scenario's ``policy_params`` (fixed during
    the study). A ``seed`` field (policy or router) is pinned to the study's first seed.

    Raises:
        ConfigError: unknown study, a trial that did not complete, or no feasible trial.
    """
    from optuna.trial import TrialState

    from .tune import (TuneConfig, _redact, best_trial, full_policy_params, full_router_params, journal_path,
                       open_study, scenario_for, scenario_of_study, split_params)

    jp = journal_path(storage_url)
    if jp is not None and not Path(jp).is_file():  # opening it would create an empty journal
        raise ConfigError(f"--storage {bounded_repr(_redact(storage_url), MAX_PATH_CHARS)}: no such journal file "
                          f"{bounded_repr(jp, MAX_PATH_CHARS)}")
    db = _sqlite_file(storage_url)
    if db is not None and not Path(db).is_file():  # opening it would create an empty database
        raise ConfigError(f"--storage {_redact(storage_url)}: no such SQLite database file {bounded_repr(db)}")
    study = open_study(study_name, storage_url)
    if "tune_config" not in study.user_attrs:
        raise ConfigError(f"study {bounded_repr(study_name)} was not created by kvsched tune (no tune_config)")
    cfg = TuneConfig.from_dict(study.user_attrs["tune_config"])
    if trial is None:
        t = best_trial(study, cfg)
        if t is None:
            raise ConfigError(f"study {bounded_repr(study_name)} has no complete feasible trial; give --trial N")
    else:
        matches = [x for x in study.get_trials(deepcopy=False) if x.number == trial]
        if not matches or matches[0].state != TrialState.COMPLETE:
            raise ConfigError(f"study {bounded_repr(study_name)}: trial {trial} does not exist or did not complete")
        t = matches[0]
    given, engine = split_params(t.params)
    seed = cfg.seeds[0]
    sc = scenario_of_study(study)
    router, router_params = None, None
    if cfg.router is None:
        params = full_policy_params(cfg.policy, given, seed)
    else:  # the scenario's policy ran with its own parameters; the trial's are the router's
        params = full_policy_params(cfg.policy, sc.policy_params, seed)
        router, router_params = cfg.router, full_router_params(cfg.router, given, seed)
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
    if router is not None:
        prov["tuned"] = cfg.tuned
    return {"policy": cfg.policy, "params": params, "engine": engine, "spec": spec, "provenance": prov,
            "router": router, "router_params": router_params}


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether the paths ``a`` and ``b`` are one existing file (also through a symlink or a
    hard link)."""
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).samefile(b)
    except OSError:
        return False


def _study_owned(out: str | Path, store: str | Path) -> bool:
    """Whether writing ``out`` would overwrite the study's storage ``store`` or a file beside it
    that the tuner uses: ``<journal>.gate`` and ``<journal>.workers/`` (the trial gate,
    :mod:`kvsched.experiments.tune_gate`), ``<journal>.torn-<n>.bak`` (a repaired journal's
    original), Optuna's ``<journal>.lock``, SQLite's ``-journal``, ``-wal`` and ``-shm``: any
    ``<store>.*`` or ``<store>-*`` in its folder, or anything under ``<store>.workers``."""
    if _same_file(out, store):
        return True
    o, st = Path(os.path.abspath(out)), Path(os.path.abspath(store))
    try:
        o = o.parent.resolve() / o.name
        st = st.resolve()
    except (OSError, RuntimeError):
        pass
    if o == st:
        return True
    if o.parent == st.parent and (o.name.startswith(st.name + ".") or o.name.startswith(st.name + "-")):
        return True
    return st.with_name(st.name + ".workers") in o.parents


def export_study(study_name: str, storage_url: str, target: str, out: Path, trial: int | None = None,
                 simulate_target: bool = True) -> ExportResult:
    """Write the ``target`` configuration of a trial (default the best feasible) to ``out``.

    For vllm and sglang (``simulate_target``) the provenance also gets
    :func:`target_objective`: what the exported file alone is expected to achieve.

    Raises:
        ConfigError: an unknown target, ``out`` being the study's own journal or SQLite file or a
            file the tuner keeps beside it (:func:`_study_owned`; writing it would damage the study),
            or a study :func:`trial_config` refuses.
    """
    if target not in TARGETS:
        raise ConfigError(f"--target={bounded_repr(target)}: allowed {', '.join(TARGETS)}")
    from .tune import _redact, journal_path

    store = journal_path(storage_url) or _sqlite_file(storage_url)
    if store is not None and _study_owned(out, store):
        raise ConfigError(f"--out {bounded_repr(str(out), MAX_PATH_CHARS)} is not allowed: "
                          f"it is the study's storage ({_redact(storage_url)}) or a file the tuner keeps beside it "
                          "(.gate, .workers, .lock, .torn-N.bak); writing the export there would damage the study; "
                          "give another file name")
    tc = trial_config(study_name, storage_url, trial)
    if target in ("vllm", "sglang") and simulate_target:
        tc["provenance"].update(target_objective(study_name, storage_url, tc, target))
    fn = {"vllm": export_vllm, "vllm-plugin": export_vllm_plugin, "sglang": export_sglang, "llm-d": export_llmd,
          "kvsched": export_kvsched}[target]
    res = fn(tc["policy"], tc["params"], tc["engine"], tc["spec"], tc["provenance"],
             router=tc["router"], router_params=tc["router_params"])
    if target in ("vllm", "vllm-plugin") and vllm_installed():  # vLLM's own parser, where it is installed
        check_with_vllm(res.text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write_text(out, res.text)
    return res


def target_objective(study_name: str, storage_url: str, tc: Mapping[str, Any], engine: str = "vllm") -> dict:
    """The study's objective when only what an engine can express is kept: the engine's native
    scheduler (fcfs, or the study's policy when ``engine`` has it: :data:`NATIVE_POLICIES`, with
    its default parameters; priority for kvsched's priority and vllm-priority policies) with the
    trial's engine settings, simulated on the study's windows and seeds. Shows how much of the tuned gain the exported
    file carries (all of it when the gain came from engine knobs; none of a heuristic's own).
    The run uses the scenario's router: for a router study, whose router the engine file cannot
    carry, ``target_router_simulated`` names it.
    """
    from .tune import TuneConfig, _nanmean, metric_value, open_study, run_scenario, scenario_of_study

    study = open_study(study_name, storage_url)
    cfg = TuneConfig.from_dict(study.user_attrs["tune_config"])
    sc = scenario_of_study(study)
    native = NATIVE_POLICIES.get(engine, {}).get(tc["policy"]) or "fcfs"
    vals = [metric_value(run_scenario(sc, w, s, native, {}, tc["engine"]), cfg.objective)
            for w in cfg.windows_s for s in cfg.seeds]
    out = {"target_policy_simulated": native, "target_objective_mean": _nanmean(vals)}
    if cfg.router is not None:  # the file carries no router: the instances sit behind the scenario's
        out["target_router_simulated"] = sc.router
    return out


# ----------------------------------------------------------------------------- shared pieces
#: kvsched policies an engine runs natively, by its scheduling-policy value: vLLM
#: ``--scheduling-policy`` (REFERENCE §4.1), SGLang ``--schedule-policy`` (§4.2; ``lpm`` is
#: SGLang's longest prefix match, :mod:`kvsched.policies.lpm`). ``priority``: kvsched's
#: shortest-prompt-first when clients send priority = prompt tokens; ``vllm-priority``: vLLM's
#: priority scheduler on the requests' own priorities.
NATIVE_POLICIES: Mapping[str, Mapping[str, str]] = {
    "vllm": {"fcfs": "fcfs", "priority": "priority", "vllm-priority": "priority"},
    "sglang": {"fcfs": "fcfs", "priority": "priority", "vllm-priority": "priority", "lpm": "lpm"},
}
#: The ``victim_rule`` each native policy's engine applies anyway (vLLM V1 ``Scheduler.schedule``:
#: ``running[-1]`` under fcfs, the largest ``(priority, arrival_time)`` under priority).
_ENGINE_VICTIM_RULE: Mapping[str, str] = {"fcfs": "newest", "vllm-priority": "priority"}

#: Parameters of a native policy that are SGLang constants, not flags: name -> where SGLang sets it.
_LPM_CONSTANTS = {
    "fcfs_above_waiting": "hard-coded 128 in SGLang's SchedulePolicy._determine_active_policy",
    "in_batch_check_tokens": "SGLang reads it from the environment: IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD",
    "in_batch_deprioritize_tokens": "SGLang reads it from the environment: "
                                    "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD",
}


def _policy_unexpressible(engine: str, policy: str, params: Mapping[str, Any]) -> tuple[str | None, list]:
    """(the engine's scheduling-policy value or None, unexpressible policy parameters)."""
    native = NATIVE_POLICIES.get(engine, {}).get(policy)
    out = []
    base_flags = ("tier_aware_preemption", "prefetch", "admit_while_swapped", "admit_in_preemption_step")
    if native is None:
        plugin = ("kvsched's plugin for it: export --target vllm-plugin" if engine == "vllm" and policy in VLLM_PLUGINS
                  else "REFERENCE §7: needs a scheduler plugin")
        out.append(("policy", policy, f"{engine} has no {policy} scheduler ({plugin}); "
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
        rule = params.get("victim_rule", "policy")
        if rule not in ("policy", _ENGINE_VICTIM_RULE.get(policy)):  # the engine picks its own victim
            out.append(("policy_params.victim_rule", rule, f"{engine} has no flag for it (it preempts as its "
                                                          f"{native} scheduler does)"))
        if params.get("priority_preemption"):  # vLLM V0 only
            out.append(("policy_params.priority_preemption", True, f"{engine} has no flag for it (vLLM V0's "
                                                                   "priority preemption; V1 engines never preempt "
                                                                   "for a waiting request)"))
        if native == "lpm":
            defaults = LPMParams()
            for k, where in _LPM_CONSTANTS.items():
                if k in params and params[k] != getattr(defaults, k):
                    out.append((f"policy_params.{k}", params[k], f"no {engine} flag ({where})"))
    return native, out


#: Gateway flags kvsched's router parameters mirror, as :mod:`kvsched.policies.routing` cites
#: them (SGLang Model Gateway ``cache_aware``, NVIDIA Dynamo's KV router). Named in the reason
#: a router parameter is not expressible in an engine file; never written as an engine flag.
ROUTER_GATEWAY_FLAGS: Mapping[tuple[str, str], str] = {
    ("cache-affinity", "cache_threshold"): "SGLang Model Gateway --cache-threshold",
    ("cache-affinity", "balance_abs_threshold"): "SGLang Model Gateway --balance-abs-threshold",
    ("cache-affinity", "balance_rel_threshold"): "SGLang Model Gateway --balance-rel-threshold",
    ("cache-affinity", "routed_prefix_ttl_s"): "SGLang Model Gateway --eviction-interval",
    ("dynamo", "overlap_score_weight"): "Dynamo --kv-overlap-score-weight",
    ("dynamo", "router_temperature"): "Dynamo --router-temperature",
    ("llm-d", "queue_weight"): "llm-d EndpointPickerConfig queue-scorer weight (export --target llm-d)",
    ("llm-d", "kv_cache_weight"):
        "llm-d EndpointPickerConfig kv-cache-utilization-scorer weight (export --target llm-d)",
    ("llm-d", "prefix_weight"): "llm-d EndpointPickerConfig prefix-cache-scorer weight (export --target llm-d)",
}


def _router_unexpressible(target: str, router: str | None, router_params: Mapping[str, Any] | None,
                          skip: tuple[str, ...] = ()) -> list:
    """The router of a router study and each of its parameters (except ``skip``), as not
    expressible in ``target``; empty for a policy study."""
    if router is None:
        return []
    out = [("router", router, f"kvsched's {router} cluster router runs in front of the engines; {target} cannot "
                              "configure it (the tuned router parameters follow)")]
    for k, v in (router_params or {}).items():
        if k in skip:
            continue
        flag = ROUTER_GATEWAY_FLAGS.get((router, k))
        where = f"; it mirrors {flag}" if flag else ""
        out.append((f"router_params.{k}", v, f"parameter of kvsched's {router} router, not a {target} setting{where}"))
    return out


def _spec_unexpressible(engine: str, spec, partial_flags: bool) -> list:
    out = []
    if spec.max_num_partial_prefills is not None:  # a limit (None: none, as vLLM V1 and SGLang)
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
                prov: Mapping[str, Any], router: str | None = None,
                router_params: Mapping[str, Any] | None = None) -> ExportResult:
    """``vllm serve --config`` YAML (vLLM engine flags; REFERENCE §4.1 and §7); a router
    study's router and its parameters are listed as not expressible."""
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
    if partial and spec.max_num_partial_prefills is not None:
        cfg["max-num-partial-prefills"] = spec.max_num_partial_prefills
        cfg["max-long-partial-prefills"] = spec.max_long_partial_prefills
    if spec.dram_kv_bytes > 0:  # native CPU offload, size in GiB (REFERENCE §4.1)
        cfg["kv-offloading-size"] = round(spec.dram_kv_bytes / GiB, 3)
        cfg["kv-offloading-backend"] = "native"
    unexp += _spec_unexpressible("vllm", spec, partial)
    unexp += _router_unexpressible("vllm", router, router_params)
    check_keys("vllm", cfg)
    notes = [f"serve with: vllm serve <HF id of {spec.model.name}> --config THIS_FILE "
             f"(keys checked against vLLM {engine_args('vllm')['version']} EngineArgs)"]
    if policy == "priority":
        notes.append("clients must send priority = prompt tokens per request (kvsched's priority policy)")
    elif policy == "vllm-priority":
        notes.append("clients send each request's priority (lower is served first), as the workload's priority column")
    text = _header(f"vLLM engine arguments exported by kvsched from study {prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_vllm_plugin(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                       prov: Mapping[str, Any], router: str | None = None,
                       router_params: Mapping[str, Any] | None = None) -> ExportResult:
    """The ``vllm`` target's engine flags plus kvsched's scheduler plugin: ``scheduler-cls``
    (:data:`VLLM_PLUGINS`) and ``additional-config.kvsched`` with the policy, every tuned
    parameter and the served system (model, GPU, TP) its cost model prices prefills with
    (:mod:`kvsched.deploy.vllm`). The policy's parameters are applied, not listed as not
    expressible.

    Raises:
        ConfigError: a policy without a plugin (allowed: lars, ewsjf).
    """
    if policy not in VLLM_PLUGINS:
        raise ConfigError(f"--target vllm-plugin: policy {bounded_repr(policy)} has no vLLM scheduler plugin; allowed: "
                          f"{', '.join(VLLM_PLUGINS)} (export --target vllm for the engine flags alone)")
    from kvsched.envs.sim.spec_io import instance_spec_to_dict

    base = export_vllm(policy, params, engine, spec, prov, router=router, router_params=router_params)
    unexp = [u for u in base.unexpressible if not (u[0] == "policy" or u[0].startswith("policy_params."))]
    cfg = dict(base.config)
    cfg["scheduling-policy"] = "fcfs"  # the plugin orders the queue itself
    cfg["scheduler-cls"] = VLLM_PLUGINS[policy]
    cfg["async-scheduling"] = False  # the plugin plans on the scheduler's own state, one step at a time
    cfg["additional-config"] = {"kvsched": {"policy": policy,
                                            "policy_params": json.loads(json.dumps(dict(params), default=str)),
                                            "spec": instance_spec_to_dict(spec)}}
    check_keys("vllm", {k: v for k, v in cfg.items() if k != "additional-config"})
    notes = ["serve with: kvsched installed in vLLM's environment (pip install -e . from a kvsched checkout; "
             "CPU-only: docs/vllm-plugin.md, Installing the extra), then vllm serve <HF id of "
             f"{spec.model.name}> --config THIS_FILE",
             f"scheduler-cls {VLLM_PLUGINS[policy]} runs kvsched's {policy} with the tuned parameters below "
             "(additional-config.kvsched); tested with vLLM 0.32.0; see docs/vllm-plugin.md for its limits"]
    text = _header(f"vLLM engine arguments and kvsched {policy} scheduler plugin exported by kvsched from study "
                   f"{prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_sglang(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                  prov: Mapping[str, Any], router: str | None = None,
                  router_params: Mapping[str, Any] | None = None) -> ExportResult:
    """SGLang server arguments (REFERENCE §4.2 and §7; approximate where the engines differ);
    a router study's router and its parameters are listed as not expressible (SGLang's router
    is a separate process, the SGLang Model Gateway, with flags of its own)."""
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
    unexp += _router_unexpressible("sglang", router, router_params)
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


#: kvsched ``llm-d`` router parameter -> the llm-d scorer plugin it weighs (REFERENCE §4.3:
#: the default ``EndpointPickerConfig`` profile, ``max-score-picker`` taking the argmax of
#: the weighted sum).
LLMD_SCORERS: Mapping[str, str] = {"queue_weight": "queue-scorer",
                                   "kv_cache_weight": "kv-cache-utilization-scorer",
                                   "prefix_weight": "prefix-cache-scorer"}


def export_llmd(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                prov: Mapping[str, Any], router: str | None = None,
                router_params: Mapping[str, Any] | None = None) -> ExportResult:
    """llm-d ``EndpointPickerConfig``: router scorer weights (``schedulingProfiles[].plugins[].weight``).

    A study of kvsched's ``llm-d`` router writes its weights onto the scorers of
    :data:`LLMD_SCORERS`; anything else configures ``random-picker`` and says so.
    """
    unexp = [(f"policy_params.{k}", v, "an engine-side scheduling parameter; llm-d configures routing only "
                                       "(export --target vllm/sglang for the engine)")
             for k, v in params.items()]
    unexp.insert(0, ("policy", policy, "engine-side policy; not a router setting"))
    for k, v in engine.items():
        unexp.append((f"engine.{k}", v, "engine argument; see --target vllm/sglang"))
    if router == "llm-d":
        rp = dict(router_params or {})
        plugins = ([{"type": "single-profile-handler"}] + [{"type": s} for s in LLMD_SCORERS.values()]
                   + [{"type": "max-score-picker"}])
        refs = ([{"pluginRef": s, "weight": rp[k]} for k, s in LLMD_SCORERS.items()]
                + [{"pluginRef": "max-score-picker"}])
        unexp += [(f"router_params.{k}", v, "kvsched's own index of routed prefixes (approximate prefix matching); "
                                            "llm-d's prefix-cache-scorer has an LRU capacity, not this setting "
                                            "(REFERENCE §4.3); its parameters are left at llm-d's defaults")
                  for k, v in rp.items() if k not in LLMD_SCORERS]
        notes = ["scorer weights of kvsched's llm-d router (tuned); only their ratios change a decision"]
    else:
        plugins = [{"type": "single-profile-handler"}, {"type": "random-picker"}]
        refs = [{"pluginRef": "random-picker"}]
        if router is None:
            notes = ["the study tuned no router weights (a policy study tunes the engine-side policy, not the "
                     "scenario's router); random-picker is a stateless llm-d spread, not the scenario's router"]
        else:
            notes = [f"the study tuned kvsched's {router} router, which an EndpointPickerConfig cannot express "
                     "(only kvsched's llm-d router maps onto llm-d scorers); random-picker is a stateless llm-d "
                     "spread, not the tuned router"]
            unexp += _router_unexpressible("llm-d", router, router_params)
    cfg = {"apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]}
    text = _header(f"llm-d EndpointPickerConfig exported by kvsched from study {prov['study']}", prov, unexp, notes)
    return ExportResult(text + _dump(cfg), cfg, unexp, dict(prov))


def export_kvsched(policy: str, params: Mapping[str, Any], engine: Mapping[str, Any], spec,
                   prov: Mapping[str, Any], router: str | None = None,
                   router_params: Mapping[str, Any] | None = None) -> ExportResult:
    """The full policy parameters as JSON (``kvsched simulate --policy-file``); nothing unexpressible.

    A router study's file also has ``router`` and ``router_params`` (every field of the router's
    parameter dataclass), which ``--policy-file`` applies too.
    """
    cfg = {"format": POLICY_FILE_FORMAT, "policy": policy, "policy_params": dict(params), "engine": dict(engine),
           "not_expressible": [], "provenance": dict(prov)}
    if router is not None:
        cfg["router"], cfg["router_params"] = router, dict(router_params or {})
    return ExportResult(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n", cfg, [], dict(prov))


def load_policy_file(path: str | Path) -> dict:
    """Read a ``--target kvsched`` file: ``{"policy", "policy_params", "engine", "router",
    "router_params"}`` (validated; ``router`` and ``router_params`` ``None`` unless the file
    comes from a router study).

    Raises:
        ConfigError: unreadable JSON, another format, an unknown policy or router, or invalid
            parameters.
    """
    p = Path(path)
    try:
        d = strict_json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # malformed, a key given twice, nested too deeply
        raise ConfigError(f"--policy-file {bounded_repr(str(p), MAX_PATH_CHARS)}: cannot read JSON "
                          f"({bounded_repr(str(e) or 'nested too deeply')[1:-1]})") \
            from None
    if not isinstance(d, dict) or d.get("format") != POLICY_FILE_FORMAT:
        raise ConfigError(f"--policy-file {bounded_repr(str(p), MAX_PATH_CHARS)}: not a kvsched policy file "
                          f"(format must be {bounded_repr(POLICY_FILE_FORMAT)}; "
                          "write one with kvsched export --target kvsched)")
    for k in ("policy", "policy_params", "engine"):
        if k not in d:
            raise ConfigError(f"--policy-file {bounded_repr(str(p), MAX_PATH_CHARS)}: missing key {bounded_repr(k)}")
    if not isinstance(d["policy_params"], dict) or not isinstance(d["engine"], dict):
        raise ConfigError(f"--policy-file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          ": policy_params and engine must be mappings")
    make_policy(d["policy"], dict(d["policy_params"]))  # validates name, fields and values
    router, router_params = d.get("router"), d.get("router_params")
    if router is not None or router_params is not None:
        if not isinstance(router, str) or not isinstance(router_params, dict):
            raise ConfigError(f"--policy-file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                              f": router={bounded_repr(router)} and router_params="
                              f"{bounded_repr(router_params)} are not allowed: expected a router name and a mapping "
                              "of its parameters (both or neither)")
        from kvsched.policies.routing import make_router

        make_router(router, dict(router_params))  # validates name, fields and values
        router_params = dict(router_params)
    return {"policy": d["policy"], "policy_params": dict(d["policy_params"]), "engine": dict(d["engine"]),
            "router": router, "router_params": router_params}
