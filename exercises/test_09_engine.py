"""Checks for chapter 9's exercises (chapters/09_engine.md, "Exercises")."""

import math

import torch
from _check import answer

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.kv_cache_manager import KVCacheManager
from minillm.sampling_params import SamplingParams

PROMPT = 'The "for" statement'


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list:
    """Each prompt's final output, in order: the engine driven by hand."""
    ids = [f"check-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[i] for i in ids]


def test_prompt_logprobs(tiny):
    """7.1: the logprob of every prompt token after the first, given those before."""
    model, tokenizer = tiny
    prompt_logprobs = answer(LLMEngine, "prompt_logprobs", "9.1")
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


def test_best_of(tiny):
    """7.2: n=1, best_of=3 returns the best of the completions n=3 samples."""
    import pytest

    def params(**kw):
        return SamplingParams(temperature=1.0, max_tokens=10, seed=7, logprobs=0, **kw)

    try:
        best_of = params(n=1, best_of=3)
    except TypeError:
        pytest.skip("exercise 9.2: SamplingParams has no best_of yet")
    with pytest.raises(ValueError):
        params(n=3, best_of=2)  # fewer than n to choose from
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    prompts = [PROMPT, "A class", "def main", "The list"]  # a lucky guess: 1 in 81
    outputs = zip(run(engine, prompts, params(n=3)), run(engine, prompts, best_of))
    for every, best in outputs:
        assert len(every.outputs) == 3 and len(best.outputs) == 1
        top = max(every.outputs, key=lambda c: c.cumulative_logprob)
        assert best.outputs[0].token_ids == top.token_ids
        assert best.outputs[0].cumulative_logprob == top.cumulative_logprob


def test_counting_kv_cache_manager(tiny):
    """7.3: a KV-cache manager registered as "counting" counts its blocks."""
    from minillm.registry import KV_CACHE_MANAGERS, load_plugins

    load_plugins()
    answer(KV_CACHE_MANAGERS.parts, "get", "9.3")  # a dict: always there
    if "counting" not in KV_CACHE_MANAGERS.parts:
        import pytest

        pytest.skip("exercise 9.3: no KV-cache manager registered as 'counting'")
    model, tokenizer = tiny
    config = EngineConfig(num_kv_blocks=64, block_size=4, prefix_cache_impl="counting")
    engine = LLMEngine(model, tokenizer, config)
    manager = engine.kv_cache_manager
    assert isinstance(manager, KVCacheManager)
    prompts = [PROMPT, "A class is", "x"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    run(engine, prompts, params)
    assert engine.num_preemptions == 0
    # every token but the last sampled one has its keys and values in the cache
    ids = [tokenizer.encode(p) for p in prompts]
    needed = sum(math.ceil((len(p) + params.max_tokens - 1) / 4) for p in ids)
    assert manager.num_allocated_blocks == needed
