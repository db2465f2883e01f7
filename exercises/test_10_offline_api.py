"""Checks for chapter 10's exercises (chapters/10_offline_api.md, "Exercises")."""

import torch
from _check import answer

from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = 'The "for" statement'


def test_stream(tiny):
    """8.1: LLM.stream yields text deltas that add up to the non-streamed text."""
    answer(LLM, "stream", "10.1")
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


def test_diverse_beam_search(tiny):
    """8.2: groups of beams pushed apart; one group without a penalty is
    beam_search."""
    import pytest

    from minillm.sampling_params import BeamSearchParams

    answer(LLM, "diverse_beam_search", "10.2")
    llm = LLM(device="cpu", dtype=torch.float32, num_kv_blocks=256)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    plain = llm.beam_search([PROMPT], params)[0].sequences
    same = llm.diverse_beam_search(PROMPT, params, num_groups=1, diversity_penalty=0.0)
    assert [s.tokens for s in same] == [s.tokens for s in plain]
    for a, b in zip(same, plain):
        assert abs(a.cum_logprob - b.cum_logprob) < 1e-6
    # one beam a group and a penalty no logprob difference can beat: group g's first
    # token is the prompt's (g+1)-th likeliest next token, and its beam descends from it
    apart = llm.diverse_beam_search(PROMPT, params, num_groups=3, diversity_penalty=1e4)
    start = len(llm.tokenizer.encode(PROMPT))
    ranked = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    first = llm.generate(PROMPT, ranked, use_tqdm=False)[0].outputs[0].logprobs[0]
    by_rank = sorted(first, key=lambda t: first[t].rank)[:3]
    assert [s.tokens[start] for s in apart] == by_rank
    assert all(len(s.tokens) == start + params.max_tokens for s in apart)
    with pytest.raises(ValueError):
        llm.diverse_beam_search(PROMPT, params, num_groups=2, diversity_penalty=1.0)
    assert not llm.engine.has_unfinished_requests()
