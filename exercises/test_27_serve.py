"""Checks for chapter 27's exercises (the app and `minillm serve`). See _check.py."""

from __future__ import annotations

import inspect
import time

import pytest
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.server import ServerThread, create_app

try:
    import httpx
# recent openai releases ship their HTTP library as httpx2, with the same API
except ImportError:
    import httpx2 as httpx

PROMPTS = ['The "for" statement']


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


# --- 26.1 A request timeout


def test_request_timeout_aborts_a_long_request(tiny):
    has_parameter(create_app, "request_timeout", "27.1")
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
