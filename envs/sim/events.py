"""Deterministic event queue.

Events are ordered by ``(time_s, priority, sequence number)``: at equal times, lower
priority values run first, and equal (time, priority) pairs run in insertion order. No
wall-clock time and no randomness: one input gives one order.

Priorities at one instant (so that a scheduler sees everything that happened "now"):
``STEP_END`` < ``TRANSFER_DONE`` < ``ARRIVAL`` < ``SCHEDULE``.
"""

from __future__ import annotations

import heapq
from typing import Any

STEP_END = 0
TRANSFER_DONE = 1
ARRIVAL = 2
SCHEDULE = 3
EVENT_NAMES = ("step_end", "transfer_done", "arrival", "schedule")


class EventQueue:
    """A min-heap of ``(time_s, priority, seq, payload)``."""

    __slots__ = ("_heap", "_seq", "popped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.popped = 0

    def push(self, time_s: float, priority: int, payload: Any) -> None:
        """Schedule ``payload`` at ``time_s`` with ``priority`` (one of the constants above)."""
        self._seq += 1
        heapq.heappush(self._heap, (time_s, priority, self._seq, payload))

    def pop(self) -> tuple[float, int, Any]:
        """Remove and return the earliest ``(time_s, priority, payload)``."""
        t, p, _, payload = heapq.heappop(self._heap)
        self.popped += 1
        return t, p, payload

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float:
        """Time of the earliest event (``inf`` when empty)."""
        return self._heap[0][0] if self._heap else float("inf")
