"""The engine (chapter 9) and the LLM API (chapter 10), against transformers and
chapter 1's dense generation.
"""

import dataclasses
import time

import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from hf_models import MODELS, hf_greedy
from helpers import TIGHT, mixed_prompts

from minillm.config import EngineConfig
from minillm.detokenizer import IncrementalDetokenizer
from minillm.engine import LIVE_ENGINES, LLMEngine
from minillm.llm import LLM
from minillm.logprobs import sampled_logprob, top_logprobs
from minillm.model import generate
from minillm.sampling_params import SamplingParams, SamplingParamsError

transformers.logging.set_verbosity_error()
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def all_blocks_free(llm):
    pool = llm.engine.kv_cache_manager.block_pool
    return (
        pool.get_num_free_blocks() == pool.num_blocks
        and not llm.engine.kv_cache_manager.req_to_blocks
    )


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(device="cpu", num_kv_blocks=256, max_num_seqs=16)


# chapter 9's engine under preemption and chunked prefill, on the tiny model
SMALLER = dict(TIGHT, num_kv_blocks=48, max_num_seqs=6, max_num_batched_tokens=20)


@pytest.mark.parametrize("cls, config", MODELS)
def test_greedy_matches_transformers_under_preemption_and_chunked_prefill(
    hf_checkpoint, cls, config
):
    reference, tmp_path = hf_checkpoint(cls, config)
    prompts = mixed_prompts(16, 384)
    llm = LLM(tmp_path, **TIGHT)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # the pool of 160 slots cannot hold 16 sequences of up to 84
    assert llm.engine.num_preemptions > 0
    assert max(len(p) for p in prompts) > 24  # some prompts needed several chunks
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24)
    assert all_blocks_free(llm)


def test_tiny_model_matches_dense_generation(tiny):
    model, tokenizer = tiny
    prompts = [
        tokenizer.encode(t)
        for t in ['The "for" statement', "A", "Exceptions are raised when", "x = 1"]
    ]
    prompts += mixed_prompts(12, tokenizer.vocab_size, seed=1)
    expected = generate(model, prompts, max_new_tokens=24)
    llm = LLM(**SMALLER)
    got = [
        o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)
    ]
    assert got == expected and llm.engine.num_preemptions > 0 and all_blocks_free(llm)


def test_seeded_sampling_is_the_same_under_preemption_and_chunked_prefill(tiny):
    """A seeded request's noise is a function of (seed, position, token): the
    schedule, the chunks and the preemptions around it change nothing."""
    _, tokenizer = tiny
    prompts = mixed_prompts(12, tokenizer.vocab_size, seed=2)
    params = [
        SamplingParams(
            temperature=1.0, top_p=0.95, seed=500 + i, max_tokens=24, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    roomy = LLM(device="cpu", num_kv_blocks=512, block_size=4, max_num_seqs=12)
    tight = LLM(**SMALLER)
    expected, got = (
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for llm in (roomy, tight)
    )
    assert roomy.engine.num_preemptions == 0 < tight.engine.num_preemptions
    assert got == expected and all_blocks_free(tight)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_llm):
    # ignore_eos: two seeds must give two 16-token samples, never two empty ones
    params = SamplingParams(
        temperature=1.0, top_k=50, seed=123, max_tokens=16, ignore_eos=True
    )
    alone = (
        tiny_llm.generate([[0, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    others = [SamplingParams(temperature=0.7, max_tokens=20)] * 5
    crowd = (
        tiny_llm.generate(
            [[7, 8, 9, 10]] * 2 + [[0, 5, 6]] + [[11]] * 3,
            others[:2] + [params] + others[2:],
            use_tqdm=False,
        )[2]
        .outputs[0]
        .token_ids
    )
    assert alone == crowd
    assert (
        tiny_llm.generate(
            [[0, 5, 6]],
            dataclasses.replace(params, seed=124),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        != alone
    )
    assert all_blocks_free(tiny_llm)


def test_max_tokens_and_finish_reason_length(tiny_llm):
    out = tiny_llm.generate(
        "The",
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert (
        len(out.outputs[0].token_ids) == 7
        and out.outputs[0].finish_reason == "length"
        and out.finished
    )


def test_stop_token_id_ends_with_stop_reason(tiny_llm):
    free = tiny_llm.generate(
        "The",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[3]
    out = tiny_llm.generate(
        "The",
        SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_is_cut_and_optionally_kept(tiny_llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = (
        tiny_llm.generate('The "for" statement', base, use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    # four characters from the middle: usually spans a token boundary
    stop = full[10:14]
    cut = tiny_llm.generate(
        'The "for" statement',
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (
        cut.text == full[: full.index(stop)]
        and cut.finish_reason == "stop"
        and cut.stop_reason == stop
    )
    kept = tiny_llm.generate(
        'The "for" statement',
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    eos = tokenizer.eos_token_id
    # Force EOS with allowed_token_ids: only EOS may be sampled.
    engine.add_request(
        "a", "The", SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[eos])
    )
    engine.add_request(
        "b",
        "The",
        SamplingParams(
            temperature=0, max_tokens=5, allowed_token_ids=[eos], ignore_eos=True
        ),
    )
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert (
        done["a"].token_ids == [eos]
        and done["a"].finish_reason == "stop"
        and done["a"].text == ""
    )
    assert done["b"].token_ids == [eos] * 5 and done["b"].finish_reason == "length"


def test_min_tokens_holds_eos_back(tiny):
    model, tokenizer = tiny
    llm_engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    eos = tokenizer.eos_token_id
    llm_engine.add_request(
        "a",
        "The",
        SamplingParams(
            temperature=0, max_tokens=10, min_tokens=4, allowed_token_ids=[eos, 5]
        ),
    )
    while llm_engine.has_unfinished_requests():
        outs = llm_engine.step()
    tokens = outs[0].outputs[0].token_ids
    assert tokens[:4] == [5] * 4 and eos not in tokens[:4]


def test_n_completions_are_indexed_and_seeded_distinctly(tiny_llm):
    out = tiny_llm.generate(
        "A",
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, logprobs=2),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(
            len(top_logprobs(pos, 2)) == 2 and next(iter(pos)) == t
            for pos, t in zip(c.logprobs, c.token_ids)
        )
        assert c.cumulative_logprob == pytest.approx(
            sum(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids))
        )


def run_steps(engine, prompt, params) -> list:
    """Every completion of every step's outputs, its deltas put together."""
    engine.add_request("r", prompt, params)
    seen, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens, text, lps = seen.get(c.index, ([], "", []))
                if params.output_kind == "delta":
                    c.token_ids, c.text = tokens + c.token_ids, text + c.text
                    c.logprobs = lps + c.logprobs
                seen[c.index] = (c.token_ids, c.text, c.logprobs)
                logprobs = [sampled_logprob(pos) for pos in c.logprobs]
                steps.append((c.index, c.token_ids, c.text, c.finish_reason))
                steps.append((logprobs, c.cumulative_logprob, out.finished))
    return steps


@pytest.mark.parametrize("with_stop", [False, True])
def test_delta_outputs_add_up_to_the_cumulative_ones(tiny, with_stop):
    """output_kind="delta": each output holds only what is new; put together, the
    deltas of every completion (tokens, text with a held-back stop string,
    logprobs) are its cumulative output, step by step."""
    model, tokenizer = tiny
    prompt, config = 'The "for" statement', EngineConfig(num_kv_blocks=128)
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=30, logprobs=1, ignore_eos=True
    )
    if with_stop:  # four characters first seen in the second half of a completion
        text = run_steps(LLMEngine(model, tokenizer, config), prompt, params)[-4][2]
        late = [i for i in range(len(text) // 2, len(text) - 3)
                if text.find(text[i : i + 4]) == i]  # fmt: skip
        assert late, f"no four characters first seen late in {text!r}"
        params = dataclasses.replace(params, stop=[text[late[0] : late[0] + 4]])
    cumulative = run_steps(LLMEngine(model, tokenizer, config), prompt, params)
    delta = dataclasses.replace(params, output_kind="delta")
    assert run_steps(LLMEngine(model, tokenizer, config), prompt, delta) == cumulative
    assert len(cumulative) > 10  # outputs step by step, not one at the end


def test_abort_frees_blocks_at_once(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    engine.add_request(
        "long", "The", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    engine.step()
    engine.step()
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < 64
    engine.abort_request("long")
    assert pool.get_num_free_blocks() == 64 and not engine.has_unfinished_requests()
    assert engine.step() == []


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([5, 10**6], SamplingParams(), "prompt token ids"),
        ("The", SamplingParams(max_tokens=10**6), "max_tokens"),
        ([1] * 5000, SamplingParams(), "context"),
        ("The", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_requests_raise_and_change_nothing(tiny, prompt, params, message):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256))
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, params)
    assert (
        not engine.has_unfinished_requests()
        and not engine.output_processor.parents
        and not engine.output_processor.request_states
    )
    engine.add_request("x", "The", SamplingParams(max_tokens=2))  # the id is still free
    assert engine.has_unfinished_requests()


def test_invalid_sampling_params_are_value_errors():
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)


def test_a_bad_prompt_in_a_batch_submits_nothing(tiny_llm):
    with pytest.raises(ValueError):
        tiny_llm.generate([[5, 6], []], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests() and all_blocks_free(tiny_llm)


class SteppedClock:
    """A fake time.monotonic: it stands still within an engine step and the test moves
    it on by STEP before each step, so every timestamp tells which step stamped it.
    """

    STEP = 0.5

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_request_metrics_follow_a_controlled_clock(tiny, monkeypatch):
    clock = SteppedClock()
    monkeypatch.setattr(time, "monotonic", clock)
    model, tokenizer = tiny
    # one sequence at a time: b queues behind a until a finishes
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_num_seqs=1))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)  # arrives now: 100.0
    clock.now += 0.25
    engine.add_request("b", [8, 9], params, arrival_time=100.125)  # not now: 100.25
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        clock.now += SteppedClock.STEP
        steps += 1
        for out in engine.step():
            assert out.metrics.last_token_time == clock.now  # a token came this step
            if out.finished:
                finished[out.request_id] = (out, steps, clock.now)
            else:
                assert out.metrics.finished_time is None
    step, start = SteppedClock.STEP, 100.25  # step k runs at start + k * step
    assert steps == 8  # 4 tokens each, one request per step
    for rid, arrival, first_step in (("a", 100.0, 1), ("b", 100.125, 5)):
        out, done_step, done_at = finished[rid]
        m, completion = out.metrics, out.outputs[0]
        assert m.arrival_time == arrival and done_step == first_step + 3
        # a prompt that fits one step is scheduled and sampled in that step
        first = start + first_step * step
        assert m.first_scheduled_time == m.first_token_time == first
        assert m.time_to_first_token == m.first_token_time - m.arrival_time
        assert m.queue_time == m.first_scheduled_time - m.arrival_time
        assert m.last_token_time == m.finished_time == done_at == first + 3 * step
        assert completion.time_per_output_token == (
            (m.last_token_time - m.first_token_time) / (len(completion.token_ids) - 1)
        )
        assert completion.time_per_output_token == step
    a, b = finished["a"][0].metrics, finished["b"][0].metrics
    assert a.time_to_first_token == a.queue_time == 0.25 + step
    # b waited out all four of a's steps before its first
    assert b.queue_time == b.time_to_first_token == 0.125 + 5 * step
    assert b.queue_time >= 4 * step and b.first_scheduled_time > a.finished_time


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_incremental_detokenization_never_emits_broken_characters(tiny, text):
    _, tokenizer = tiny
    ids = tokenizer.encode(text, add_special_tokens=False)
    # special tokens kept: a text may spell one ("<|end_of_text|>"), which encodes to
    # the token itself
    detok = IncrementalDetokenizer(
        tokenizer, [tokenizer.bos_token_id], SamplingParams(skip_special_tokens=False)
    )
    shown = ""
    for i in ids:
        detok.update([i])
        new = detok.text(finished=False)
        assert new.startswith(shown)  # shown text is never taken back
        # and never holds half a character
        assert "\ufffd" not in new or "\ufffd" in text
        shown = new
    assert detok.text(finished=True) == text


@pytest.mark.parametrize(
    "first, second",
    [
        (("0_x", 1), ("x", 2)),  # a child of the new request collides with a request
        (("x", 2), ("0_x", 1)),  # the new request collides with a child
        (("x", 2), ("x", 3)),  # the parent id itself
    ],
)
def test_a_colliding_request_id_is_refused_and_changes_nothing(first, second):
    llm = LLM(device="cpu", num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(first[0], [5, 6, 7], dataclasses.replace(params, n=first[1]))
    op = engine.output_processor
    before = (dict(op.parents), dict(op.request_states))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(second[0], [8, 9], dataclasses.replace(params, n=second[1]))
    assert (dict(op.parents), dict(op.request_states)) == before
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = [o for o in outputs if o.finished]
    assert [o.request_id for o in finished] == [first[0]]
    assert all(len(c.token_ids) == 3 for c in finished[0].outputs)
    assert all_blocks_free(llm)


def test_shutdown_gives_the_cache_back_and_refuses_new_work():
    llm = LLM(device="cpu", num_kv_blocks=32, max_num_seqs=4)
    engine = llm.engine
    cache = engine.kv_cache.key_cache  # a name that outlives the engine's use of it
    assert engine.kv_cache_bytes() > 0 and engine in LIVE_ENGINES
    engine.add_request("left", [1, 2, 3], GREEDY)  # unfinished when shut down
    llm.shutdown()
    assert cache.untyped_storage().nbytes() == 0  # freed although still referenced
    assert engine.kv_cache_bytes() == 0 and engine not in LIVE_ENGINES
    assert not engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("The", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    llm.shutdown()  # idempotent


def test_an_llm_used_as_a_context_manager_shuts_down_on_exit():
    with LLM(device="cpu", num_kv_blocks=32, max_num_seqs=4) as llm:
        out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert llm.engine.is_shut_down and llm.engine.kv_cache_bytes() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles a GPU's memory")
def test_a_new_engine_on_a_full_gpu_names_the_live_one_and_fits_after_shutdown():
    first = LLM(max_num_seqs=16)  # sizes its cache to fill the device
    with pytest.raises(ValueError, match=f"LLMEngine at {id(first.engine):#x}"):
        LLM(max_num_seqs=16)
    first.shutdown()
    second = LLM(max_num_seqs=16)  # the memory came back
    out = second.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    del second  # and dropping every name does it too
    third = LLM(max_num_seqs=16)
    third.shutdown()
