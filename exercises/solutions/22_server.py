"""Worked solutions to chapter 22's exercises (chapters/22_server.md).

Installed the way a reader's exported cells would be: changed methods set on
AsyncLLM, CompletionRequest and OpenAIServingCompletion, and create_app with one more
argument. The checks are exercises/test_22_server.py.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools

import minillm.server as server_module
from minillm import protocol
from minillm.async_llm import AsyncLLM, RequestStream, Sink, _Add
from minillm.outputs import RequestOutput
from minillm.protocol import random_id
from minillm.serving import APIError, bad_request, with_adapter
from minillm.serving_completion import OpenAIServingCompletion


# 22.1
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


# 22.2
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


# 22.3
def to_sampling_params(self):
    """CompletionRequest's, with echo accepted (suffix is still not supported)."""
    if self.suffix is not None:
        raise protocol.InvalidRequestError("suffix is not supported", "suffix")
    return self._sampling_params(self.max_tokens, self.logprobs)


class EchoStream:
    """A RequestStream whose outputs' texts begin with their prompt. Outputs are
    cumulative, so a stream's first chunk of each choice carries the prompt."""

    def __init__(self, stream: RequestStream, prompt_text):
        self._stream, self._prompt_text = stream, prompt_text

    def __aiter__(self) -> EchoStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return self._echo(await self._stream.__anext__())

    def ready(self) -> list[RequestOutput]:
        return [self._echo(o) for o in self._stream.ready()]

    def _echo(self, output: RequestOutput) -> RequestOutput:
        prompt = self._prompt_text(output)
        outputs = [dataclasses.replace(c, text=prompt + c.text) for c in output.outputs]
        return dataclasses.replace(output, outputs=outputs)

    def __getattr__(self, name):  # abort(), pending
        return getattr(self._stream, name)


async def create_completion(self, req):
    """The completions endpoint; echo: each choice's text starts with its prompt
    (a prompt of token ids: their text). Usage counts tokens, so it is unchanged."""
    lora = self.check_model(req.model)
    try:
        params = self.constrain(req, req.to_sampling_params())
        prompts = [with_adapter(p, lora) for p in req.prompts()]
    except ValueError as e:
        raise bad_request(e) from e
    request_id = random_id("cmpl")
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        stream = await self.llm.generate(list(zip(ids, prompts, [params] * len(ids))))
    except ValueError as e:
        raise bad_request(e) from e
    if req.echo:

        def prompt_text(output: RequestOutput) -> str:
            if output.prompt is not None:
                return output.prompt
            return self.tokenizer.decode(output.prompt_token_ids, False)

        stream = EchoStream(stream, prompt_text)
    index_of = {rid: i for i, rid in enumerate(ids)}
    finish = self._stream_completion if req.stream else self._full_completion
    result = finish(req, request_id, stream, index_of, params.logprobs)
    return result if req.stream else await result


AsyncLLM.generate = generate
server_module.create_app = create_app
protocol.CompletionRequest.to_sampling_params = to_sampling_params
OpenAIServingCompletion.create_completion = create_completion

SOLUTIONS = {
    "coalesce": (CoalescingQueue, generate),
    "timeout": (TimedStream, create_app),
    "echo": (EchoStream, create_completion),
}
