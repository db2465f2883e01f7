"""Worked solutions to chapter 27's exercises (chapters/27_serve.md).

Installed the way a reader's exported cells would be: create_app with one more
argument. The checks are exercises/test_27_serve.py.
"""

from __future__ import annotations

import asyncio

import minillm.server as server_module
from minillm.async_llm import RequestStream
from minillm.outputs import RequestOutput
from minillm.serving import APIError


# 26.1
class TimedStream:
    """A RequestStream that gives up at a deadline: it raises an API error in
    OpenAI's shape (HTTP 408 for a whole response; an error event in a stream), and
    the handler's `finally: stream.abort()` frees the blocks."""

    def __init__(self, stream: RequestStream, deadline: float):
        self._stream, self._deadline = stream, deadline

    def __aiter__(self) -> TimedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._stream.__anext__()
        except TimeoutError:
            raise APIError(408, "the request ran longer than request_timeout") from None

    def __getattr__(self, name):  # ready(), abort(), pending: the stream's own
        return getattr(self._stream, name)


class TimedLLM:
    """The server's AsyncLLM (or EngineCoreClient), whose streams time out."""

    def __init__(self, llm, request_timeout: float):
        self._llm, self._timeout = llm, request_timeout

    async def generate(self, requests, **kwargs):
        deadline = asyncio.get_running_loop().time() + self._timeout
        return TimedStream(await self._llm.generate(requests, **kwargs), deadline)

    def __getattr__(self, name):  # start, shutdown, is_alive, abort, ...
        return getattr(self._llm, name)


_create_app = server_module.create_app


def create_app(
    engine,
    served_model_name: str = "minillm-tiny",
    chat_template: str | None = None,
    model_path: str | None = None,
    request_timeout: float | None = None,
):
    """create_app; request_timeout (seconds): a request that runs longer is aborted
    and its client gets an error."""
    app = _create_app(engine, served_model_name, chat_template, model_path)
    if request_timeout is not None:
        server = app.state.server
        server.llm = TimedLLM(server.llm, request_timeout)
    return app


server_module.create_app = create_app

SOLUTIONS = {"timeout": (TimedStream, create_app)}
