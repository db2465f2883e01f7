"""Chapter 29's load generator, minillm.loadgen, against a scripted stream: what it
times as the first token, and what it makes of a stream that carries none
(chapters/29_vllm_comparison.md, "Load, seen from the client")."""

import math
from types import SimpleNamespace

import pytest

from minillm import loadgen
from minillm.loadgen import RequestTiming, percentiles, stream_one, summarize


def choice(text: str) -> SimpleNamespace:
    return SimpleNamespace(choices=[SimpleNamespace(text=text)], usage=None)


def usage(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=tokens))


class ScriptedClient:
    """An OpenAI client whose stream yields each chunk at its scripted time, on a
    clock that stream_one reads as time.perf_counter."""

    def __init__(self, events: list[tuple[float, SimpleNamespace]]):
        self.now, self.events = 0.0, events
        self.completions = SimpleNamespace(create=self.create)

    def create(self, **request):
        assert request["stream"] is True
        for at, chunk in self.events:
            self.now = at
            yield chunk
        self.now = self.events[-1][0] + 0.01 if self.events else 0.01


def timed(monkeypatch, events) -> RequestTiming:
    client = ScriptedClient(events)
    clock = SimpleNamespace(perf_counter=lambda: client.now)
    monkeypatch.setattr(loadgen, "time", clock)  # loadgen's clock, no one else's
    return stream_one(client, "m", [1, 2, 3], max_tokens=3)


def test_first_token_is_the_first_chunk_even_with_empty_text(monkeypatch):
    # the first token ends inside a UTF-8 character: the server sends it, text ""
    t = timed(
        monkeypatch,
        [(0.1, choice("")), (0.2, choice("é")), (0.3, choice("x")), (0.3, usage(3))],
    )
    assert t.ttft == pytest.approx(0.1)
    assert t.itls == pytest.approx([0.1, 0.1])
    assert t.completion_tokens == 3
    assert t.tpot == pytest.approx((0.31 - 0.1) / 2)


def test_a_stream_of_tokens_without_text_is_timed(monkeypatch):
    t = timed(monkeypatch, [(0.05, choice("")), (0.15, choice("")), (0.2, usage(2))])
    assert t.ttft == pytest.approx(0.05)
    assert t.itls == pytest.approx([0.1])


def test_a_stream_without_tokens_has_no_ttft_and_is_counted(monkeypatch):
    t = timed(monkeypatch, [(0.2, usage(0))])  # only the usage chunk
    assert t.ttft is None and t.tpot is None and t.itls == []
    ok = RequestTiming(start=0.0, chunk_times=[0.1, 0.3], end=0.3, completion_tokens=2)
    summary = summarize([t, ok], seconds=1.0, concurrency=2)
    assert summary["num_requests"] == 2 and summary["requests_without_tokens"] == 1
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)  # the one that had one
    assert summary["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert summary["output_tokens_per_s"] == pytest.approx(2.0)


def test_percentiles_of_nothing_are_nan():
    assert all(math.isnan(v) for v in percentiles([None, None]).values())
    assert all(math.isnan(v) for v in percentiles([]).values())
    assert percentiles([None, 0.004, None])["p99"] == pytest.approx(4.0)
