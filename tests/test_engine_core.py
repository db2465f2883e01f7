"""The engine in a process of its own (chapter 28, engine_core.py): the HTTP suite of
test_server.py against a server whose engine runs in a spawned child, and what only a
second process can do wrong (a failed step, a dead process, a failed start, deltas
rebuilt into the outputs AsyncLLM gives)."""

import asyncio
import concurrent.futures

import pytest
import torch
from engine_builders import FAILING_MAX_TOKENS, build_broken, build_failing
from helpers import MODEL, metric, wait_for

# the end-to-end tests of test_server.py that read nothing of the engine object, and
# its client fixtures: here they run against EngineCoreClient (the `live` below)
from test_server import (  # noqa: F401
    PROMPT,
    client,
    disconnect_mid_stream,
    http,
    test_bad_requests_get_openai_errors,
    test_bad_schema_is_an_openai_400,
    test_chat_json_schema_outputs_validate,
    test_chat_logprobs_shape,
    test_chat_stream_joins_to_the_non_streamed_message,
    test_completion_json_object_and_structured_outputs,
    test_completion_logprobs_shape,
    test_greedy_stream_joins_to_the_non_streamed_text,
    test_include_usage_adds_a_final_chunk_with_empty_choices,
    test_malformed_json_is_a_400,
    test_metrics_expose_the_named_metrics_with_the_model_label,
    test_models_health_and_openapi,
    test_n_gives_indexed_choices_and_prompts_lists_are_numbered,
    test_seed_reproduces_a_sampled_output,
    test_stop_string_and_max_tokens_set_the_finish_reason,
    test_stop_token_ids_and_min_tokens,
    test_tokenize_and_detokenize_round_trip,
    test_usage_counts_are_exact,
    test_vllm_extra_sampling_fields_are_accepted,
)

from minillm.async_llm import AsyncLLM, EngineDeadError
from minillm.engine_core import EngineCoreClient
from minillm.metrics import EngineMetrics
from minillm.sampling_params import SamplingParams
from minillm.server import ServerThread, build_engine, create_app, parse_args

# test_server.py's engine: the tiny model, float32 on the CPU
FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256"]
FLAGS += ["--max-model-len", "512", "--max-num-seqs", "16"]


def start(build, args) -> EngineCoreClient:
    """An engine process computing with this process's thread count (spawn passes
    the environment on): another count sums in another order, and floats such as
    logprobs would differ in their last bits from an engine in this process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        return EngineCoreClient(build, args)


@pytest.fixture(scope="module")
def live():
    engine = start(build_failing, parse_args(FLAGS))
    with ServerThread(create_app(engine, MODEL)) as server:
        server.engine_process = engine
        yield server


def test_a_failed_step_is_a_500_and_the_engine_process_serves_on(http, live):  # noqa: F811
    body = {"prompt": PROMPT, "max_tokens": FAILING_MAX_TOKENS}
    r = http.post("/v1/completions", json=body)
    stream = http.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert "simulated failure" in r.json()["error"]["message"]
    events = [line for line in stream.text.splitlines() if line]
    assert '"InternalServerError"' in events[-2] and events[-1] == "data: [DONE]"
    ok = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert wait_for(lambda: metric(http, "minillm:kv_cache_usage_perc") == 0)
    assert live.engine_process.is_alive()


def test_a_disconnect_aborts_in_the_engine_process_and_frees_blocks(http, live):  # noqa: F811
    disconnect_mid_stream(http)  # the gauges: the engine process's answer to the abort
    assert live.engine_process._outputs == {} and live.engine_process._sinks == {}


async def _outputs(llm, requests):
    """The final output of each of requests, submitted as one call."""
    stream = await llm.generate(requests)
    final = {}
    async for output in stream:
        final[output.request_id] = output
    return [final[request_id] for request_id, _, _ in requests]


def _run(coroutine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a loop of its own
        return pool.submit(asyncio.run, coroutine).result()


def test_deltas_rebuild_what_async_llm_gives_and_a_dead_process_fails_callers():
    args = parse_args(FLAGS)
    requests = [
        ("stop", 'The "while" statement', SamplingParams(max_tokens=40, stop=["."])),
        ("n2", [5, 6, 7], SamplingParams(n=2, seed=3, max_tokens=12, logprobs=3)),
        ("eos", "x", SamplingParams(temperature=0, max_tokens=30, min_tokens=2)),
        ("prompt", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2)),
    ]

    async def in_thread():
        llm = AsyncLLM(build_engine(args)[0], EngineMetrics(MODEL))
        llm.start()
        try:
            return await _outputs(llm, requests)
        finally:
            llm.shutdown()

    core = start(build_engine, args)

    async def in_process():
        got = await _outputs(core, requests)
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = await core.generate([("long", PROMPT, long)])
        await stream.__anext__()  # it runs...
        core._process.kill()  # ...and the engine's process dies
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await core.generate([("late", PROMPT, long)])
        return got

    try:
        expected, got = _run(in_thread()), _run(in_process())
    finally:
        core.shutdown()
    assert not core.is_alive()
    for a, b in zip(got, expected):
        assert (a.request_id, a.prompt, a.prompt_token_ids, a.finished) == (
            b.request_id,
            b.prompt,
            b.prompt_token_ids,
            b.finished,
        )
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.index, x.text, x.token_ids, x.finish_reason, x.stop_reason) == (
                y.index,
                y.text,
                y.token_ids,
                y.finish_reason,
                y.stop_reason,
            )
            assert x.logprobs == y.logprobs and x.cumulative_logprob == pytest.approx(
                y.cumulative_logprob
            )
    assert len(got[1].outputs) == 2
    # the prompt's logprobs cross the process boundary too
    assert got[3].prompt_logprobs is not None
    assert len(got[3].prompt_logprobs) == len(got[3].prompt_token_ids)
    assert got[3].prompt_logprobs == expected[3].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in got[:3])


async def _every_output(llm, requests):
    """Each request's outputs as its stream gives them, in order."""
    stream, seen = await llm.generate(requests), {}
    async for output in stream:
        seen.setdefault(output.request_id, []).append(
            [output.finished, output.prompt_token_ids]
            + [(c.index, c.text, c.token_ids, c.finish_reason) for c in output.outputs]
        )
    return seen


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_every_output_kind_streams_as_async_llm_streams_it(kind):
    """The engine's process asks its engine for deltas and the front end adds them
    up: a stream of every output kind is, output by output, what AsyncLLM's in one
    process is, and the token counter counts each token once."""
    args = parse_args(FLAGS)
    params = dict(max_tokens=9, ignore_eos=True, output_kind=kind)
    requests = [
        ("n2", [5, 6, 7], SamplingParams(n=2, seed=3, **params)),
        ("stop", PROMPT, SamplingParams(temperature=0, stop=["e"], **params)),
    ]

    async def in_thread():
        llm = AsyncLLM(build_engine(args)[0], EngineMetrics(MODEL))
        llm.start()
        try:
            return await _every_output(llm, requests), llm.metrics
        finally:
            llm.shutdown()

    core = start(build_engine, args)
    try:
        (expected, ours), got = _run(in_thread()), _run(_every_output(core, requests))
    finally:
        core.shutdown()
    assert got == expected
    assert len(got["n2"]) == (1 if kind == "final_only" else 9)
    name, labels = "minillm:generation_tokens_total", {"model_name": MODEL}
    counted = [o for outs in expected.values() for o in outs[-1:] if kind != "delta"]
    counted += [o for outs in expected.values() for o in outs if kind == "delta"]
    tokens = sum(len(c[2]) for output in counted for c in output[2:])
    assert ours.registry.get_sample_value(name, labels) == tokens
    assert core.metrics.registry.get_sample_value(name, labels) == tokens


def test_an_engine_that_cannot_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="failed to start: FileNotFoundError"):
        EngineCoreClient(build_broken, parse_args(FLAGS))


def test_a_script_starts_the_engine_process_without_running_twice(tmp_path):
    """spawn re-runs the parent's __main__ script in the child unless it is hidden
    (a chapter run as a plain script would start a second engine there)."""
    import os
    import pathlib
    import subprocess
    import sys

    tests = pathlib.Path(__file__).resolve().parent
    marks = tmp_path / "runs.txt"
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        f"open({str(marks)!r}, 'a').write('run\\n')\n"
        "from engine_builders import build_broken\n"
        "from minillm.engine_core import EngineCoreClient\n"
        "from minillm.server import parse_args\n"
        "try:\n"
        f"    EngineCoreClient(build_broken, parse_args({FLAGS!r}))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    root = str(tests.parent)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert "failed to start: FileNotFoundError" in done.stdout, done.stderr[-2000:]
    assert marks.read_text() == "run\n"  # the child did not run the script


def test_the_engine_waits_in_send_only_while_the_front_end_falls_behind():
    """EngineCore.send_wait: the seconds a step's message waited for the socket,
    which fills while the front end reads nothing (the metric of that name)."""
    import socket
    import threading
    import time
    from multiprocessing.connection import Connection

    from minillm.engine_core import EngineCore

    def waited(front_end_late_s: float) -> float:
        engine, _ = build_engine(parse_args(FLAGS))
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        core = EngineCore(engine, Connection(ours.detach()))
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        core.add([(f"r{i}", PROMPT, params) for i in range(16)])
        stepping = threading.Thread(target=lambda: [core.step() for _ in range(24)])
        stepping.start()
        time.sleep(front_end_late_s)  # the front end, busy elsewhere, reads nothing
        front_end = Connection(theirs.detach())
        while stepping.is_alive() or front_end.poll():
            if front_end.poll(0.05):
                front_end.recv_bytes()
        stepping.join()
        return core.send_wait

    assert waited(0.5) > 0.25 and waited(0.0) < 0.1


def test_the_engine_process_reports_its_send_wait(http, live):  # noqa: F811
    name = "minillm:engine_core_send_wait_seconds_total"
    before = metric(http, name)
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert wait_for(lambda: metric(http, name) > before)
