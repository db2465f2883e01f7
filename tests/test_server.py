"""The OpenAI-compatible server (chapter 27), end to end: a live server on 127.0.0.1,
the official client.
"""

import json

import openai
import pytest
from helpers import MODEL, metric, openai_client, wait_for

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.model import generate
from minillm.server import ServerThread, create_app

try:
    import httpx
# recent openai releases ship their HTTP library as httpx2, with the same API
except ImportError:
    import httpx2 as httpx

PROMPT = 'The "for" statement'
MESSAGES = [{"role": "user", "content": "What does the while statement do?"}]


@pytest.fixture(scope="module")
def client(live):
    return openai_client(live)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def completion(client, **kwargs):
    """The served model's completion of PROMPT (or of kwargs' prompt)."""
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, **kwargs})


def chat_completion(client, **kwargs):
    """The served model's reply to MESSAGES (or to kwargs' messages)."""
    return client.chat.completions.create(
        **{"model": MODEL, "messages": MESSAGES, **kwargs}
    )


# --- completions and chat
# ---------------------------------------------------------------------


def test_greedy_stream_joins_to_the_non_streamed_text(client):
    full = completion(client, max_tokens=30, temperature=0)
    chunks = list(completion(client, max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert (
        reasons == [full.choices[0].finish_reason]
        and chunks[-1].choices[0].finish_reason is not None
    )


def test_chat_stream_joins_to_the_non_streamed_message(client):
    kwargs = dict(max_tokens=25, temperature=0, extra_body={"ignore_eos": True})
    full = chat_completion(client, **kwargs)
    chunks = list(chat_completion(client, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == full.choices[0].message.content
    )
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason
    ] == ["length"]
    assert (
        full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    )


def test_usage_counts_are_exact(client, http):
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = completion(
        client,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert (
        out.usage.completion_tokens == 7
        and out.usage.total_tokens == len(prompt_ids) + 7
    )
    chat_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    chat = chat_completion(
        client,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        len(chat_ids),
        5,
    )


def test_include_usage_adds_a_final_chunk_with_empty_choices(client):
    chunks = list(
        completion(
            client,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(
        chat_completion(
            client,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        chat[-1].choices == []
        and chat[-1].usage.total_tokens
        == chat[-1].usage.prompt_tokens + chat[-1].usage.completion_tokens
    )


def test_n_gives_indexed_choices_and_prompts_lists_are_numbered(client):
    out = completion(
        client,
        n=3,
        max_tokens=5,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert (
        sorted(c.index for c in out.choices) == [0, 1, 2]
        and out.usage.completion_tokens == 15
    )
    two = client.completions.create(
        model=MODEL, prompt=["a", "b"], n=2, max_tokens=3, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    ids = client.completions.create(
        model=MODEL, prompt=[[264, 77], [326]], max_tokens=2, temperature=0
    )
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 3
    streamed = list(completion(client, n=3, max_tokens=5, stream=True))
    finishes = [c.choices[0].index for c in streamed if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]  # each choice finishes exactly once
    chat = chat_completion(client, n=3, max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_stop_string_and_max_tokens_set_the_finish_reason(client):
    greedy = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**greedy).choices[0].text
    # a stop string the model is sure to produce: a word from its own continuation
    words = full.split()
    stop = words[len(words) // 2] if words else full[-2:]
    out = client.completions.create(stop=[stop], **greedy)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].model_extra.get("stop_reason") == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **greedy))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    capped = completion(
        client,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (
        capped.choices[0].finish_reason == "length"
        and capped.usage.completion_tokens == 3
    )
    chat = chat_completion(
        client,
        max_completion_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert (
        chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2
    )


def test_stop_token_ids_and_min_tokens(client, http, tiny):
    # the server's greedy tokens, computed without it (chapter 1's generate)
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    greedy_ids = generate(tiny[0], [prompt_ids], max_new_tokens=10)[0]
    stop_token = greedy_ids[2]
    out = completion(
        client,
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [stop_token], "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra.get("stop_reason") == stop_token
    assert out.usage.completion_tokens == greedy_ids.index(stop_token) + 1
    long = completion(
        client,
        max_tokens=12,
        temperature=0,
        extra_body={"min_tokens": 12},
    )
    assert long.usage.completion_tokens == 12


def test_completion_logprobs_shape(client):
    out = completion(
        client,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == 6
    )
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert (
            logprob <= 0 and 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        )
        # greedy: the chosen token is the most likely
        assert max(top.values()) == pytest.approx(logprob)
    streamed = list(
        completion(
            client,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [
        o for c in streamed for o in c.choices[0].logprobs.text_offset
    ] == lp.text_offset
    stopped = [
        c
        for c in completion(
            client,
            max_tokens=12,
            temperature=0,
            logprobs=1,
            stream=True,
            stop=["zzz-never"],
            extra_body={"ignore_eos": True},
        )
    ]
    offsets = [o for c in stopped for o in c.choices[0].logprobs.text_offset]
    # hold-back for the stop string changes nothing
    assert len(offsets) == 12 and offsets[:6] == lp.text_offset


def test_chat_logprobs_shape(client):
    out = chat_completion(
        client,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert (
        len(content) == 5
        and "".join(c.token for c in content) == out.choices[0].message.content
    )
    for c in content:
        assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
    plain = chat_completion(client, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_seed_reproduces_a_sampled_output(client):
    def sample(seed):
        return (
            completion(
                client,
                max_tokens=20,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 50, "ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_vllm_extra_sampling_fields_are_accepted(client):
    out = completion(
        client,
        max_tokens=8,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "include_stop_str_in_output": True,
            "skip_special_tokens": True,
            "ignore_eos": True,  # so that the count is known: max_tokens
        },
    )
    assert out.usage.completion_tokens == 8
    # ...and they reach the engine's SamplingParams rather than being dropped as unknown
    # fields
    from minillm.protocol import CompletionRequest

    params = CompletionRequest(
        model=MODEL,
        prompt=PROMPT,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.2,
        min_tokens=2,
        include_stop_str_in_output=True,
        ignore_eos=True,
        stop_token_ids=[5],
    ).to_sampling_params()
    assert (
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.min_tokens,
    ) == (20, 0.05, 1.2, 2)
    assert (
        params.include_stop_str_in_output
        and params.ignore_eos
        and params.stop_token_ids == [5]
    )
    # and change what comes out: top_k=1 at temperature 1 is greedy
    greedy = completion(client, max_tokens=8, temperature=0).choices[0].text
    top1 = (
        completion(
            client,
            max_tokens=8,
            temperature=1.0,
            seed=3,
            extra_body={"top_k": 1},
        )
        .choices[0]
        .text
    )
    assert top1 == greedy


# --- errors
# ----------------------------------------------------------------------------------

BAD_REQUESTS = [
    (
        "negative temperature",
        "/v1/completions",
        {"prompt": "x", "temperature": -1},
        400,
        "temperature",
    ),
    (
        "top_p out of range",
        "/v1/completions",
        {"prompt": "x", "top_p": 1.5},
        400,
        "top_p",
    ),
    (
        "unknown model",
        "/v1/completions",
        {"model": "gpt-5", "prompt": "x"},
        404,
        "model",
    ),
    ("prompt too long", "/v1/completions", {"prompt": "word " * 1000}, 400, None),
    (
        "max_tokens too large",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 10_000},
        400,
        None,
    ),
    (
        "wrong type",
        "/v1/completions",
        {"prompt": "x", "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        {"prompt": [10**9]},
        400,
        None,
    ),
    (
        "response_format",
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "logprobs too many",
        "/v1/completions",
        {"prompt": "x", "logprobs": 50},
        400,
        "logprobs",
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "gpt-5", "messages": MESSAGES},
        404,
        "model",
    ),
    (
        "chat response_format",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {}},
        },
        400,
        "response_format",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": MESSAGES, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "image content",
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                }
            ]
        },
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(
    "name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_openai_errors(http, name, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    if param is not None:
        assert error["param"] == param


def test_malformed_json_is_a_400(http):
    r = http.post(
        "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert (
        r.json()["error"]["param"] is None
        and "not valid JSON" in r.json()["error"]["message"]
    )


def test_the_client_raises_its_usual_errors_and_the_server_keeps_serving(client, live):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert (
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 2
    )
    assert wait_for(lambda: not live.engine.has_unfinished_requests())


def test_an_engine_failure_is_a_500_and_the_server_recovers(http, live):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    live.engine.step = broken  # the engine thread's next step raises
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        stream = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True}
        )
    finally:
        del live.engine.step  # the class's step again
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert r.json()["error"]["code"] == 500
    events = [line for line in stream.text.splitlines() if line]
    assert '"InternalServerError"' in events[-2] and events[-1] == "data: [DONE]"
    ok = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert wait_for(lambda: live.engine.kv_cache_manager.usage == 0)


# --- disconnects
# -----------------------------------------------------------------------------


def disconnect_mid_stream(http):
    """Leave a long stream after 6 lines, while it runs and holds blocks: the gauges
    fall back to 0 (with an engine process, they come from its answer to the abort)
    and one more request finished as "abort"."""
    aborted = metric(http, "minillm:request_success_total", finished_reason="abort")
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(http, "minillm:num_requests_running") == 1
        assert metric(http, "minillm:kv_cache_usage_perc") > 0
    assert wait_for(
        lambda: (
            metric(http, "minillm:kv_cache_usage_perc") == 0
            and metric(http, "minillm:num_requests_running") == 0
        )
    )
    after = metric(http, "minillm:request_success_total", finished_reason="abort")
    assert after == aborted + 1


def test_a_client_disconnect_mid_stream_aborts_and_frees_blocks(http, live):
    engine = live.engine
    disconnect_mid_stream(http)
    assert wait_for(
        lambda: (
            not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0
        )
    )


def test_a_client_disconnect_without_streaming_aborts_too(live, http):
    engine = live.engine
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            live.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 450, "ignore_eos": True},
            timeout=0.3,
        )
    assert wait_for(
        lambda: (
            metric(http, "minillm:num_requests_running") == 0
            and not engine.has_unfinished_requests()
        )
    )
    assert engine.kv_cache_manager.usage == 0


# --- the other endpoints
# ---------------------------------------------------------------------


def test_models_health_and_openapi(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").status_code == 200
    spec = http.get("/openapi.json").json()
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
    ]:
        assert path in spec["paths"]
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_tokenize_and_detokenize_round_trip(http):
    text = "naïve café — 東京 🚀"
    tokens = http.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert (
        http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        == text
    )
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": chat}).json()["prompt"]
    assert rendered.endswith("user: What does the while statement do?\nassistant:")
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400


def test_metrics_expose_the_named_metrics_with_the_model_label(client, http):
    completion(client, max_tokens=4, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    names = [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
    ]
    for name in names:
        lines = [
            line for line in text.splitlines() if line.startswith(f"minillm:{name}")
        ]
        assert lines, name
        assert all(f'model_name="{MODEL}"' in line for line in lines), name
    assert metric(http, "minillm:time_to_first_token_seconds_count") >= 1
    assert metric(http, "minillm:generation_tokens_total") >= 4
    assert metric(http, "minillm:request_success_total", finished_reason="length") >= 1
    assert metric(http, "minillm:prefix_cache_hits_total") == 0


def test_two_servers_in_one_process_have_their_own_metrics(tiny):
    model, tokenizer = tiny
    apps = [
        create_app(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=32)), name)
        for name in ("a", "b")
    ]
    with ServerThread(apps[0]) as a, ServerThread(apps[1]) as b:
        httpx.post(
            a.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "ignore_eos": True},
        )
        assert 'model_name="a"' in httpx.get(a.url + "/metrics").text
        text_b = httpx.get(b.url + "/metrics").text
        assert (
            'model_name="a"' not in text_b
            and 'minillm:generation_tokens_total{model_name="b"} 0.0' in text_b
        )


def test_concurrent_requests_are_batched_and_match_sequential_ones(client, live):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [
        f'The "{kw}" statement'
        for kw in ["if", "try", "with", "del", "pass", "return", "class", "def"]
    ]

    def run(p):
        return (
            client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    one_by_one = [run(p) for p in prompts]
    steps_before = live.engine.num_steps
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert together == one_by_one
    assert live.engine.num_steps - steps_before < 8 * 12  # they shared steps


def test_cli_help_lists_the_flags(capsys):
    from minillm.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in [
        "--host",
        "--port",
        "--model",
        "--max-model-len",
        "--num-kv-blocks",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--served-model-name",
        "--prefix-cache-impl",
        "--attention-backend",
        "--enforce-eager",
    ]:
        assert flag in out
    assert json.dumps(vars(parse_args(["--port", "9000"])))  # plain values


def test_cli_flags_reach_the_engine_config(tiny, fast_path):
    from minillm.server import build_engine, parse_args

    engine, name = build_engine(
        parse_args(
            ["--prefix-cache-impl", "hash", "--num-kv-blocks", "64", "--device", "cpu"]
        )
    )
    assert (
        engine.config.prefix_cache_impl == "hash"
        and engine.kv_cache_manager.num_blocks == 64
    )
    assert name == "minillm-tiny"
    # "auto" on a CPU
    path = fast_path(engine)
    assert path["attention_backend"] == "torch" and not path["cuda_graphs"]
    eager, _ = build_engine(
        parse_args(["--enforce-eager", "--num-kv-blocks", "64", "--device", "cpu"])
    )
    assert eager.config.cuda_graphs is False and eager.config.torch_compile is False


def test_prefix_cache_counters_follow_the_kv_cache_manager(tiny):
    from minillm.metrics import EngineMetrics
    from minillm.sampling_params import SamplingParams

    model, tokenizer = tiny
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(num_kv_blocks=64, block_size=4, prefix_cache_impl="hash"),
    )
    metrics = EngineMetrics("m")
    prompt = "The for statement is used to iterate over the elements of a sequence"
    for i in range(2):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            metrics.record_step(engine.step(), engine)
    value = metrics.registry.get_sample_value
    queries = value("minillm:prefix_cache_queries_total", {"model_name": "m"})
    hits = value("minillm:prefix_cache_hits_total", {"model_name": "m"})
    assert queries == engine.kv_cache_manager.prefix_cache_queries > 0
    assert 0 < hits == engine.kv_cache_manager.prefix_cache_hits <= queries


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] "
    "}}<|im_end|>\n{% endfor %}{% if add_generation_prompt "
    "%}<|im_start|>assistant\n{% endif %}"
)


def test_a_model_chat_template_is_rendered_with_jinja(tiny):
    from minillm.protocol import ChatMessage, InvalidRequestError
    from minillm.server import OpenAIServer

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16))
    server = OpenAIServer(engine, "m", chat_template=CHATML)
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(
            role="user",
            content=[
                {"type": "text", "text": "Hi "},
                {"type": "text", "text": "there"},
            ],
        ),
    ]
    text = tokenizer.decode(server.render_chat(messages), skip_special_tokens=False)
    assert (
        text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi "
        "there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    strict = OpenAIServer(
        engine, "m", chat_template="{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.render_chat(messages)


def test_response_format_text_is_accepted(http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 2,
            "ignore_eos": True,
            "response_format": {"type": "text"},
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_outputs_validate(client, stream):
    """Chapter 24 through the server: every choice validates against the schema."""
    import jsonschema

    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        n=2,
        seed=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        },
    )
    if stream:
        texts = ["", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        reply = client.chat.completions.create(**kwargs)
        texts = [c.message.content for c in reply.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completion_json_object_and_structured_outputs(client):
    reply = completion(
        client,
        max_tokens=30,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(reply.choices[0].text), dict)
    reply = completion(
        client,
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "integer", "multipleOf": 3},
                },
            },
            "multipleOf",
        ),  # fmt: skip
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "required": 5},
                },
            },
            "required",
        ),  # fmt: skip
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "yaml"}, "yaml"),
    ],
)
def test_bad_schema_is_an_openai_400(client, live, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat_completion(client, max_tokens=4, response_format=body)
    err = e.value.response.json()["error"]
    assert err["param"] == "response_format" and words in err["message"]
    assert e.value.status_code == 400


def test_a_token_whose_text_is_not_whole_yet_is_streamed_as_an_empty_piece():
    """The first token of a streamed choice is sent when it arrives, even when it
    holds only the first bytes of a character (no text yet), as vLLM sends it: a
    client's time to first token must not wait for the next token."""
    from minillm.outputs import CompletionOutput, RequestOutput
    from minillm.serving import OpenAIServing

    serving = OpenAIServing.__new__(OpenAIServing)  # _new_pieces reads no state
    states = {}

    def pieces(text, tokens, finish=None):
        out = RequestOutput("r", "p", [1], [CompletionOutput(0, text, tokens, finish)],
                            finish is not None)  # fmt: skip
        return list(serving._new_pieces(out, states, 0))

    first = pieces("", [7])  # a token, no text yet
    assert [p.text for p in first] == [""]
    assert pieces("", [7]) == []  # nothing new: nothing sent
    assert [p.text for p in pieces("é", [7, 8])] == ["é"]
    last = pieces("é", [7, 8], finish="length")
    assert [(p.text, p.finish_reason) for p in last] == [("", "length")]
