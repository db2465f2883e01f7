"""Checks for chapter 22's exercises (the server). See _check.py."""

from __future__ import annotations

import asyncio
import inspect
import json
import time

import pytest
from minillm.async_llm import AsyncLLM
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.server import ServerThread, create_app

try:
    import httpx
# recent openai releases ship their HTTP library as httpx2, with the same API
except ImportError:
    import httpx2 as httpx

PROMPTS = ['The "for" statement', 'The "while" statement']


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def has_parameter(fn, name: str, exercise: str) -> None:
    if name not in inspect.signature(fn).parameters:
        pytest.skip(f"exercise {exercise}: {fn.__qualname__} has no `{name}` yet")


def all_blocks_free(engine) -> bool:
    pool = engine.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


# --- 19.1 Backpressure


def test_coalesce_keeps_one_output_per_request_for_a_slow_reader(tiny):
    has_parameter(AsyncLLM.generate, "coalesce", "22.1")
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


# --- 19.2 A request timeout


def test_request_timeout_aborts_a_long_request(tiny):
    has_parameter(create_app, "request_timeout", "22.2")
    engine = LLMEngine(*tiny, EngineConfig(num_kv_blocks=256, max_model_len=2048))
    app = create_app(engine, "minillm-tiny", request_timeout=0.3)
    # about 1,500 steps: several seconds on a CPU, unless the timeout stops it
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True}
    with (
        ServerThread(app) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        t0 = time.monotonic()
        r = http.post("/v1/completions", json=body)
        plain_s = time.monotonic() - t0
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert 0 < r.json()["usage"]["completion_tokens"] < 1500
        else:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        t0 = time.monotonic()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        stream_s = time.monotonic() - t0
        assert lines[-1] == "data: [DONE]"
        assert plain_s < 2.5 and stream_s < 2.5, (plain_s, stream_s)
        assert wait_for(lambda: all_blocks_free(engine))
        # short requests are not affected
        ok = http.post("/v1/completions", json={**body, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# --- 19.3 Echo


def test_echo_puts_the_prompt_in_front_of_each_choice(tiny):
    engine = LLMEngine(*tiny, EngineConfig(num_kv_blocks=64))
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    with (
        ServerThread(create_app(engine, "minillm-tiny")) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        echoed = http.post("/v1/completions", json={**body, "echo": True})
        if echoed.status_code == 400 and echoed.json()["error"]["param"] == "echo":
            pytest.skip("exercise 22.3: echo is still rejected")
        assert echoed.status_code == 200, echoed.text
        plain = http.post("/v1/completions", json=body).json()
        texts = [c["text"] for c in sorted(plain["choices"], key=lambda c: c["index"])]
        got = sorted(echoed.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == [PROMPTS[1] + t for t in texts]
        assert echoed.json()["usage"] == plain["usage"]
        with http.stream(
            "POST", "/v1/completions", json={**body, "echo": True, "stream": True}
        ) as r:
            chunks = [
                json.loads(line[len("data: ") :])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        streamed = ["", ""]
        for chunk in chunks:
            for c in chunk["choices"]:
                streamed[c["index"]] += c["text"]
        assert streamed == [PROMPTS[1] + t for t in texts]
        # a prompt of token ids echoes their text
        ids = http.post(
            "/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}
        ).json()["tokens"]
        by_ids = http.post(
            "/v1/completions", json={**body, "prompt": ids, "n": 1, "echo": True}
        ).json()
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert by_ids["choices"][0]["text"].startswith(text)
