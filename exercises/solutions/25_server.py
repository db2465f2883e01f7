"""Worked solutions to chapter 25's exercises (chapters/25_server.md).

Installed the way a reader's exported cells would be: a changed method set on
AsyncLLM. The checks are exercises/test_25_server.py.
"""

from __future__ import annotations

import asyncio
import collections
import itertools

from minillm.async_llm import AsyncLLM, RequestStream, Sink, _Add
from minillm.outputs import RequestOutput


# 24.1
class CoalescingQueue(asyncio.Queue):
    """An asyncio.Queue holding at most one output per request: a newer output takes
    the place of the one still waiting (outputs are cumulative). Errors and markers
    are never replaced. _init, _put and _get are asyncio.Queue's hooks for a
    different storage, as PriorityQueue and LifoQueue use them."""

    def _init(self, maxsize: int) -> None:
        self._queue = collections.OrderedDict()
        self._keys = itertools.count()

    def _put(self, item) -> None:
        key = item.request_id if isinstance(item, RequestOutput) else next(self._keys)
        self._queue[key] = item  # an existing key keeps its place in line

    def _get(self):
        return self._queue.popitem(last=False)[1]


async def generate(self, requests, coalesce: bool = False) -> RequestStream:
    """AsyncLLM.generate; coalesce=True: a slow reader finds only the newest output
    of each request in its queue, which never holds more than one per request."""
    sink = Sink()
    if coalesce:
        sink.queue = CoalescingQueue()  # put_now, on the loop, puts into it
    request_ids = [request_id for request_id, _, _ in requests]
    self._send(_Add(requests, sink))
    try:
        answer = await sink.queue.get()
    except asyncio.CancelledError:
        self.abort(request_ids)
        raise
    if isinstance(answer, BaseException):
        raise answer
    return RequestStream(self, request_ids, sink)


AsyncLLM.generate = generate

SOLUTIONS = {"coalesce": (CoalescingQueue, generate)}
