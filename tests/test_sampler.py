"""The sampler (minillm/sampler.py, minillm/sampling_params.py,
minillm/logits_processors.py; chapter 7): the specification.

Parameters are validated with messages that name the field; greedy rows are exact
argmax; seeded rows depend on nothing but their seed; every filter keeps what its
definition says; the batched sampler equals the one-request reference `reference_probs`
on random batches; and the draws follow the distribution (chi-square goodness of fit,
fixed seeds, 20,000 draws).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.logits_processors import apply_penalties, apply_top_k_top_p
from minillm.sampler import (
    Sampler,
    exponential_noise,
    random_sample,
    row_keys,
    stream_keys,
    uniform_from_bits,
)
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampler_reference import chi2_sf, chi_square_test, reference_probs
from minillm.sampling_params import SamplingParams, SamplingParamsError, SamplingType

EOS = 1


def metadata(params, vocab, prompts=None, outputs=None, eos=(EOS,)):
    n = len(params)
    prompts = prompts if prompts is not None else [[0]] * n
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingMetadata.from_requests(
        params, prompts, outputs, vocab, eos_token_ids=eos
    )


def random_logits(num_seqs, vocab, seed=0, scale=3.0):
    return (
        torch.randn(num_seqs, vocab, generator=torch.Generator().manual_seed(seed))
        * scale
    )


def support(probs_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


# --------------------------------------------------------------------------------------
# -------
# SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (
        1.0,
        0.0,
        0.0,
    )
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert (
        p.stop == []
        and p.stop_token_ids == []
        and p.skip_special_tokens
        and not p.ignore_eos
    )


def test_conventions_are_normalised():
    # vLLM's older "off" is stored as the one convention
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_turns_the_cutters_off_and_ignores_the_seed_for_its_type():
    p = SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2, seed=7)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(seed=7).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams().sampling_type == SamplingType.RANDOM


def test_tiny_positive_temperature_is_raised_with_a_warning():
    with pytest.warns(UserWarning, match="temperature"):
        p = SamplingParams(temperature=1e-4)
    assert p.temperature == 0.01 and p.sampling_type == SamplingType.RANDOM


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(seed=1.0), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-2), "logprobs"),  # -1 is vLLM's "all tokens"
        (dict(stop=[""]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(banned_token_ids=["a"]), "banned_token_ids"),
        (dict(logits_processors=[42]), "logits_processors"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_invalid_params_raise(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SamplingParamsError) and info.value.field == field
    message = str(info.value)
    # names the field and the allowed range
    assert message.startswith(f"{field} must be") and "got" in message


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(
        stop_token_ids=[99], allowed_token_ids=[0, 99], logprobs=100
    ).verify_token_ids(100)
    for kwargs, field in [
        (dict(stop_token_ids=[100]), "stop_token_ids"),
        (dict(banned_token_ids=[100]), "banned_token_ids"),
        (dict(allowed_token_ids=[3, 100]), "allowed_token_ids"),
        (dict(logprobs=101), "logprobs"),
    ]:
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**kwargs).verify_token_ids(100)
        assert info.value.field == field and "100" in str(info.value)


# --------------------------------------------------------------------------------------
# -------
# Metadata


def test_metadata_skips_features_no_row_uses():
    md = metadata([SamplingParams(), SamplingParams(temperature=0.5)], 32)
    assert (
        md.top_k is None and md.top_p is None and md.min_p is None and md.no_penalties
    )
    assert (
        md.prompt_token_ids is None
        and md.allowed_token_ids_mask is None
        and md.max_num_logprobs is None
    )
    assert md.all_random and not md.all_greedy and not md.seeded.any()


def test_metadata_seeds_and_positions():
    params = [
        SamplingParams(seed=2**64 + 5),
        SamplingParams(temperature=0, seed=9),  # greedy: draws nothing
        SamplingParams(),
        SamplingParams(seed=-2),  # (-1 is vLLM's "no seed")
        SamplingParams(seed=2**63),
    ]
    md = metadata(params, 32, outputs=[[1, 2, 3], [], [4], [5, 5], []])
    assert md.seeded.tolist() == [True, False, False, True, True]
    assert md.seeds.tolist() == [5, 0, 0, -2, -(2**63)]  # the low 64 bits, signed
    assert md.seeds.dtype == md.positions.dtype == torch.int64
    assert md.positions.tolist() == [3, 0, 1, 2, 0]


def test_metadata_needs_one_prompt_and_one_output_per_row():
    with pytest.raises(ValueError, match="one of each per row"):
        SamplingMetadata.from_requests([SamplingParams()] * 2, [[0]], [[], []], 32)


# --------------------------------------------------------------------------------------
# -------
# Greedy, seeds and the draw


def test_temperature_zero_is_argmax():
    vocab = 50
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, seed=3),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0, repetition_penalty=1.5),
    ]
    logits = random_logits(len(params), vocab)
    # row 4's favourite is already in its output
    outputs = [[], [], [], [], [int(logits[4].argmax())]]
    md = metadata(params, vocab, outputs=outputs)
    for seed in range(5):
        tokens = Sampler(generator=torch.Generator().manual_seed(seed))(
            logits, md
        ).sampled_token_ids
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
        penalised = Sampler.apply_constraints_and_penalties(logits.clone(), md)
        assert tokens[4] == penalised[4].argmax() != logits[4].argmax()


def test_all_greedy_batch_needs_no_random_numbers():
    logits = random_logits(4, 30)
    md = metadata([SamplingParams(temperature=0)] * 4, 30)
    state = torch.get_rng_state()
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)


def test_same_seed_same_output_regardless_of_batch():
    vocab, steps = 40, 8
    request = SamplingParams(temperature=1.0, top_p=0.9, seed=2024)
    own_logits = random_logits(steps, vocab, seed=99)

    def run(row: int, num_seqs: int, neighbour_seed: int) -> list[int]:
        rng = random.Random(neighbour_seed)
        params = [
            SamplingParams(
                temperature=rng.choice([0, 0.5, 1.0]), seed=rng.choice([None, 5])
            )
            for _ in range(num_seqs)
        ]
        params[row] = request
        outputs = [[] for _ in range(num_seqs)]
        sampler = Sampler(generator=torch.Generator().manual_seed(neighbour_seed))
        for step in range(steps):
            logits = random_logits(num_seqs, vocab, seed=1000 * neighbour_seed + step)
            logits[row] = own_logits[step]
            md = metadata(params, vocab, outputs=outputs)
            for out, token in zip(
                outputs, sampler(logits, md).sampled_token_ids.tolist()
            ):
                out.append(token)
        return outputs[row]

    alone = run(0, 1, 0)
    assert run(3, 6, 1) == alone and run(0, 4, 2) == alone and run(1, 2, 3) == alone
    assert run(0, 1, 0) == alone  # and again


def test_different_seeds_give_different_streams():
    # uniform: any two streams agreeing on 5 draws would be a miracle
    logits = torch.zeros(1, 1000)
    draws = {}
    for seed in (1, 2):
        outputs = [[]]
        for _ in range(5):
            md = metadata([SamplingParams(seed=seed)], 1000, outputs=outputs)
            outputs[0].append(Sampler()(logits, md).sampled_token_ids.item())
        draws[seed] = outputs[0]
    assert draws[1] != draws[2]
    # and one stream does not repeat itself from position to position
    assert len(set(draws[1])) > 1


def test_a_seeded_row_redraws_the_same_token_at_the_same_position():
    # what makes preemption by recompute reproduce a seeded request
    logits = random_logits(1, 300, scale=0.5)
    md = metadata([SamplingParams(seed=77)], 300, outputs=[[4, 5, 6]])
    tokens = {
        Sampler(generator=torch.Generator().manual_seed(g))(
            logits, md
        ).sampled_token_ids.item()
        for g in range(5)
    }
    assert len(tokens) == 1


def test_unseeded_rows_follow_the_shared_generator():
    logits = torch.zeros(8, 1000)
    md = metadata([SamplingParams()] * 8, 1000)
    first = Sampler(generator=torch.Generator().manual_seed(5))(
        logits, md
    ).sampled_token_ids
    again = Sampler(generator=torch.Generator().manual_seed(5))(
        logits, md
    ).sampled_token_ids
    other = Sampler(generator=torch.Generator().manual_seed(6))(
        logits, md
    ).sampled_token_ids
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sampler_on_the_test_device_matches_cpu(device):
    """On $MINILLM_TEST_DEVICE (cuda on the GPU box) the distributions equal the
    CPU's; seeds reproduce.
    """
    vocab = 64
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=1),
        SamplingParams(
            min_p=0.1,
            repetition_penalty=1.3,
            frequency_penalty=0.2,
            banned_token_ids=[3],
        ),
        SamplingParams(allowed_token_ids=[1, 2, 5, 9], min_tokens=2, logprobs=2),
    ]
    prompts, outputs = [[0, 4, 4]] * 4, [[5, 6], [], [7, 7, 7], [1]]
    logits = random_logits(4, vocab)
    on_cpu = Sampler().sampling_distribution(
        logits, metadata(params, vocab, prompts, outputs)
    )
    md = SamplingMetadata.from_requests(
        params, prompts, outputs, vocab, eos_token_ids=[EOS], device=device
    )
    on_device = Sampler().sampling_distribution(logits.to(device), md)
    assert torch.allclose(on_device.cpu(), on_cpu, atol=1e-6)
    draws = []
    for _ in range(2):
        md = SamplingMetadata.from_requests(
            params, prompts, outputs, vocab, eos_token_ids=[EOS], device=device
        )
        out = Sampler(generator=torch.Generator(device).manual_seed(0))(
            logits.to(device), md
        )
        draws.append(out.sampled_token_ids.cpu())
        assert out.logprobs_tensors.token_ids.device.type == torch.device(device).type
    assert torch.equal(draws[0], draws[1]) and draws[0][0] == logits[0].argmax()
    # the seeded row's token is the CPU's too: the noise is the same function there
    on_cpu = Sampler(generator=torch.Generator().manual_seed(0))(
        logits, metadata(params, vocab, prompts, outputs)
    )
    assert draws[0][1] == on_cpu.sampled_token_ids[1]
    seeds = torch.tensor([3, -(2**63), 2**62 + 1])
    positions = torch.tensor([0, 7, 2**31 + 3])
    keys = [k.cpu() for k in row_keys(seeds.to(device), positions.to(device))]
    assert all(map(torch.equal, keys, row_keys(seeds, positions)))  # integers: exact
    # the log may differ in its last bit between devices
    assert torch.allclose(
        exponential_noise(seeds.to(device), positions.to(device), 500).cpu(),
        exponential_noise(seeds, positions, 500),
        rtol=1e-6,
        atol=0,
    )


def test_sampler_does_not_modify_the_callers_logits():
    params = [
        SamplingParams(
            temperature=0.5,
            top_k=3,
            top_p=0.8,
            min_p=0.1,
            repetition_penalty=1.3,
            banned_token_ids=[0],
            logprobs=2,
        )
    ] * 3
    logits = random_logits(3, 20)
    before = logits.clone()
    Sampler()(logits, metadata(params, 20, outputs=[[1, 2]] * 3))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------------------
# -------
# What each rule keeps


def test_top_k_keeps_k_best():
    vocab = 100
    logits = random_logits(3, vocab)
    params = [SamplingParams(top_k=k) for k in (1, 7, 100)]
    probs = Sampler().sampling_distribution(logits, metadata(params, vocab))
    for row, k in enumerate((1, 7, 100)):
        assert support(probs[row]) == set(logits[row].topk(k).indices.tolist())
        best = logits[row].topk(k).indices
        # renormalised over the k
        assert torch.allclose(probs[row, best], logits[row, best].softmax(-1))


def test_top_p_keeps_the_smallest_nucleus():
    vocab = 200
    logits = random_logits(4, vocab, scale=2.0)
    top_ps = (0.1, 0.5, 0.9, 0.99)
    probs = Sampler().sampling_distribution(
        logits, metadata([SamplingParams(top_p=p) for p in top_ps], vocab)
    )
    for row, top_p in enumerate(top_ps):
        p_sorted, order = logits[row].softmax(-1).sort(descending=True)
        # the first prefix whose mass reaches top_p
        n = int((p_sorted.cumsum(0) < top_p).sum()) + 1
        assert support(probs[row]) == set(order[:n].tolist())
        assert p_sorted[:n].sum() >= top_p > p_sorted[: n - 1].sum()


def test_top_p_always_keeps_the_most_likely_token():
    logits = random_logits(2, 500)
    probs = Sampler().sampling_distribution(
        logits, metadata([SamplingParams(top_p=1e-9)] * 2, 500)
    )
    assert torch.equal(
        probs, torch.nn.functional.one_hot(logits.argmax(-1), 500).float()
    )


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    vocab = 200
    logits = random_logits(2, vocab)
    probs = Sampler().sampling_distribution(
        logits,
        metadata(
            [SamplingParams(min_p=m, temperature=0.7) for m in (0.05, 0.5)], vocab
        ),
    )
    for row, min_p in enumerate((0.05, 0.5)):
        p = (logits[row] / 0.7).softmax(-1)
        assert support(probs[row]) == set(
            torch.nonzero(p >= min_p * p.max()).flatten().tolist()
        )


def test_min_tokens_masks_eos():
    vocab = 10
    logits = torch.full((1, vocab), -5.0)
    logits[0, EOS] = 10.0  # EOS is by far the most likely token...
    logits[0, 7] = 9.0  # ...then stop token 7
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])]
    # ...but not before 3 tokens exist
    for produced, expected in [(0, 0), (2, 0), (3, EOS)]:
        tokens = Sampler()(
            logits, metadata(params, vocab, outputs=[[4] * produced])
        ).sampled_token_ids
        assert tokens.item() == expected
    # EOS ends nothing: not masked
    ignore = [SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)]
    assert (
        Sampler()(
            logits, metadata(ignore, vocab, outputs=[[]])
        ).sampled_token_ids.item()
        == EOS
    )


def test_allowed_and_banned_tokens_are_never_sampled():
    vocab = 64
    params = [
        SamplingParams(temperature=2.0, allowed_token_ids=[3, 5, 8, 13]),
        SamplingParams(temperature=2.0, banned_token_ids=list(range(1, vocab))),
    ]
    md = metadata(params, vocab)
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    seen = [set(), set()]
    for step in range(300):
        tokens = sampler(
            random_logits(2, vocab, seed=step), md
        ).sampled_token_ids.tolist()
        seen[0].add(tokens[0])
        seen[1].add(tokens[1])
    assert seen[0] == {3, 5, 8, 13} and seen[1] == {0}


def test_logits_processors_see_the_output_and_run_first():
    calls = []

    def only_token_9_after_two(output_token_ids, logits):
        calls.append(list(output_token_ids))
        if len(output_token_ids) >= 2:
            logits = torch.full_like(logits, float("-inf"))
            logits[9] = 0.0
        return logits

    params = [
        SamplingParams(temperature=0.8, logits_processors=[only_token_9_after_two]),
        SamplingParams(),
    ]
    outputs = [[4, 4], []]
    tokens = Sampler()(
        random_logits(2, 16), metadata(params, 16, outputs=outputs)
    ).sampled_token_ids
    assert tokens[0] == 9 and calls == [[4, 4]]  # called once, for its own row only


class OnlyToken:
    """A batch-level logits processor (apply_batch): its rows may only produce
    `token`; records each batch call."""

    calls: list = []

    def __init__(self, token: int):
        self.token = token

    def __call__(self, output_token_ids, logits):  # the per-row form
        keep = logits[self.token].clone()
        logits.fill_(float("-inf"))
        logits[self.token] = keep
        return logits

    @staticmethod
    def apply_batch(logits, rows, processors, output_token_ids):
        OnlyToken.calls.append((list(rows), [list(o) for o in output_token_ids]))
        for row, p, ids in zip(rows, processors, output_token_ids):
            p(ids, logits[row])
        return logits


def test_batch_level_processors_get_one_call_for_their_rows():
    OnlyToken.calls = []
    params = [
        SamplingParams(logits_processors=[OnlyToken(3)]),
        SamplingParams(),
        SamplingParams(logits_processors=[OnlyToken(7)]),
    ]
    outputs = [[4], [5], [6, 6]]
    tokens = Sampler()(
        random_logits(3, 16), metadata(params, 16, outputs=outputs)
    ).sampled_token_ids.tolist()
    assert tokens[0] == 3 and tokens[2] == 7
    assert OnlyToken.calls == [([0, 2], [[4], [6, 6]])]  # one call, both rows


def test_penalties_follow_openai_and_ctrl():
    z = torch.tensor([[2.0, 2.0, -1.0, 1.0, 0.5]])
    # 5 = padding
    out = apply_penalties(
        z.clone(),
        torch.tensor([[0, 5]]),
        torch.tensor([[1, 2, 1, 5]]),
        presence_penalties=torch.tensor([0.5]),
        frequency_penalties=torch.tensor([0.25]),
        repetition_penalties=torch.tensor([2.0]),
    )
    assert torch.allclose(
        out, torch.tensor([[1.0, 2.0 / 2 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 0.5]])
    )


def test_penalties_match_reference():
    rng = random.Random(0)
    vocab = 80
    params = [
        SamplingParams(
            temperature=rng.choice([0, 1.0]),
            repetition_penalty=rng.choice([0.7, 1.0, 1.4]),
            frequency_penalty=rng.uniform(-2, 2),
            presence_penalty=rng.uniform(-2, 2),
        )
        for _ in range(12)
    ]
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in params
    ]
    outputs = [
        [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in params
    ]
    logits = random_logits(len(params), vocab)
    ours = Sampler().sampling_distribution(
        logits, metadata(params, vocab, prompts, outputs)
    )
    for row, p in enumerate(params):
        expected = reference_probs(
            logits[row].tolist(), p, prompts[row], outputs[row], [EOS]
        )
        assert torch.allclose(
            ours[row].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6
        )


# --------------------------------------------------------------------------------------
# -------
# The batched sampler against the one-request reference


def forbid_odd_after_two(output_token_ids, logits):
    if len(output_token_ids) >= 2:
        logits = logits.clone()
        logits[1::2] = float("-inf")
    return logits


@st.composite
def requests(draw, vocab: int):
    temperature = draw(st.sampled_from([0.0, 0.25, 0.7, 1.0, 1.8]))
    params = SamplingParams(
        temperature=temperature,
        seed=draw(st.none() | st.integers(0, 2**31)),
        top_k=draw(st.sampled_from([0, 1, 2, 5, vocab, vocab + 3])),
        top_p=draw(st.sampled_from([1.0, 0.3, 0.75, 0.95])),
        min_p=draw(st.sampled_from([0.0, 0.02, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.6, 1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, -1.0, 0.8])),
        presence_penalty=draw(st.sampled_from([0.0, -0.5, 1.5])),
        min_tokens=draw(st.sampled_from([0, 1, 4])),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
        ignore_eos=draw(st.booleans()),
        allowed_token_ids=draw(
            st.none()
            | st.lists(
                st.sampled_from(range(0, vocab, 2)), min_size=6, max_size=8, unique=True
            )
        ),
        banned_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=3)),
        logits_processors=draw(st.sampled_from([None, [forbid_odd_after_two]])),
        logprobs=draw(st.none() | st.integers(0, 4)),
    )
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    return params, prompt, output


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    data=st.data(), vocab=st.sampled_from([16, 48]), logits_seed=st.integers(0, 10_000)
)
def test_sampler_matches_reference_on_random_batches(data, vocab, logits_seed):
    batch = data.draw(st.lists(requests(vocab), min_size=1, max_size=6))
    params, prompts, outputs = (list(column) for column in zip(*batch))
    logits = random_logits(len(batch), vocab, seed=logits_seed)
    md = metadata(params, vocab, prompts, outputs)
    ours = Sampler().sampling_distribution(logits, md)
    out = Sampler(generator=torch.Generator().manual_seed(logits_seed))(logits, md)
    for row, p in enumerate(params):
        expected = torch.tensor(
            reference_probs(logits[row].tolist(), p, prompts[row], outputs[row], [EOS]),
            dtype=torch.float64,
        )
        assert torch.allclose(ours[row].double(), expected, atol=1e-6)
        token = out.sampled_token_ids[row].item()
        assert expected[token] > 0
        if p.temperature == 0:
            assert token == int(expected.argmax())


# --------------------------------------------------------------------------------------
# -------
# Logprobs


def test_logprobs_shapes_and_values():
    vocab = 30
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=3, temperature=0),
        SamplingParams(logprobs=5, top_k=2),
    ]
    logits = random_logits(len(params), vocab)
    md = metadata(params, vocab)
    out = Sampler(generator=torch.Generator().manual_seed(0))(logits, md)
    lp = out.logprobs_tensors
    assert lp.token_ids.shape == lp.logprobs.shape == (
        4,
        6,
    ) and lp.sampled_token_ranks.shape == (4,)
    raw = logits.log_softmax(-1)  # the default: the model's own distribution
    entries = lp.tolists(md.num_logprobs)
    assert entries[0] is None
    for row in (1, 2, 3):
        e, token = entries[row], out.sampled_token_ids[row].item()
        assert e.token_id == token and math.isclose(
            e.logprob, raw[row, token].item(), abs_tol=1e-6
        )
        assert e.rank == int((raw[row] >= raw[row, token]).sum())
        n = md.num_logprobs[row]
        assert [t for t, _ in e.top_logprobs] == raw[row].topk(n).indices.tolist()
        assert torch.allclose(
            torch.tensor([v for _, v in e.top_logprobs]), raw[row].topk(n).values
        )
    assert entries[2].rank == 1  # greedy: the most likely token


def test_no_logprobs_requested_none_returned():
    out = Sampler()(random_logits(2, 10), metadata([SamplingParams()] * 2, 10))
    assert out.logprobs_tensors is None


def test_processed_logprobs_are_the_sampled_distribution():
    vocab = 30
    params = [
        SamplingParams(logprobs=2, temperature=0.5, top_k=3),
        SamplingParams(logprobs=1, temperature=0),
    ]
    logits = random_logits(2, vocab)
    md = metadata(params, vocab)
    out = Sampler(logprobs_mode="processed_logprobs")(logits, md)
    e0, e1 = out.logprobs_tensors.tolists(md.num_logprobs)
    # renormalised over the top 3
    expected0 = (logits[0] / 0.5).topk(3).values.log_softmax(-1)
    assert math.isclose(e0.logprob, expected0[e0.rank - 1].item(), abs_tol=1e-5)
    # both alternatives are inside the top 3
    assert torch.isinf(out.logprobs_tensors.logprobs[0]).sum() == 0
    assert e1.rank == 1 and math.isclose(
        e1.logprob, logits[1].log_softmax(-1).max().item(), abs_tol=1e-5
    )
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="raw_logits")


# --------------------------------------------------------------------------------------
# -------
# Statistics


def test_chi2_sf_matches_closed_forms_and_tables():
    for x in (0.01, 0.5, 2.0, 7.0, 30.0, 80.0):
        assert math.isclose(chi2_sf(x, 2), math.exp(-x / 2), rel_tol=1e-9)
        assert math.isclose(chi2_sf(x, 1), math.erfc(math.sqrt(x / 2)), rel_tol=1e-9)
        assert math.isclose(chi2_sf(x, 4), math.exp(-x / 2) * (1 + x / 2), rel_tol=1e-9)
    for x, dof, p in [
        (3.841, 1, 0.05),
        (18.307, 10, 0.05),
        (124.342, 100, 0.05),
        (149.449, 100, 0.001),
    ]:
        assert abs(chi2_sf(x, dof) - p) < 2e-4


def test_exponential_race_matches_multinomial_chi_square():
    probs = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.05, 0.02, 0.0])
    draws = 20_000
    # one row per seed, seeds 0, 1, 2, ...: neighbouring seeds must be unrelated
    tokens = random_sample(
        probs.expand(draws, 8),
        torch.arange(draws),
        torch.zeros(draws, dtype=torch.int64),
    )
    counts = torch.bincount(tokens, minlength=8).tolist()
    statistic, dof, p_value = chi_square_test(counts, probs.tolist())
    assert counts[7] == 0 and dof == 6 and p_value > 0.001


def draw_counts(logits_row, params, vocab, draws=20_000, chunk=2_000, seed=0):
    sampler, counts = (
        Sampler(generator=torch.Generator().manual_seed(seed)),
        torch.zeros(vocab, dtype=torch.int64),
    )
    for start in range(0, draws, chunk):
        rows = [params] * chunk
        if params.seed is not None:  # a seed per row
            rows = [
                dataclasses.replace(params, seed=params.seed + start + i)
                for i in range(chunk)
            ]
        md = metadata(rows, vocab, prompts=[[0]] * chunk)
        counts += torch.bincount(
            sampler(logits_row.expand(chunk, vocab), md).sampled_token_ids,
            minlength=vocab,
        )
    return counts.tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.3, allowed_token_ids=list(range(10, 40, 3))),
        # seeded rows, one generator each
        SamplingParams(temperature=1.0, top_p=0.7, seed=1_000),
    ],
    ids=["top-k+top-p+min-p", "allowed-set", "seeded-top-p"],
)
def test_filtered_draws_follow_the_reference_distribution(params):
    vocab = 256
    logits_row = random_logits(1, vocab, seed=42, scale=2.5)[0]
    expected = reference_probs(logits_row.tolist(), params, [0], [], [EOS])
    counts = draw_counts(logits_row, params, vocab)
    outside = sum(c for c, p in zip(counts, expected) if p == 0)
    statistic, dof, p_value = chi_square_test(counts, expected)
    assert outside == 0, "a token outside the allowed / kept set was drawn"
    assert dof >= 5 and p_value > 0.001, (statistic, dof, p_value)


def test_chi_square_rejects_a_wrong_distribution():
    vocab = 256
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    logits_row = random_logits(1, vocab, seed=42, scale=2.5)[0]
    counts = draw_counts(logits_row, params, vocab)
    hotter = reference_probs(
        logits_row.tolist(),
        dataclasses.replace(params, temperature=0.9),
        [0],
        [],
        [EOS],
    )
    assert chi_square_test(counts, hotter)[2] < 0.001
    impossible = [0.0] * vocab
    # all mass on one token: the other draws are impossible
    impossible[int(logits_row.argmax())] = 1.0
    assert chi_square_test(counts, impossible)[2] == 0.0


# --------------------------------------------------------------------------------------
# -------
# The counter-based noise


def mix32_reference(x: int) -> int:
    """lowbias32 on Python ints: no overflow, so the int64 wrap-around is checked."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_on_all_32_bit_words():
    from minillm.sampler import mix32

    rng = random.Random(0)
    words = [0, 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    ours = mix32(torch.tensor(words, dtype=torch.int64)).tolist()
    assert ours == [mix32_reference(w) for w in words]
    # a bijection: no two of 2**20 consecutive words collide
    start = rng.randrange(2**32 - 2**20)
    block = mix32(torch.arange(start, start + 2**20, dtype=torch.int64))
    assert block.unique().numel() == 2**20 and int(block.min()) >= 0


def test_uniform_stays_strictly_inside_zero_one():
    # the largest and smallest words, where a 24-bit grid would round U to 1
    extremes = torch.tensor([0, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_bits(extremes)
    assert u.tolist() == [2.0**-24, 1 - 2.0**-24]
    assert (-torch.log(u) > 0).all()  # E > 0: a token with p = 0 gets p / E = 0
    grid = uniform_from_bits(torch.arange(2**23, dtype=torch.int64) << 9)
    assert (grid.diff() > 0).all() and grid.max() < 1  # every cell its own value


def test_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([5, 5, 5 + 2**32, -3, 2**62, 5])
    positions = torch.tensor([0, 1, 0, 4, 4, 0])
    noise = exponential_noise(seeds, positions, 777)  # (6, 777)
    for row in range(6):  # alone
        alone = exponential_noise(seeds[row : row + 1], positions[row : row + 1], 777)
        assert torch.equal(alone[0], noise[row])
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # at other row indices
    assert torch.equal(
        exponential_noise(seeds[order], positions[order], 777), noise[order]
    )
    # a longer vocabulary extends the row: token v's number does not depend on it
    assert torch.equal(exponential_noise(seeds, positions, 1000)[:, :777], noise)
    assert torch.equal(noise[0], noise[5])  # same seed, same position
    for a, b in [(0, 1), (0, 2), (3, 4)]:  # another position, seed, or high word
        assert (noise[a] != noise[b]).float().mean() > 0.99
    assert noise.dtype == torch.float32 and (noise > 0).all()


def test_noise_follows_exp_1():
    # 1,048,576 draws: 64 rows of consecutive seeds and positions
    sample = exponential_noise(torch.arange(64), torch.arange(64) % 5, 16_384)
    sample = sample.flatten().double()
    n = sample.numel()
    assert abs(sample.mean() - 1) < 5 / n**0.5  # standard error of the mean 1/sqrt(n)
    assert (
        abs(sample.var() - 1) < 10 / n**0.5
    )  # that of the variance, about 2.8/sqrt(n)
    cdf = 1 - torch.exp(-sample.sort().values)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max()
    assert ks < 1.63 / n**0.5  # Kolmogorov-Smirnov at the 1% level
    # and no correlation between neighbouring tokens of a row
    rows = sample.view(64, 16_384)
    corr = torch.corrcoef(torch.stack([rows[:, :-1].flatten(), rows[:, 1:].flatten()]))
    assert abs(corr[0, 1]) < 5 / n**0.5


def test_stream_keys_seeded_rows_keep_their_seed_others_follow_the_generator():
    params = [SamplingParams(seed=11), SamplingParams(), SamplingParams(seed=-2)]
    params += [SamplingParams()]
    md = metadata(params, 16)
    keys = stream_keys(md, torch.Generator().manual_seed(3))
    expected = torch.randint(
        -(2**63),
        2**63 - 1,
        (4,),
        dtype=torch.int64,
        generator=torch.Generator().manual_seed(3),
    )
    assert keys.tolist() == [11, int(expected[1]), -2, int(expected[3])]
    again = stream_keys(md, torch.Generator().manual_seed(4))
    assert again[[0, 2]].tolist() == [11, -2] and again[1] != keys[1]


def test_top_p_keeps_a_tie_group_at_the_boundary_whole():
    # sorted: 0.4, then three tied at 0.15, then 0.1 and 0.05; top-p 0.6 reaches its
    # mass inside the tie group, so all three stay (a cut by position kept two)
    probs = torch.tensor([0.15, 0.4, 0.05, 0.15, 0.1, 0.15])
    logits = probs.log()[None]  # (1, 6)
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.6]))
    assert support(kept[0].exp()) == {0, 1, 3, 5}
    reference = reference_probs(logits[0].tolist(), SamplingParams(top_p=0.6), [], [])
    assert support(torch.tensor(reference)) == {0, 1, 3, 5}
    # top-k 2 keeps the ties with the 2nd largest; top-p then measures those four
    both = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.5]))
    assert support(both[0].exp()) == {0, 1, 3, 5}


def test_top_p_on_tied_bf16_logits_matches_the_reference():
    vocab = 64
    for trial in range(20):
        # bf16 rounding: many exact ties
        logits = random_logits(4, vocab, seed=trial, scale=2.0).bfloat16().float()
        params = [SamplingParams(top_p=p) for p in (0.3, 0.55, 0.83, 0.97)]
        ours = Sampler().sampling_distribution(logits, metadata(params, vocab))
        for row, p in enumerate(params):
            expected = reference_probs(logits[row].tolist(), p, [0], [])
            assert torch.allclose(
                ours[row].double(),
                torch.tensor(expected, dtype=torch.float64),
                atol=1e-6,
            ), (trial, row)


def test_noise_matches_the_integer_reference():
    from minillm.sampler_reference import reference_noise
    from minillm.sampling_metadata import int64_seed

    rng = random.Random(3)
    seeds = [0, -1, 2**63, 2**64 + 7, -(2**63)] + [
        rng.randrange(-(2**80), 2**80) for _ in range(59)
    ]
    positions = [0, 2**31, 2**32 - 1, 5, 2**32 + 5] + [
        rng.randrange(2**32) for _ in range(59)
    ]
    noise = exponential_noise(
        torch.tensor([int64_seed(s) for s in seeds]), torch.tensor(positions), 512
    )
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        for token in (0, 1, rng.randrange(512), 511):
            expected = reference_noise(seed, position, token)
            assert math.isclose(noise[row, token].item(), expected, rel_tol=3e-7)
