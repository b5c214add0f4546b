"""Reading the real vLLM measurements of ``shared/groundtruth`` at run time (never bundled).

The ground-truth directory holds data from three repositories of the inference-sim GitHub
organisation (its ``README.md`` documents every file). Two of them carry no licence
(``training_default_args/`` from inference-sim/training and ``sim_to_real/`` from
inference-sim/sim-to-real-accuracy-validation), so kvsched reads them from disk when asked and
never copies them into the package; ``blis/`` is Apache-2.0. :func:`find_groundtruth` locates
the directory: ``$KVSCHED_GROUNDTRUTH``, else ``../shared/groundtruth`` next to the repository
root, else ``../shared/groundtruth`` or ``shared/groundtruth`` under the current directory.

:func:`load_experiments` returns one :class:`Experiment` per real run it can read:

- ``training_default_args/<run>/``: server flags (``exp-config.yaml``), the inference-perf
  workload (``profile.yaml``, one-line JSON) and measured per-stage metrics
  (``results/stage_<k>_lifecycle_metrics.json``, seconds);
- ``sim_to_real/trainval_error_records.csv``: measured per-stage metrics (``actual``, ms) and
  the peers' predictions (``predicted``) for experiments whose workload spec and vLLM-logged
  ``total_kv_blocks`` are in ``blis/trained_physics_iter29_experiments.json``.

The replayed workload follows what the client actually ran (:func:`_workload`): the load stages
and lengths of ``profile.yaml``, but the prompt population of ``results/config.yaml``, which shows
that the client version used ignored the profile's multi-turn keys and sent 10 x 10 fixed
prompts round-robin (:data:`RESOLVED_DEFAULT_PROMPTS`); the measured prompt lengths confirm it
(they never grow, 16,800 requests at max_model_len 4096 never fail).

Measured metrics per stage, in milliseconds: TTFT mean/p90/p99, E2E mean/p90/p99 and
``itl_mean``. The latter is what the sim-to-real table calls ITL:
``(E2E_mean − TTFT_mean) / (output_len_mean − 1)`` with the **client-counted** mean output length
(checked: it reproduces every ``actual`` itl_mean of the csv from the stage JSON to 1e-9). That
count re-tokenises the streamed text and is below the tokens vLLM decoded (``ignore_eos``): for
Llama-2-7B 194 instead of 247, so this ITL is 27 % above the true time per token. For csv-only
experiments the count is implied by the same identity, ``(E2E − TTFT) / ITL + 1``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd
import yaml

from kvsched.envs.sim.errors import ConfigError, KvschedError, UnknownPresetError, bounded_repr, MAX_PATH_CHARS
from kvsched.envs.sim.model_spec import quantized_checkpoint
from kvsched.envs.sim.specs import ModelSpec, get_model
from kvsched.envs.sim.yaml_loading import load_yaml
from kvsched.envs.workload.inference_perf import LoadStage, SharedPrefixConfig

__all__ = ["METRICS", "PEERS", "PRECISIONS", "QUANTILE_KEYS", "VLLM_VERSION_UNKNOWN", "Experiment",
           "GroundTruthMissing", "StageMeasurement", "find_groundtruth", "load_experiments", "quantized_preset",
           "retokenization", "weight_dtype_for"]

METRICS = ("ttft_mean", "ttft_p90", "ttft_p99", "itl_mean", "e2e_mean", "e2e_p90", "e2e_p99")
"""Metric names of the sim-to-real table (all in ms)."""

QUANTILE_KEYS = ("min", "p0.1", "p1", "p5", "p10", "p25", "median", "p75", "p90", "p95", "p99", "p99.9", "max")
"""Quantile keys of a distribution in the stage JSONs of ``training_default_args`` (in order)."""

VLLM_VERSION_UNKNOWN = "unknown"
"""The vLLM version of every published run: none of the files records it (below)."""

_VLLM_VERSION_SOURCE = {
    "training_default_args": ("not recorded: inference-sim/training logs no version in exp-config.yaml, profile.yaml "
                              "or the results (vLLM V1 by its defaults; sibling repos of the organisation pin "
                              "vllm/vllm-openai v0.8.4 to v0.11.0)"),
    "sim_to_real": ("not recorded: neither the sim-to-real csv nor blis/trained_physics_iter29_experiments.json "
                    "(whose workload 'version' is inference-perf's spec version) names it"),
}
"""Where the vLLM version of a run was looked for, per source. BLIS's blackbox coefficient
table (``blis/defaults_blackbox_coeffs_at_90522ded_parent.yaml``) names vLLM versions
(v0.8.4, v0.10.1.1, v0.11.0) per model, GPU and TP, but of the runs those coefficients were fitted
on, not of these; kvsched does not borrow them."""

PEERS = ("vidur", "blis-evolved", "blis-roofline", "llm-optimizer-estimate", "aiconfigurator-estimate")
"""Peer simulators with predictions in ``sim_to_real/trainval_error_records.csv``."""

OVERLOAD_FAILURE_FRACTION = 0.01
"""Runs where more than this share of requests failed at the client are not replayed: the
failure cause (timeout, abort) is not published, so the successes-only latencies cannot be
reproduced. The training repo's README marks these runs (the three ``reasoning`` ones) as
overloaded as well."""

RESOLVED_DEFAULT_PROMPTS = (10, 10)
"""(num_groups, num_prompts_per_group) inference-perf used when the run does not say: every one of
the 12 ``results/config.yaml`` files (the configuration as inference-perf resolved it) shows
10 x 10 and no ``enable_multi_turn_chat``, whatever ``profile.yaml`` asked for -- that client
version did not know the profile's ``num_unique_system_prompts`` / ``num_users_per_system_prompt``
/ ``enable_multi_turn_chat`` keys and used its defaults. The sim-to-real runs used the same
workload files (the csv-only runs' resolved configs are not published), so the same is assumed."""

_RETOKENIZATION: dict[str, tuple[float, float, str]] = {
    "llama-2": (1.0486, 0.28,
                "mean of measured stage-0 successes.prompt_len / (system_prompt_len + question_len) over "
                "the 8 Llama-2 runs of training_default_args (1.045-1.052); jitter = (p90 - p10)/2.563 "
                "/ sqrt(nominal), 0.25-0.32 over the same runs"),
    "mixtral": (1.0420, 0.25,
                "mean of measured stage-0 successes.prompt_len / (system_prompt_len + question_len) over "
                "the 4 Mixtral-8x7B runs of training_default_args (1.040-1.043); jitter as for Llama-2, "
                "0.22-0.30 over the same runs"),
}
"""Re-tokenisation of inference-perf's random-token prompts per tokenizer family:
(prompt_scale, prompt_jitter, source)."""


class GroundTruthMissing(KvschedError, FileNotFoundError):
    """The ground-truth directory (or a file in it) is not there."""


def _repo_root() -> Path:
    import kvsched

    return Path(kvsched.__file__).resolve().parents[1]


def find_groundtruth(path: str | os.PathLike | None = None) -> Path:
    """The ground-truth directory: ``path`` if given, else the first that exists of
    ``$KVSCHED_GROUNDTRUTH``, ``<repo root>/../shared/groundtruth``, ``./../shared/groundtruth``,
    ``./shared/groundtruth``.

    Raises:
        GroundTruthMissing: none of them is a directory holding ``README.md``; the message lists
            the places searched.
    """
    if path is not None:
        candidates = [Path(path)]
    else:
        candidates = []
        env = os.environ.get("KVSCHED_GROUNDTRUTH")
        if env:
            candidates.append(Path(env))
        for c in (_repo_root().parent / "shared" / "groundtruth", Path.cwd().parent / "shared" / "groundtruth",
                  Path.cwd() / "shared" / "groundtruth"):
            if c.resolve() not in {x.resolve() for x in candidates}:  # the repo root is often the cwd
                candidates.append(c)
    for c in candidates:
        if c.is_dir() and (c / "README.md").is_file():
            return c.resolve()
    raise GroundTruthMissing(
        "ground-truth directory not found; searched " + ", ".join(str(c) for c in candidates)
        + ". Set KVSCHED_GROUNDTRUTH to the shared/groundtruth directory (it is not bundled: two of "
        "its source repositories carry no licence)")


def retokenization(model_id: str) -> tuple[float, float, str]:
    """``(prompt_scale, prompt_jitter, source)`` for the tokenizer of HF ``model_id``.

    Llama-2 and Mixtral tokenizers: measured (see :data:`_RETOKENIZATION`). Others: ``(1.0, 0.0)``, no
    measurement is published (the sim-to-real csv carries no prompt lengths).
    """
    key = model_id.lower()
    for family in _RETOKENIZATION:
        if family in key:
            return _RETOKENIZATION[family]
    return 1.0, 0.0, "no measured prompt lengths for this tokenizer: nominal lengths"


@dataclass(frozen=True)
class StageMeasurement:
    """Measured metrics of one load stage.

    Attributes:
        stage: 0-based stage index.
        values_ms: metric name (:data:`METRICS`) -> measured value in ms.
        output_len_mean: the client-counted mean output length the ITL definition uses.
        count: requests sent in the stage (None when unknown).
        failures: requests that failed (None when unknown).
        prompt_len: measured prompt-length statistics (mean, min, max, p10, p90) or None.
        peers_ms: metric -> {simulator: predicted ms} from the sim-to-real csv.
        ttft_quantiles_ms: measured TTFT quantiles (those of :data:`QUANTILE_KEYS` the stage JSON
            publishes -> ms; all of them in ``training_default_args``), else None (csv-only runs).
        schedule_delay_ms: inference-perf's ``load_summary.schedule_delay`` quantiles
            (:data:`QUANTILE_KEYS` -> ms: how late the client sent each request against its fixed
            schedule), or None where not published in full.

    Raises:
        ConfigError: a measured value (:attr:`values_ms`, the TTFT quantiles) that is not a finite
            number > 0 (every score divides by the measurement: APE, log residuals, log-scale
            plots), or an ``output_len_mean`` that is not a finite number > 1 (the ITL divides by
            ``output_len_mean − 1``); the run is then skipped with this reason.
    """

    stage: int
    values_ms: Mapping[str, float]
    output_len_mean: float
    count: int | None = None
    failures: int | None = None
    prompt_len: Mapping[str, float] | None = None
    peers_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    ttft_quantiles_ms: Mapping[str, float] | None = None
    schedule_delay_ms: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        where = f"stage {self.stage}"
        _measured(f"{where} output_len_mean", self.output_len_mean, lambda x: x > 1.0, "a finite number > 1")
        for m, v in self.values_ms.items():
            _measured(f"{where} {m}", v, lambda x: x > 0.0, "a finite number of ms > 0")
        for q, v in (self.ttft_quantiles_ms or {}).items():
            _measured(f"{where} ttft {q}", v, lambda x: x > 0.0, "a finite number of ms > 0")


def _measured(what: str, value: Any, ok: Any, allowed: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is a finite real number with ``ok(value)``."""
    from kvsched.envs.sim.spec_validation import is_real

    if not (is_real(value) and ok(float(value))):
        raise ConfigError(f"measured {what}={bounded_repr(value)} is not allowed: expected {allowed}")


@dataclass(frozen=True)
class Experiment:
    """One real vLLM run: serving configuration, workload, measured stages, peer predictions.

    Attributes:
        exp_id: the run's folder name (unique).
        source: ``"training_default_args"`` or ``"sim_to_real"`` (where the measurements come from).
        model_id: Hugging Face model id as logged.
        preset: kvsched model preset name, or None when the model is not modelled.
        hardware: GPU name as logged (all H100 here).
        tp, max_num_batched_tokens, max_num_seqs: vLLM flags.
        max_model_len: vLLM ``--max-model-len`` when logged, else None.
        total_kv_blocks: GPU KV blocks from the vLLM log (blis experiments file) or None.
        cpu_kv_blocks: CPU blocks from the same file (vLLM's swap space; unused by V1 unless
            CPU offload is on).
        cpu_offload: vLLM CPU KV offload on (csv column, exp-config ``cpu_offload``, or implied by
            ``kv_offloading_size``; no published run sets it).
        workload: the inference-perf workload with the tokenizer's re-tokenisation.
        stages: measured stages.
        notes: what was inferred or deduplicated while reading.
        skip_reason: why the run cannot be replayed (None when it can).
        gpu_memory_utilization: vLLM ``--gpu-memory-utilization`` (csv ``gpu_mem_util``; vLLM's
            default 0.9 when not logged). It sets the KV capacity when ``total_kv_blocks`` is not
            logged (:meth:`~kvsched.envs.sim.instance_spec.InstanceSpec.num_hbm_blocks`).
        dp: vLLM data-parallel replicas (csv ``dp``; 1 when not logged), each with ``tp`` GPUs.
        precision: weight precision as logged (csv ``precision``: FP16, BF16, FP8).
        workload_source: where the workload spec comes from: ``"run"`` (the run's own
            ``profile.yaml`` or blis experiments entry), ``"blis:<id>"`` (another blis entry of the
            same model and family) or ``"family:<run folder>"`` (the training_default_args
            ``profile.yaml`` of the same family, the groundtruth README's recipe; rates may differ).
        weight_dtype: ``InstanceSpec.weight_dtype`` of the run: "auto" (the checkpoint's, e.g.
            FP8 for RedHatAI's FP8-dynamic checkpoint) or the dtype the run's ``precision``
            column names for a 16-bit checkpoint (:func:`weight_dtype_for`).
        vllm_version: the vLLM version the run used, or :data:`VLLM_VERSION_UNKNOWN`.
        vllm_version_source: where it was read, or why it is unknown.
        enable_prefix_caching, enable_chunked_prefill, kv_cache_dtype, block_size: vLLM engine flags
            of the run (:func:`engine_knobs`; vLLM V1's defaults when not logged: on, on, auto, 16).
        kv_offloading_gib: vLLM ``--kv-offloading-size`` of the run (GiB for one engine, all its TP
            ranks together; exp-config key or csv column ``kv_offloading_size``), or None when not
            logged (then the DRAM tier is ``cpu_kv_blocks`` or
            :data:`DEFAULT_CPU_OFFLOAD_GIB_PER_RANK` per rank).
        model: the resolved model (a preset, its quantized checkpoint, or a model read from a
            Hugging Face config.json of ``model_configs``); None on a skipped run, and on an
            Experiment built by hand, whose ``preset`` names it.
    """

    exp_id: str
    source: str
    model_id: str
    preset: str | None
    hardware: str
    tp: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    total_kv_blocks: int | None
    cpu_kv_blocks: int | None
    cpu_offload: bool
    workload: SharedPrefixConfig
    stages: tuple[StageMeasurement, ...]
    notes: tuple[str, ...] = ()
    skip_reason: str | None = None
    gpu_memory_utilization: float = 0.9
    dp: int = 1
    precision: str = "BF16"
    workload_source: str = "run"
    weight_dtype: str = "auto"
    vllm_version: str = VLLM_VERSION_UNKNOWN
    vllm_version_source: str = ""
    model: ModelSpec | None = field(default=None, compare=False)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_offloading_gib: float | None = None

    @property
    def family(self) -> str:
        """Workload family from the folder name (general, codegen, roleplay, reasoning)."""
        for fam in ("general", "codegen", "roleplay", "reasoning"):
            if fam in self.exp_id:
                return fam
        return "?"

    @property
    def model_family(self) -> str:
        """Architecture family: the model name without its size and variant (``Llama-2-7B`` ->
        ``Llama-2``, ``Llama-3.1-70B`` -> ``Llama-3.1``, ``Mistral-Nemo-12B`` -> ``Mistral-Nemo``,
        ``Mixtral-8x7B-v0.1`` -> ``Mixtral``)."""
        import re

        name = self.preset or self.model_id.split("/")[-1]
        m = re.match(r"^(.*?)-(\d+x)?\d+(\.\d+)?[bB]\b", name)
        return m.group(1) if m else name

    @property
    def label(self) -> str:
        """Short display name: ``<preset or model> TP<n> <family>``."""
        return f"{self.preset or self.model_id.split('/')[-1]} TP{self.tp} {self.family}"


# ------------------------------------------------------------------------------------------------
def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GroundTruthMissing(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: missing") from None
    except (json.JSONDecodeError, RecursionError) as e:  # malformed, or nested too deeply
        raise ConfigError(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: invalid JSON: "
                          f"{bounded_repr(str(e) or 'nested too deeply', 200)}") from None


def config_dir_for(model_id: str, model_configs: Path | None) -> Path | None:
    """The directory of ``model_configs`` holding ``model_id``'s config.json, or None: the id's repo
    name as given or lower-cased (``meta-llama/Llama-2-7b-hf`` -> ``llama-2-7b-hf/``, the layout of
    inference-sim's ``model_configs/`` that the blis experiments' ``model_config_dir`` points into),
    or the whole id as folders (``meta-llama/Llama-2-7b-hf/``)."""
    if model_configs is None:
        return None
    repo = model_id.strip().rsplit("/", 1)[-1]
    if not repo or repo in (".", ".."):
        return None
    for rel in (repo, repo.lower(), model_id.strip()):
        d = model_configs / rel
        if ".." not in Path(rel).parts and not Path(rel).is_absolute() and (d / "config.json").is_file():
            return d
    return None


def resolve_model(model_id: str, model_configs: Path | None = None) -> tuple[ModelSpec | None, str | None]:
    """``(model, skip reason)`` of a run's model id: a preset (or a quantized checkpoint of one,
    :func:`~kvsched.envs.sim.model_spec.get_model`) first, else the id's Hugging Face config.json in
    ``model_configs`` (:func:`config_dir_for`, read by
    :func:`~kvsched.envs.sim.hf_config.read_hf_config` and named by the id). A config that cannot be
    modelled gives its error as the skip reason; no preset and no config, a reason naming both."""
    from kvsched.envs.sim.hf_config import read_hf_config

    try:
        return get_model(model_id), None
    except UnknownPresetError:
        pass
    d = config_dir_for(model_id, model_configs)
    if d is None:
        where = (f" and has no config.json in {bounded_repr(str(model_configs), MAX_PATH_CHARS)}"
                 if model_configs is not None else " (give its Hugging Face config.json with --model-configs)")
        return None, (f"model {bounded_repr(model_id)} matches no kvsched model preset (envs/sim/model_spec.py "
                      f"MODEL_ALIASES){where}")
    try:
        return read_hf_config(d, name=model_id.strip().rsplit("/", 1)[-1]), None
    except ConfigError as e:
        return None, f"model {bounded_repr(model_id)}: {e}"


PRECISIONS = {"FP16": "bf16", "BF16": "bf16", "FP8": "fp8", "NVFP4": "nvfp4", "INT8": "int8", "W8A8": "int8",
              "INT4": "int4", "W4A16": "int4"}
"""The sim-to-real csv's ``precision`` column -> kvsched weight dtype (W8A8 / W4A16: LLM Compressor's
scheme names of int8 and int4 checkpoints)."""


def weight_dtype_for(precision: Any, preset: str | ModelSpec) -> tuple[str, str | None]:
    """``(InstanceSpec.weight_dtype, skip reason or None)`` of a run logged with ``precision``.

    A missing precision (NaN) or one that names the checkpoint's own dtype gives "auto"; FP8/NVFP4
    on a 16-bit checkpoint gives that dtype (vLLM ``--quantization``, online quantization); INT8/INT4
    on one gives that dtype too, which :func:`quantized_preset` turns into the quantized checkpoint
    (vLLM has no online int8/int4 quantization: such runs serve an LLM Compressor checkpoint). A
    16-bit precision on a quantized checkpoint contradicts the checkpoint, and an unknown value is
    not modelled: both give a skip reason.
    """
    if isinstance(precision, float) and math.isnan(precision):
        return "auto", None
    p = str(precision).strip().upper()
    if p not in PRECISIONS:
        return "auto", (f"precision {bounded_repr(precision)} is not modelled (known: "
                        f"{', '.join(PRECISIONS)})")
    model = preset if isinstance(preset, ModelSpec) else get_model(preset)
    want, have, preset = PRECISIONS[p], model.weight_dtype, model.name
    if want == have or (want == "bf16" and have == "fp16"):
        return "auto", None
    if have in ("bf16", "fp16"):
        return want, None  # int8/int4: served from the quantized checkpoint (:func:`quantized_preset`)
    return "auto", (f"precision {p} contradicts the {have} checkpoint of {preset} (vLLM serves a quantized "
                    "checkpoint as stored)")


def quantized_preset(preset: str, weight_dtype: str) -> tuple[str, str]:
    """``(preset, weight_dtype)`` of a run whose precision asks a 16-bit preset for int8 or int4
    weights: the preset of its quantized checkpoint (every decoder Linear layer quantized, the
    embedding and lm_head bf16; ``model_spec.get_model`` resolves ``<preset>-INT8`` / ``-INT4``)
    with ``"auto"``; any other pair unchanged."""
    if weight_dtype in ("int8", "int4"):
        return get_model(f"{preset}-{weight_dtype.upper()}").name, "auto"
    return preset, weight_dtype


def quantized_model(model: ModelSpec, weight_dtype: str) -> tuple[ModelSpec, str]:
    """:func:`quantized_preset` for a model that may not be a preset (read from a config.json): its
    int8/int4 checkpoint (:func:`~kvsched.envs.sim.model_spec.quantized_checkpoint`) with "auto"."""
    if weight_dtype not in ("int8", "int4"):
        return model, weight_dtype
    return quantized_checkpoint(model, weight_dtype), "auto"


def _workload(sp: Mapping[str, Any], stages: Iterable[Mapping[str, Any]], model_id: str,
              max_model_len: int | None, resolved: Mapping[str, Any] | None = None) -> SharedPrefixConfig:
    """The replayed workload: ``profile.yaml``'s lengths and load stages, the prompt population of
    the resolved config (``num_groups`` x ``num_prompts_per_group`` distinct prompts, each a group's
    system prompt + its own question, sent round-robin; :data:`RESOLVED_DEFAULT_PROMPTS` when not
    published), single-turn (``history="fixed"``), every prompt block shareable through the prefix
    cache (``"system+user"``: vLLM hashes the full blocks of identical prompts alike), and the
    tokenizer's re-tokenisation (:func:`retokenization`)."""
    scale, jitter, _ = retokenization(model_id)
    first = int(sp["system_prompt_len"]) + int(sp["question_len"]) + int(sp["output_len"])
    groups, per_group = RESOLVED_DEFAULT_PROMPTS
    if resolved is not None:
        groups, per_group = int(resolved["num_groups"]), int(resolved["num_prompts_per_group"])
    return SharedPrefixConfig(
        num_groups=groups, users_per_group=per_group,
        system_prompt_len=int(sp["system_prompt_len"]), question_len=int(sp["question_len"]),
        output_len=int(sp["output_len"]),
        stages=tuple(LoadStage(float(s["rate"]), float(s["duration"])) for s in stages),
        history="fixed", prefix_sharing="system+user", prompt_scale=scale, prompt_jitter=jitter,
        max_context_tokens=max(first, int(max_model_len or 4096)))


def _get(doc: Any, keys: tuple[str, ...], where: str) -> Any:
    """The value at ``keys`` (one key per level) of a parsed JSON/YAML document.

    Raises:
        ConfigError: a level that is missing or not a mapping, naming ``where`` (the file) and the field.
    """
    cur = doc
    for i, key in enumerate(keys):
        if not isinstance(cur, Mapping):
            field_name = ".".join(keys[:i]) or "the document"
            raise ConfigError(f"{where}: {field_name}={bounded_repr(cur)} is not allowed: expected a mapping "
                              f"holding {bounded_repr(key)}")
        if key not in cur:
            raise ConfigError(f"{where}: {'.'.join(keys[:i + 1])} is missing")
        cur = cur[key]
    return cur


def _number(value: Any, where: str, name: str, ok: Any, allowed: str) -> float:
    """``value`` as a float when it is a finite real number (not a bool or text) with ``ok(value)``.

    Raises:
        ConfigError: one line naming ``where`` (the file), the field ``name``, the value and ``allowed``.
    """
    from kvsched.envs.sim.spec_validation import is_real

    if not (is_real(value) and ok(float(value))):
        raise ConfigError(f"{where}: {name}={bounded_repr(value)} is not allowed: expected {allowed}")
    return float(value)


def _integer(value: Any, where: str, name: str, low: int) -> int:
    """``value`` as an int when it is an integer >= ``low`` (an integral float such as 12.0 too;
    4096.7 is refused, never truncated).

    Raises:
        ConfigError: one line naming ``where``, the field, the value and what is allowed.
    """
    return int(_number(value, where, name, lambda x: x >= low and x == int(x), f"an integer >= {low}"))


def _stage_from_json(k: int, d: Any, where: str = "stage JSON") -> StageMeasurement:
    """Stage ``k``'s measurements from its ``stage_<k>_lifecycle_metrics.json`` (seconds -> ms).

    Raises:
        ConfigError: a field that is missing, of another type, or outside its range (latencies
            finite > 0 s, ``successes.output_len.mean`` > 1, counts integers >= 0), naming ``where``
            (the file), the field and the value.
    """
    lat = ("successes", "latency")

    def seconds(*keys: str) -> float:
        return _number(_get(d, keys, where), where, ".".join(keys), lambda x: x > 0.0,
                       "a finite number of seconds > 0 (scores divide by it)") * 1e3

    out_mean = _number(_get(d, ("successes", "output_len", "mean"), where), where, "successes.output_len.mean",
                       lambda x: x > 1.0, "a finite number > 1 (the ITL divides by output_len.mean - 1)")
    vals = {"ttft_mean": seconds(*lat, "time_to_first_token", "mean"),
            "ttft_p90": seconds(*lat, "time_to_first_token", "p90"),
            "ttft_p99": seconds(*lat, "time_to_first_token", "p99"),
            "e2e_mean": seconds(*lat, "request_latency", "mean"),
            "e2e_p90": seconds(*lat, "request_latency", "p90"),
            "e2e_p99": seconds(*lat, "request_latency", "p99")}
    vals["itl_mean"] = (vals["e2e_mean"] - vals["ttft_mean"]) / (out_mean - 1.0)
    if not vals["itl_mean"] > 0.0:
        raise ConfigError(f"{where}: successes.latency.request_latency.mean={vals['e2e_mean'] / 1e3:g} s is not "
                          f"above time_to_first_token.mean={vals['ttft_mean'] / 1e3:g} s: the ITL "
                          "(E2E - TTFT) / (output_len - 1) would not be > 0")
    ttft = _get(d, (*lat, "time_to_first_token"), where)
    prompt = {key: _number(_get(d, ("successes", "prompt_len", key), where), where, f"successes.prompt_len.{key}",
                           lambda x: x >= 0.0, "a finite number of tokens >= 0")
              for key in ("mean", "min", "max", "p10", "p90")}
    summary = _get(d, ("load_summary",), where)
    sd = summary.get("schedule_delay") if isinstance(summary, Mapping) else None
    try:
        return StageMeasurement(
            stage=k, values_ms=vals, output_len_mean=out_mean,
            count=_integer(_get(d, ("load_summary", "count"), where), where, "load_summary.count", 0),
            failures=_integer(_get(d, ("failures", "count"), where), where, "failures.count", 0),
            prompt_len=prompt,
            ttft_quantiles_ms=_quantiles_ms(ttft, where, "successes.latency.time_to_first_token", positive=True),
            schedule_delay_ms=_quantiles_ms(sd, where, "load_summary.schedule_delay", complete=True) if sd else None)
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


def _quantiles_ms(dist: Any, where: str = "stage JSON", name: str = "distribution", complete: bool = False,
                  positive: bool = False) -> dict[str, float] | None:
    """The :data:`QUANTILE_KEYS` a stage-JSON distribution (s) publishes, in ms; None when it
    publishes none of them, or (``complete``) misses one.

    Raises:
        ConfigError: ``dist`` is no mapping, or a quantile is not a finite number (> 0 when
            ``positive``: a latency), naming ``where`` and the field.
    """
    if not isinstance(dist, Mapping):
        raise ConfigError(f"{where}: {name}={bounded_repr(dist)} is not allowed: expected a mapping of quantiles")
    ok, allowed = (lambda x: x > 0.0, "a finite number of seconds > 0") if positive else \
        (lambda x: True, "a finite number of seconds")
    got = {k: _number(dist[k], where, f"{name}.{k}", ok, allowed) * 1e3 for k in QUANTILE_KEYS if k in dist}
    if not got or (complete and len(got) < len(QUANTILE_KEYS)):
        return None
    return got


def _csv_rows(gt: Path) -> pd.DataFrame:
    p = gt / "sim_to_real" / "trainval_error_records.csv"
    if not p.is_file():
        raise GroundTruthMissing(f"{bounded_repr(str(p), MAX_PATH_CHARS)}: missing")
    where = bounded_repr(str(p), MAX_PATH_CHARS)
    try:
        d = pd.read_csv(p)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as e:
        raise ConfigError(f"{where}: not a readable csv: {bounded_repr(str(e), 200)}") from None
    missing = [c for c in _CSV_COLUMNS if c not in d.columns]
    if missing:
        raise ConfigError(f"{where}: missing column(s) {', '.join(missing)} (needed: {', '.join(_CSV_COLUMNS)})")
    try:
        d["stage_index"] = pd.to_numeric(d["stage_index"], errors="raise")
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: column stage_index holds a value that is not a number") from None
    d["folder"] = d["experiment_folder"].astype(str).str.rstrip("/").str.split("/").str[-1]
    return d


_CSV_COLUMNS = ("experiment_folder", "stage_index", "model", "workload", "metric_name", "simulator", "actual",
                "predicted")
"""Columns of ``sim_to_real/trainval_error_records.csv`` every run needs (others are optional)."""


def _cell_number(v: Any) -> float | None:
    """A csv cell as a finite float (numbers, or text that reads as one), else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _peer_table(rows: pd.DataFrame, where: str = "sim_to_real csv") -> tuple[dict[int, dict[str, dict[str, float]]],
                                                                          list[str]]:
    """``(stage -> metric -> simulator -> predicted ms, notes)`` of one run's csv rows.

    A ``predicted`` cell that is not a finite number drops that peer's value (named in a note): it
    never skips kvsched's own replay of the run. Rows repeating one (stage, metric, simulator) are
    read once when their predictions agree.

    Raises:
        ConfigError: two rows of one (stage, metric, simulator) with different predictions
            (which to pair with the measurement is unknown), naming both values.
    """
    out: dict[int, dict[str, dict[str, float]]] = {}
    bad: list[str] = []
    for r in rows.itertuples(index=False):
        stage, metric, sim = int(r.stage_index), str(r.metric_name), str(r.simulator)
        x = _cell_number(r.predicted)
        if x is None:
            bad.append(f"{bounded_repr(sim, 40)} stage {stage} {bounded_repr(metric, 40)} "
                       f"predicted={bounded_repr(r.predicted, 40)}")
            continue
        have = out.setdefault(stage, {}).setdefault(metric, {})
        if sim in have and have[sim] != x:
            raise ConfigError(f"{where}: two rows of stage {stage} {bounded_repr(metric, 40)} simulator "
                              f"{bounded_repr(sim, 40)} predict {bounded_repr(have[sim])} and {bounded_repr(x)}; "
                              "one prediction per stage, metric and simulator (identical repeats are read once)")
        have[sim] = x
    notes = []
    if bad:
        notes.append(f"sim_to_real csv: {len(bad)} peer prediction(s) not a finite number, dropped (the peer is "
                     f"not scored there): {bounded_repr('; '.join(bad), 300)[1:-1]}")
    return out, notes


def _measured_table(rows: pd.DataFrame, where: str) -> dict[int, dict[str, float]]:
    """``stage -> metric -> measured ms`` of one run's csv rows (column ``actual``; every simulator's
    row repeats it).

    Raises:
        ConfigError: an ``actual`` that is not a finite number > 0 (scores divide by it), or rows of
            one (stage, metric) with different ``actual`` values (which one is the measurement is
            unknown); one line naming the column, stage, metric and values.
    """
    out: dict[int, dict[str, float]] = {}
    for r in rows.itertuples(index=False):
        stage, metric = int(r.stage_index), str(r.metric_name)
        x = _cell_number(r.actual)
        if x is None or x <= 0.0:
            raise ConfigError(f"{where}: column actual={bounded_repr(r.actual, 60)} (stage {stage}, "
                              f"{bounded_repr(metric, 40)}, simulator {bounded_repr(str(r.simulator), 40)}) is not "
                              "allowed: expected a finite number of ms > 0")
        have = out.setdefault(stage, {})
        if metric in have and have[metric] != x:
            raise ConfigError(f"{where}: rows of stage {stage} {bounded_repr(metric, 40)} give two measured values, "
                              f"actual={bounded_repr(have[metric])} and {bounded_repr(x)}; one measurement per stage "
                              "and metric (identical repeats are read once)")
        have[metric] = x
    return out


FAMILIES = ("general", "codegen", "roleplay", "reasoning")
"""The inference-perf workload families of the ground truth (csv ``workload`` column)."""

MAX_DP = 64
"""Most data-parallel replicas a run may declare (csv ``dp``, exp-config ``data_parallelism``): the
replay simulates every replica, so a typo such as 10**9 would run for hours; 64 replicas of a
TP group is far above any published run (all have dp 1)."""

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization`` (``vllm/config/cache.py``), used when a run does not
log it (the csv's ``gpu_mem_util`` is empty for every published run)."""

DEFAULT_CPU_OFFLOAD_GIB_PER_RANK = 8.0
"""CPU KV space per TP rank (GiB) assumed for a CPU-offload run whose ``cpu_kv_blocks`` is not
logged: every ``cpu_kv_blocks`` of ``blis/trained_physics_iter29_experiments.json`` is 8 GiB of
the run's per-rank blocks (Llama-2-7B 1,023 x 8 MiB, Llama-3.1-70B TP4 6,553 x 1.25 MiB,
Mistral-Nemo TP1 3,276 x 2.5 MiB) [inferred]."""

_PLACEHOLDER_WORKLOAD = SharedPrefixConfig(num_groups=1, users_per_group=1, system_prompt_len=1, question_len=1,
                                           output_len=2, stages=(LoadStage(1.0, 1.0),))
"""Workload of an :class:`Experiment` that could not be read (it carries a skip reason and is
never replayed)."""


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def _column(row: Mapping[str, Any], name: str) -> Any:
    """The csv row's ``name`` value, None when the column is absent or the cell empty."""
    v = row.get(name)
    return None if _is_missing(v) else v


def _csv_flag(row: Mapping[str, Any], name: str, source: str = "csv column") -> bool:
    """A boolean csv cell or exp-config value (True/False, 1/0, yes/no, on/off); empty = False.

    Raises:
        ConfigError: another value (one line naming ``source``, the column and the value).
    """
    v = _column(row, name)
    if v is None:
        return False
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, float, np.integer, np.floating)) and float(v) in (0.0, 1.0):
        return bool(v)
    t = str(v).strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off", "none"):
        return False
    raise ConfigError(f"{source} {name}={bounded_repr(v)} is not allowed: true/false, 1/0, yes/no or on/off")


def _csv_number(row: Mapping[str, Any], name: str, default: float, ok: Any, allowed: str,
                source: str = "csv column") -> float:
    """A numeric csv cell or exp-config value, ``default`` when empty.

    Raises:
        ConfigError: not a number, or ``ok(value)`` is false (one line naming ``source`` -- "csv
            column" or the file -- the column and the value).
    """
    v = _column(row, name)
    if v is None:
        return default
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and ok(x)):
        raise ConfigError(f"{source} {name}={bounded_repr(v)} is not allowed: {allowed}")
    return x


KNOWN_CSV_COLUMNS = ("simulator", "experiment_folder", "model", "workload", "stage_index", "metric_name",
                     "predicted", "actual", "mape", "mpe", "absolute_error", "exp_id", "hardware", "dp", "cpu_offload",
                     "kv_offloading_size",
                     "gpu_mem_util", "precision", "tp", "max_num_batched_tokens", "enable_prefix_caching",
                     "enable_chunked_prefill", "kv_cache_dtype", "block_size", "folder")
"""The sim-to-real csv columns the reader knows (the published ones, ``folder`` derived from
``experiment_folder``, and the engine flags of :func:`engine_knobs`); a run's other non-empty
columns are named in its notes."""
KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8", "fp8_e4m3": "fp8",
                   "fp8_e5m2": "fp8"}
"""vLLM ``--kv-cache-dtype`` values -> ``InstanceSpec.kv_dtype`` (both FP8 formats are one byte).
vLLM's ``CacheDType``: auto, fp8, fp8_e4m3, fp8_e5m2 (v0.8-v0.10, ``vllm/config.py``), with
bfloat16 from v0.11 (``vllm/config/cache.py``) and float16 later; fp8_inc (Intel Gaudi only) and
fp8_ds_mla (DeepSeek-V3.2's 656-byte MLA layout) are not modelled. ``bf16``/``fp16`` were never
vLLM spellings (vLLM refuses them), so a run logging them is refused too."""
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
"""vLLM ``--block-size`` choices (``BlockSize``: 1-128 in ``vllm/config.py`` v0.8-v0.10, 256 added
in ``vllm/config/cache.py`` v0.11)."""
EXP_CONFIG_KEYS = ("model", "tensor_parallelism", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                   "gpu_memory_utilization", "data_parallelism", "data_parallel_size", "hardware", "cpu_offload",
                   "kv_offloading_size", "precision", "enable_prefix_caching", "enable_chunked_prefill",
                   "kv_cache_dtype", "block_size", "app")
"""The ``exp-config.yaml`` keys a run's replay reads (``app``, the client, changes nothing served);
dashes in a key read as underscores (vLLM's flag spelling). Any other key is listed in the run's
notes, never dropped without a word."""


def engine_knobs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM engine flags a run sets (an ``exp-config.yaml`` or csv row), as
    :class:`Experiment` fields; the ones it does not set are left out (vLLM V1's defaults then).

    Raises:
        ConfigError: a flag whose value is not one vLLM accepts (one line naming it).
    """
    out: dict[str, Any] = {}
    for name in ("enable_prefix_caching", "enable_chunked_prefill"):
        if _column(row, name) is not None:
            out[name] = _csv_flag(row, name)
    kv = _column(row, "kv_cache_dtype")
    if kv is not None:
        if str(kv).strip().lower() not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={bounded_repr(kv)} is not allowed: one of {', '.join(KV_CACHE_DTYPES)}")
        out["kv_cache_dtype"] = KV_CACHE_DTYPES[str(kv).strip().lower()]
    if isinstance(_column(row, "block_size"), (bool, np.bool_)):  # YAML true is no block size (float(True) == 1)
        raise ConfigError(f"csv column block_size={bounded_repr(row['block_size'])} is not allowed: "
                          f"one of {', '.join(map(str, BLOCK_SIZES))}")
    if _column(row, "block_size") is not None:
        out["block_size"] = int(_csv_number(row, "block_size", 16, lambda x: x in BLOCK_SIZES,
                                            f"one of {', '.join(map(str, BLOCK_SIZES))}"))
    return out


ENGINE_FLAGS = ("enable_prefix_caching", "enable_chunked_prefill", "kv_cache_dtype", "block_size")
"""The vLLM engine flags :func:`engine_knobs` reads."""
_CSV_RUN_COLUMNS = ("model", "hardware", "dp", "cpu_offload", "kv_offloading_size", "gpu_mem_util", "precision",
                    "tp", "max_num_batched_tokens") + ENGINE_FLAGS
"""The csv columns that describe a run's configuration (one value for all its rows)."""


def _one_value(rows: pd.DataFrame, name: str, where: str) -> None:
    """Refuse a configuration column whose rows of one run differ (the reader would keep one).

    Raises:
        ConfigError: naming the column and its distinct values.
    """
    if name not in rows:
        return
    distinct = list(dict.fromkeys("" if _is_missing(v) else str(v) for v in rows[name]))
    if len(distinct) > 1:
        raise ConfigError(f"{where}: csv column {name} differs between the run's rows ({bounded_repr(distinct, 200)}); "
                          "one run has one configuration")


def _csv_agrees(rows: pd.DataFrame, knobs: Mapping[str, Any], where: str) -> None:
    """A training run's csv rows set no engine flag other than its ``exp-config.yaml`` (or vLLM's default).

    Raises:
        ConfigError: naming the flag and both values.
    """
    defaults = {f.name: f.default for f in fields(Experiment) if f.name in ENGINE_FLAGS}
    for name in ENGINE_FLAGS:
        _one_value(rows, name, where)
        cell = _column(rows.iloc[0].to_dict(), name) if name in rows and len(rows) else None
        if cell is None:
            continue
        csv_value = engine_knobs({name: cell})[name]
        if csv_value != knobs.get(name, defaults[name]):
            raise ConfigError(f"{where}: csv column {name}={bounded_repr(cell)} disagrees with exp-config.yaml "
                              f"({name}={bounded_repr(knobs.get(name, defaults[name]))}"
                              f"{'' if name in knobs else ', not given: vLLM default'})")


def _engine_skip(knobs: Mapping[str, Any], mbt: int, max_model_len: int | None, model: ModelSpec | None,
                 cpu_offload: bool) -> str | None:
    """Why a run's engine flags cannot be replayed (None: they can).

    Without chunked prefill vLLM refuses to start when ``max_num_batched_tokens`` is below
    ``max_model_len`` (the model's context length when not given; ``SchedulerConfig._verify_args``,
    v0.8-v0.11), so such a run was not measured as logged. CPU offload is replayed as a prefix
    tier below HBM's prefix cache (:func:`~kvsched.experiments.replay.instance_spec_for`), which
    needs prefix caching.
    """
    model_len = max_model_len if max_model_len is not None else (model.max_context_tokens if model else None)
    if not knobs.get("enable_chunked_prefill", True) and model_len is not None and mbt < model_len:
        return (f"enable_chunked_prefill false with max_num_batched_tokens {mbt} < max_model_len {model_len}: "
                "vLLM refuses to start with these flags, so the run's logged configuration is not what was served")
    if cpu_offload and not knobs.get("enable_prefix_caching", True):
        return ("cpu_offload with enable_prefix_caching false is not modelled (the replay's CPU tier holds "
                "prefixes of HBM's prefix cache)")
    return None


def _family_of(text: str) -> str | None:
    t = text.lower()
    return next((f for f in FAMILIES if f in t), None)


def _lengths(sp: Mapping[str, Any]) -> tuple[int, int, int]:
    return int(sp["system_prompt_len"]), int(sp["question_len"]), int(sp["output_len"])


@dataclass(frozen=True)
class _WorkloadSpec:
    """A candidate workload for a csv-only run: its shared-prefix lengths and load stages."""

    source: str
    model_id: str
    family: str | None
    shared_prefix: Mapping[str, Any]
    stages: tuple[Mapping[str, Any], ...]


def _skipped(exp_id: str, source: str, reason: str, model_id: str = "?", hardware: str = "?",
             notes: tuple[str, ...] = ()) -> Experiment:
    """An experiment that cannot be read or replayed: listed with its reason, never simulated."""
    return Experiment(exp_id=exp_id, source=source, model_id=model_id, preset=None, hardware=hardware, tp=1,
                      max_num_batched_tokens=1, max_num_seqs=1, max_model_len=None, total_kv_blocks=None,
                      cpu_kv_blocks=None, cpu_offload=False, workload=_PLACEHOLDER_WORKLOAD, stages=(),
                      notes=notes, skip_reason=reason)


_READ_ERRORS = (KvschedError, KeyError, TypeError, ValueError, IndexError, OSError, yaml.YAMLError, ArithmeticError,
                RecursionError)
"""Errors of one run's files that make that run unreadable (it is skipped with the message);
a missing index file (the csv, the blis experiments file) still stops :func:`load_experiments`."""


MAX_REASON_CHARS = 400
"""Most characters of the message a skip reason quotes from a read error (:func:`_why`)."""


def _error_text(e: BaseException) -> str:
    """``<type>: <message>`` of an error on one line, the message as it reads (quoted once: it is
    text, not a value), cut to :data:`MAX_REASON_CHARS` with ``...``."""
    msg = str(e) if not isinstance(e, KeyError) else f"missing key {bounded_repr(e.args[0] if e.args else '')}"
    msg = " ".join(msg.split())
    if len(msg) > MAX_REASON_CHARS:
        msg = msg[:MAX_REASON_CHARS - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _why(e: BaseException) -> str:
    """One bounded line for a read error of one run (:func:`_error_text`)."""
    return f"unreadable: {_error_text(e)}"


def load_experiments(groundtruth: str | os.PathLike | None = None,
                     model_configs: str | os.PathLike | None = None) -> list[Experiment]:
    """Every run of the ground truth as an :class:`Experiment` (replayable or with a skip reason).

    Order: training_default_args runs by folder name, then csv-only runs by experiment id.

    Runs never seen before are read the same way: a ``training_default_args`` folder with its own
    files, or a csv experiment that is not in ``blis/trained_physics_iter29_experiments.json``.
    The latter's workload is, in order of preference, the blis entry of the same model and family,
    else the ``profile.yaml`` of a training_default_args run of the same family (same model
    first), as the groundtruth README prescribes ("replay them with the §1 profile.yaml of the
    same family ... Rates may differ"); the first candidate with as many load stages as the csv
    rows is used (:attr:`Experiment.workload_source` says which). Its KV capacity is derived from
    memory with the row's ``gpu_mem_util``; ``hardware``, ``tp``, ``dp``, ``cpu_offload``,
    ``precision`` and ``max_num_batched_tokens`` come from the row. A run whose files or columns
    cannot be read, or with no workload of its family, gets a skip reason; it never stops the
    others.

    A model id that is no preset is read from its Hugging Face config.json in ``model_configs``
    (default: the ground truth's own ``model_configs/`` folder when it has one, the layout of
    inference-sim's repository; :func:`resolve_model`).

    Raises:
        GroundTruthMissing: the directory or one of its index files is missing.
        ConfigError: an index file that does not parse, or ``model_configs`` given and not a directory.
    """
    gt = find_groundtruth(groundtruth)
    if model_configs is not None:
        configs: Path | None = Path(model_configs)
        if not configs.is_dir():
            raise ConfigError(f"--model-configs {bounded_repr(str(configs), MAX_PATH_CHARS)} is not a directory "
                              "(give a folder of <model>/config.json)")
    else:
        configs = gt / "model_configs" if (gt / "model_configs").is_dir() else None
    blis_path = gt / "blis" / "trained_physics_iter29_experiments.json"
    blis_doc = _read_json(blis_path)
    blis = blis_doc.get("experiments") if isinstance(blis_doc, Mapping) else None
    if not isinstance(blis, list) or not all(isinstance(e, Mapping) for e in blis):
        raise ConfigError(f"{bounded_repr(str(blis_path), MAX_PATH_CHARS)}: expected an object whose "
                          "'experiments' is a list of objects")
    csv = _csv_rows(gt)
    out: list[Experiment] = []
    seen_folders: set[str] = set()
    family_specs: list[_WorkloadSpec] = []

    def blis_entry(folder: str) -> Mapping[str, Any] | None:
        for e in blis:
            if folder.startswith(str(e["id"]) + "-"):
                return e
        return None

    def csv_for(folder: str, family: str) -> tuple[pd.DataFrame, list[str]]:
        """The run's per-stage csv rows (of its family's label) and notes on what was left out.

        Raises:
            ConfigError: a stage_index that is not an integer (0.5 is refused, not read as 0).
        """
        run = csv[csv["folder"] == folder]
        odd = [v for v in run["stage_index"] if not (math.isfinite(float(v)) and float(v) == int(float(v)))]
        if odd:
            raise ConfigError(f"sim_to_real csv: column stage_index={bounded_repr(odd[0])} of {bounded_repr(folder)} "
                              "is not allowed: expected an integer (>= 0 a load stage, -1 the run's aggregate)")
        rows = run[run["stage_index"] >= 0]
        notes = []
        unknown = sorted({str(x) for x in rows["metric_name"]} - set(METRICS))
        if unknown:
            notes.append(f"sim_to_real csv rows of metrics outside the sim-to-real table, not read: "
                         f"{bounded_repr(', '.join(unknown), 200)[1:-1]} (known: {', '.join(METRICS)})")
        other = sorted({str(x) for x in rows["simulator"]} - set(PEERS))
        if other:
            notes.append(f"sim_to_real csv rows of simulators kvsched does not compare with (not scored): "
                         f"{bounded_repr(', '.join(other), 200)[1:-1]} (known: {', '.join(PEERS)})")
        fams = sorted(rows["workload"].astype(str).unique())
        if len(fams) > 1:
            keep = rows[rows["workload"] == family]
            # the other labels repeat the same measured values: say so, keep one
            notes.append(f"sim_to_real csv lists {folder} under workloads {fams}; the rows are copies with "
                         f"identical measured values, kept once as '{family}'")
            rows = keep
        return rows, notes

    root = gt / "training_default_args"
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")) if root.is_dir() else []:
        if (csv["folder"] == d.name).any():
            seen_folders.add(d.name)  # measured here: its csv rows are read with it, not again below
        try:
            exp, spec = _read_training_run(d, csv_for, blis_entry, configs)
        except _READ_ERRORS as e:
            out.append(_skipped(d.name, "training_default_args", _why(e)))
            continue
        if spec is not None:
            family_specs.append(spec)
        out.append(exp)

    blis_specs = []
    for e in blis:
        try:
            wl = e["workload"]["inference_perf"]
            lengths = _lengths(wl["shared_prefix"])
            fam = next((f.family for f in family_specs if _lengths(f.shared_prefix) == lengths), None)
            blis_specs.append(_WorkloadSpec(f"blis:{e['id']}", str(e["model"]), fam, wl["shared_prefix"],
                                            tuple(wl["stages"])))
        except _READ_ERRORS:
            continue  # an entry without a usable workload is no candidate for other runs

    for folder in sorted(set(csv["folder"]) - seen_folders, key=lambda f: (len(f.split("-")[0]), f)):
        try:
            out.append(_read_csv_run(folder, csv, csv_for, blis_entry(folder), blis_specs, family_specs, configs))
        except _READ_ERRORS as e:
            sub = csv[csv["folder"] == folder]
            out.append(_skipped(folder, "sim_to_real", _why(e), str(sub.iloc[0]["model"]) if len(sub) else "?",
                                str(sub.iloc[0]["hardware"]) if len(sub) and "hardware" in sub else "?"))
    return out


def _read_training_run(d: Path, csv_for: Any, blis_entry: Any,
                       configs: Path | None = None) -> tuple[Experiment, _WorkloadSpec | None]:
    """One ``training_default_args/<run>/`` folder: its Experiment and its workload as a family
    candidate for csv-only runs (None when the run has no family).

    Optional ``exp-config.yaml`` keys beyond the published five are honoured:
    ``gpu_memory_utilization``, ``data_parallelism`` / ``data_parallel_size`` (one of them, or both
    equal), ``hardware``, ``cpu_offload`` / ``kv_offloading_size`` (vLLM's ``--kv-offloading-size``:
    GiB for the engine, split over its TP ranks, :func:`~kvsched.experiments.replay.instance_spec_for`;
    ``cpu_offload: false`` with a size is refused), ``precision`` and the engine flags of
    :func:`engine_knobs`; any other key is named in the run's notes (:data:`EXP_CONFIG_KEYS`). The
    integer flags (TP, ``max_model_len``, ``max_num_batched_tokens``, ``max_num_seqs``), the profile's
    lengths and the resolved prompt counts must be integers (4096.7 is refused, never truncated).

    Raises:
        the errors of :data:`_READ_ERRORS` (the caller skips the run); a bad value is a one-line
        ConfigError naming the file, the field and the value.
    """
    cfg_name, prof_name, rc_name = (f"{d.name}/exp-config.yaml", f"{d.name}/profile.yaml",
                                    f"{d.name}/results/config.yaml")
    cfg = load_yaml((d / "exp-config.yaml").read_text(encoding="utf-8"), cfg_name)  # no duplicates
    prof = _read_json(d / "profile.yaml")
    if not isinstance(cfg, Mapping) or not isinstance(prof, Mapping):
        raise ConfigError(f"{d.name}: exp-config.yaml or profile.yaml is not a mapping")
    spelled: dict[str, str] = {}  # vLLM's flag spelling (dashes) reads alike, but one key given twice is refused
    for k in cfg:
        key = str(k).replace("-", "_")
        if key in spelled:
            raise ConfigError(f"{cfg_name}: {bounded_repr(spelled[key], 80)} and "
                              f"{bounded_repr(str(k), 80)} name one key; give it once")
        spelled[key] = str(k)
    cfg = {str(k).replace("-", "_"): v for k, v in cfg.items()}
    model_id = str(_get(cfg, ("model",), cfg_name))
    tp, mbt, max_seqs, max_model_len = (_integer(_get(cfg, (key,), cfg_name), cfg_name, key, 1) for key in (
        "tensor_parallelism", "max_num_batched_tokens", "max_num_seqs", "max_model_len"))
    sp = _get(prof, ("data", "shared_prefix"), prof_name)
    stages_cfg = _get(prof, ("load", "stages"), prof_name)
    _check_profile(sp, stages_cfg, prof_name)
    notes: list[str] = []
    unread = [k for k in cfg if k not in EXP_CONFIG_KEYS]
    if unread:
        notes.append(f"exp-config.yaml keys not modelled (the replay runs without them): "
                     f"{bounded_repr(', '.join(unread), 300)[1:-1]}")
    resolved_sp = None
    rc = d / "results" / "config.yaml"
    if rc.is_file():
        doc = yaml.safe_load(rc.read_text(encoding="utf-8"))
        data = doc.get("data") if isinstance(doc, Mapping) else None
        resolved_sp = data.get("shared_prefix") if isinstance(data, Mapping) else None
        if resolved_sp is None:
            notes.append(f"results/config.yaml has no data.shared_prefix: assumed {RESOLVED_DEFAULT_PROMPTS[0]} x "
                         f"{RESOLVED_DEFAULT_PROMPTS[1]} single-turn prompts like every published one")
        else:
            for key in ("num_groups", "num_prompts_per_group"):
                _integer(_get(doc, ("data", "shared_prefix", key), rc_name), rc_name, f"data.shared_prefix.{key}", 1)
        if resolved_sp and "enable_multi_turn_chat" not in resolved_sp and sp.get("enable_multi_turn_chat"):
            notes.append(f"profile asks for multi-turn chat with {sp.get('num_unique_system_prompts')} x "
                         f"{sp.get('num_users_per_system_prompt')} users; the resolved config ran single-turn "
                         f"with {resolved_sp.get('num_groups')} x "
                         f"{resolved_sp.get('num_prompts_per_group')} prompts")
    if prof["load"].get("type") != "constant":
        raise ConfigError(f"{prof_name}: load.type={bounded_repr(prof['load'].get('type'))}; "
                          "only 'constant' is modelled")
    stages = []
    for k in range(len(stages_cfg)):
        path = d / "results" / f"stage_{k}_lifecycle_metrics.json"
        stages.append(_stage_from_json(k, _read_json(path), f"{d.name}/results/{path.name}"))
    extra = sorted((f.name for f in (d / "results").glob("stage_*_lifecycle_metrics.json")
                    if not (f.name[6:-23].isdigit() and int(f.name[6:-23]) < len(stages_cfg))),
                   key=lambda n: (len(n), n))
    if extra:
        notes.append(f"results/{bounded_repr(', '.join(extra), 200)[1:-1]} beyond profile.yaml's {len(stages_cfg)} "
                     "load stage(s): not read (the replay runs the profile's stages)")
    family = _family_of(d.name) or "?"
    rows, n2 = csv_for(d.name, family)
    notes += n2
    if len(rows):
        where = f"sim_to_real csv ({d.name})"
        peers, n3 = _peer_table(rows, where)
        notes += n3
        measured = _measured_table(rows, where)
        for i, st in enumerate(stages):
            for m, v in measured.get(st.stage, {}).items():
                if m in st.values_ms and not math.isclose(v, st.values_ms[m], rel_tol=1e-6):
                    raise ConfigError(f"{d.name} stage {st.stage} {m}: csv actual {v} != stage JSON "
                                      f"{st.values_ms[m]}")
            stages[i] = StageMeasurement(**{**st.__dict__, "peers_ms": peers.get(st.stage, {})})
        beyond = sorted(k for k in measured if k >= len(stages))
        if beyond:
            notes.append(f"sim_to_real csv rows of stage(s) {', '.join(map(str, beyond[:8]))} beyond the run's "
                         f"{len(stages)} measured stage(s): not read")
    be = blis_entry(d.name)
    model, skip = resolve_model(model_id, configs)
    cfg_note = preset_config_note(model_id, model, configs)
    if cfg_note:
        notes.append(cfg_note)
    weight_dtype = "auto"
    if model is not None:
        weight_dtype, skip = weight_dtype_for(cfg.get("precision") or math.nan, model)
        model, weight_dtype = quantized_model(model, weight_dtype)
    preset = model.name if model is not None else None
    if skip is None:
        failed = sum(s.failures or 0 for s in stages)
        sent = sum(s.count or 0 for s in stages)
        if sent and failed / sent > OVERLOAD_FAILURE_FRACTION:
            skip = (f"overloaded: {failed} of {sent} requests failed at the client (cause not "
                    "published), so the successes-only latencies cannot be replayed")
    if be is None:
        notes.append("total_kv_blocks not logged for this run: derived from memory (InstanceSpec)")
    src = f"{cfg_name}:"
    util = _csv_number(cfg, "gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION, lambda x: 0 < x <= 1,
                       "a number in (0, 1]", src)
    dps = {key: int(_csv_number(cfg, key, 1, lambda x: 1 <= x <= MAX_DP and x == int(x),
                                f"an integer in [1, {MAX_DP}]", src))
           for key in ("data_parallelism", "data_parallel_size") if _column(cfg, key) is not None}
    if len(set(dps.values())) > 1:
        raise ConfigError(f"{cfg_name}: data_parallelism={dps['data_parallelism']} and data_parallel_size="
                          f"{dps['data_parallel_size']} disagree (one engine has one data-parallel size; give one)")
    dp = next(iter(dps.values()), 1)
    cpu_offload, offload_gib, n4 = _offload(cfg, src)
    notes += n4
    knobs = engine_knobs(cfg)
    _csv_agrees(rows, knobs, d.name)
    skip = skip or _engine_skip(knobs, mbt, max_model_len, model, cpu_offload)
    try:
        workload = _workload(sp, stages_cfg, model_id, max_model_len, resolved_sp)
    except ConfigError as e:
        raise ConfigError(f"{prof_name}{' / results/config.yaml' if resolved_sp else ''}: {e}") from None
    exp = Experiment(
        model=model, exp_id=d.name, source="training_default_args", model_id=model_id, preset=preset,
        hardware=str(cfg.get("hardware") or "H100"),
        tp=tp, max_num_batched_tokens=mbt, max_num_seqs=max_seqs, max_model_len=max_model_len,
        total_kv_blocks=int(be["total_kv_blocks"]) if be and util == DEFAULT_GPU_MEMORY_UTILIZATION else None,
        cpu_kv_blocks=int(be["cpu_kv_blocks"]) if be else None, cpu_offload=cpu_offload,
        kv_offloading_gib=offload_gib, workload=workload,
        stages=tuple(stages), notes=tuple(notes), skip_reason=skip, gpu_memory_utilization=util, dp=dp,
        precision=str(cfg.get("precision") or "BF16").upper(), weight_dtype=weight_dtype,
        vllm_version_source=_VLLM_VERSION_SOURCE["training_default_args"], **knobs)
    spec = None if family == "?" else _WorkloadSpec(f"family:{d.name}", model_id, family, sp, tuple(stages_cfg))
    return exp, spec


def _check_profile(sp: Any, stages: Any, where: str) -> None:
    """The parts of an inference-perf profile the replay reads: ``data.shared_prefix`` lengths
    (integers: ``system_prompt_len`` >= 0, ``question_len`` and ``output_len`` >= 1) and
    ``load.stages`` (a non-empty list of ``rate`` > 0 requests/s and ``duration`` > 0 s).

    Raises:
        ConfigError: one line naming ``where`` (the file), the field and the value.
    """
    if not isinstance(sp, Mapping):
        raise ConfigError(f"{where}: data.shared_prefix={bounded_repr(sp)} is not allowed: expected a mapping")
    for key, low in (("system_prompt_len", 0), ("question_len", 1), ("output_len", 1)):
        _integer(_get(sp, (key,), where), where, f"data.shared_prefix.{key}", low)
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{where}: load.stages={bounded_repr(stages)} is not allowed: expected a non-empty list "
                          "of {rate, duration}")
    for i, st in enumerate(stages):
        _number(_get(st, ("rate",), f"{where} load.stages[{i}]"), where, f"load.stages[{i}].rate", lambda x: x > 0,
                "a finite number of requests/s > 0")
        _number(_get(st, ("duration",), f"{where} load.stages[{i}]"), where, f"load.stages[{i}].duration",
                lambda x: x > 0, "a finite number of s > 0")


def _offload(cfg: Mapping[str, Any], source: str) -> tuple[bool, float | None, list[str]]:
    """``(cpu_offload, kv_offloading_size GiB or None, notes)`` of a run's ``cpu_offload`` flag and
    ``kv_offloading_size`` (exp-config key or csv column). vLLM offloads whenever
    ``--kv-offloading-size`` is set (``vllm/config/vllm.py`` ``_post_init_kv_transfer_config``) and
    refuses a size of 0 (``vllm/v1/kv_offload/cpu/spec.py``: ``cpu_bytes_to_use`` must be given).

    Raises:
        ConfigError: a size that is not a number > 0, or ``cpu_offload`` false with a size (naming both).
    """
    flag = _csv_flag(cfg, "cpu_offload", source)
    gib = None
    if _column(cfg, "kv_offloading_size") is not None:
        gib = _csv_number(cfg, "kv_offloading_size", 0.0, lambda x: x > 0,
                          "a number of GiB > 0 (vLLM's --kv-offloading-size; leave it out for no offload)", source)
    if _column(cfg, "cpu_offload") is not None and not flag and gib is not None:
        raise ConfigError(f"{source} cpu_offload={bounded_repr(cfg['cpu_offload'])} and kv_offloading_size={gib:g} "
                          "disagree: vLLM offloads whenever kv_offloading_size is set (give one)")
    notes = []
    if flag and gib is None:
        notes.append(f"cpu_offload without kv_offloading_size: the DRAM tier is the blis cpu_kv_blocks when logged, "
                     f"else {DEFAULT_CPU_OFFLOAD_GIB_PER_RANK:g} GiB per TP rank [inferred]")
    return flag or gib is not None, gib, notes


def preset_config_note(model_id: str, model: ModelSpec | None, model_configs: Path | None) -> str | None:
    """A note for a run whose model id is a preset while ``model_configs`` also holds a config.json
    for it that differs from the preset (or does not read as a model): the preset is used, as
    :func:`resolve_model` and ``--model-configs`` document (a config.json serves ids that are no
    preset). None when there is no such config or it equals the preset (all but name and source)."""
    from kvsched.envs.sim.hf_config import read_hf_config

    if model is None or model_configs is None:
        return None
    try:
        preset = get_model(model_id)
    except UnknownPresetError:
        return None  # the model was read from the config
    d = config_dir_for(model_id, model_configs)
    if d is None:
        return None
    where = bounded_repr(str(d / "config.json"), MAX_PATH_CHARS)
    try:
        other = read_hf_config(d, name=model_id.strip().rsplit("/", 1)[-1])
    except (ConfigError, OSError, ValueError, TypeError, KeyError) as e:
        return (f"preset {preset.name} used for {bounded_repr(model_id)}; {where} does not read as a model "
                f"({bounded_repr(str(e), 150)[1:-1]}) and is not used (--model-configs serves ids that are no preset)")
    differ = [f.name for f in fields(ModelSpec)
              if f.name not in ("name", "source") and getattr(other, f.name) != getattr(preset, f.name)]
    if not differ:
        return None
    shown = "; ".join(f"{n} {getattr(preset, n)} vs {getattr(other, n)}" for n in differ[:6])
    return (f"preset {preset.name} used for {bounded_repr(model_id)}; {where} differs from it ({shown}) and is not "
            "used (--model-configs serves ids that are no preset)")


def _read_csv_run(folder: str, csv: pd.DataFrame, csv_for: Any, be: Mapping[str, Any] | None,
                  blis_specs: list[_WorkloadSpec], family_specs: list[_WorkloadSpec],
                  configs: Path | None = None) -> Experiment:
    """One experiment of the sim-to-real csv that has no training_default_args folder (see
    :func:`load_experiments` for the workload of a run not in the blis experiments file).

    Raises:
        the errors of :data:`_READ_ERRORS` (the caller skips the run).
    """
    sub = csv[csv["folder"] == folder]
    first = sub.iloc[0].to_dict()
    for name in _CSV_RUN_COLUMNS:  # the run is read from its first row
        _one_value(sub, name, folder)
    model_id = str(first["model"])
    hardware = str(_column(first, "hardware") or "H100")
    family = str(first["workload"])
    rows, notes_l = csv_for(folder, family)
    notes = list(notes_l)
    unread = [str(k) for k in first if k not in KNOWN_CSV_COLUMNS and _column(first, k) is not None]
    if unread:
        notes.append(f"csv columns not modelled (the replay runs without them): "
                     f"{bounded_repr(', '.join(unread), 300)[1:-1]}")
    where = f"sim_to_real csv ({folder})"
    peers, n_peers = _peer_table(rows, where)
    notes += n_peers
    measured = _measured_table(rows, where)
    stages = []
    for k in sorted(measured):
        a = measured[k]
        missing = [m for m in METRICS if m not in a]
        if missing:
            raise ConfigError(f"{folder} stage {k}: the csv has no measured {', '.join(missing)}")
        vals = {m: a[m] for m in METRICS}
        out_mean = (vals["e2e_mean"] - vals["ttft_mean"]) / vals["itl_mean"] + 1.0
        try:
            stages.append(StageMeasurement(stage=int(k), values_ms=vals, output_len_mean=out_mean,
                                           peers_ms=peers.get(int(k), {})))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e} (output_len_mean = (e2e_mean - ttft_mean) / itl_mean + 1 of column "
                              "actual)") from None
    if not stages:
        return _skipped(folder, "sim_to_real", "no per-stage rows (stage_index >= 0) in the csv", model_id, hardware)
    if be is None and _column(first, "tp") is None:
        raise ConfigError(f"{folder}: csv column tp is empty and the run is not in the blis experiments file")
    tp = int(_csv_number(first, "tp", float(be["tp"]) if be else 1.0, lambda x: x >= 1 and x == int(x),
                         "an integer >= 1"))
    mbt = int(_csv_number(first, "max_num_batched_tokens", float(be["max_num_batched_tokens"]) if be else 2048.0,
                          lambda x: x >= 1 and x == int(x), "an integer >= 1"))
    util = _csv_number(first, "gpu_mem_util", DEFAULT_GPU_MEMORY_UTILIZATION, lambda x: 0 < x <= 1,
                       "a number in (0, 1]")
    dp = int(_csv_number(first, "dp", 1.0, lambda x: 1 <= x <= MAX_DP and x == int(x), f"an integer in [1, {MAX_DP}]"))
    cpu_offload, offload_gib, n_off = _offload(first, "csv column")
    notes += n_off
    precision = str(_column(first, "precision") or "FP16").upper()
    if be is not None:
        cands = [_WorkloadSpec("run", model_id, family, be["workload"]["inference_perf"]["shared_prefix"],
                               tuple(be["workload"]["inference_perf"]["stages"]))]
    else:
        fam = _family_of(family) or _family_of(folder)
        same = [c for c in blis_specs if c.family == fam and c.model_id == model_id]
        prof = [c for c in family_specs if c.family == fam]
        cands = same + sorted(prof, key=lambda c: c.model_id != model_id)
    chosen = next((c for c in cands if len(c.stages) == len(stages)), None)
    if chosen is None:
        why = (f"no workload spec of family {family!r} with {len(stages)} load stages (candidates: "
               f"{', '.join(f'{c.source} ({len(c.stages)} stages)' for c in cands) or 'none'})")
        return _skipped(folder, "sim_to_real", why, model_id, hardware, tuple(notes))
    if chosen.source != "run":
        notes.append(f"run not in blis/trained_physics_iter29_experiments.json: workload of {chosen.source} "
                     "(same family; its rates, which may differ from the run's)")
    notes.append(f"resolved inference-perf config not published: assumed {RESOLVED_DEFAULT_PROMPTS[0]} x "
                 f"{RESOLVED_DEFAULT_PROMPTS[1]} single-turn prompts like every published one")
    try:
        workload = _workload(chosen.shared_prefix, chosen.stages, model_id, None)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{folder}: the workload of {chosen.source} does not build: {_error_text(e)}") from None
    knobs = engine_knobs(first)
    # the blis entry logs its blocks at 16 tokens and the model's KV dtype (it records neither flag)
    logged_blocks = be is not None and int(be["tp"]) == tp and int(be["max_num_batched_tokens"]) == mbt \
        and util == DEFAULT_GPU_MEMORY_UTILIZATION and knobs.get("block_size", 16) == 16 \
        and knobs.get("kv_cache_dtype", "auto") == "auto"
    if not logged_blocks:
        notes.append(f"total_kv_blocks not logged for this configuration: derived from memory at "
                     f"gpu_memory_utilization {util}")
    model, skip = resolve_model(model_id, configs)
    cfg_note = preset_config_note(model_id, model, configs)
    if cfg_note:
        notes.append(cfg_note)
    weight_dtype = "auto"
    if model is not None:
        raw_precision = _column(first, "precision")
        weight_dtype, skip = weight_dtype_for(math.nan if raw_precision is None else raw_precision, model)
        model, weight_dtype = quantized_model(model, weight_dtype)
    preset = model.name if model is not None else None
    skip = skip or _engine_skip(knobs, mbt, None, model, cpu_offload)
    return Experiment(
        model=model, exp_id=folder, source="sim_to_real", model_id=model_id, preset=preset, hardware=hardware,
        tp=tp, max_num_batched_tokens=mbt, max_num_seqs=int(be["max_num_seqs"]) if be else 128, max_model_len=None,
        total_kv_blocks=int(be["total_kv_blocks"]) if logged_blocks and be else None,
        cpu_kv_blocks=int(be["cpu_kv_blocks"]) if be and int(be["cpu_kv_blocks"]) > 0 else None,
        cpu_offload=cpu_offload, kv_offloading_gib=offload_gib, workload=workload, stages=tuple(stages),
        notes=tuple(notes), skip_reason=skip, gpu_memory_utilization=util, dp=dp, precision=precision,
        workload_source=chosen.source, weight_dtype=weight_dtype,
        vllm_version_source=_VLLM_VERSION_SOURCE["sim_to_real"], **knobs)
