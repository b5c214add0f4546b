"""Fixed-size observations of one instance at a scheduler decision, from the FeatureTable.

The candidates of a decision are the requests the instance's policy would order at this
step: the waiting queue (new and recompute-preempted requests) when admission is open, and
with stall-free batching (Sarathi-Serve, LARS) also the running requests whose prefill is
unfinished. They are ranked in the reference policy's order and the first ``K`` become the
rows of the observation (padded with zeros; ``valid`` = 0).

All scales are fixed and documented (no running normalisation): token counts are divided by
the model's length limit (``max_model_len``), so they lie in [0, 1]; unbounded quantities
(seconds, counts) are squashed with ``x / (x + scale)`` into [0, 1) or ``tanh`` into (-1, 1).

Per-candidate features (``CANDIDATE_FEATURES``, ``K`` rows):

===  ===================  =================================================================
col  name                 value
===  ===================  =================================================================
0    valid                1 for a candidate, 0 for padding
1    prompt               prompt_tokens / max_model_len
2    to_compute           tokens still to prefill / max_model_len (recompute-preempted: incl.
                          generated output)
3    wait                 w / (w + TTFT SLO of its class), w = now - arrival (s)
4    ttft_slack           tanh((TTFT SLO - w) / TTFT SLO): < 0 once the TTFT SLO is missed
5    running              1 for an unfinished prefill already running (stall-free only)
6    preempted            1 if it was preempted before
7    long                 1 if prompt_tokens >= MetricsConfig.long_prompt_tokens
8    kv_need              b / (b + HBM capacity), b = KV blocks its remaining prefill needs
===  ===================  =================================================================

Instance features (``INSTANCE_FEATURES``, appended after the ``K x 9`` block):

===  ===================  =================================================================
0    hbm_used             used / capacity HBM blocks
1    hbm_available        (free + evictable) / capacity HBM blocks
2    dram_used            used / capacity DRAM blocks (0 without DRAM tier)
3    nvme_used            used / capacity NVMe blocks (0 without NVMe tier)
4    waiting              n / (n + K), n = waiting requests
5    running              running requests / max_num_seqs
6    swapped              n / (n + 1), n = swapped-out requests
7    partial_prefills     n / (n + 1), n = running requests with an unfinished prefill
8    candidates_beyond_k  n / (n + K), n = candidates not shown (beyond K)
9    since_last           dt / (dt + 0.1 s), dt = simulated time since the previous decision
===  ===================  =================================================================
"""

from __future__ import annotations

import math

import numpy as np

from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.request import RUNNING

CANDIDATE_FEATURES = ("valid", "prompt", "to_compute", "wait", "ttft_slack", "running", "preempted", "long",
                      "kv_need")
INSTANCE_FEATURES = ("hbm_used", "hbm_available", "dram_used", "nvme_used", "waiting", "running", "swapped",
                     "partial_prefills", "candidates_beyond_k", "since_last")
SINCE_LAST_SCALE_S = 0.1


def is_partial_prefill(st) -> bool:
    """A running request whose prefill (or recompute after preemption) is unfinished."""
    return st.computed < st.prompt_tokens + st.generated - (1 if st.generated > 0 else 0)


def admission_open(inst) -> bool:
    """The instance would offer its waiting queue cache residency at this step (vLLM V0 rule:
    not while requests are swapped out, unless ``admit_while_swapped``), and it has a free seat
    and at least one free or evictable HBM block (a new chunk needs a block)."""
    return (bool(inst.waiting) and (not inst.swapped or inst.admit_while_swapped)
            and len(inst.running) < inst.spec.max_seqs and inst.hbm.available_blocks > 0)


def has_scheduling_choice(inst, now_s: float) -> bool:
    """The decision-point filter of ``kvsched/Scheduling-v0`` (see its docstring)."""
    if admission_open(inst):
        return True
    for st in inst.running:
        if st.status == RUNNING and st.ready_s <= now_s and is_partial_prefill(st):
            return True
    return False


def candidates(inst, now_s: float) -> tuple[list, np.ndarray]:
    """The decision's candidate requests and which of them are running (partial prefills).

    Same sets as :meth:`Instance.schedule` builds before it asks the policy for an order.
    """
    waiting = list(inst.waiting) if admission_open(inst) else []
    if not inst.policy.stall_free:
        return waiting, np.zeros(len(waiting), dtype=bool)
    partial = [st for st in inst.running if st.status == RUNNING and st.ready_s <= now_s and is_partial_prefill(st)]
    cands = partial + waiting
    running = np.zeros(len(cands), dtype=bool)
    running[:len(partial)] = True
    return cands, running


def reference_order(policy, table: FeatureTable, stall_free: bool) -> np.ndarray | None:
    """The reference policy's order over ``table`` (``None`` = table order)."""
    if not len(table):
        return None
    order = policy.order_prefills(table) if stall_free else policy.order_waiting(table)
    return None if order is None else np.asarray(order, dtype=np.int64)


def observation_size(k: int) -> int:
    """Length of the flat observation vector for ``k`` candidate rows."""
    return k * len(CANDIDATE_FEATURES) + len(INSTANCE_FEATURES)


def build_observation(inst, table: FeatureTable, states: list, order: np.ndarray | None, k: int,
                      ttft_slo_s: tuple[float, float], long_prompt_tokens: int, since_last_s: float) -> np.ndarray:
    """The flat float32 observation (``observation_size(k)``,) for one decision.

    Args:
        inst: the instance deciding.
        table: the candidates' FeatureTable (reference order applied through ``order``).
        states: the candidates' request states, in table row order (only the shown rows are
            read, so the cost does not grow with the waiting queue).
        order: the reference order (rows of ``table``), ``None`` for table order.
        k: rows shown.
        ttft_slo_s: TTFT SLO (s) of the short and of the long class (a row's class is its length
            class: ``prompt_tokens >= long_prompt_tokens`` is long).
        long_prompt_tokens: the metrics' long-class threshold (tokens).
        since_last_s: simulated time since the previous decision (s).
    """
    n = len(table)
    nf = len(CANDIDATE_FEATURES)
    # Values are float64 (Python floats) assigned into a zeroed float32 vector: each is rounded
    # to float32 once, as casting a float64 array would; the padding rows stay 0.
    obs = np.zeros(k * nf + len(INSTANCE_FEATURES), dtype=np.float32)
    max_len = float(inst.spec.model_len_limit)
    hbm = inst.hbm
    cap = float(max(hbm.capacity_blocks, 1))
    if n:
        vals: list[float] = []
        slack: list[float] = []
        rows = range(min(n, k)) if order is None else order[:k].tolist()
        running = table.running
        now_s = table.now_s
        slo_short, slo_long = ttft_slo_s
        bs = inst.bs
        for r in rows:
            st = states[r]
            p = st.prompt_tokens
            c = p + st.generated - st.computed  # FeatureTable.to_compute_tokens
            w = now_s - st.arrival_s  # FeatureTable.wait_s
            if w < 0.0:
                w = 0.0
            long = p >= long_prompt_tokens
            t = slo_long if long else slo_short
            need = float(math.ceil(c / bs))
            slack.append((t - w) / t)
            vals += (1.0, p / max_len, c / max_len, w / (w + t), 0.0, 1.0 if running[r] else 0.0,
                     1.0 if st.preemptions > 0 else 0.0, 1.0 if long else 0.0, need / (need + cap))
        obs[:len(vals)] = vals
        # column 4 (ttft_slack) of the shown rows; np.tanh, not math.tanh: NumPy's SIMD tanh differs
        # from libm's in the last bit for ~14 % of inputs, and the observations stay byte-identical
        obs[4:len(vals):nf] = np.tanh(slack)
    dram, nvme = inst.kv.by_name["dram"].pool, inst.kv.by_name["nvme"].pool
    dram_cap, nvme_cap = dram.capacity_blocks, nvme.capacity_blocks
    n_partial = 0
    for st in inst.running:  # is_partial_prefill, inlined
        if st.computed < st.prompt_tokens + st.generated - (1 if st.generated > 0 else 0):
            n_partial += 1
    n_wait, n_swap, beyond = len(inst.waiting), len(inst.swapped), max(n - k, 0)
    obs[k * nf:] = (
        hbm.used_blocks / cap,
        hbm.available_blocks / cap,
        dram.used_blocks / dram_cap if dram_cap else 0.0,
        nvme.used_blocks / nvme_cap if nvme_cap else 0.0,
        n_wait / (n_wait + k),
        len(inst.running) / inst.spec.max_seqs,
        n_swap / (n_swap + 1.0),
        n_partial / (n_partial + 1.0),
        beyond / (beyond + k),
        since_last_s / (since_last_s + SINCE_LAST_SCALE_S),
    )
    return obs
