"""Checks for chapter 16's exercises (chapters/16_async_scheduling.md, "Exercises")."""

import pytest
import torch
from _check import answer

from minillm.llm import LLM
from minillm.sampling_params import SamplingParams


def test_processed_logprobs_ahead(tiny):
    """12.1: processed logprobs run ahead and are chapter 9's."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    params = [
        SamplingParams(
            temperature=0.8,
            top_k=40,
            top_p=0.9,
            seed=i,
            max_tokens=10,
            ignore_eos=True,
            repetition_penalty=1.2,
            logprobs=3,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(temperature=0, max_tokens=7, logprobs=2)
    common = dict(device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    ahead = LLM(**common, persistent_batch=True, async_scheduling=True)
    ahead.engine.model_runner.sampler.logprobs_mode = "processed_logprobs"
    got = ahead.generate(prompts, params, use_tqdm=False)
    if ahead.engine.stepper.num_in_step > 0:
        pytest.skip("exercise 16.1: steps with processed logprobs still run in step")
    reference = LLM(**common, persistent_batch=False)
    reference.engine.model_runner.sampler.logprobs_mode = "processed_logprobs"
    expected = reference.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # one {token id: Logprob} per token: the sampled token first, then the top
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(x) == list(y), "the same tokens, in the same order"
            for token_id, lp in x.items():
                assert lp.rank == y[token_id].rank
                assert lp.logprob == pytest.approx(y[token_id].logprob, abs=1e-5)


def test_packed_prompt_mask():
    """12.2: the prompt mask in bits, and the kernel reading it gives chapter 7's
    logits."""
    import random

    from minillm.kernels import penalties
    from minillm.logits_processors import apply_penalties, token_counts
    from minillm.sampling_metadata import pad_token_ids

    pack = answer(penalties, "pack_prompt_mask", "16.2")
    apply_packed = answer(penalties, "apply_penalties_packed", "16.2")
    rng, vocab, rows = random.Random(0), 1000, 4
    prompts = [[rng.randrange(vocab) for _ in range(50)] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(30)] for _ in range(rows)]
    seen = token_counts(pad_token_ids(prompts, vocab), vocab) > 0
    packed = pack(seen)
    assert packed.dtype == torch.int32 and packed.shape == (rows, (vocab + 31) // 32)
    tokens = torch.arange(vocab)
    bits = (packed[:, tokens // 32] >> (tokens % 32)) & 1
    assert torch.equal(bits.bool(), seen)
    counts = token_counts(pad_token_ids(outputs, vocab), vocab)
    penalty_rows = torch.tensor([[0.5, 0.0, -0.3, 0.5], [0.5, 1.0, 0.0, -1.0],
                                 [1.1, 0.8, 1.0, 2.0]])  # fmt: skip
    logits = torch.randn(rows, vocab).round(decimals=1).bfloat16()
    expected = apply_penalties(
        logits.float(),
        pad_token_ids(prompts, vocab),
        pad_token_ids(outputs, vocab),
        *penalty_rows,
    )
    state_rows = torch.arange(rows, dtype=torch.int32)
    got = apply_packed(logits, state_rows, counts.int(), packed, penalty_rows)
    assert torch.equal(got, expected)
