"""The server (chapter 25) on the GPU default path's logic, its shutdown and its
failures, and a randomised stress run; all on a CPU.

A GPU engine runs chapter 16's persistent batch with async scheduling: while the
server hands out step N's tokens, step N+1 is already launched. The same logic runs on
a CPU when asked for (`persistent_batch=True, async_scheduling=True`), so these tests
check that an abort or a disconnect while a token is in flight ends the request and
frees its blocks, and that the streams equal the non-streamed answers.
"""

import asyncio
import json
import random
import threading
import time

import helpers
import pytest
from helpers import MODEL, SERVER_SIZES, live_server
from hypothesis import given, settings
from hypothesis import strategies as st

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

PROMPTS = [
    f'The "{kw}" statement'
    for kw in ["for", "while", "if", "try", "with", "return", "del", "pass"]
]
ASYNC = dict(persistent_batch=True, async_scheduling=True)


def wait_for(predicate):
    return helpers.wait_for(predicate, timeout=10.0)


def record_aborts(engine, stepper):
    """Make engine.abort_request record whether a step was in flight at each abort;
    returns (that record, the original method)."""
    in_flight_at_abort, original = [], engine.abort_request

    def recording_abort(request_ids):  # runs on the engine thread
        in_flight_at_abort.append(stepper is not None and stepper.in_flight is not None)
        return original(request_ids)

    engine.abort_request = recording_abort
    return in_flight_at_abort, original


def all_blocks_free(engine) -> bool:
    pool = engine.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


def num_in_flight(engine) -> int:
    scheduler = engine.scheduler
    return len(scheduler.running) + len(scheduler.waiting)


def idle_and_free(engine) -> bool:
    return not engine.has_unfinished_requests() and all_blocks_free(engine)


def reference_texts(tiny, prompt, params: SamplingParams) -> list[str]:
    """The texts of each choice from chapter 9's plain engine, driven by hand."""
    engine = LLMEngine(*tiny, EngineConfig(num_kv_blocks=64, max_model_len=512))
    engine.add_request("ref", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return [c.text for c in sorted(final.outputs, key=lambda c: c.index)]


def events(response) -> list[dict | str]:
    """The server-sent events of a streamed response: JSON payloads, then "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def joined(chunks: list[dict], n: int) -> tuple[list[str], list[str | None]]:
    """(text, finish reason) of each choice index, from completion stream chunks."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            texts[i] += (
                choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            )
            if choice["finish_reason"] is not None:
                assert reasons[i] is None, "a choice finished twice"
                reasons[i] = choice["finish_reason"]
    return texts, reasons


@pytest.fixture(scope="module")
def fast(tiny, fast_path):
    """A live server over an engine with the persistent batch and async scheduling."""
    engine = LLMEngine(*tiny, EngineConfig(**SERVER_SIZES, **ASYNC))
    path = fast_path(engine)
    assert path["async_scheduling"] and path["persistent_batch"] and path["stepper"]
    with live_server(engine) as server:
        yield server


@pytest.fixture(scope="module")
def http(fast):
    with httpx.Client(base_url=fast.url, timeout=30) as c:
        yield c


# --- the GPU default path's logic behind the HTTP API
# ----------------------------------------------------


def test_async_engine_completions_match_the_plain_engine(http, tiny):
    body = {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
    full = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    want = reference_texts(
        tiny, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    assert [c["text"] for c in full["choices"]] == want
    assert full["usage"]["completion_tokens"] == 20
    chat = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What does if do?"}],
            "max_tokens": 6,
            "ignore_eos": True,
        },
    ).json()
    assert chat["usage"]["completion_tokens"] == 6


def test_async_engine_streams_join_to_the_non_streamed_text_with_n(http):
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "n": 3,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
    }
    full = http.post("/v1/completions", json=body).json()
    assert full["usage"]["completion_tokens"] == 36
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        got = events(r)
    assert got[-1] == "[DONE]"
    texts, reasons = joined(got[:-1], 3)
    by_index = sorted(full["choices"], key=lambda c: c["index"])
    assert texts == [c["text"] for c in by_index]
    assert reasons == ["length"] * 3
    assert len(set(texts)) > 1  # the choices were sampled on their own seeds


def test_a_disconnect_with_a_step_in_flight_ends_the_request_and_frees_blocks(
    http, fast, tiny, fast_path
):
    engine = fast.engine
    stepper = fast_path(engine)["stepper"]
    in_flight_at_abort, original = record_aborts(engine, stepper)
    try:
        # greedy: a step is launched ahead only when every request is plain greedy
        body = {
            "prompt": PROMPTS[2],
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
        }
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
        assert wait_for(lambda: in_flight_at_abort and idle_and_free(engine))
        # the same without streaming: the client gives up while the request runs
        with pytest.raises(httpx.TimeoutException):
            httpx.post(fast.url + "/v1/completions", json=body, timeout=0.3)
        assert wait_for(lambda: len(in_flight_at_abort) >= 2 and idle_and_free(engine))
    finally:
        engine.abort_request = original
    assert in_flight_at_abort[:2] == [True, True]  # a step was launched ahead each time
    # and the server keeps serving, with the same answers
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    after = http.post(
        "/v1/completions",
        json={
            "prompt": PROMPTS[3],
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert [c["text"] for c in after["choices"]] == reference_texts(
        tiny, PROMPTS[3], params
    )


def test_an_abort_through_async_llm_with_a_step_in_flight(tiny, fast_path):
    engine = LLMEngine(*tiny, EngineConfig(**SERVER_SIZES, **ASYNC))
    stepper = fast_path(engine)["stepper"]
    in_flight_at_abort, _ = record_aborts(engine, stepper)
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run():
        llm = AsyncLLM(engine)
        llm.start()
        try:
            stream = await llm.generate([("long", PROMPTS[4], long)])
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 3:
                    break
            stream.abort()
            assert not stream.pending
            other = await llm.generate([("short", PROMPTS[5], short)])
            async for output in other:
                pass
            return output
        finally:
            llm.shutdown()

    output = asyncio.run(run())
    assert in_flight_at_abort == [True]
    assert (
        output.finished
        and output.outputs[0].text == reference_texts(tiny, PROMPTS[5], short)[0]
    )
    assert idle_and_free(engine)


# --- shutdown and a dead engine thread
# -----------------------------------------------------------------------


def test_shutdown_with_requests_in_flight_ends_every_stream(tiny):
    engine = LLMEngine(
        *tiny, EngineConfig(num_kv_blocks=512, max_model_len=2048, **ASYNC)
    )
    app = create_app(engine, MODEL)
    server = ServerThread(app).start()
    body = {"prompt": PROMPTS[6], "max_tokens": 1800, "temperature": 0}
    body["ignore_eos"] = True
    results, started = {}, threading.Semaphore(0)

    def streamed(i):
        try:
            with httpx.stream(
                "POST",
                server.url + "/v1/completions",
                json={**body, "stream": True},
                timeout=20,
            ) as r:
                got = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[len("data: ") :])
                        if len(got) == 3:
                            started.release()
                results[i] = got
        except httpx.HTTPError as e:
            results[i] = e

    def plain():
        started.release()
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=20)
            results["plain"] = r
        except httpx.HTTPError as e:
            results["plain"] = e

    threads = [threading.Thread(target=streamed, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=plain))
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=20)
    assert wait_for(lambda: num_in_flight(engine) == 4)
    t0 = time.monotonic()
    server.stop()
    stop_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    assert stop_s < 4, f"the server took {stop_s:.1f} s to stop"
    assert not server.thread.is_alive() and not app.state.server.llm.is_alive()
    for i in range(3):
        got = results[i]
        assert isinstance(got, list), f"stream {i} broke off: {got!r}"
        # the stream ends with an error event that names the shutdown, then [DONE]
        assert got[-1] == "[DONE]"
        error = json.loads(got[-2])["error"]
        assert error["code"] == 500 and "shutting down" in error["message"]
    plain_response = results["plain"]
    assert isinstance(plain_response, httpx.Response), plain_response
    assert plain_response.status_code == 500
    assert "shutting down" in plain_response.json()["error"]["message"]
    assert idle_and_free(engine)


class Fatal(BaseException):
    """An error the engine loop does not recover from (it is not an Exception)."""


@pytest.mark.parametrize("failure", ["fatal", "unrecoverable"])
def test_a_dead_engine_thread_fails_health_and_every_request(tiny, failure):
    engine = LLMEngine(*tiny, EngineConfig(**SERVER_SIZES, **ASYNC))
    app = create_app(engine, MODEL)
    body = {"prompt": PROMPTS[7], "max_tokens": 400, "temperature": 0}
    body["ignore_eos"] = True
    plain = {}

    def broken_step():
        if failure == "fatal":
            raise Fatal("simulated")
        raise RuntimeError("simulated failure")

    def broken_abort(request_ids):
        raise RuntimeError("the engine's state is broken")

    with (
        ServerThread(app) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        assert http.get("/health").status_code == 200
        background = threading.Thread(
            target=lambda: plain.update(r=http.post("/v1/completions", json=body))
        )
        background.start()
        assert wait_for(lambda: num_in_flight(engine) == 1)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines)
            # two requests in flight; the engine thread reads these at its next step
            if failure == "unrecoverable":  # the step fails, and so does the clean-up
                engine.abort_request = broken_abort
            engine.step = broken_step
            rest = [line[len("data: ") :] for line in lines]
        background.join(timeout=15)
        assert not background.is_alive(), "a request waits for a dead engine"
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == 500
        assert plain["r"].status_code == 500
        assert wait_for(lambda: http.get("/health").status_code == 503)
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and time.monotonic() - t0 < 5
        assert "engine" in r.json()["error"]["message"]
        stream = http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        assert stream.status_code == 500
    assert not app.state.server.llm.is_alive()


# --- a randomised stress run
# ---------------------------------------------------------------------------------


def stress_specs(
    rng: random.Random, words: list[str], count: int, greedy_share: float
) -> list[dict]:
    """Random requests: prompts, n, greedy or seeded sampling, stop strings, lengths,
    arrival times; some clients go away after a few chunks.
    """
    specs = []
    for i in range(count):
        body = {
            "max_tokens": rng.randint(1, 40),
            "n": rng.choice([1, 1, 1, 2, 3]),
            "ignore_eos": rng.random() < 0.5,
        }
        if rng.random() < greedy_share:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000))
            body["top_k"] = rng.choice([0, 20])
        if rng.random() < 0.4:
            body["stop"] = rng.sample(words, rng.randint(1, 2))
        chat = rng.random() < 0.25
        prompt = rng.choice(PROMPTS)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        specs.append(
            {
                "id": i,
                "chat": chat,
                "body": body,
                "delay": rng.uniform(0, 1.0),
                "drop_after": rng.randint(1, 6) if rng.random() < 0.3 else None,
            }
        )
    return specs


async def run_stream(client, spec) -> dict:
    await asyncio.sleep(spec["delay"])
    path = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
    got, dropped = [], False
    async with client.stream("POST", path, json={**spec["body"], "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            got.append(data if data == "[DONE]" else json.loads(data))
            if spec["drop_after"] is not None and len(got) == spec["drop_after"]:
                dropped = got[-1] != "[DONE]"
                break  # leaving the block closes the connection
    return {"events": got, "dropped": dropped}


async def run_plain(client, spec) -> dict:
    path = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
    r = await client.post(path, json=spec["body"])
    assert r.status_code == 200, r.text
    return r.json()


async def stop_words(client) -> list[str]:
    """Words of the model's own greedy output: stop strings it is sure to reach."""
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    outputs = await asyncio.gather(
        *(
            run_plain(client, {"chat": False, "body": {**body, "prompt": p}})
            for p in PROMPTS[:4]
        )
    )
    return sorted({w for o in outputs for w in o["choices"][0]["text"].split()})


@pytest.mark.parametrize(
    "config,greedy_share",
    # async scheduling launches a step ahead only while every request is greedy
    [(ASYNC, 1.0), (ASYNC, 0.6), ({}, 0.6)],
    ids=["async-greedy", "async-mixed", "plain-mixed"],
)
def test_randomised_concurrent_streams_with_drops(
    tiny, config, greedy_share, fast_path
):
    engine = LLMEngine(*tiny, EngineConfig(**SERVER_SIZES, **config))
    stepper = fast_path(engine)["stepper"]
    in_flight_at_abort, _ = record_aborts(engine, stepper)
    rng = random.Random(20240611)
    with ServerThread(create_app(engine, MODEL)) as server:

        async def scenario():
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(
                base_url=server.url, timeout=60, limits=limits
            ) as client:
                words = await stop_words(client)
                specs = stress_specs(rng, words, 40, greedy_share)
                streamed = await asyncio.gather(*(run_stream(client, s) for s in specs))
                kept = [s for s, r in zip(specs, streamed) if not r["dropped"]]
                # the same requests without streaming, again concurrently
                plain = await asyncio.gather(*(run_plain(client, s) for s in kept))
                return specs, streamed, kept, plain

        specs, streamed, kept, plain = asyncio.run(scenario())
        assert wait_for(lambda: idle_and_free(engine)), "blocks were left in use"
    assert 0 < len(kept) < len(specs)  # some clients went away, most did not
    if stepper is not None and greedy_share == 1:
        # steps ran ahead, and some of the drops came while one was in flight
        assert stepper.num_ahead > 0 and any(in_flight_at_abort)
    by_id = {s["id"]: r for s, r in zip(specs, streamed)}
    for spec, full in zip(kept, plain):
        got = by_id[spec["id"]]["events"]
        assert got[-1] == "[DONE]", spec
        chunks = [e for e in got[:-1] if e["choices"]]
        n = spec["body"]["n"]
        texts, reasons = joined(chunks, n)
        choices = sorted(full["choices"], key=lambda c: c["index"])
        want = [c["message"]["content"] if spec["chat"] else c["text"] for c in choices]
        assert texts == want, spec
        # every choice finished, for the same reason as without streaming
        assert reasons == [c["finish_reason"] for c in choices], spec
        if spec["body"]["ignore_eos"] and "stop" not in spec["body"]:
            assert full["usage"]["completion_tokens"] == n * spec["body"]["max_tokens"]


def test_a_stream_that_fell_behind_catches_up_without_losing_an_output(tiny):
    """RequestStream.ready() hands over every queued output, in order: a handler that
    wakes late writes several steps' events at once, and none is lost."""
    model, tokenizer = tiny
    llm = AsyncLLM(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64)))
    llm.start()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def slow_reader():
        stream = await llm.generate([("late", [5, 6, 7], greedy)])
        batches = []
        async for first in stream:
            await asyncio.sleep(0.03)  # the engine runs ahead meanwhile
            batches.append([first, *stream.ready()])
        assert stream.ready() == []  # finished: nothing left, nothing pending
        return batches

    try:
        batches = asyncio.run(slow_reader())
    finally:
        llm.shutdown()
    outputs = [o for batch in batches for o in batch]
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 13))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert any(len(batch) > 1 for batch in batches)  # it did catch up


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=20),
    index=st.integers(0, 300),
    finish=st.sampled_from([None, "stop", "length"]),
    stop=st.one_of(st.none(), st.integers(0, 10**6), st.text(max_size=5)),
    model=st.text(min_size=1, max_size=10),
)
def test_text_event_is_pydantics_bytes(text, index, finish, stop, model):
    """The fast path of a streamed chunk writes what the protocol's models write."""
    from minillm.protocol import CompletionResponse, CompletionResponseChoice
    from minillm.serving import StreamPiece, sse
    from minillm.serving_completion import text_event

    def chunk(choices):
        return sse(
            CompletionResponse(id="cmpl-x", created=7, model=model, choices=choices)
        )

    envelope = tuple(chunk([]).split('"choices":[]'))
    choice = CompletionResponseChoice(
        index=index, text=text, finish_reason=finish, stop_reason=stop
    )
    piece = StreamPiece(index, text, None, finish, stop, 0)
    assert text_event(envelope, piece) == chunk([choice])
