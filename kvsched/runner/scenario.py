"""Scenarios: one YAML file that says what to serve, on what, under which policy and SLOs.

A scenario composes the simulator's configuration objects; it defines no behaviour itself.

```yaml
name: azure-conv-h100          # free text
trace: azure-conv-2023         # a bundled trace name or a path (or use `synthetic:`)
window_s: [0, 600]             # optional [start, end) in seconds, rebased to 0
rate_scale: 1.0                # > 1 compresses arrivals (a higher request rate)
max_requests: null             # optional: keep the first N requests
synthetic: null                # SyntheticConfig fields instead of `trace`
instance:                      # InstanceSpec fields; model/gpu as preset names or inline
  model: Llama-3.1-8B
  gpu: H100-SXM
  tp: 1
n_instances: 1
policy: fcfs
policy_params: {}              # the policy's parameters, e.g. {tier_aware_preemption: true}
router: round-robin            # cluster router (kvsched.policies.routing), used when n_instances > 1
router_params: {}              # the router's parameters, e.g. {cache_threshold: 0.5}
router_delay_s: 0.0            # staleness of the state routers see (s)
shared_kv: null                # cluster KV tier: {capacity_bytes: 2e12, network: {...}, fetch_policy: cost}
cluster: null                  # prefill/decode roles (docs/disaggregation.md): {prefill: {count: 2,
                               #   instance: {...}}, decode: {count: 2}, link: ib_ndr_400g, transfer: whole}
oracle_lengths: false          # show true output lengths to the policy
metrics:                       # MetricsConfig fields
  long_prompt_tokens: 8192
  slos: {short: {ttft_s: 1.0, tpot_s: 0.1}, long: {ttft_s: 10.0, tpot_s: 0.2}}
seed: 0
```

Unknown keys are errors (naming the key, the file and the allowed keys), never ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from kvsched.envs.sim.disagg import MAX_ROLE_INSTANCES
from kvsched.envs.sim.errors import ConfigError, bounded_repr, text_number_hint, MAX_PATH_CHARS
from kvsched.envs.sim.yaml_loading import load_yaml
from kvsched.envs.sim.metrics import SLO, MetricsConfig
from kvsched.envs.sim.request import Workload
from kvsched.envs.sim.specs import InstanceSpec, instance_spec_from_dict, instance_spec_to_dict
from kvsched.envs.workload import synthetic as synth
from kvsched.envs.workload import traces

#: Largest scenario ``seed`` (the bound of every ``--seed`` flag, :data:`kvsched.experiments.cli_types.MAX_SEED`:
#: seeds derived from it, ``seed + k`` per worker, must stay below NumPy's and Gymnasium's 2**32).
MAX_SEED = 2**31 - 1

DEFAULT_TRACE = "azure-conv-2023"
DEFAULT_MODEL = "Llama-3.1-8B"
DEFAULT_GPU = "H100-SXM"


@dataclass(frozen=True)
class Scenario:
    """A validated scenario (see the module docstring for the YAML form).

    Raises:
        ConfigError: on any field out of range, naming the field, value and what is allowed.
    """

    name: str = "default"
    trace: str | None = DEFAULT_TRACE
    window_s: tuple[float, float] | None = None
    rate_scale: float = 1.0
    max_requests: int | None = None
    synthetic: dict | None = None
    instance: dict = field(default_factory=lambda: {"model": DEFAULT_MODEL, "gpu": DEFAULT_GPU})
    n_instances: int = 1
    policy: str = "fcfs"
    policy_params: dict = field(default_factory=dict)
    router: str = "round-robin"
    router_params: dict = field(default_factory=dict)
    router_delay_s: float = 0.0
    shared_kv: dict | None = None
    cluster: dict | None = None
    oracle_lengths: bool = False
    metrics: dict = field(default_factory=dict)
    seed: int = 0
    source: str = "<defaults>"

    def __post_init__(self) -> None:
        # what errors name: the scenario file, or the command line's flags, or the study
        where = f"scenario {self.source}" if self.source not in ("command line", "<defaults>") else self.source
        if (self.trace is None) == (self.synthetic is None):
            raise ConfigError(f"{where}: give exactly one of 'trace' and 'synthetic' "
                              f"(trace={bounded_repr(self.trace)}, synthetic={'set' if self.synthetic else None})")
        if self.window_s is not None:
            ws = self.window_s
            ok = isinstance(ws, (list, tuple)) and len(ws) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in ws)
            if not ok or not (0 <= ws[0] < ws[1]):
                raise ConfigError(f"{where}: window_s={bounded_repr(ws)} must be [start_s, end_s] (two numbers, "
                                  f"0 <= start_s < end_s)")
            object.__setattr__(self, "window_s", (float(ws[0]), float(ws[1])))
        if not isinstance(self.oracle_lengths, bool):
            raise ConfigError(f"{where}: oracle_lengths={bounded_repr(self.oracle_lengths)} must be true or false")
        if not isinstance(self.policy, str):
            raise ConfigError(f"{where}: policy={bounded_repr(self.policy)} must be a policy name")
        if not isinstance(self.policy_params, dict):
            raise ConfigError(f"{where}: policy_params={bounded_repr(self.policy_params)} must be a mapping of the "
                              f"policy's parameters")
        from kvsched.policies.base import make_policy
        try:
            policy = make_policy(self.policy, self.policy_params)  # raises listing known policies / parameters
        except ConfigError as e:
            raise type(e)(f"{where}: {e}") from None
        # the registered name ("LARS" finds "lars"): what runs, labels and comparisons see
        object.__setattr__(self, "policy", policy.name)
        if not isinstance(self.router, str):
            raise ConfigError(f"{where}: router={bounded_repr(self.router)} must be a router name")
        if not isinstance(self.router_params, dict):
            raise ConfigError(f"{where}: router_params={bounded_repr(self.router_params)} must be a mapping of the "
                              f"router's parameters")
        from kvsched.envs.sim.routing import StateProvider
        from kvsched.policies.routing import make_router
        try:
            router = make_router(self.router, self.router_params)  # raises listing known routers / parameters
            StateProvider(self.router_delay_s)
        except ConfigError as e:
            raise type(e)(f"{where}: {e}") from None
        object.__setattr__(self, "router", router.name)  # the registered name ("RR" finds "round-robin")
        if self.shared_kv is not None:
            self.shared_kv_spec()
        if self.cluster is not None:
            layout = self.cluster_layout()
            assert layout is not None
            total = sum(layout.counts.values())
            n = self.n_instances
            if n != total and not (n == 1 and isinstance(n, int) and not isinstance(n, bool)):
                raise ConfigError(f"{where}: n_instances={bounded_repr(n)} disagrees with cluster ({total} instances: "
                                  f"{layout.counts['prefill']} prefill, {layout.counts['decode']} decode, "
                                  f"{layout.counts['mixed']} mixed); leave n_instances out")
            object.__setattr__(self, "n_instances", total)
            if self.shared_kv is not None:
                raise ConfigError(f"{where}: shared_kv and cluster cannot be combined (give one of them)")
            if self.router_delay_s:
                raise ConfigError(f"{where}: router_delay_s={bounded_repr(self.router_delay_s)} is not allowed with "
                                  "cluster roles (their routers see live state); give 0")
            try:
                make_router(layout.prefill_router, dict(layout.prefill_router_params))
            except ConfigError as e:
                raise type(e)(f"{where}: cluster.prefill_router: {e}") from None
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace.strip()):
            raise ConfigError(f"{where}: trace={bounded_repr(self.trace)} must be a bundled trace name or a file path"
                              + (" (not empty)" if isinstance(self.trace, str) else ""))
        if self.synthetic is not None and not isinstance(self.synthetic, dict):
            raise ConfigError(f"{where}: synthetic={bounded_repr(self.synthetic)} "
                              "must be a mapping of SyntheticConfig fields")
        if not isinstance(self.name, str):
            raise ConfigError(f"{where}: name={bounded_repr(self.name)} must be text")
        if isinstance(self.rate_scale, bool) or not (isinstance(self.rate_scale, (int, float)) and self.rate_scale > 0
                                                     and self.rate_scale != float("inf")):
            raise ConfigError(f"{where}: rate_scale={bounded_repr(self.rate_scale)} must be a finite number > 0"
                              f"{text_number_hint(self.rate_scale)}")
        if self.max_requests is not None and (not is_int(self.max_requests) or self.max_requests < 1):
            raise ConfigError(f"{where}: max_requests={bounded_repr(self.max_requests)} must be an integer >= 1"
                              f"{text_number_hint(self.max_requests, integer=True)}")
        if not is_int(self.n_instances) or not 1 <= self.n_instances <= MAX_ROLE_INSTANCES:
            raise ConfigError(f"{where}: n_instances={bounded_repr(self.n_instances)} must be an integer in "
                              f"[1, {MAX_ROLE_INSTANCES}]{text_number_hint(self.n_instances, integer=True)}")
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"{where}: seed={bounded_repr(self.seed)} must be an integer in [0, 2**31-1] "
                              f"(as --seed){text_number_hint(self.seed, integer=True)}")
        if not isinstance(self.instance, dict):
            raise ConfigError(f"{where}: instance must be a mapping of InstanceSpec fields")
        if not isinstance(self.metrics, dict):
            raise ConfigError(f"{where}: metrics={bounded_repr(self.metrics)} "
                              "must be a mapping of MetricsConfig fields")
        # build once to validate early (errors name the scenario file)
        self.instance_spec()
        if self.cluster is not None:
            self.instance_specs()
        self.metrics_config()

    # ------------------------------------------------------------------------------ builders
    def instance_spec(self) -> InstanceSpec:
        """The :class:`InstanceSpec` this scenario serves on."""
        return instance_spec_from_dict(self.instance, source=f"{self.source}: instance")

    def cluster_layout(self):
        """The :class:`~kvsched.envs.sim.disagg.ClusterLayout` of ``cluster`` (roles), or ``None``."""
        from kvsched.envs.sim.disagg import cluster_layout_from_dict

        if self.cluster is None:
            return None
        return cluster_layout_from_dict(self.cluster, source=f"scenario {self.source}: cluster")

    def instance_specs(self) -> list[InstanceSpec]:
        """One :class:`InstanceSpec` per instance: ``n_instances`` copies of ``instance``, or with
        ``cluster`` the prefill, decode and mixed instances in that order, each role's ``instance``
        fields merged over the scenario's ``instance``."""
        layout = self.cluster_layout()
        if layout is None:
            return [self.instance_spec()] * self.n_instances
        out: list[InstanceSpec] = []
        base = self.instance_spec()
        for role in ("prefill", "decode", "mixed"):
            if layout.counts[role]:
                spec = self._role_spec(role, base, layout.overrides[role])
                if out and (spec.model, spec.kv_dtype_bytes) != (out[0].model, out[0].kv_dtype_bytes):
                    differ = [f.name for f in fields(spec.model) if f.name != "name"
                              and getattr(spec.model, f.name) != getattr(out[0].model, f.name)]
                    shown = ", ".join(f if f == "source" else f"{f} ({bounded_repr(getattr(spec.model, f), 40)} vs "
                                      f"{bounded_repr(getattr(out[0].model, f), 40)})" for f in differ[:4])
                    raise ConfigError(
                        f"{self.source}: cluster.{role}.instance serves {spec.model.name} with {spec.kv_dtype_bytes:g}-"
                        f"byte KV, the first role {out[0].model.name} with {out[0].kv_dtype_bytes:g}-byte KV"
                        + (f" (the models differ in {shown})" if differ else "") + ": expected "
                        "one model and KV dtype on every instance (KV moves between them)")
                out += [spec] * layout.counts[role]
        return out

    def _role_spec(self, role: str, base: InstanceSpec, override: Mapping[str, Any]) -> InstanceSpec:
        """Instance spec of ``role``: its ``instance`` fields merged over the scenario's. The API
        front end is the cluster's (:data:`~kvsched.envs.sim.cost_params.FRONT_END_FIELDS`): a role
        on another GPU, whose default cost parameters differ, takes the front-end fields of the
        scenario's ``instance`` unless its ``cost`` gives them.

        Raises:
            ConfigError: a bad field, or a role whose ``cost`` gives a front-end field other than
                the scenario instance's (the instances of one cluster share one front end).
        """
        from kvsched.envs.sim.cost_params import FRONT_END_FIELDS

        where = f"{self.source}: cluster.{role}.instance"
        merged = {**self.instance, **override}
        spec = instance_spec_from_dict(merged, source=where)
        theirs, ours = spec.cost_params, base.cost_params
        differ = [f for f in FRONT_END_FIELDS if getattr(theirs, f) != getattr(ours, f)]
        if not differ:
            return spec
        given = merged.get("cost")
        given = dict(given) if isinstance(given, Mapping) else {}
        explicit = next((f for f in differ if f in given), None)
        if explicit is not None:
            raise ConfigError(f"{where}: cost.{explicit}={bounded_repr(given[explicit])} is not allowed: expected "
                              f"{bounded_repr(getattr(ours, explicit))} as in the scenario's instance (the instances "
                              "of one cluster share the API front end)")
        return instance_spec_from_dict({**merged, "cost": {**{f: getattr(ours, f) for f in differ}, **given}},
                                       source=where)

    def disagg_spec(self):
        """The :class:`~kvsched.envs.sim.disagg.DisaggSpec` of ``cluster``, or ``None``."""
        layout = self.cluster_layout()
        return None if layout is None else layout.disagg_spec()

    def with_layout(self, counts: dict[str, int]) -> "Scenario":
        """A copy whose ``cluster`` has these instance counts per role (e.g. from ``2P2D``); a role
        it gains takes the scenario's ``instance`` unless ``cluster`` already configures it.

        Raises:
            ConfigError: the scenario has no ``cluster`` section, or the counts are invalid.
        """
        if self.cluster is None:
            raise ConfigError(f"scenario {self.source}: comparing cluster layouts needs a `cluster:` section "
                              "(prefill/decode roles; docs/disaggregation.md)")
        new = dict(self.cluster)
        for role in ("prefill", "decode", "mixed"):
            sec = dict(new.get(role) or {})
            sec["count"] = int(counts.get(role, 0))
            new[role] = sec
        return replace(self, cluster=new, n_instances=1)

    def shared_kv_spec(self):
        """The :class:`~kvsched.envs.sim.shared_kv.SharedKVSpec` of ``shared_kv``, or ``None``."""
        from kvsched.envs.sim.shared_kv import SharedKVSpec

        if self.shared_kv is None:
            return None
        return SharedKVSpec.from_dict(self.shared_kv, source=f"scenario {self.source}: shared_kv")

    def metrics_config(self) -> MetricsConfig:
        """The :class:`MetricsConfig` (defaults for fields the scenario leaves out)."""
        m = dict(self.metrics)
        allowed = {f.name for f in fields(MetricsConfig)}
        unknown = set(m) - allowed
        if unknown:
            raise ConfigError(f"scenario {self.source}: metrics has unknown keys {sorted(unknown, key=str)}; "
                              f"allowed: {sorted(allowed)}")
        if "slos" in m:
            slos = m["slos"]
            if not isinstance(slos, dict):
                raise ConfigError(f"scenario {self.source}: metrics.slos must map class -> {{ttft_s, tpot_s}}")
            built = dict(MetricsConfig().slos)
            for k, v in slos.items():
                if isinstance(v, SLO):
                    built[k] = v
                elif isinstance(v, dict):
                    unknown_slo = sorted(set(v) - {"ttft_s", "tpot_s", "e2e_s"}, key=str)
                    missing_slo = [n for n in ("ttft_s", "tpot_s") if n not in v]
                    if unknown_slo or missing_slo:
                        what = "; ".join(([f"unknown keys {unknown_slo}"] if unknown_slo else [])
                                         + ([f"missing {missing_slo}"] if missing_slo else []))
                        raise ConfigError(f"scenario {self.source}: metrics.slos.{k}={bounded_repr(v)}: "
                                          f"{what}; allowed: "
                                          "ttft_s, tpot_s (required), e2e_s (optional), all in seconds")
                    try:
                        built[k] = SLO(**v)
                    except (TypeError, ConfigError) as e:
                        raise ConfigError(f"scenario {self.source}: metrics.slos.{k}={bounded_repr(v)}: {e}") from None
                else:
                    raise ConfigError(f"scenario {self.source}: metrics.slos.{k}={bounded_repr(v)} must be a mapping")
            m["slos"] = built
        if "percentiles" in m:
            if not isinstance(m["percentiles"], (list, tuple)):
                raise ConfigError(f"scenario {self.source}: metrics.percentiles={bounded_repr(m['percentiles'])} "
                                  "must be a list of numbers in (0, 100]")
            m["percentiles"] = tuple(m["percentiles"])
        try:
            return MetricsConfig(**m)
        except ConfigError as e:
            raise ConfigError(f"scenario {self.source}: metrics: {e}") from None

    def check_slo_classes(self, workload: Workload) -> None:
        """Every SLO class in ``metrics.slos`` must be a length class or a workload SLO class.

        Raises:
            ConfigError: naming the unknown classes and the allowed names (a typo such as
                ``shrt`` would otherwise be silently unused).
        """
        allowed = {"short", "long"} | set(workload.slo_class_names)
        unknown = sorted(set(self.metrics.get("slos", {}) or {}) - allowed)
        if unknown:
            raise ConfigError(f"scenario {self.source}: metrics.slos has classes {unknown} that no request "
                              f"uses; allowed: {sorted(allowed)}")

    def workload(self) -> Workload:
        """Load or generate the requests, then apply window, rate scaling and max_requests."""
        if self.trace is not None:
            w = traces.load_trace(self.trace)
        else:
            cfg = _build(synth.SyntheticConfig, self.synthetic, f"{self.source}: synthetic")
            w = synth.generate(cfg, seed=self.seed)
        if self.window_s is not None:
            w = traces.window(w, self.window_s[0], self.window_s[1])
        if self.rate_scale != 1.0:
            w = traces.scale_rate(w, self.rate_scale)
        if self.max_requests is not None:
            w = traces.head(w, self.max_requests)
        return w

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form for provenance: every field (``source`` aside) with the instance
        resolved inline (:func:`instance_spec_to_dict` of :meth:`instance_spec`), its ``cost`` as
        the scenario gives it (null: the GPU's defaults, which a cluster role on another GPU must
        resolve for itself).

        Written as YAML and read by :func:`load_scenario`, it gives this scenario again: the same
        instance spec, the same hash and, run with the same seed, the same records. The hash is
        taken of another form (:meth:`hashed_dict`), kept as scenarios were hashed before some
        fields existed.
        """
        d = self._resolved_dict()
        # the cost as the scenario gives it (null: the GPU's defaults): a cluster role on another GPU
        # merges the scenario's instance fields under its own and takes that GPU's defaults for the
        # rest, so the resolved base cost written here would become that role's (the resolved
        # values are run.json's ``instance`` entry)
        given = self.instance.get("cost") if isinstance(self.instance, Mapping) else None
        if given is None or isinstance(given, Mapping):
            d["instance"]["cost"] = None if given is None else dict(given)
        return d

    def _resolved_dict(self) -> dict[str, Any]:
        """Every field (``source`` aside) with the instance resolved inline (:func:`instance_spec_to_dict`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}
        d["window_s"] = list(self.window_s) if self.window_s else None
        d["instance"] = instance_spec_to_dict(self.instance_spec())
        return d

    def hashed_dict(self) -> dict[str, Any]:
        """The form :meth:`sha256` is taken of (instance resolved inline), not a spec to re-run from.

        The resolved instance keeps the form scenarios were hashed in before
        ``max_num_partial_prefills`` took None: no limit is written as 1 (what 1 meant then) and
        a limit of k > 1 as k; a limit of one, new, as 1 with ``partial_prefill_limit_of_one:
        true`` (so its hash differs from no limit's). Fields at the defaults they had when
        they were added are left out.
        """
        d = self._resolved_dict()
        if not d["instance"]["extra_tiers"]:  # likewise scenarios written before extra tiers existed
            del d["instance"]["extra_tiers"]
        # and before prefix tiers and the freeing order existed (issue #21): left out at their
        # defaults (the default order changed then, to vLLM's tail first; kvsched_commit in the run
        # metadata says which simulator served it)
        if d["instance"]["prefix_offload"] is None:
            del d["instance"]["prefix_offload"]
        if d["instance"].get("parallel") is None:  # and before long-context parallelism (issue #25)
            d["instance"].pop("parallel", None)
        if d["instance"]["kv_free_order"] == "tail_first":
            del d["instance"]["kv_free_order"]
        if d["instance"]["self_preemption"] == "ends_pass":  # likewise (issue #23)
            del d["instance"]["self_preemption"]
        # and before the vLLM 0.32 scheduling options existed (admission at an unchunked prompt over
        # the budget left, the long-prefill threshold of a request alone): left out at their defaults
        for key, default in (("unchunked_overflow", "skip"), ("long_prefill_threshold_alone", "cap")):
            if d["instance"][key] == default:
                del d["instance"][key]
        _drop_moe_defaults(d["instance"], self.instance_spec())
        partial = d["instance"]["max_num_partial_prefills"]
        if partial is None:
            d["instance"]["max_num_partial_prefills"] = 1
        elif partial == 1:
            d["instance"]["partial_prefill_limit_of_one"] = True
        # routing fields at their defaults are left out, so scenarios written before routing
        # existed keep their hash
        for key, default in (("router", "round-robin"), ("router_params", {}), ("router_delay_s", 0.0),
                             ("shared_kv", None), ("cluster", None)):
            if d[key] == default:
                del d[key]
        return d

    def sha256(self) -> str:
        """Hash of the scenario's plain-data form (provenance of exports and results)."""
        return hashlib.sha256(json.dumps(self.hashed_dict(), sort_keys=True, default=str).encode()).hexdigest()

    def with_overrides(self, **kw: Any) -> "Scenario":
        """A copy with some fields replaced (validated again)."""
        return replace(self, **kw)


_MOE_MODEL_DEFAULTS = {"n_experts": 0, "experts_per_token": 0, "expert_intermediate_size": 0,
                       "n_shared_experts": 0, "first_dense_layers": 0, "moe_layer_step": 1, "routing_skew": 0.0,
                       "kv_lora_rank": 0, "qk_rope_head_dim": 0, "weight_dtype": "bf16", "quantized_weights": "all"}
"""ModelSpec fields added with mixture of experts (issue #22) and their dense defaults."""

_COST_DEFAULTS_ADDED = {"moe_efficiency": 1.0, "seq_overhead_s": 0.0, "step_token_overhead_s": 0.0,
                        "allreduce_algorithm": "ring", "allreduce_hop_latency_s": 0.0, "step_time_sigma": 0.0,
                        "hiccup_probability": 0.0, "hiccup_mean_s": 0.0, "front_end_hiccup_probability": 0.0,
                        "front_end_hiccup_mean_s": 0.0}
"""CostParams fields added in issue #22 and their neutral defaults (left out of the hashed form);
``allreduce_algorithm`` "ring" is the all-reduce price every scenario had before the field."""


def _drop_moe_defaults(inst: dict[str, Any], spec: InstanceSpec) -> None:
    """Leave the fields added in issue #22 out of a resolved instance at their defaults, so
    scenarios written before them keep their hash: the model's MoE, MLA and precision fields, the
    GPU's FP4 peak, the new cost terms (:data:`_COST_DEFAULTS_ADDED`), ``expert_parallel``, the
    prefix offload's ``fence_pending_writes``; and
    ``weight_dtype`` "auto" is written as the dtype it resolves to (it was "bf16" by default)."""
    for key, default in _MOE_MODEL_DEFAULTS.items():
        if inst["model"].get(key) == default:
            del inst["model"][key]
    if inst["gpu"].get("fp4_flops_per_s") == 0.0:
        del inst["gpu"]["fp4_flops_per_s"]
    for key, default in _COST_DEFAULTS_ADDED.items():
        if inst["cost"].get(key) == default:
            del inst["cost"][key]
    offload = inst.get("prefix_offload")
    if isinstance(offload, dict) and offload.get("fence_pending_writes") is False:
        del offload["fence_pending_writes"]
    if inst.get("expert_parallel") is False:
        del inst["expert_parallel"]
    if inst["weight_dtype"] == "auto":
        inst["weight_dtype"] = spec.effective_weight_dtype


def _build(cls, d: dict | None, where: str):
    d = dict(d or {})
    allowed = {f.name for f in fields(cls)}
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown, key=str)}; allowed: {sorted(allowed)}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:  # a value the class refuses: say which file (or flags) it came from
        raise type(e)(f"{where}: {e}") from None


def bundled_scenario_dir() -> Path:
    """The folder of the scenarios shipped with the package: ``experiments/scenarios/*.yaml`` in a
    checkout, package data of ``kvsched.experiments.scenarios`` when installed."""
    import importlib.resources

    return Path(str(importlib.resources.files("kvsched.experiments") / "scenarios"))


def bundled_scenarios() -> list[str]:
    """Names of the bundled scenarios (file stems in :func:`bundled_scenario_dir`), sorted."""
    return sorted(p.stem for p in bundled_scenario_dir().glob("*.yaml"))


def scenario_path(path: str | Path) -> Path:
    """The file of a scenario given as a path, or as the name of a bundled scenario
    (``mixed-long-short`` or ``mixed-long-short.yaml``: usable outside a checkout, since the
    scenarios ship inside the package). An existing file always wins over a bundled name; a
    folder of a bundled scenario's name does not (``simulate --scenario short-only --out
    short-only`` makes that folder before the scenario is read).

    Raises:
        ConfigError: neither an existing path nor a bundled name (the message lists the names).
    """
    if isinstance(path, str) and not path.strip():  # Path("") is ".", the current folder
        raise ConfigError(f"scenario file {bounded_repr(path)}: an empty path; give a .yaml file or a bundled "
                          f"scenario name: {', '.join(bundled_scenarios())}")
    p = Path(path)
    try:
        if p.is_file():
            return p
        exists = p.exists()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}: "
                          f"cannot be looked up ({e.strerror or e})") from None
    if len(p.parts) == 1:
        q = bundled_scenario_dir() / (p.name if p.name.endswith(".yaml") else f"{p.name}.yaml")
        if q.is_file():
            return q
    if exists:  # a folder or a device: load_scenario says it is not a file
        return p
    stem = p.name[:-len(".yaml")] if p.name.endswith(".yaml") else p.name
    if len(p.parts) > 1 and stem in bundled_scenarios():  # e.g. experiments/scenarios/x.yaml off the checkout root
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)} does not exist here; a bundled "
                          f"scenario has that name: give --scenario {stem} (bundled scenarios are found by name "
                          "from any folder)")
    raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)} does not exist, "
                      "nor is it a bundled scenario; bundled (give the "
                      f"name): {', '.join(bundled_scenarios())}")


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file, given by path or by bundled name (:func:`scenario_path`).

    Raises:
        ConfigError: no such file or bundled name, an empty path, unreadable YAML (or beyond the
            limits of :mod:`kvsched.envs.sim.yaml_loading`), an empty file, unknown keys, no
            workload (neither ``trace`` nor ``synthetic``), or invalid values (naming the file).
    """
    p = scenario_path(path)
    if not p.is_file():
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)} is not a file (give a .yaml file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = load_yaml(text, f"scenario file {p}")
    if data is not None and not isinstance(data, dict):  # `[]` or `false` is not an empty file
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": top level must be a mapping, got {type(data).__name__}")
    if not data:  # almost surely the wrong file: do not run every default in its name
        what = "the file is empty" if data is None else "an empty mapping"
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": {what}; give at least its workload (`trace:` a bundled "
                          "trace name or a file, or `synthetic:`); every other key has a default")
    allowed = {f.name for f in fields(Scenario)} - {"source"}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          f": unknown keys {sorted(unknown, key=str)}; allowed: {sorted(allowed)}")
    if "synthetic" in data and "trace" not in data:
        data["trace"] = None
    scenario = Scenario(**data, source=str(p))  # the other fields' errors first
    if "trace" not in data and "synthetic" not in data:  # never the bundled default in its place
        raise ConfigError(f"scenario file {bounded_repr(str(p), MAX_PATH_CHARS)}"
                          ": no workload; add `trace:` (a bundled trace name or a file) or "
                          "`synthetic:` (SyntheticConfig fields)")
    return scenario
