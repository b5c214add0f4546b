"""The event queue (envs/sim/events.py): events come out by (time, priority, insertion order)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as hst

from kvsched.envs.sim.events import ARRIVAL, EVENT_NAMES, SCHEDULE, STEP_END, TRANSFER_DONE, EventQueue


def test_earlier_time_comes_first_whatever_the_priority():
    q = EventQueue()
    q.push(2.0, STEP_END, "late step end")
    q.push(1.0, SCHEDULE, "early schedule")
    assert q.pop() == (1.0, SCHEDULE, "early schedule")
    assert q.pop() == (2.0, STEP_END, "late step end")


def test_at_one_instant_step_ends_then_transfers_then_arrivals_then_scheduling():
    q = EventQueue()
    for prio, what in ((SCHEDULE, "schedule"), (ARRIVAL, "arrival"), (TRANSFER_DONE, "transfer"), (STEP_END, "step")):
        q.push(5.0, prio, what)
    assert [q.pop()[2] for _ in range(4)] == ["step", "transfer", "arrival", "schedule"]
    assert STEP_END < TRANSFER_DONE < ARRIVAL < SCHEDULE
    assert EVENT_NAMES == ("step_end", "transfer_done", "arrival", "schedule")


def test_equal_time_and_priority_keep_insertion_order_even_for_unorderable_payloads():
    q = EventQueue()
    payloads = [object() for _ in range(5)]  # the heap never compares payloads
    for p in payloads:
        q.push(0.5, ARRIVAL, p)
    assert [q.pop()[2] for _ in range(5)] == payloads


def test_peek_length_and_popped_counter():
    q = EventQueue()
    assert len(q) == 0 and q.peek_time() == math.inf
    q.push(3.0, ARRIVAL, None)
    q.push(1.5, ARRIVAL, None)
    assert len(q) == 2 and q.peek_time() == 1.5 and q.popped == 0
    q.pop()
    assert len(q) == 1 and q.peek_time() == 3.0 and q.popped == 1


@given(hst.lists(hst.tuples(hst.sampled_from([0.0, 0.5, 1.0, 2.5]), hst.integers(0, 3)), max_size=40))
def test_pop_order_is_the_sorted_time_priority_sequence_order(events):
    q = EventQueue()
    for i, (t, p) in enumerate(events):
        q.push(t, p, i)
    got = [q.pop() for _ in range(len(events))]
    want = sorted(((t, p, i) for i, (t, p) in enumerate(events)))
    assert got == want
