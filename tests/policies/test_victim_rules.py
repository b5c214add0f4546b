"""The victim rule as a parameter of every policy (``PolicyParams.victim_rule``,
policies/victims.py; issue #21 item 4): each rule picks its documented row, the default keeps the
policy's own victim, tier-aware preemption then picks only the mode, and the rule governs real
preemptions in a simulation."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.envs.sim.cluster import Cluster
from kvsched.envs.sim.errors import ConfigError
from kvsched.envs.sim.features import FeatureTable
from kvsched.envs.sim.instance import InstanceOptions
from kvsched.envs.sim.request import Request, RequestState, Workload
from kvsched.policies.base import make_policy, policy_names
from kvsched.policies.victims import PARAM_VICTIM_RULES, RULES, max_priority_row, victim_row
from simkit import make_spec

# rows in admission order: (arrival_s, priority, computed tokens, HBM blocks)
ROWS = [(0.0, 0, 400, 25),   # 0: oldest
        (0.5, 3, 20, 2),     # 1: least computed
        (1.0, 1, 900, 57),   # 2: most computed, most blocks
        (1.5, 5, 300, 19),   # 3: largest (priority, arrival)
        (2.0, 2, 100, 7)]    # 4: newest
EXPECTED = {"newest": 4, "oldest": 0, "least-computed": 1, "most-computed": 2, "priority": 3, "most-blocks": 2}


def table(rows=ROWS) -> FeatureTable:
    states = []
    for i, (arr, prio, computed, blocks) in enumerate(rows):
        st = RequestState(Request(i, arr, 1000, 50, priority=prio), 16, 0)
        st.computed, st.private_blocks = computed, blocks
        states.append(st)
    return FeatureTable(states, now_s=3.0)


@pytest.mark.parametrize("rule", sorted(EXPECTED))
def test_each_rule_picks_its_documented_row(rule):
    assert victim_row(rule, table()) == EXPECTED[rule]


def test_least_cost_per_block_is_the_cheapest_mode_per_freed_block():
    costs = {"recompute": np.array([4.0, 1.0, 9.0, 3.0, 2.0]), "swap": np.array([5.0, 0.5, 2.0, np.inf, 1.0])}
    # per block at the cheapest mode: 4/25, .5/2, 2/57, 3/19, 1/7 -> row 2
    assert victim_row("least-cost-per-block", table(), costs) == 2


def test_priority_ties_go_to_the_earliest_row_as_vllm_v1_and_to_the_last_as_v0():
    rows = [(1.0, 4, 10, 1), (2.0, 4, 10, 1), (2.0, 4, 10, 1), (0.5, 1, 10, 1)]
    t = table(rows)
    assert victim_row("priority", t) == max_priority_row(t) == 1  # max(): first of the largest keys
    assert max_priority_row(t, last=True) == 2  # V0: last of the running queue sorted by the key


def test_every_documented_parameter_value_is_a_rule_and_others_are_refused():
    assert set(PARAM_VICTIM_RULES) - {"policy"} <= set(RULES)
    assert PARAM_VICTIM_RULES == ("policy", "newest", "oldest", "least-computed", "most-computed", "priority")
    for name in policy_names():
        assert make_policy(name).params.victim_rule == "policy"  # nothing changes by default
        for bad in ("fewest_computed", "largest", None):
            with pytest.raises(ConfigError,
                               match=r"PolicyParams.victim_rule=.* is not allowed: expected one of policy"):
                make_policy(name, {"victim_rule": bad})


def test_the_default_keeps_the_policys_own_victim_and_a_rule_replaces_it():
    t, costs = table(), {"recompute": np.ones(5)}
    # shortest-prompt-first preempts the longest prompt: make row 0 the longest
    states = t._states
    states[0].prompt_tokens = 5000
    t = FeatureTable(states, 3.0)
    assert make_policy("priority").choose_preemption(t, costs, "recompute") == (0, "recompute")
    assert make_policy("fcfs").choose_preemption(t, costs, "recompute") == (4, "recompute")
    for rule, row in EXPECTED.items():
        if rule in PARAM_VICTIM_RULES:
            for name in ("fcfs", "priority", "lars"):
                assert make_policy(name, {"victim_rule": rule}).choose_preemption(t, costs, "swap") == (row, "swap")


def test_with_tier_aware_preemption_the_rule_picks_the_victim_and_tier_awareness_its_mode():
    t = table()
    costs = {"recompute": np.array([4.0, 1.0, 9.0, 3.0, 2.0]), "swap": np.array([5.0, 0.5, 2.0, np.inf, 1.0]),
             "offload": np.array([3.0, 2.0, 3.0, 2.5, 3.0])}
    # tier-aware alone: least cost per freed block, never row 0 -> row 2 by swap (2 s / 57 blocks)
    assert make_policy("fcfs", {"tier_aware_preemption": True}).choose_preemption(t, costs, "recompute") == (2, "swap")
    pick = {"newest": (4, "swap"), "oldest": (0, "offload"), "least-computed": (1, "swap"),
            "most-computed": (2, "swap"), "priority": (3, "offload")}
    for rule, expected in pick.items():
        p = make_policy("fcfs", {"tier_aware_preemption": True, "victim_rule": rule})
        assert p.choose_preemption(t, costs, "recompute") == expected, rule


def _two_requests() -> Workload:
    # A: old, short prompt, long decode; B: newer, long prompt, long decode. Together they need
    # ceil(432/16) + ceil(1200/16) = 27 + 75 = 102 blocks of the 80: someone is preempted, and
    # whenever that happens A holds fewer computed tokens than B (B's prefill alone is 800).
    return Workload.from_requests([Request(0, 0.0, 32, 400), Request(1, 0.01, 800, 400)])


def _preemptions(policy: str, params: dict) -> dict[int, int]:
    res = Cluster([make_spec(hbm_kv_blocks=80, enable_prefix_caching=False)], lambda: make_policy(policy, params),
                  options=InstanceOptions(check_invariants=True)).run(_two_requests())
    assert (res.records.status == "finished").all()
    return dict(zip(res.records.request_id.tolist(), res.records.preemptions.tolist()))


def test_a_policy_with_victim_rule_least_computed_preempts_the_request_with_least_computed_tokens():
    fcfs = _preemptions("fcfs", {})
    assert fcfs[0] == 0 and fcfs[1] >= 1  # vLLM's newest victim: B
    least = _preemptions("fcfs", {"victim_rule": "least-computed"})
    assert least[0] >= 1 and least[1] == 0
    assert _preemptions("priority", {"victim_rule": "least-computed"}) == least  # whatever the policy
    assert _preemptions("fcfs", {"victim_rule": "oldest"})[1] == 0
