"""Worked solutions to chapter 26's exercises (chapters/26_openai_api.md).

Installed the way a reader's exported cells would be: changed methods set on
CompletionRequest and OpenAIServingCompletion. The checks are
exercises/test_26_openai_api.py.
"""

from __future__ import annotations

import dataclasses

from minillm import protocol
from minillm.async_llm import RequestStream
from minillm.outputs import RequestOutput
from minillm.protocol import random_id
from minillm.serving import bad_request, with_adapter
from minillm.serving_completion import OpenAIServingCompletion


# 25.1
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


protocol.CompletionRequest.to_sampling_params = to_sampling_params
OpenAIServingCompletion.create_completion = create_completion

SOLUTIONS = {"echo": (EchoStream, create_completion)}
