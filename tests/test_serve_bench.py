"""benchmarks/serve.py, the online-serving benchmark: its arrival schedule, its
concurrency limit, its HTTP/SSE parsing, and a run against the tiny-model server."""

import asyncio
import json
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.serve import (
    ChunkedDecoder,
    SSEParser,
    arrival_times,
    payload,
    run_load,
    stats_ms,
    summarize,
)


def test_poisson_arrivals_have_the_requested_rate():
    rate, n = 20.0, 4000
    times = arrival_times(n, rate, seed=3)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert times == sorted(times) and times[0] > 0
    assert times[-1] == pytest.approx(n / rate)  # rescaled as vLLM's get_request
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=1e-9)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1, abs=0.1)
    assert arrival_times(n, rate, seed=3) == times  # seeded
    assert arrival_times(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError, match="positive"):
        arrival_times(5, 0)


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece, at = body[at : at + size], at + size
        if piece:
            out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    if at < len(body):
        out += f"{len(body) - at:x}\r\n".encode() + body[at:] + b"\r\n"
    return out + b"0\r\n\r\n"


@settings(max_examples=60, deadline=None)
@given(
    texts=st.lists(st.text(max_size=12), min_size=1, max_size=6),
    chunk_sizes=st.lists(st.integers(1, 40), max_size=20),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_sse_parser_handles_any_split(texts, chunk_sizes, cuts):
    events = [json.dumps({"choices": [{"text": t}]}) for t in texts] + ["[DONE]"]
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    wire = chunked(body, chunk_sizes)
    decoder, parser, got = ChunkedDecoder(), SSEParser(), []
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    for a, b in zip(points, points[1:]):  # the network splits the bytes anywhere
        got += parser.feed(decoder.feed(wire[a:b]))
    assert got == events
    assert decoder.done


async def fake_server(delay: float, tokens: int):
    """A stand-in server that streams `tokens` chunks per request; it counts the
    connections open at once."""
    state = {"open": 0, "peak": 0}

    async def handle(reader, writer):
        state["open"] += 1
        state["peak"] = max(state["peak"], state["open"])
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        events = [{"choices": [{"text": "x"}]} for _ in range(tokens)]
        events.append({"choices": [], "usage": {"completion_tokens": tokens}})
        for e in events:
            await asyncio.sleep(delay)
            data = f"data: {json.dumps(e)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        state["open"] -= 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], state


def test_max_concurrency_is_never_exceeded():
    async def main():
        server, port, state = await fake_server(0.002, tokens=3)
        async with server:
            payloads = [payload("m", [1, 2], 3)] * 24
            results, seconds, peak = await run_load(
                "127.0.0.1", port, payloads, max_concurrency=5
            )
        return results, peak, state

    results, peak, state = asyncio.run(main())
    assert peak == 5 and state["peak"] <= 5
    assert all(r.success and r.output_tokens == 3 and r.chunks == 3 for r in results)
    assert all(len(r.itl) == 2 and 0 < r.ttft <= r.latency for r in results)


def test_stats_follow_numpys_linear_percentile():
    values = [random.Random(1).random() for _ in range(101)]
    ordered = sorted(values)
    stats = stats_ms(values)
    assert stats["median"] == pytest.approx(1e3 * ordered[50])
    assert stats["p99"] == pytest.approx(1e3 * ordered[99])
    assert stats_ms([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_end_to_end_against_the_tiny_model_server(tiny):
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.server import ServerThread, create_app

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=128))
    lengths = [4, 9, 16, 7, 12, 5]
    payloads = [
        payload("minillm-tiny", [5 + i, 6, 7], n) for i, n in enumerate(lengths)
    ]
    with ServerThread(create_app(engine)) as server:
        results, seconds, peak = asyncio.run(
            run_load(server.host, server.port, payloads, rate=200.0, seed=1)
        )
    assert [r.output_tokens for r in results] == lengths  # ignore_eos, max_tokens
    for r in results:
        assert r.success, r.error
        assert 0 < r.ttft <= r.latency <= seconds
        assert len(r.itl) == r.chunks - 1 and sum(r.itl) == pytest.approx(
            r.latency - r.ttft
        )
    summary = summarize(results, seconds)
    assert summary["completed"] == len(lengths) and summary["failed"] == 0
    assert summary["output_tokens"] == sum(lengths)
    assert summary["ttft_ms"]["median"] <= summary["e2el_ms"]["p99"]
    assert 1 <= peak <= len(lengths)
