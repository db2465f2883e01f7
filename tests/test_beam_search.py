"""Beam search (chapter 10, "Beam search"): `LLM.beam_search` against a naive beam
search that recomputes every beam with chapter 1's model, the bookkeeping on a
made-up model, vLLM's parameters and output types, and the prefix cache's sharing.
"""

import math

import pytest
import torch

from minillm.beam_search import (
    BeamSearchOutput,
    BeamSearchSequence,
    beam_score,
    run_beam_search,
)
from minillm.llm import LLM
from minillm.logprobs import Logprob
from minillm.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)

PROMPTS = ["The result of", 'def main():\n    """', "A class"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype=torch.float32)


@torch.inference_mode()  # the engine's compiled layers on a GPU have no backward
def naive_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """[(tokens, cum_logprob)], best first: every beam recomputed from its first
    token by the plain model, in float32, every step."""

    def score(beam):
        tokens, cum = beam
        return cum / max(len(tokens) - (tokens[-1] == eos), 1) ** length_penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        live = []
        for tokens, cum in beams:
            with torch.no_grad():
                hidden = model(torch.tensor(tokens), torch.arange(len(tokens)))
                logits = model.compute_logits(hidden[-1]).float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == eos else live).append((tokens + [t], cum + lp))
        beams = sorted(live, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize(
    "width, max_tokens, length_penalty", [(3, 8, 1.0), (2, 6, 0.0), (4, 5, 2.0)]
)
def test_beams_equal_a_naive_beam_search(llm, width, max_tokens, length_penalty):
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty
    )
    found = llm.beam_search(PROMPTS, params)
    eos = llm.tokenizer.eos_token_id
    for text, out in zip(PROMPTS, found):
        ids = llm.tokenizer.encode(text)
        expected = naive_beam_search(
            llm.engine.model, ids, width, max_tokens, eos, length_penalty
        )
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


def test_output_types_and_fields_as_vllm(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    (out,) = llm.beam_search([PROMPTS[0]], params)
    assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 3
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    eos = llm.tokenizer.eos_token_id
    scores = [beam_score(s, eos, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        assert isinstance(seq, BeamSearchSequence)
        # vLLM's tokens and text hold the prompt too
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        generated = seq.tokens[len(prompt_ids) :]
        assert len(seq.logprobs) == len(generated) <= 6
        assert seq.text == llm.tokenizer.decode(seq.tokens)
        assert seq.text.startswith(PROMPTS[0])
        chosen = [step[t].logprob for step, t in zip(seq.logprobs, generated)]
        assert seq.cum_logprob == pytest.approx(sum(chosen), abs=1e-6)
        assert all(
            isinstance(lp, Logprob) for step in seq.logprobs for lp in step.values()
        )
        assert all(len(step) >= 6 for step in seq.logprobs)  # 2 * beam_width
        # vLLM sets neither on a beam that was not aborted
        assert seq.finish_reason is None and seq.stop_reason is None
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_beam_width_one_is_greedy(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    params = BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True)
    for out, want in zip(llm.beam_search(PROMPTS, params), expected):
        (seq,) = out.sequences
        assert seq.tokens == want.prompt_token_ids + want.outputs[0].token_ids


def test_token_prompts_dicts_and_concurrency_limit_agree(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    as_text = llm.beam_search(PROMPTS, params)
    as_ids = llm.beam_search(ids, params)
    as_dicts = llm.beam_search([{"prompt_token_ids": i} for i in ids], params)
    one_at_a_time = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    tokens = [[s.tokens for s in o.sequences] for o in as_text]
    for other in (as_ids, as_dicts, one_at_a_time):
        assert [[s.tokens for s in o.sequences] for o in other] == tokens


class MadeUpModel:
    """next_logprobs for run_beam_search from a table: the candidates after a
    sequence depend on its last token only."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, sequences):
        self.calls.append([list(s) for s in sequences])
        return [
            {t: Logprob(math.log(p)) for t, p in self.table[s[-1]].items()}
            for s in sequences
        ]


def test_bookkeeping_ends_beams_on_eos_and_applies_length_penalty():
    eos = 0
    # after 1: EOS (0.5) or 2 (0.3) or 3 (0.2); after 2 or 3: more of the same
    table = {
        1: {0: 0.5, 2: 0.3, 3: 0.2},
        2: {2: 0.9, 0: 0.1},
        3: {3: 0.6, 0: 0.4},
    }
    prompt = {"prompt_token_ids": [1]}
    model = MadeUpModel(table)
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    (out,) = run_beam_search([prompt], params, model, eos)
    # the first step finishes [1, 0] at once; it never runs again
    assert model.calls[0] == [[1]]
    assert all([1, 0] != s for step in model.calls[1:] for s in step)
    # scores: [1, 0] = log .5 / 1; [1,2,2,2] = log(.3*.9*.9) / 4
    expected = sorted(
        [
            ([1, 0], math.log(0.5)),
            ([1, 2, 2, 2], math.log(0.3 * 0.81)),
            ([1, 2, 2, 0], math.log(0.3 * 0.9 * 0.1)),
            ([1, 3, 3, 3], math.log(0.2 * 0.36)),
            ([1, 3, 3, 0], math.log(0.2 * 0.6 * 0.4)),
            ([1, 3, 0], math.log(0.2 * 0.4)),
            ([1, 2, 0], math.log(0.3 * 0.1)),
        ],
        key=lambda b: b[1] / max(len(b[0]) - (b[0][-1] == eos), 1),
        reverse=True,
    )[:2]
    assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
    # ignore_eos: EOS is a token like any other, no beam ends
    ignoring = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    (out,) = run_beam_search(
        [prompt], ignoring, MadeUpModel({**table, 0: {0: 1.0}}), eos
    )
    assert all(len(s.tokens) == 4 for s in out.sequences)


def test_bad_arguments_raise_and_change_nothing(llm):
    for bad in [
        {"beam_width": 0, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 0},
        {"beam_width": 2, "max_tokens": 4, "temperature": -1.0},
    ]:
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    too_long = BeamSearchParams(beam_width=2, max_tokens=llm.engine.max_model_len)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(PROMPTS, too_long)
    with pytest.raises(ValueError, match="structured_outputs"):
        structured = StructuredOutputsParams(choice=["yes", "no"])
        llm.beam_search(
            PROMPTS,
            BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=structured),
        )
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search(PROMPTS, params, lora_request=object())
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([[]], params)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.output_processor.parents


def test_prefix_cache_shares_the_beams_blocks(llm):
    """With chapter 11's prefix cache the beams' full blocks are found, not
    recomputed; the beams are the same."""
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    cached = LLM(
        device="cpu", dtype=torch.float32, prefix_cache_impl="hash", block_size=4
    )
    again = cached.beam_search(PROMPTS, params)
    plain = llm.beam_search(PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in again] == [
        [s.tokens for s in o.sequences] for o in plain
    ]
    for a, b in zip(again, plain):
        for x, y in zip(a.sequences, b.sequences):
            assert x.cum_logprob == pytest.approx(y.cum_logprob, abs=1e-4)
    manager = cached.engine.kv_cache_manager
    assert manager.prefix_cache_hits > 0.6 * manager.prefix_cache_queries
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    cached.shutdown()
