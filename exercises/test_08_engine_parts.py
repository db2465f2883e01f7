"""Checks for chapter 8's exercises (chapters/08_engine_parts.md, "Exercises")."""

import pytest
from _check import answer

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.registry import KV_CACHE_MANAGERS, OPTIONS, SAMPLERS, Registry
from minillm.registry import load_plugins
from minillm.sampling_params import SamplingParams


def run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_max_prompt_tokens(tiny):
    """7.1: an option of one's own, checked, and a request check that reads it."""
    load_plugins()
    if "max_prompt_tokens" not in OPTIONS:
        pytest.skip("exercise 8.1: no option max_prompt_tokens declared yet")
    assert OPTIONS["max_prompt_tokens"] is None  # no limit unless asked
    for bad in (0, -1, 2.5, "8", True):
        with pytest.raises(ValueError, match="max_prompt_tokens"):
            EngineConfig(max_prompt_tokens=bad)
    model, tokenizer = tiny
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    config = EngineConfig(num_kv_blocks=64, max_prompt_tokens=8)
    engine = LLMEngine(model, tokenizer, config)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.add_request("a", list(range(1, 10)), params)  # 9 tokens
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("a", list(range(1, 9)), params)  # 8; the id is free again
    final = run(engine)[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 2
    unlimited = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    unlimited.add_request("b", list(range(1, 13)), params)  # the default: no limit
    assert run(unlimited)[-1].finished


def test_suggest():
    """7.2: a mistyped part's name gets a suggestion, as a mistyped keyword does."""
    answer(Registry, "suggest", "8.2")
    load_plugins()
    assert KV_CACHE_MANAGERS.suggest("hsh") == "hash"
    assert KV_CACHE_MANAGERS.suggest("radx") == "radix"
    assert SAMPLERS.suggest("zzzzzz") is None
    with pytest.raises(ValueError, match=r"did you mean 'hash'\?"):
        EngineConfig(prefix_cache_impl="hsh")
    with pytest.raises(ValueError, match="no sampler of that name") as refused:
        EngineConfig(sampler="zzzzzz")
    assert "did you mean" not in str(refused.value)
    EngineConfig(prefix_cache_impl="hash")  # a right name is still right
