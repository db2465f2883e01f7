"""Checks for chapter 26's exercises (the OpenAI API). See _check.py.

The endpoints are called as chapter 26 calls them, from a coroutine, without HTTP.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.protocol import CompletionRequest, CompletionResponse
from minillm.serving import APIError
from minillm.serving_completion import OpenAIServingCompletion

PROMPTS = ['The "for" statement', 'The "while" statement']


async def complete(serving: OpenAIServingCompletion, body: dict):
    """A completions call: the response as a dict, or a stream's chunks as dicts."""
    result = await serving.create_completion(CompletionRequest(**body))
    if isinstance(result, CompletionResponse):
        return result.model_dump()
    events = "".join([event async for event in result]).split("\n\n")
    return [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]


# --- 25.1 Echo


def test_echo_puts_the_prompt_in_front_of_each_choice(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    serving = OpenAIServingCompletion(engine, "minillm-tiny")
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)

    async def calls():
        try:
            echoed = await complete(serving, {**body, "echo": True})
        except APIError as e:
            if e.status == 400 and e.param == "echo":
                pytest.skip("exercise 26.1: echo is still rejected")
            raise
        plain = await complete(serving, body)
        chunks = await complete(serving, {**body, "echo": True, "stream": True})
        by_ids = {**body, "prompt": ids, "n": 1, "echo": True}
        return echoed, plain, chunks, await complete(serving, by_ids)

    serving.llm.start()
    try:
        echoed, plain, chunks, by_ids = asyncio.run(calls())
    finally:
        serving.llm.shutdown()
    texts = [c["text"] for c in sorted(plain["choices"], key=lambda c: c["index"])]
    got = sorted(echoed["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == [PROMPTS[1] + t for t in texts]
    assert echoed["usage"] == plain["usage"]
    streamed = ["", ""]
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [PROMPTS[1] + t for t in texts]
    # a prompt of token ids echoes their text
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert by_ids["choices"][0]["text"].startswith(text)
