"""Worked solutions to chapter 6's exercises (chapters/06_scheduler.md).

The answers change the scheduler itself, so they are installed the way the chapter's
edited cells would be: two new SchedulerConfig fields (a subclass with the same name
in minillm.scheduler) and the changed methods set on Scheduler. The checks are
exercises/test_06_scheduler.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import minillm.scheduler as scheduler
from minillm.kv_cache_manager import NoFreeBlocksError
from minillm.request import Request, RequestStatus
from minillm.scheduler import Scheduler, _tokens_to_go, _urgency


# 5.1 and 5.3: two new fields (0 and 0.0 are off: the chapter's scheduler)
@dataclasses.dataclass(frozen=True)
class SchedulerConfig(scheduler.SchedulerConfig):
    long_prefill_token_threshold: int = 0  # 5.1: most tokens per request per step
    watermark: float = 0.0  # 5.3: the share of blocks an admission leaves free


def _cap(self, num_new: int) -> int:
    """5.1: no request gets more than long_prefill_token_threshold tokens a step."""
    cap = getattr(self.config, "long_prefill_token_threshold", 0)
    return min(num_new, cap) if cap > 0 else num_new


def _schedule_running(self, budget, scheduled, preempted) -> int:
    """Chapter 6's pass 1; the only change is the cap on num_new."""
    for request in sorted(self.running, key=_tokens_to_go):
        if request.status is not RequestStatus.RUNNING:
            continue
        num_new = _cap(self, min(_tokens_to_go(request), budget))  # 5.1
        if num_new == 0:
            continue
        while True:
            try:
                self.kv_cache_manager.allocate_slots(request, num_new)
                break
            except NoFreeBlocksError:
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += scheduled.pop(victim.request_id, 0)
                if victim is request:
                    break
        if request.status is RequestStatus.RUNNING:
            scheduled[request.request_id] = num_new
            budget -= num_new
    return budget


def _leaves_watermark(self, request: Request, blocks, num_cached, num_new) -> bool:
    """5.3: after this allocation at least watermark * num_blocks blocks stay free
    (always true while nothing runs, so an idle scheduler makes progress)."""
    watermark = getattr(self.config, "watermark", 0.0)
    if watermark <= 0 or not self.running:
        return True
    kv = self.kv_cache_manager
    new_blocks = kv.blocks_needed(num_cached + num_new) - len(blocks)
    free_after = kv.block_pool.get_num_free_blocks() - new_blocks
    return free_after >= watermark * kv.num_blocks


def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
    """Chapter 6's pass 2, with the cap (5.1) and the watermark (5.3)."""
    held: list[Request] = []
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        request = self.waiting[0]
        if not all(check(request, self.running) for check in self.admission_checks):
            held.append(self.waiting.popleft())
            continue
        blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        num_new = _tokens_to_go(request) - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            break
        num_new = _cap(self, min(num_new, budget))  # 5.1
        if not _leaves_watermark(self, request, blocks, num_cached, num_new):
            break  # 5.3: wait until running requests give blocks back
        try:
            self.kv_cache_manager.allocate_slots(
                request, num_new, new_computed_blocks=blocks
            )
        except NoFreeBlocksError:
            break
        request.num_computed_tokens += num_cached
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled[request.request_id] = num_new
        budget -= num_new
    for request in reversed(held):
        self.waiting.appendleft(request)


# 5.2
class PriorityRequestQueue:
    """The priority policy's waiting requests as a heap on (priority, arrival_time):
    O(log n) to add and to pop, instead of a walk to keep a list sorted."""

    def __init__(self, requests=()):
        self._heap: list = []
        self._count = itertools.count()  # ties: first in, first out
        for request in requests:
            self.append(request)

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (*_urgency(request), next(self._count), request))

    appendleft = append  # a preempted request goes back to its place by urgency

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        """From the middle (finish_requests, an abort): O(n), and rare."""
        i = next(i for i, entry in enumerate(self._heap) if entry[-1] is request)
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __getitem__(self, i: int) -> Request:
        if i != 0:
            raise IndexError("a heap only shows its most urgent request, [0]")
        return self._heap[0][-1]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._heap))


def _add_waiting(self, request: Request, front: bool = False) -> None:
    if self.config.policy == "priority":
        if not isinstance(self.waiting, PriorityRequestQueue):
            # the first time (or after chapter 12 swapped the queue for a step)
            self.waiting = PriorityRequestQueue(self.waiting)
        self.waiting.append(request)
    elif front:
        self.waiting.appendleft(request)
    else:
        self.waiting.append(request)


SchedulerConfig.__module__ = "minillm.scheduler"  # where the reader's fields live
scheduler.SchedulerConfig = SchedulerConfig
scheduler.PriorityRequestQueue = PriorityRequestQueue
Scheduler._schedule_running = _schedule_running
Scheduler._schedule_waiting = _schedule_waiting
Scheduler._add_waiting = _add_waiting

SOLUTIONS = {
    "prefill_cap": (SchedulerConfig, _cap),
    "priority": (PriorityRequestQueue, _add_waiting),
    "watermark": (_leaves_watermark, _schedule_waiting),
}
