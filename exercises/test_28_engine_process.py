"""Checks for chapter 28's exercises (the engine in a process of its own). See
_check.py."""

from __future__ import annotations

import asyncio

import pytest
from _check import answer
from minillm.async_llm import EngineDeadError
from minillm.engine_core import EngineCoreClient
from minillm.sampling_params import SamplingParams
from minillm.server import build_engine, parse_args

PROMPTS = ['The "for" statement', 'The "while" statement']


# --- 20.1 An engine that comes back


def test_restart_serves_again_after_the_engine_process_died():
    """20.1: after a kill, restart() brings the engine back: same seed, same tokens."""
    answer(EngineCoreClient, "restart", "28.1")
    args = parse_args(["--device", "cpu", "--num-kv-blocks", "64"])
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)

    async def tokens(client, request_id):
        stream = await client.generate([(request_id, PROMPTS[0], params)])
        async for output in stream:
            pass
        return output.outputs[0].token_ids

    async def scenario(client):
        before = await tokens(client, "a")
        client._process.kill()
        with pytest.raises(EngineDeadError):
            await tokens(client, "b")
        assert not client.is_alive()
        await client.restart()
        assert client.is_alive()
        return before, await tokens(client, "c")

    client = EngineCoreClient(build_engine, args)
    try:
        before, after = asyncio.run(scenario(client))
    finally:
        client.shutdown()
    assert before == after and len(after) == 8


# --- 20.2 Draining


def test_drain_finishes_the_requests_in_flight_and_refuses_new_ones():
    """20.2: after drain(), the requests in flight have streamed to their end, a new
    one is refused, and the process has stopped."""
    answer(EngineCoreClient, "drain", "28.2")
    args = parse_args(["--device", "cpu", "--num-kv-blocks", "64"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def read(stream):
        async for output in stream:
            pass
        return output

    async def scenario(client):
        streams = [
            await client.generate([(f"r{i}", prompt, params)])
            for i, prompt in enumerate(PROMPTS)
        ]
        readers = [asyncio.create_task(read(stream)) for stream in streams]
        await client.drain(timeout=60)
        with pytest.raises(EngineDeadError):
            await client.generate([("late", PROMPTS[0], params)])
        return await asyncio.gather(*readers)

    client = EngineCoreClient(build_engine, args)
    try:
        outputs = asyncio.run(scenario(client))
        assert not client.is_alive()
    finally:
        client.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [24, 24]
    assert all(o.finished for o in outputs)
