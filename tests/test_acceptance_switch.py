"""Chapter 21's AcceptanceSwitch: a request whose proposing steps accept too little
stops asking for proposals for a pause that doubles, and the tokens never change.

The engine tests replace the n-gram proposer's lookup with proposers whose acceptance
is known whatever the weights: one that finds nothing (accepts 0) and an oracle that
proposes the target's own greedy continuation (accepts every draft).
"""

from types import SimpleNamespace

import pytest
import torch

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.speculative.runner import AcceptanceSwitch, SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def request(rid="a", num_output=0):
    return SimpleNamespace(request_id=rid, num_output_tokens=num_output)


def test_four_steps_that_accept_too_little_pause_16_then_32_then_64_tokens():
    switch = AcceptanceSwitch(0.5)
    r = request()
    for pause in (16, 32, 64):
        for accepted in (1, 0, 0, 0):  # 1/4 < 0.5: the fourth step decides
            assert switch.allows(r)
            switch.record(r, accepted, 1)
            r.num_output_tokens += 1
        assert not switch.allows(r)
        r.num_output_tokens += pause - 1
        assert not switch.allows(r)
        r.num_output_tokens += 1
        assert switch.allows(r)
    assert switch.num_pauses == 3


def test_a_window_that_pays_resets_the_pause_and_the_window_slides():
    switch = AcceptanceSwitch(0.5)
    r = request()
    for accepted in (0, 0, 0, 0):
        switch.record(r, accepted, 1)
    r.num_output_tokens = switch.paused["a"][0]
    for accepted in (2, 0, 0, 0, 3):  # 2/4 pays; then 0, 0, 0, 3 pays too
        switch.record(r, accepted, 1)
        r.num_output_tokens += 1
        assert switch.allows(r)
    assert "a" not in switch.paused and switch.num_pauses == 1  # the next pause: 16
    for accepted in (0, 0, 0, 0):  # 3, 0, 0, 0 pays; 0, 0, 0, 0: paused for 16
        switch.record(r, accepted, 1)
    assert not switch.allows(r) and switch.paused["a"][0] - r.num_output_tokens == 17
    switch.forget("a")
    assert switch.allows(r) and not switch.tries and not switch.paused


def test_the_threshold_is_checked():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig.from_dict(spec).disable_by_acceptance is None  # off
    for bad in (-0.1, 3.5):
        with pytest.raises(ValueError, match="disable_by_acceptance"):
            SpeculativeConfig.from_dict({**spec, "disable_by_acceptance": bad})
    off = SpeculativeConfig.from_dict({**spec, "disable_by_acceptance": None})
    assert off.disable_by_acceptance is None


def run(tiny, prompts, propose, threshold, **options):
    """Greedy outputs, proposer calls and the engine, with propose(context, k)."""
    model, tokenizer = tiny
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    spec["disable_by_acceptance"] = threshold
    config = EngineConfig(num_kv_blocks=128, speculative_config=spec, **options)
    engine = LLMEngine(model, tokenizer, config)
    calls = []

    def counted(context, k):
        calls.append(k)
        return propose(context, k)

    engine.model_runner.proposer.propose = counted
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))], calls, engine


def test_a_proposer_that_finds_nothing_is_asked_less_and_tokens_stay(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 2000, (n,), generator=g).tolist() for n in (5, 30)]
    tokens, calls, engine = run(tiny, prompts, lambda c, k: [], None)
    paused, paused_calls, paused_engine = run(tiny, prompts, lambda c, k: [], 0.5)
    assert paused == tokens
    # without the switch each request asks after each of its first 62 tokens (its
    # last token needs no proposal); with it, after tokens 1-4 (paused at 5 till 21),
    # 21-24 (paused at 25 till 57) and 57-60 (paused at 61 for 64 tokens)
    assert engine.model_runner.switch is None and len(calls) == 2 * 62
    assert len(paused_calls) == 2 * 12
    assert paused_engine.model_runner.switch.num_pauses == 2 * 3


def test_steps_whose_requests_are_all_paused_launch_ahead(tiny):
    """Chapter 16's runner: a step that may propose runs in step; once every request
    of the batch is paused, steps launch ahead again."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 2000, (n,), generator=g).tolist() for n in (9, 17)]
    fast = dict(persistent_batch=True, async_scheduling=True)
    tokens, _, never = run(tiny, prompts, lambda c, k: [], None, **fast)
    assert never.stepper.num_ahead == 0  # without the switch they always may propose
    got, _, engine = run(tiny, prompts, lambda c, k: [], 0.5, **fast)
    assert got == tokens and engine.model_runner.switch.num_pauses > 0
    assert engine.stepper.num_ahead > 0


def test_an_oracle_proposer_is_never_paused(tiny):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2000, (n,), generator=g).tolist() for n in (7, 20)]
    tokens, _, _ = run(tiny, prompts, lambda c, k: [], None)
    futures = {tuple(p): p + t for p, t in zip(prompts, tokens)}

    def oracle(context, k):
        for prompt, whole in futures.items():
            if tuple(context[: len(prompt)]) == prompt:
                return whole[len(context) : len(context) + k]
        raise AssertionError("an unknown context")

    # every draft is taken: 3 a step, fewer only where max_tokens cuts k at the end
    got, calls, engine = run(tiny, prompts, oracle, 2.0)
    assert got == tokens and engine.model_runner.switch.num_pauses == 0
    stats = engine.model_runner.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
