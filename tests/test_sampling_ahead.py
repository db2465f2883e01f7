"""Chapter 16, "Penalties and token rules ahead": the per-row counts kept on the
device hold what chapter 7 would count from the token lists, and the steps launched
ahead with penalties, min_tokens, allowed and banned tokens draw chapter 9's tokens.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from minillm.llm import LLM
from minillm.logits_processors import apply_penalties, token_counts
from minillm.request import Request
from minillm.sampling_ahead import PenaltiesState, has_token_rules, uses_penalties
from minillm.sampling_metadata import SamplingMetadata, pad_token_ids
from minillm.sampling_params import SamplingParams

VOCAB = 50


def request(rid, prompt, output, placeholders=0):
    r = Request(rid, prompt, SamplingParams(repetition_penalty=1.2))
    r.append_output_token_ids(output)
    r.num_output_placeholders = placeholders
    return r


def counts_of(tokens):
    return token_counts(torch.tensor([tokens], dtype=torch.int64), VOCAB)[0].int()


def test_rules_are_recognised():
    assert not has_token_rules(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    for rule in [
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=-0.5),
        dict(presence_penalty=0.3),
        dict(min_tokens=2),
        dict(allowed_token_ids=[3, 4]),
        dict(banned_token_ids=[7]),
    ]:
        assert has_token_rules(SamplingParams(**rule)), rule
    assert not uses_penalties(SamplingParams(min_tokens=2, banned_token_ids=[1]))


def test_a_row_is_built_from_the_lists_then_follows_its_request():
    state = PenaltiesState(4, torch.device("cpu"))
    a = request("a", [1, 2, 2], [5, 5, 9])
    state.update([2], [a], VOCAB, None)
    assert torch.equal(state.output_counts[2], counts_of([5, 5, 9]))
    assert state.prompt_seen[2].nonzero().flatten().tolist() == [1, 2]
    a.append_output_token_ids([4])  # a token of a step run in step: from the list
    state.update([2], [a], VOCAB, None)
    assert torch.equal(state.output_counts[2], counts_of([5, 5, 9, 4]))
    assert state.num_rebuilt == 1
    # another request takes the row: rebuilt, nothing of a's left
    b = request("b", [7], [3])
    state.update([2], [b], VOCAB, None)
    assert torch.equal(state.output_counts[2], counts_of([3]))
    assert state.prompt_seen[2].nonzero().flatten().tolist() == [7]
    # a comes back after a preemption, into the same row: rebuilt from its lists
    a.num_preemptions += 1
    state.update([2], [a], VOCAB, None)
    assert torch.equal(state.output_counts[2], counts_of([5, 5, 9, 4]))
    assert state.num_rebuilt == 3


def test_counts_are_int16_where_no_output_can_overflow_them():
    assert PenaltiesState(2, torch.device("cpu"), 2**15 - 1).counts_dtype == torch.int16
    for max_model_len in (2**15, None):
        state = PenaltiesState(2, torch.device("cpu"), max_model_len)
        assert state.counts_dtype == torch.int32
    state = PenaltiesState(2, torch.device("cpu"), 100)
    a = request("a", [1], [7] * 40)
    state.update([0], [a], VOCAB, None)
    assert state.output_counts.dtype == torch.int16 and state.output_counts[0, 7] == 40


def test_the_token_in_flight_is_counted_from_the_device():
    state = PenaltiesState(2, torch.device("cpu"))
    a = request("a", [1], [4, 6])
    state.update([1], [a], VOCAB, None)
    a.num_output_placeholders = 1  # step N drew 11 for it: only the device knows
    other = request("o", [1], [])
    previous = SimpleNamespace(sampling=[other, a], tokens=torch.tensor([0, 11]))
    state.update([1], [a], VOCAB, previous)
    assert torch.equal(state.output_counts[1], counts_of([4, 6, 11]))
    assert state.num_counted[1] == 3 and state.num_rebuilt == 1
    # the CPU reads it and step N+1 draws 11 again: counted once each
    a.append_output_token_ids([11])
    previous = SimpleNamespace(sampling=[a], tokens=torch.tensor([11]))
    state.update([1], [a], VOCAB, previous)
    assert torch.equal(state.output_counts[1], counts_of([4, 6, 11, 11]))
    # a token in flight that was dropped (more counted than the request has): rebuilt
    a.num_output_placeholders = 0
    state.update([1], [a], VOCAB, None)
    assert torch.equal(state.output_counts[1], counts_of([4, 6, 11]))
    assert state.num_rebuilt == 2


def test_apply_is_chapter6s_apply_penalties():
    rng = random.Random(0)
    prompts = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(5)
    ]
    outputs = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for _ in range(5)
    ]
    params = [
        SamplingParams(
            repetition_penalty=rng.choice([1.0, 0.8, 1.3]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.0]),
            presence_penalty=rng.choice([0.0, 0.7]),
        )
        for _ in range(5)
    ]
    md = SamplingMetadata.from_requests(params, prompts, outputs, VOCAB)
    logits = 3 * torch.randn(5, VOCAB)
    expected = apply_penalties(
        logits.clone(),
        md.prompt_token_ids,
        pad_token_ids(outputs, VOCAB),
        md.presence_penalties,
        md.frequency_penalties,
        md.repetition_penalties,
    )
    state = PenaltiesState(8, torch.device("cpu"))
    requests = [request(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    rows = [6, 0, 3, 1, 7]  # batch rows in any order
    state.update(rows, requests, VOCAB, None)
    got = state.apply(logits.clone(), list(range(5)), rows, md)
    assert torch.equal(got, expected)
    # 16-bit logits: a float32 copy, penalised as chapter 7 penalises it
    half = logits.bfloat16()
    got = state.apply(half, list(range(5)), rows, md)
    assert got.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert torch.equal(
        got,
        apply_penalties(
            half.float(),
            md.prompt_token_ids,
            pad_token_ids(outputs, VOCAB),
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        ),
    )


def run(prompts, params, **options):
    common = dict(device="cpu", num_kv_blocks=40, block_size=4, max_num_seqs=8)
    llm = LLM(**{**common, **options})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def ban_token_3(output_ids, logits_row):
    """A per-row logits processor: the kind that still runs in step."""
    logits_row[3] = float("-inf")
    return logits_row


@pytest.mark.parametrize("seed", range(2))
def test_token_rules_run_ahead_with_chapter7s_tokens(tiny, seed):
    """A batch mixing the three penalties, min_tokens, allowed and banned tokens,
    seeded and greedy rows, and chunked prompts runs every step ahead, with the
    synchronous engine's tokens; a per-row processor makes its steps run in step,
    and the counts catch up with the tokens those steps appended."""
    rng = random.Random(seed)
    stop = list(range(0, 2048, 3))
    rules = [
        dict(repetition_penalty=3.0),
        dict(frequency_penalty=2.0, presence_penalty=2.0),
        dict(min_tokens=7, stop_token_ids=stop),
        dict(allowed_token_ids=list(range(100, 160))),
        dict(banned_token_ids=list(range(0, 300))),
        dict(presence_penalty=-0.5, repetition_penalty=0.9, min_tokens=3),
        dict(),
    ]
    prompts, params = [], []
    for i in range(9):
        prompts.append([rng.randrange(1, 2048) for _ in range(rng.randint(2, 30))])
        params.append(
            SamplingParams(
                temperature=rng.choice([0, 0.8, 1.1]),
                top_p=rng.choice([1.0, 0.9]),
                seed=i,  # the same noise in both engines
                max_tokens=rng.randint(6, 16),
                **rules[i % len(rules)],
            )
        )
    sizes = dict(max_num_batched_tokens=24)
    expected, _ = run(prompts, params, persistent_batch=False, **sizes)
    got, ahead = run(
        prompts, params, persistent_batch=True, async_scheduling=True, **sizes
    )
    assert got == expected
    assert ahead.engine.stepper.num_in_step == 0 and ahead.engine.stepper.num_ahead > 0
    assert all(t not in stop for t in got[2][:7])
    # a per-row processor on a short request: its steps run in step, the rest ahead
    params[0] = SamplingParams(
        temperature=0, max_tokens=4, logits_processors=[ban_token_3]
    )
    expected, _ = run(prompts, params, persistent_batch=False, **sizes)
    got, mixed = run(
        prompts, params, persistent_batch=True, async_scheduling=True, **sizes
    )
    assert got == expected
    assert mixed.engine.stepper.num_in_step > 0 and mixed.engine.stepper.num_ahead > 0


def test_preempted_requests_are_rebuilt_with_chapter7s_tokens(tiny):
    """A cache too small for the batch preempts requests with tokens in flight
    (recompute, and swap): each comes back to a row built from its lists, and the
    tokens are the synchronous engine's."""
    rng = random.Random(3)
    prompts = [
        [rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(8)
    ]
    params = [
        SamplingParams(
            temperature=0.9 if i % 2 else 0,
            seed=i,
            max_tokens=18,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.3 * (i % 3),
        )
        for i in range(8)
    ]
    for options in [{}, {"preemption_mode": "swap", "num_cpu_blocks": 64}]:
        sizes = dict(num_kv_blocks=16, max_num_batched_tokens=16, **options)
        expected, ref = run(prompts, params, persistent_batch=False, **sizes)
        got, ahead = run(
            prompts, params, persistent_batch=True, async_scheduling=True, **sizes
        )
        assert got == expected
        engine = ahead.engine
        assert engine.num_preemptions > 0 and engine.stepper.num_in_step == 0
        assert engine.model_runner.penalties.num_rebuilt > len(prompts)


def test_token_rules_run_ahead_on_the_device(device):
    """On a GPU (MINILLM_TEST_DEVICE=cuda): the same rules with the Triton sampling
    kernel and the device's counts, float32, against the synchronous engine."""
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 2048) for _ in range(rng.randint(4, 40))] for _ in range(12)
    ]
    rules = [
        dict(repetition_penalty=1.3, temperature=0.8, top_p=0.95, seed=1),
        dict(frequency_penalty=0.5, presence_penalty=0.5, temperature=0),
        dict(
            min_tokens=8,
            stop_token_ids=list(range(0, 2048, 3)),
            temperature=1.0,
            seed=2,
        ),
        dict(allowed_token_ids=list(range(50, 300)), temperature=0.7, top_k=20, seed=3),
        dict(banned_token_ids=list(range(0, 500)), temperature=0),
        dict(temperature=0.8, top_p=0.9, seed=4),
    ]
    params = [SamplingParams(max_tokens=20, **rules[i % len(rules)]) for i in range(12)]
    common = dict(
        device="cuda", dtype=torch.float32, num_kv_blocks=48, block_size=16,
        max_num_seqs=8, max_num_batched_tokens=64, attention_backend="torch",
        cuda_graphs=False,
    )  # fmt: skip
    expected, _ = run(prompts, params, persistent_batch=False, **common)
    got, ahead = run(
        prompts, params, persistent_batch=True, async_scheduling=True, **common
    )
    assert got == expected
    assert ahead.engine.stepper.num_in_step == 0
    assert ahead.engine.model_runner.penalties.output_counts.is_cuda
