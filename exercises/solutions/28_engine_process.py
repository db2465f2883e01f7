"""Worked solutions to chapter 28's exercises (chapters/28_engine_process.md).

Installed the way a reader's exported cells would be: changed and new methods set on
EngineCoreClient. The checks are exercises/test_28_engine_process.py.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import multiprocessing
import socket

from minillm.async_llm import EngineDeadError, RequestStream
from minillm.engine_core import (
    EngineCoreClient,
    run_engine_core,
    start_without_main,
    stop_process,
)


# 27.1
_client_init = EngineCoreClient.__init__


def client_init(self, build, *build_args, timeout: float = 1800.0):
    """EngineCoreClient.__init__, keeping what restart() needs."""
    self._build, self._build_args, self._timeout = build, build_args, timeout
    _client_init(self, build, *build_args, timeout=timeout)


def _spawn(self) -> None:
    """A new engine process with the same build; blocks until it is ready."""
    context = multiprocessing.get_context("spawn")
    self._socket, theirs = socket.socketpair()
    self._process = context.Process(
        target=run_engine_core,
        args=(theirs, self._build, self._build_args),
        name="minillm-engine-core",
    )
    start_without_main(self._process, self._build)
    theirs.close()
    atexit.unregister(self._at_exit)
    self._at_exit = functools.partial(stop_process, self._process)
    atexit.register(self._at_exit)
    for key, value in self._wait_ready(self._timeout).items():
        setattr(self, key, value)


async def restart(self) -> None:
    """Bring a dead engine back: a new process, connected on the running loop."""
    if self.is_alive():
        raise RuntimeError("the engine process is running: nothing to restart")
    reading = getattr(self, "_reading", None)
    if reading is not None:
        await reading  # the old reader has ended, and failed its callers
    await asyncio.to_thread(stop_process, self._process)  # reap the old one
    await asyncio.to_thread(_spawn, self)  # _wait_ready blocks: not on the loop
    self._outputs, self._num_completions, self._deltas = {}, {}, set()
    self._calls, self._sinks, self._closed = {}, {}, False
    self._waited = 0.0  # the new engine counts its send_wait from 0
    self._loop = asyncio.get_running_loop()
    self._connected = self._loop.create_task(self._connect())
    await self._connected


# 27.2
_generate = EngineCoreClient.generate


async def generate(self, requests) -> RequestStream:
    """EngineCoreClient.generate, refusing new requests once drain() has begun."""
    if getattr(self, "_draining", False):
        raise EngineDeadError("the engine is draining: it takes no new requests")
    return await _generate(self, requests)


async def drain(self, timeout: float = 30.0) -> None:
    """Take no new requests, let those in flight finish (for at most timeout
    seconds), then stop the process; a request still running ends with
    EngineDeadError, as at a shutdown."""
    self._draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # _sinks: the requests in flight; _calls: adds the engine has not answered yet
    while (self._sinks or self._calls) and not self._closed:
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.01)
    await asyncio.to_thread(self.shutdown)  # the reading task then sees the end


EngineCoreClient.__init__ = client_init
EngineCoreClient.restart = restart
EngineCoreClient.generate = generate
EngineCoreClient.drain = drain

SOLUTIONS = {
    "restart": (_spawn, restart),
    "drain": (drain, generate),
}
