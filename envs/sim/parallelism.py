"""Long-context parallelism inside one serving instance that spans several GPU groups.

:class:`ParallelSpec` (``InstanceSpec.parallel``) describes how the instance's GPUs are laid out
beyond tensor parallelism (TP, ``InstanceSpec.tp`` GPUs per stage); :class:`ParallelCost` prices a
step on that layout. The policy still sees one instance with one KV pool and one step loop.

Mechanisms and sources (Medha = Agrawal et al., arXiv 2409.17264: v4 "Medha: Efficient LLM
Inference on Multi-Million Context Lengths Without Approximation", v5 "No Request Left Behind";
LoongServe = Wu et al., SOSP 2024, arXiv 2404.09526). The papers' section text could not be read
for this project (REFERENCE §1.1 has the abstracts); every formula below is **inferred from the
mechanism** the abstracts name, as REFERENCE §1.4 sketches it:

- **Pipeline parallelism (PP)**, ``pp_stages = S``: the layers are split over S stages (the
  largest stage holds ``ceil(L/S)`` layers, so weights and KV per GPU shrink by ``ceil(L/S)/L``).
  A step's batch flows through the stages as micro-batches: the decodes split into
  ``g = min(n_decodes, pp_microbatches)`` equal micro-batches, each prefill chunk one. With
  per-stage times ``τ_i`` (the roofline of REFERENCE §5.3 on one stage's layers) the stages form
  a proportionate flow shop: micro-batch ``i`` leaves the last stage at
  ``C_i = Σ_{j<=i} τ_j + (S−1)·(max_{j<=i} τ_j + p2p_i)`` (p2p_i: its activations, ``n·hidden·2 B /
  tp`` per rank, crossing one stage boundary over ``link``). A step ends when stage 1 is free
  (``Σ τ_j``) and every micro-batch that emits a token has left the last stage. Equal
  micro-batches give the pipeline bubble ``(S−1)/(g+S−1)`` of GPipe (Huang et al., arXiv
  1811.06965 §2.3).
- **Stream pipeline parallelism (SPP)**, ``spp: true`` (Medha v5's "Stream Pipeline Parallel",
  v4's "Sequence Pipeline Parallelism": "pipelining prefill chunks" of the same request): a
  non-final prefill chunk emits nothing, so the step need not wait for it to drain: its next chunk
  enters stage 1 as soon as this one leaves stage 1. A step is one cycle of the S-deep pipeline
  (the decodes need S stage-times to come back), in which the real system issues S iterations,
  each with its own chunk of the long request; the simulator's chunk of the step is therefore
  streamed as up to S equal sub-chunks, each a micro-batch, the last one emitting if the chunk
  completes the prompt; the chunks still in flight (their longest
  stage time, the "carry") delay the next step's micro-batches at every stage, as in one flow shop.
  A lone prefill of ``n`` pipelined units (sub-chunks) then takes ``Σ_k τ(c_k) + (S−1)·(max_k
  τ(c_k) + p2p)`` (≈ ``(n + S − 1)`` stage-times; REFERENCE §1.4 writes ``τ(c_n)``, the same when
  the last unit is the longest, as with equal units whose attention grows) instead of ``n·S``
  stage-times without SPP, where a request's next chunk waits for the previous to leave the
  pipeline (and is one micro-batch). Steps with decodes or a prompt's last chunk still drain.
- **KV parallelism (KVP)**, ``kvp_groups = K`` (Medha: "distributing decoding across servers"):
  K groups of ``S × tp`` GPUs, each holding a replica of the weights; a long context's KV is
  striped over the groups (capacity = K × one group's). Per step each group attends its shard:
  attention pairs and KV reads divide by K; a decode's linear layers run on the group that owns
  it (decodes balanced over the groups: their tokens divide by K, at least one whole decode on the
  busiest group), a prefill chunk's on one group (not divided). The partial attention outputs and
  softmax statistics are combined per layer:
  ``L · (latency + (K−1)/K · q · n_h/tp · d_h · 4 B / link bandwidth)`` per step for ``q`` query
  tokens (REFERENCE §1.4: "~n_h·d_h·4 B per query per layer plus the interconnect latency").
- **Elastic sequence parallelism (ESP)**, ``esp_groups = E`` (LoongServe): E instances of ``tp``
  GPUs form one KV pool; a prefill batch of ``n`` tokens is split over ``d = min(E, ceil(n /
  esp_tokens_per_group))`` of them (elastic scale-up, the degree chosen per step [inferred];
  LoongServe's scheduler picks it with its own cost model): its linear work, attention and KV
  traffic divide by ``d``, and the KV shards circulate in a ring (ring attention, Liu et al., arXiv
  2310.01889), ``(d−1)/d · kv_tokens · kvt / bandwidth + L·(d−1)·latency``, overlapped with the
  compute (the step takes the larger). Decodes run on the instances holding their KV (elastic
  scale-down, multi-master decoding): divided by E like KVP, with the same combine. ESP is
  LoongServe's non-preemptive comparison: served with unchunked prefills (policy
  ``nonpreemptive``), a long prompt runs to completion while short requests wait.

All step prices are computed with +, −, ×, ÷ and max only, elementwise, so the decode-only price
of a scalar and of an array element are bitwise equal (fast-forward equals step-by-step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError, bounded_repr, require
from .hardware import LinkSpec
from .spec_validation import int_at_least, is_int

if TYPE_CHECKING:  # pragma: no cover
    from .cost_model import CostModel

IB_NDR400_LINK = LinkSpec("ib-ndr400", 45e9, 20e-6)
"""Default link between GPU groups (PP stage boundaries, KVP combines, ESP rings): InfiniBand NDR
400G per NIC, ~45 GB/s achievable (REFERENCE §5.2), 20 µs per operation (REFERENCE §1.4:
"≈10–30 µs IB")."""
NVLINK4_LINK = LinkSpec("nvlink4", 375e9, 8e-6)
"""Groups inside one NVLink domain: NVLink4 ~350-400 GB/s p2p (REFERENCE §5.2), 8 µs per operation
(REFERENCE §1.4: "≈5–10 µs NVLink")."""
GROUP_LINKS: dict[str, LinkSpec] = {IB_NDR400_LINK.name: IB_NDR400_LINK, NVLINK4_LINK.name: NVLINK4_LINK}
"""Link presets for ``ParallelSpec.link`` (any link preset of :mod:`.hardware` is accepted too)."""

ESP_TOKENS_PER_GROUP = 8192
"""Default prefill tokens per ESP instance before a prefill scales up to another [inferred]."""
COMBINE_BYTES_PER_HEAD_DIM = 4.0
"""Bytes per query, head and head dimension in a KVP / ESP combine: fp32 partial outputs with
their softmax statistics (REFERENCE §1.4: "~n_h·d_h·4 B per query per layer")."""
ACTIVATION_BYTES = 2.0
"""Bytes per activation element crossing a stage boundary (bf16)."""


@dataclass(frozen=True)
class ParallelSpec:
    """How one instance spans GPU groups beyond TP (module docstring; all [inferred from the
    mechanism] of Medha arXiv 2409.17264 and LoongServe arXiv 2404.09526).

    Attributes:
        pp_stages: pipeline stages S (>= 1, at most the model's layers); each stage has ``tp`` GPUs.
        kvp_groups: KV-parallel groups K (>= 1), each of ``pp_stages × tp`` GPUs with a weight
            replica; the KV capacity is K groups'.
        spp: stream a request's prefill chunks through the stages (Medha's SPP); with False a
            chunk waits for the previous one to leave the pipeline (plain PP). No effect at S = 1.
        pp_microbatches: most micro-batches the decodes of one step split into, None = S.
        esp_groups: LoongServe ESP instances E (>= 1; > 1 only with pp_stages = kvp_groups = 1).
        esp_tokens_per_group: prefill tokens per ESP instance before the prefill scales up to
            another (elastic degree ``min(E, ceil(tokens / this))``), 8192 [inferred].
        link: the link between groups and stages (a :class:`LinkSpec`), default InfiniBand NDR.

    Raises:
        ConfigError: a value out of range, or a setting the layout ignores (``pp_microbatches``
            with one stage, a non-default ``esp_tokens_per_group`` without ESP); one line naming
            the field, the value and what is allowed.
    """

    pp_stages: int = 1
    kvp_groups: int = 1
    spp: bool = True
    pp_microbatches: int | None = None
    esp_groups: int = 1
    esp_tokens_per_group: int = ESP_TOKENS_PER_GROUP
    link: LinkSpec = IB_NDR400_LINK

    def __post_init__(self) -> None:
        o = "InstanceSpec.parallel"
        int_at_least(o, "pp_stages", self.pp_stages, 1)
        int_at_least(o, "kvp_groups", self.kvp_groups, 1)
        require(isinstance(self.spp, bool), f"{o}.spp", self.spp, "true or false")
        if self.pp_microbatches is not None:
            int_at_least(o, "pp_microbatches", self.pp_microbatches, 1)
        int_at_least(o, "esp_groups", self.esp_groups, 1)
        int_at_least(o, "esp_tokens_per_group", self.esp_tokens_per_group, 1)
        require(isinstance(self.link, LinkSpec), f"{o}.link", self.link, "a LinkSpec (or, in YAML, a link preset "
                f"name such as {', '.join(GROUP_LINKS)}, or a mapping of name, bytes_per_s, latency_s)")
        require(self.esp_groups == 1 or (self.pp_stages == 1 and self.kvp_groups == 1), f"{o}.esp_groups",
                self.esp_groups, "1 when pp_stages or kvp_groups is > 1 (ESP is LoongServe's layout, the "
                "alternative to Medha's PP/SPP/KVP, not combined with it)")
        # a setting the layout ignores is refused, not dropped
        require(self.pp_microbatches is None or self.pp_stages > 1, f"{o}.pp_microbatches", self.pp_microbatches,
                "null unless pp_stages > 1 (it splits a pipeline step's decodes)")
        require(self.esp_tokens_per_group == ESP_TOKENS_PER_GROUP or self.esp_groups > 1,
                f"{o}.esp_tokens_per_group", self.esp_tokens_per_group,
                f"the default {ESP_TOKENS_PER_GROUP} unless esp_groups > 1 (it sets LoongServe's elastic degree)")

    @property
    def kv_groups(self) -> int:
        """GPU groups holding KV (each with a weight replica): K, or E under ESP."""
        return self.kvp_groups if self.esp_groups == 1 else self.esp_groups

    @property
    def microbatches(self) -> int:
        """Most decode micro-batches per step: ``pp_microbatches`` or S."""
        return self.pp_stages if self.pp_microbatches is None else int(self.pp_microbatches)

    def stage_fraction(self, n_layers: int) -> float:
        """Share of the model's layers on the largest stage: ``ceil(L/S)/L``."""
        return math.ceil(n_layers / self.pp_stages) / n_layers

    def describe(self) -> str:
        """The layout in words, for messages (e.g. "4 PP stages (SPP) x 2 KVP groups")."""
        if self.esp_groups > 1:
            return f"{self.esp_groups} ESP instances"
        spp = " (SPP)" if self.spp and self.pp_stages > 1 else ""
        return f"{self.pp_stages} PP stage(s){spp} x {self.kvp_groups} KVP group(s)"

    def to_dict(self) -> dict[str, Any]:
        """Plain-type dict (YAML-safe); the link inline."""
        return {"pp_stages": int(self.pp_stages), "kvp_groups": int(self.kvp_groups), "spp": self.spp,
                "pp_microbatches": None if self.pp_microbatches is None else int(self.pp_microbatches),
                "esp_groups": int(self.esp_groups), "esp_tokens_per_group": int(self.esp_tokens_per_group),
                "link": {"name": self.link.name, "bytes_per_s": float(self.link.bytes_per_s),
                         "latency_s": float(self.link.latency_s)}}

    @classmethod
    def from_dict(cls, d: Any, where: str, get_link: Any = None) -> ParallelSpec:
        """A ParallelSpec from a mapping (YAML). ``link`` is a preset name (:data:`GROUP_LINKS`, or
        a :mod:`.hardware` link preset through ``get_link``) or a mapping of LinkSpec fields.

        Raises:
            ConfigError: not a mapping, an unknown key, or a bad value (one line).
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where} must be a mapping of {', '.join(_PARALLEL_KEYS)}, got {type(d).__name__}")
        unknown = [k for k in d if k not in _PARALLEL_KEYS]
        if unknown:
            raise ConfigError(f"{where}: unknown key {bounded_repr(unknown[0])}; allowed keys: "
                              f"{', '.join(_PARALLEL_KEYS)}")
        kw = dict(d)
        for key in ("pp_stages", "kvp_groups", "esp_groups", "esp_tokens_per_group", "pp_microbatches"):
            if key in kw and not (is_int(kw[key]) or (key == "pp_microbatches" and kw[key] is None)):
                raise ConfigError(f"{where}.{key}={bounded_repr(kw[key])} is not allowed: expected an integer")
        if "link" in kw:
            kw["link"] = _link_from(kw["link"], f"{where}.link", get_link)
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


_PARALLEL_KEYS = ("pp_stages", "kvp_groups", "spp", "pp_microbatches", "esp_groups", "esp_tokens_per_group", "link")


def _link_from(value: Any, where: str, get_link: Any) -> LinkSpec:
    if isinstance(value, LinkSpec):
        return value
    if isinstance(value, str):
        if value.lower() in GROUP_LINKS:
            return GROUP_LINKS[value.lower()]
        if get_link is not None:
            try:
                return get_link(value)
            except ConfigError:
                pass
        raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a link preset "
                          f"({', '.join(GROUP_LINKS)}, or one of `kvsched presets`) or a mapping")
    if isinstance(value, Mapping):
        keys = ("name", "bytes_per_s", "latency_s")
        unknown = [k for k in value if k not in keys]
        if unknown:
            raise ConfigError(f"{where}: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(keys)}")
        if "name" not in value or "bytes_per_s" not in value:
            raise ConfigError(f"{where}: missing key(s) name and bytes_per_s")
        from .spec_validation import as_float
        lat = as_float(value["latency_s"], f"{where}.latency_s") if "latency_s" in value else 10e-6
        try:
            return LinkSpec(value["name"], as_float(value["bytes_per_s"], f"{where}.bytes_per_s"), lat)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(f"{where}={bounded_repr(value)} is not allowed: expected a link preset name or a mapping")


class ParallelCost:
    """Step prices of an instance with a :class:`ParallelSpec` (module docstring).

    Built by :class:`~.cost_model.CostModel` from its per-GPU coefficients: weights and KV bytes
    per GPU are already those of one stage (``InstanceSpec`` divides them); FLOPs and the TP
    all-reduce are scaled here by the stage's share of layers.
    """

    def __init__(self, cost: CostModel) -> None:
        spec = cost.spec
        par = spec.parallel
        assert par is not None
        m = spec.model
        self.par = par
        self.S = int(par.pp_stages)
        self.G = int(par.kv_groups)
        self.esp = par.esp_groups > 1
        self.spp = bool(par.spp) and self.S > 1
        self.microbatches = par.microbatches
        self.esp_tokens = float(par.esp_tokens_per_group)
        frac = par.stage_fraction(m.n_layers)
        self.lin = 2.0 * cost.matmul_params_per_gpu * frac
        self.attn = cost.attn_flops_per_pair_per_gpu * frac
        self.weights = cost.weight_bytes_per_gpu
        self.kvt = cost.kv_bytes_per_token_per_gpu
        self.half = cost._mfu_half
        self.ramp_discount = cost._ramp_discount * frac  # weight-only quantization (CostModel)
        self.eff_flops = cost._eff_flops
        self.eff_bw = cost._eff_bw
        self.overhead = cost._overhead
        self.seq_overhead = cost._seq_overhead  # host time per sequence and per token (CostParams)
        self.tok_overhead = cost._tok_overhead
        self.tp_comm = cost._comm_per_token * frac
        self.tp_fixed = cost._comm_fixed * frac
        #: the stage's all-reduces under CostParams.allreduce_algorithm = "vllm" (None under "ring")
        self.tp_allreduce = None if cost._allreduce is None else cost._allreduce.scaled(frac)
        link = par.link
        self.link_lat = float(link.latency_s)
        self.p2p_per_token = m.hidden_size * ACTIVATION_BYTES / spec.tp / link.bytes_per_s
        heads = max(1, m.n_heads // spec.tp)
        self.combine_fixed = m.n_layers * self.link_lat if self.G > 1 else 0.0
        self.combine_per_token = (m.n_layers * (self.G - 1) / self.G * heads * m.head_dim
                                  * COMBINE_BYTES_PER_HEAD_DIM / link.bytes_per_s) if self.G > 1 else 0.0
        # ESP ring: KV bytes per token per GPU over all layers (the stage is the whole model at S = 1)
        self.ring_per_token = self.kvt / link.bytes_per_s
        self.ring_fixed_per_hop = m.n_layers * self.link_lat

    # ------------------------------------------------------------------ building blocks
    def stage_time(self, n: Any, pairs: Any, kv: Any) -> Any:
        """Seconds one stage spends on a micro-batch of ``n`` tokens (linear work), ``pairs``
        attention pairs and ``kv`` KV tokens read or written, per GPU of one group (REFERENCE §5.3
        on the stage's layers). ``n > 0``; scalars or equal-length arrays."""
        flops = self.lin * n + self.attn * pairs
        compute = flops * (n + self.half) / (self.eff_flops * n) - self.ramp_discount
        memory = (self.weights + self.kvt * kv) / self.eff_bw
        comm = self.tp_comm * n + self.tp_fixed
        if self.tp_allreduce is not None:
            comm = comm + self.tp_allreduce.over(n)
        return np.maximum(compute, memory) + comm

    def p2p_s(self, n: Any) -> Any:
        """Seconds a micro-batch of ``n`` tokens' activations take over one stage boundary (0 at S = 1)."""
        if self.S == 1:
            return 0.0 * n
        return self.link_lat + self.p2p_per_token * n

    def combine_s(self, q: Any) -> Any:
        """Seconds of the per-layer combine of partial attention for ``q`` query tokens (KVP/ESP)."""
        return self.combine_fixed + self.combine_per_token * q

    # ------------------------------------------------------------------ decode-only steps
    def decode_step_s(self, n_decodes: Any, ctx: Any) -> Any:
        """Seconds of a decode-only step of ``n_decodes`` requests with ``ctx`` context tokens in
        all (scalars or arrays, ``n_decodes > 0``): ``g = min(n, microbatches)`` equal micro-batches
        through S stages, ``(g + S − 1)·τ + (S−1)·p2p``, decodes and contexts over the KV groups,
        plus the step overhead and the combine."""
        n = np.asarray(n_decodes, dtype=np.float64)
        c = np.asarray(ctx, dtype=np.float64)
        g = np.minimum(n, float(self.microbatches)) if self.S > 1 else np.ones_like(n)
        share = g * self.G
        lin = np.maximum(n / share, 1.0)  # the busiest group computes at least one whole decode
        tau = self.stage_time(lin, c / share, c / share)
        pipe = (g + (self.S - 1)) * tau + (self.S - 1) * self.p2p_s(lin)
        return (pipe + self.overhead + self.combine_s(n) + (self.seq_overhead * n + self.tok_overhead * n))[()]

    # ------------------------------------------------------------------ any step
    def step_s(self, n_decodes: int, decode_ctx: int, chunks: Sequence[tuple[int, int, bool]]) -> float:
        """Seconds of one step: ``n_decodes`` decodes with ``decode_ctx`` context tokens in all, and
        prefill ``chunks`` as ``(tokens, cached tokens before, emits)`` in plan order (``emits``:
        the chunk completes its prompt), with an empty pipeline at its start. Decode-only steps
        equal :meth:`decode_step_s` bitwise."""
        return self.step_with_carry(n_decodes, decode_ctx, chunks, 0.0)[0]

    def step_with_carry(self, n_decodes: int, decode_ctx: int, chunks: Sequence[tuple[int, int, bool]],
                        carry_s: float) -> tuple[float, float]:
        """:meth:`step_s` after streaming steps: ``carry_s`` is the longest stage time of the
        micro-batches earlier steps left in the pipeline (SPP chunks that did not drain), which the
        step's micro-batches queue behind at every stage (the flow shop's running maximum starts
        there). Returns ``(seconds, carry_s after the step)``: the longest stage time of the
        non-emitting micro-batches after the step's last emitting one (with none emitting, the
        larger of ``carry_s`` and all of the step's), 0 when the step drains."""
        if not chunks and carry_s == 0.0:
            return float(self.decode_step_s(float(n_decodes), float(decode_ctx))), 0.0
        if self.esp:
            return self._esp_step(n_decodes, decode_ctx, chunks), 0.0
        G = float(self.G)
        q = float(n_decodes)
        if self.S == 1:  # one fused pass
            n = max(n_decodes / G, 1.0) if n_decodes else 0.0
            pairs = decode_ctx / G
            kv = decode_ctx / G
            for c, p, _ in chunks:
                n += c
                pairs += c * (p + c / 2.0) / G
                kv += (p + c) / G
                q += c
            return (float(self.stage_time(n, pairs, kv)) + self.overhead + float(self.combine_s(q))
                    + self._host_s(n_decodes, chunks)), 0.0
        mbs: list[tuple[float, float, bool]] = []  # (stage time, tokens, emits)
        if n_decodes:
            g = float(min(n_decodes, self.microbatches))
            share = g * G
            lin = max(n_decodes / share, 1.0)
            tau = float(self.stage_time(lin, decode_ctx / share, decode_ctx / share))
            mbs.extend([(tau, lin, True)] * int(g))
        for c, p, emits in chunks:
            q += c
            if not self.spp:  # plain PP: the chunk is one micro-batch and drains
                tau = float(self.stage_time(float(c), c * (p + c / 2.0) / G, (p + c) / G))
                mbs.append((tau, float(c), True))
                continue
            # SPP: the chunk streams as up to S sub-chunks (the pipeline's S in-flight iterations)
            u = min(self.S, c)
            base, extra = divmod(c, u)
            at = p
            for j in range(u):
                cj = base + (1 if j < extra else 0)
                tau = float(self.stage_time(float(cj), cj * (at + cj / 2.0) / G, (at + cj) / G))
                mbs.append((tau, float(cj), emits and j == u - 1))
                at += cj
        span, carry = self._pipeline(mbs, carry_s)
        return span + self.overhead + float(self.combine_s(q)) + self._host_s(n_decodes, chunks), carry

    def _host_s(self, n_decodes: int, chunks: Sequence[tuple[int, int, bool]]) -> float:
        """Host time of a step (``CostParams.seq_overhead_s`` per scheduled sequence,
        ``step_token_overhead_s`` per scheduled token), as :class:`~.cost_model.CostModel` adds it."""
        tokens = float(n_decodes) + float(sum(c for c, _, _ in chunks))
        return self.seq_overhead * float(n_decodes + len(chunks)) + self.tok_overhead * tokens

    def _pipeline(self, mbs: list[tuple[float, float, bool]], carry_s: float = 0.0) -> tuple[float, float]:
        """Step span of micro-batches through S stages (proportionate flow shop, module docstring),
        behind ``carry_s`` left in flight by earlier steps; returns ``(span, carry after)``."""
        cum = 0.0
        run_max = carry_s
        span = 0.0
        s1 = self.S - 1
        tail = carry_s  # longest stage time still in flight after the last emitting micro-batch
        for tau, n, emits in mbs:
            cum += tau
            if tau > run_max:
                run_max = tau
            if tau > tail:
                tail = tau
            if emits:
                tail = 0.0
                exit_s = cum + s1 * (run_max + float(self.p2p_s(n)))
                if exit_s > span:
                    span = exit_s
        return (cum if cum > span else span), tail

    def _esp_step(self, n_decodes: int, decode_ctx: int, chunks: Sequence[tuple[int, int, bool]]) -> float:
        n_p = 0.0
        pairs_p = 0.0
        kv_p = 0.0
        for c, p, _ in chunks:
            n_p += c
            pairs_p += c * (p + c / 2.0)
            kv_p += p + c
        d = float(min(self.G, max(1, math.ceil(n_p / self.esp_tokens))))
        G = float(self.G)
        n = n_p / d + (max(n_decodes / G, 1.0) if n_decodes else 0.0)
        tau = float(self.stage_time(n, pairs_p / d + decode_ctx / G, kv_p / d + decode_ctx / G))
        ring = 0.0
        if d > 1:
            ring = (d - 1.0) / d * kv_p * self.ring_per_token + (d - 1.0) * self.ring_fixed_per_hop
        core = tau if tau >= ring else ring
        return core + self.overhead + float(self.combine_s(float(n_decodes))) + self._host_s(n_decodes, chunks)

    # ------------------------------------------------------------------ predictions
    def one_pass_s(self, n_tokens: Any, attn_pairs: Any, kv_tokens: Any) -> Any:
        """Aggregate view for callers that only have batch totals (a policy's TBT check): the batch
        as one micro-batch through every stage, ``S·τ + (S−1)·p2p`` (under SPP streamed as S
        sub-batches: ``τ(all) + (S−1)·(τ(all/S) + p2p)``), attention and KV over the groups (ESP:
        everything over the groups), plus overhead and combine. 0 where n = 0."""
        n = np.asarray(n_tokens, dtype=np.float64)
        pairs = np.asarray(attn_pairs, dtype=np.float64) / self.G
        kv = np.asarray(kv_tokens, dtype=np.float64) / self.G
        n_lin = n / self.G if self.esp else n
        safe = np.where(n_lin > 0, n_lin, 1.0)
        if self.spp:  # the batch streams as S sub-batches: one stage's time of all, then the last's drain
            sub = np.maximum(safe / self.S, 1.0)
            t = self.stage_time(safe, pairs, kv) + (self.S - 1) * (
                self.stage_time(sub, pairs / self.S, kv) + self.p2p_s(sub))
        else:
            t = self.S * self.stage_time(safe, pairs, kv) + (self.S - 1) * self.p2p_s(safe)
        t = t + self.overhead + self.combine_s(n) + (self.seq_overhead + self.tok_overhead * n)  # one sequence
        return np.where(n > 0, t, 0.0)[()]

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        """Seconds of a lone prefill of ``prompt − cached`` tokens in chunks of ``chunk_tokens`` (the
        last takes the remainder), step by step as the simulator prices them (SPP: ``Σ_k τ(c_k) +
        (S−1)·(max_k τ(c_k) + p2p)``, which is REFERENCE §1.4's ``(S−1)·τ(c_last)`` when the last
        chunk is the longest, plus per-step overheads and combines)."""
        total = 0.0
        carry = 0.0
        p = int(cached_tokens)
        end = int(prompt_tokens)
        while p < end:
            c = min(int(chunk_tokens), end - p)
            dt, carry = self.step_with_carry(0, 0, ((c, p, p + c == end),), carry)
            total += dt
            p += c
        return total
