"""Checks for chapter 7's exercises (chapters/07_engine.md, "Exercises")."""

import math

import torch
from _check import answer

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.kv_cache_manager import KVCacheManager
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = 'The "for" statement'


def test_prompt_logprobs(tiny):
    """7.1: the logprob of every prompt token after the first, given those before."""
    model, tokenizer = tiny
    prompt_logprobs = answer(LLMEngine, "prompt_logprobs", "7.1")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=4))
    ids = tokenizer.encode('The "while" statement repeats a block of code')
    got = torch.tensor(prompt_logprobs(engine, ids), dtype=torch.float32)
    with torch.no_grad():  # chapter 1's dense forward on the same tokens
        logits = model.compute_logits(
            model(torch.tensor([ids]), torch.arange(len(ids))[None])
        )
    expected = torch.log_softmax(logits[0, :-1].float(), -1)[
        torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    ]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    pool = engine.kv_cache_manager.block_pool
    assert not engine.has_unfinished_requests()
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_stream(tiny):
    """7.2: LLM.stream yields text deltas that add up to the non-streamed text."""
    answer(LLM, "stream", "7.2")
    llm = LLM(device="cpu", dtype=torch.float32, num_kv_blocks=64)
    full = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    deltas = list(llm.stream(PROMPT, GREEDY))
    assert all(isinstance(d, str) for d in deltas) and "".join(deltas) == full
    words = full.split()
    if len(words) > 2:  # a stop string from the model's own text
        stop = words[len(words) // 2]
        params = SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]
        )
        expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
        shown = ""
        for delta in llm.stream(PROMPT, params):
            shown += delta
            assert expected.startswith(shown), "a delta showed text taken back later"
        assert shown == expected == full[: full.index(stop)]


def test_delta_outputs(tiny):
    """7.3: output_kind="delta": each output holds what is new since the last."""
    try:
        delta = SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, n=2, output_kind="delta"
        )
    except ValueError:
        import pytest

        pytest.skip("exercise 7.3: output_kind='delta' is not accepted yet")
    model, tokenizer = tiny
    finals = {}
    for kind, params in [("final", None), ("delta", delta)]:
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
        for rid, prompt in [("a", PROMPT), ("b", "A class")]:
            p = params or SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, n=2
            )
            engine.add_request(rid, prompt, p)
        tokens, texts = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    key = (out.request_id, c.index)
                    if kind == "delta":
                        tokens[key] = tokens.get(key, []) + c.token_ids
                        texts[key] = texts.get(key, "") + c.text
                    else:
                        tokens[key], texts[key] = c.token_ids, c.text
        finals[kind] = (tokens, texts)
    assert finals["delta"] == finals["final"]


def test_counting_kv_cache_manager(tiny):
    """7.4: a KV-cache manager registered as "counting" counts its blocks."""
    from minillm.registry import KV_CACHE_MANAGERS, load_plugins

    load_plugins()
    answer(KV_CACHE_MANAGERS.parts, "get", "7.4")  # a dict: always there
    if "counting" not in KV_CACHE_MANAGERS.parts:
        import pytest

        pytest.skip("exercise 7.4: no KV-cache manager registered as 'counting'")
    llm = LLM(
        device="cpu",
        dtype=torch.float32,
        num_kv_blocks=64,
        block_size=4,
        prefix_cache_impl="counting",
    )
    manager = llm.engine.kv_cache_manager
    assert isinstance(manager, KVCacheManager)
    prompts = [PROMPT, "A class is", "x"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions == 0
    # every token but the last sampled one has its keys and values in the cache
    ids = [llm.tokenizer.encode(p) for p in prompts]
    needed = sum(math.ceil((len(p) + params.max_tokens - 1) / 4) for p in ids)
    assert manager.num_allocated_blocks == needed
