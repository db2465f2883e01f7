"""Checks for chapter 25's exercises (many callers, one engine). See _check.py."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
from minillm.async_llm import AsyncLLM
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams

PROMPTS = ['The "for" statement', 'The "while" statement']


def has_parameter(fn, name: str, exercise: str) -> None:
    if name not in inspect.signature(fn).parameters:
        pytest.skip(f"exercise {exercise}: {fn.__qualname__} has no `{name}` yet")


# --- 22.1 Backpressure


def test_coalesce_keeps_one_output_per_request_for_a_slow_reader(tiny):
    has_parameter(AsyncLLM.generate, "coalesce", "25.1")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]

    async def run(coalesce: bool):
        engine = LLMEngine(*tiny, EngineConfig(num_kv_blocks=64))
        llm = AsyncLLM(engine)
        llm.start()
        try:
            stream = await llm.generate(requests, coalesce=coalesce)
            if coalesce:  # a slow reader: nothing is read until the engine is done
                deadline = time.monotonic() + 20
                while engine.has_unfinished_requests() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.1)  # the last outputs reach the loop
            return [output async for output in stream]
        finally:
            llm.shutdown()

    eager, slow = asyncio.run(run(False)), asyncio.run(run(True))
    assert len(eager) == 2 * 30  # without coalescing: one output per token
    final = {o.request_id: o.outputs[0].text for o in eager if o.finished}
    # a slow reader finds only the newest output of each request: the finished one
    assert len(slow) == 2, f"{len(slow)} outputs were queued for 2 requests"
    assert all(o.finished for o in slow)
    assert {o.request_id: o.outputs[0].text for o in slow} == final
