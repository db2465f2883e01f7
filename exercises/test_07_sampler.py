"""Checks for chapter 7's exercises (chapters/07_sampler.md, "Exercises").

Each test skips until its answer exists (a new SamplingParams field, a new logits
processor), then checks it against definitions written out here.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minillm.logits_processors as logits_processors
from _check import answer
from minillm.logits_processors import apply_top_k_top_p
from minillm.sampler import Sampler
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampler_reference import reference_probs
from minillm.sampling_params import SamplingParams, SamplingParamsError


def needs_field(name: str, exercise: str) -> None:
    if name not in {f.name for f in dataclasses.fields(SamplingParams)}:
        pytest.skip(f"exercise {exercise}: SamplingParams.{name} does not exist yet")


def distribution(params, logits, prompts=None, outputs=None):
    """The batched sampler's sampling_distribution, (num_seqs, vocab)."""
    n, vocab = logits.shape
    md = SamplingMetadata.from_requests(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab,
    )
    return md, Sampler().sampling_distribution(logits, md)


def random_logits(num_seqs, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, vocab, generator=gen) * 3


def test_logit_bias():
    """6.1: logit_bias is validated, added before the penalties, and in the oracle."""
    needs_field("logit_bias", "7.1")
    for bad in [{3: 101.0}, {3: -100.5}, {-1: 1.0}, {3: float("nan")}, {True: 1.0}]:
        with pytest.raises(SamplingParamsError) as error:
            SamplingParams(logit_bias=bad)
        assert error.value.field == "logit_bias", bad
    SamplingParams(logit_bias={3: 100, 4: -100.0})  # the ends of the range are fine
    with pytest.raises(SamplingParamsError):
        SamplingParams(logit_bias={16: 1.0}).verify_token_ids(16)

    logits = random_logits(3, 16, seed=0)
    md, _ = distribution([SamplingParams()] * 3, logits)
    assert md.logit_bias is None, "no row uses logit_bias: the tensor is not built"
    params = [
        SamplingParams(temperature=0, logit_bias={int(logits[0].argmin()): 100}),
        SamplingParams(temperature=1.0, logit_bias={2: 1.5, 5: -4.0}),
        SamplingParams(temperature=1.0),
    ]
    md, probs = distribution(params, logits)
    assert md.logit_bias.shape == (3, 16)
    assert probs[0].argmax() == logits[0].argmin(), "+100 makes a greedy row choose it"
    biased = logits[1].clone()
    biased[2] += 1.5
    biased[5] -= 4.0
    assert torch.allclose(probs[1], biased.softmax(-1), atol=1e-6)
    assert torch.allclose(probs[2], logits[2].softmax(-1), atol=1e-6)

    # before the repetition penalty: (1 + 1) / 2 = 1, not 1 / 2 + 1 = 1.5
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0})]
    _, probs = distribution(params, logits, prompts=[[0]])
    assert torch.allclose(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0]).softmax(-1))

    # the sampler against the reader's reference, on random batches
    rng = random.Random(0)
    for trial in range(20):
        vocab, n = rng.choice([16, 64]), rng.randint(1, 6)
        params = [
            SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.0]),
                top_p=rng.choice([1.0, 0.8]),
                repetition_penalty=rng.choice([1.0, 1.3]),
                presence_penalty=rng.choice([0.0, 0.5]),
                logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
                if rng.random() < 0.7
                else None,
            )
            for _ in range(n)
        ]
        prompts = [[rng.randrange(vocab) for _ in range(3)] for _ in range(n)]
        outputs = [[rng.randrange(vocab) for _ in range(2)] for _ in range(n)]
        logits = random_logits(n, vocab, seed=trial)
        _, probs = distribution(params, logits, prompts, outputs)
        for row in range(n):
            expected = reference_probs(
                logits[row].tolist(), params[row], prompts[row], outputs[row]
            )
            assert torch.allclose(
                probs[row].double(),
                torch.tensor(expected, dtype=torch.float64),
                atol=1e-6,
            ), (trial, row, params[row])


class NoSorting(TorchDispatchMode):
    SORTS = {"sort", "argsort", "topk", "kthvalue", "msort", "median"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in self.SORTS, f"aten.{name} called: bisect instead"
        return func(*args, **(kwargs or {}))


def test_top_p_bisection():
    """6.2: the smallest top set holding p, found without sorting the vocabulary."""
    bisection = answer(logits_processors, "apply_top_p_bisection", "7.2")
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for vocab, scale in [(50, 3.0), (1000, 2.0), (1000, 6.0)]:
        logits = torch.randn(8, vocab, generator=gen) * scale
        logits[0, 3] = 20.0  # one token holds nearly all the mass: only it is kept
        for top_p in (0.3, 0.8, 0.95, 1.0):
            p = torch.full((8,), top_p)
            p[1] = 0.5  # rows have their own p
            with NoSorting():
                out = bisection(logits.clone(), p)
            expected = apply_top_k_top_p(logits.clone(), None, p)
            probs = logits.double().softmax(-1)
            for row in range(8):
                kept = out[row] > float("-inf")
                if p[row] == 1:
                    assert kept.all(), "a row with p = 1 keeps every token"
                    continue
                # the mass of the likelier tokens, for each token
                above = (
                    probs[row][None, :] * (probs[row][None, :] > probs[row][:, None])
                ).sum(-1)
                if ((above - p[row].double()).abs() < 1e-5).any():
                    continue  # a token sits on the boundary: float32 may go either way
                assert torch.equal(kept, expected[row] > float("-inf")), (
                    vocab,
                    top_p,
                    row,
                )
                assert torch.equal(out[row][kept], logits[row][kept]), (
                    "kept logits change"
                )
                checked += 1
    assert checked > 60


def test_bad_words():
    """6.3: a banned sequence's last token is masked only after the rest of it."""
    needs_field("bad_words_token_ids", "7.3")
    vocab = 16
    logits = random_logits(6, vocab, seed=1)
    bad = [[7, 8], [5], [3, 4, 9]]
    params = [SamplingParams(bad_words_token_ids=bad)] * 5 + [SamplingParams()]
    outputs = [[1, 7], [7, 1], [2, 3, 4], [3, 1, 4], [], [1, 7]]
    _, probs = distribution(params, logits, outputs=outputs)
    banned = {
        0: {8, 5},  # ends with 7
        1: {5},  # a 7, but not at the end
        2: {5, 9},  # ends with 3, 4
        3: {5},  # ends with 4 only
        4: {5},  # nothing generated yet
        5: set(),  # a row without bad words, after the same 7
    }
    for row, tokens in banned.items():
        zero = set(torch.nonzero(probs[row] == 0).flatten().tolist())
        assert zero == tokens, (row, outputs[row], sorted(zero))
    # and the draws: token 8 never follows a 7 in a row that bans it
    md = SamplingMetadata.from_requests(
        [SamplingParams(bad_words_token_ids=[[7, 8]])] * 64,
        [[0]] * 64,
        [[7]] * 64,
        vocab,
    )
    boost = torch.zeros(64, vocab)
    boost[:, 8] = 10.0  # token 8 would be drawn almost always
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    assert 8 not in sampler(boost, md).sampled_token_ids.tolist()


def test_exponential_from_bits32():
    """6.4: E = -log(1 - (bits + 1/2) 2**-32) in float32, for every 32-bit word."""
    import minillm.sampler as sampler_module

    exponential = answer(sampler_module, "exponential_from_bits32", "7.4")
    extremes = [0, 1, 2**23, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    random_words = torch.randint(
        0,
        2**32,
        (100_000,),
        dtype=torch.int64,
        generator=torch.Generator().manual_seed(0),
    )
    words = torch.cat([torch.tensor(extremes, dtype=torch.int64), random_words])
    e = exponential(words.clone())
    assert e.dtype == torch.float32 and e.shape == words.shape
    assert torch.isfinite(e).all() and (e > 0).all(), "E must be finite and positive"
    v = (words.double() + 0.5) * 2.0**-32
    expected = -torch.log1p(-v)  # float64: exact enough for every word
    worst = ((e.double() - expected).abs() / expected).max().item()
    assert worst < 1e-6, f"relative error {worst:.2g}: more than float32 rounding"
    assert e[0] < 1e-9, "the smallest word must give an E near 2**-33"
