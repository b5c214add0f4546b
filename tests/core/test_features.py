"""The FeatureTable (envs/sim/features.py): what a policy may see -- lazily built columns of the
requests' progress and KV holdings, and never the output length unless oracle lengths are on."""

from __future__ import annotations

import numpy as np

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.features import TIER_CODES, FeatureTable
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import RUNNING, Request, RequestState, Workload
from kvsched.policies.base import SchedulerPolicy
from simkit import make_spec


def states():
    a = RequestState(Request(7, 1.0, 100, 50), 16, 0)
    a.computed, a.generated, a.status, a.private_blocks, a.shared_blocks = 104, 5, RUNNING, 5, 2
    b = RequestState(Request(8, 2.5, 300, 60), 16, 1)
    b.lower_tier, b.lower_blocks, b.preemptions = "dram", 19, 2
    c = RequestState(Request(9, 3.0, 40, 70), 16, 0)
    c.on_pnm, c.pnm_blocks, c.status, c.computed, c.generated = True, 4, RUNNING, 45, 6
    return [a, b, c]


def test_columns_describe_each_requests_progress_and_holdings():
    t = FeatureTable(states(), now_s=4.0)
    assert len(t) == 3
    assert t.request_id.tolist() == [7, 8, 9] and t.request_id.dtype == np.int64
    assert t.arrival_s.tolist() == [1.0, 2.5, 3.0] and t.wait_s.tolist() == [3.0, 1.5, 1.0]
    assert t.prompt_tokens.tolist() == [100, 300, 40] and t.computed_tokens.tolist() == [104, 0, 45]
    assert t.generated_tokens.tolist() == [5, 0, 6] and t.to_compute_tokens.tolist() == [1, 300, 1]
    assert t.hbm_blocks.tolist() == [7, 0, 0] and t.lower_blocks.tolist() == [0, 19, 0]
    assert t.tier.tolist() == [TIER_CODES["hbm"], TIER_CODES["dram"], TIER_CODES["pnm"]]
    assert t.pnm_blocks.tolist() == [0, 0, 4] and t.preemptions.tolist() == [0, 2, 0]
    assert t.running.tolist() == [True, False, True]


def test_output_length_is_minus_one_unless_oracle():
    assert FeatureTable(states(), 0.0).output_tokens.tolist() == [-1, -1, -1]
    assert FeatureTable(states(), 0.0, oracle_lengths=True).output_tokens.tolist() == [50, 60, 70]


def test_given_running_column_and_tier_codes_are_used():
    t = FeatureTable(states(), 0.0, running=np.array([False, True, False]),
                     tier_codes={"hbm": 0, "dram": 1, "nvme": 2, "cxl": 3, "pnm": 4, "": -1})
    assert t.running.tolist() == [False, True, False] and t.tier.tolist() == [0, 1, 4]


def test_columns_are_computed_once_on_first_access():
    sts = states()
    t = FeatureTable(sts, 0.0)
    assert "computed_tokens" not in t.__dict__  # nothing built before a policy reads it
    first = t.computed_tokens
    sts[0].computed = 999
    assert t.computed_tokens is first and first[0] == 104  # a snapshot at the decision
    assert "computed_tokens" in t.__dict__ and "wait_s" not in t.__dict__


def _reachable_values(obj, depth, seen):
    """Values reachable from ``obj`` through public attributes and sequence items."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(obj, np.ndarray):
        return
    if isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        for item in list(obj)[:50]:
            yield from _reachable_values(item, depth - 1, seen)
        return
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            v = getattr(obj, name)
        except Exception:  # noqa: BLE001
            continue
        if callable(v):
            continue
        yield from _reachable_values(v, depth - 1, seen)


def test_no_public_path_of_the_table_leads_to_the_hidden_output_length():
    """Promise (README "Visibility", features.py): policies read a FeatureTable and the
    output length stays hidden unless the scenario sets ``oracle_lengths``.

    Defect (envs/sim/features.py): the table keeps the raw ``RequestState`` objects in the
    public attribute ``states`` (for admission it is even the live waiting deque), and each
    carries ``output_tokens`` and ``req.output_tokens``. Any policy can read
    ``table.states[i].output_tokens`` with oracle lengths off.

    Expected: with ``oracle_lengths=False`` no public attribute path of the table leads to the
    true output length (7777 here); ``table.output_tokens`` is all -1.
    """
    secret = 7777
    st = RequestState(Request(0, 0.0, 100, secret), 16, 0)
    table = FeatureTable([st], 0.0, oracle_lengths=False)
    assert (table.output_tokens == -1).all()
    leaked = []
    for v in _reachable_values(table, 4, set()):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v == secret:
            leaked.append(v)
        elif isinstance(v, np.ndarray) and v.dtype.kind in "iu" and (v == secret).any():
            leaked.append(v)
    assert not leaked, "the hidden output length is reachable from the FeatureTable"


_SEEN_OUTPUT_COLUMNS: list[np.ndarray] = []


class _SpyPolicy(SchedulerPolicy):
    """FCFS that records the output-length column of every table it is shown."""

    order_is_static = True

    def order_waiting(self, table):
        _SEEN_OUTPUT_COLUMNS.append(table.output_tokens.copy())
        return None

    def choose_victim(self, table):
        _SEEN_OUTPUT_COLUMNS.append(table.output_tokens.copy())
        return len(table) - 1


def run_spy(w, spec, oracle=False):
    """One run under the spy (not registered: the policy registry stays the reference set)."""
    return Cluster([spec], _SpyPolicy, options=InstanceOptions(check_invariants=True, oracle_lengths=oracle)).run(w)


def test_policies_see_output_lengths_only_with_oracle_lengths():
    """Through the FeatureTable column interface, a policy sees -1 for every output length in
    admission and preemption decisions, and the true lengths only with oracle_lengths."""
    reqs = [Request(i, 0.01 * i, 150, 40 + i) for i in range(6)]
    w = Workload.from_requests(reqs)
    spec = make_spec(hbm_kv_blocks=40, enable_prefix_caching=False, max_num_batched_tokens=2048)
    _SEEN_OUTPUT_COLUMNS.clear()
    res = run_spy(w, spec)
    assert res.records.preemptions.sum() > 0  # victims were chosen, so both hooks ran
    assert _SEEN_OUTPUT_COLUMNS and all((c == -1).all() for c in _SEEN_OUTPUT_COLUMNS)
    _SEEN_OUTPUT_COLUMNS.clear()
    run_spy(w, spec, oracle=True)
    seen = np.concatenate(_SEEN_OUTPUT_COLUMNS)
    assert set(seen.tolist()) <= {40 + i for i in range(6)} and len(seen)
