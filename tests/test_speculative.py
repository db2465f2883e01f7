"""Speculative decoding (chapter 21): verification against its reference and the
target's distribution, the n-gram proposer against brute force, and the engine with
speculation against the engine without it and against transformers.
"""

import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from transformers import LlamaConfig, LlamaForCausalLM
from hf_models import MODELS, SHAPE, hf_greedy
from helpers import TIGHT

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.llm import LLM
from minillm.sampler_reference import chi_square_test
from minillm.sampling_params import SamplingParams
from minillm.speculative.ngram import NgramProposer, ngram_propose_ref
from minillm.speculative.rejection import (
    greedy_accept,
    rejection_sample,
    rejection_sample_ref,
)

transformers.logging.set_verbosity_error()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def all_blocks_free(engine):
    """No request holds a block; each is free or held once by a radix tree."""
    kv = engine.kv_cache_manager
    tree = getattr(kv, "tree", None)
    in_tree = {id(b) for n in tree.nodes() for b in n.value} if tree else set()
    return not kv.req_to_blocks and all(
        b.ref_cnt == (id(b) in in_tree) for b in kv.block_pool.blocks
    )


def generate(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        p = params[i] if isinstance(params, list) else params
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))]


def repetitive_prompts(n, vocab, seed=0):
    """Prompts that repeat a random phrase (many proposals) and random ones (few)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        phrase = torch.randint(1, vocab, (int(torch.randint(3, 8, (1,), generator=g)),))
        length = int(torch.randint(4, 50, (1,), generator=g))
        if i % 3 == 2:
            prompts.append(torch.randint(1, vocab, (length,), generator=g).tolist())
        else:
            prompts.append((phrase.tolist() * 12)[:length])
    return prompts


def code_prompts(tokenizer):
    """Prefixes of a repeated piece of code and repetitive_prompts (proposals find
    matches), the first again at the end (a shared prefix); and the code's ids."""
    code = tokenizer.encode("for x in range(10):\n    print(x)\n" * 3)
    prompts = [code[: 10 + 6 * i] for i in range(5)] + repetitive_prompts(4, 2048, 1)
    return prompts + [prompts[0]], code


def greedy_then_a_stop(prompts, code):
    """GREEDY for every prompt but the last, which stops at the token code[8]."""
    stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[code[8]])
    return [GREEDY] * (len(prompts) - 1) + [stop]


def small_sizes(num_kv_blocks, options):
    """Engine sizes in blocks of 4 tokens for 6 sequences, with chunks of 24 tokens
    unless options sets its own max_num_batched_tokens (taken out of options)."""
    chunk = options.pop("max_num_batched_tokens", 24)
    return dict(
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=chunk,
    )


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(1, 6),
    vocab=st.integers(2, 9),
    full_q=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rejection_sample_matches_its_reference(k, vocab, full_q, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=g).pow(4).softmax(-1)
    p[:, 0] = 0.0  # a token the target never takes
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(k, vocab, generator=g).softmax(-1) if full_q else None
    drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
    fast = rejection_sample(drafts, p, q, torch.Generator().manual_seed(seed))
    slow = rejection_sample_ref(drafts, p, q, torch.Generator().manual_seed(seed))
    assert fast == slow
    assert 1 <= len(fast) <= k + 1 and fast[:-1] == drafts[: len(fast) - 1]
    assert 0 not in fast  # never a token of target probability 0
    one_hot = torch.nn.functional.one_hot(p.argmax(-1), vocab).float()
    assert greedy_accept(drafts, p.argmax(-1).tolist()) == rejection_sample(
        drafts, one_hot
    )


@pytest.mark.parametrize("point_mass", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """First and second tokens of a 2-proposal run follow p, whatever q is."""
    p = torch.tensor(
        [
            [0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.00, 0.10, 0.25, 0.30, 0.30],
            [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],
        ]
    )
    q = torch.tensor(
        [[0.10, 0.10, 0.20, 0.20, 0.20, 0.20], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]]
    )
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(2, 6, dtype=torch.long)
    for _ in range(6000):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        out = rejection_sample(drafts, p, None if point_mass else q, g)
        if len(out) == 1:
            d = int(torch.multinomial(q[1], 1, generator=g))
            out += rejection_sample([d], p[1:], None if point_mass else q[1:], g)
        for position in range(2):
            counts[position, out[position]] += 1
    for position in range(2):
        _, _, p_value = chi_square_test(counts[position].tolist(), p[position].tolist())
        assert p_value > 1e-4
        _, _, p_q = chi_square_test(counts[position].tolist(), q[position].tolist())
        assert p_q < 1e-6


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(1, 5),
    ns=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_ngram_proposer_matches_brute_force(ids, k, ns):
    min_n, max_n = ns[0], ns[0] + ns[1]
    assert NgramProposer(min_n, max_n).propose(ids, k) == ngram_propose_ref(
        ids, k, min_n, max_n
    )


@pytest.mark.parametrize("cls, config", MODELS)
def test_greedy_matches_transformers_under_preemption_and_chunked_prefill(
    hf_checkpoint, cls, config
):
    reference, path = hf_checkpoint(cls, config)
    prompts = repetitive_prompts(12, 384)
    llm = LLM(path, **TIGHT, speculative_config=NGRAM)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.engine
    assert engine.num_preemptions > 0
    assert engine.model_runner.spec_stats.num_drafts > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24)
    assert all_blocks_free(engine)


@pytest.mark.parametrize(
    "options",
    [
        dict(prefix_cache_impl="hash"),
        dict(prefix_cache_impl="radix"),
        dict(preemption_mode="swap", num_cpu_blocks=64),
        dict(enable_chunked_prefill=True, max_num_batched_tokens=9),
    ],
)
def test_tiny_model_is_unchanged_by_speculation(tiny, options):
    model, tokenizer = tiny
    prompts, code = code_prompts(tokenizer)
    params = greedy_then_a_stop(prompts, code)
    small = small_sizes(40, options)
    base = LLMEngine(model, tokenizer, EngineConfig(**small, **options))
    expected = [o.token_ids for o in generate(base, prompts, params)]
    runs = [("ngram", 1), ("ngram", 4), ("draft_model", 3)]
    for method, k in runs if "prefix_cache_impl" in options else runs[1:]:
        spec = {"method": method, "num_speculative_tokens": k}
        config = EngineConfig(**small, **options, speculative_config=spec)
        engine = LLMEngine(model, tokenizer, config)
        outputs = generate(engine, prompts, params)
        assert [o.token_ids for o in outputs] == expected
        assert engine.model_runner.spec_stats.num_accepted_tokens > 0
        assert all_blocks_free(engine)


def test_limits_and_stops_hold_inside_a_verified_step(tiny):
    """max_tokens, stop token ids and EOS end a request at the same token as without
    speculation, even when a step verifies several tokens past them."""
    model, tokenizer = tiny
    loop = ([5, 6, 7, 8] * 10)[:30]
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=NGRAM)
    )
    base = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5)
    ]
    first = generate(base, [loop], GREEDY)[0].token_ids
    params.append(
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first[3]])
    )
    params.append(SamplingParams(temperature=0, max_tokens=24))  # EOS as the model says
    outputs = generate(engine, [loop] * len(params), params)
    expected = generate(base, [loop] * len(params), params)
    for got, want, p in zip(outputs, expected, params):
        assert (
            got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        )
        assert len(got.token_ids) <= p.max_tokens
    assert engine.model_runner.spec_stats.num_drafts > 0


def test_requests_it_cannot_verify_decode_one_token_at_a_time(tiny):
    model, tokenizer = tiny
    loop = ([5, 6, 7, 8] * 10)[:30]
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=NGRAM)
    )
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zz"]),
    ]
    outputs = generate(engine, [loop, loop], params)
    base = generate(
        LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64)),
        [loop, loop],
        params,
    )
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    assert len(outputs[0].logprobs) == 12
    assert engine.model_runner.spec_stats.num_drafts == 0


def test_disable_by_batch_size_turns_proposals_off_in_large_steps(tiny):
    model, tokenizer = tiny
    loop = ([5, 6, 7, 8] * 10)[:30]
    spec = {**NGRAM, "disable_by_batch_size": 4}
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
    )
    generate(engine, [loop] * 4, GREEDY)
    assert engine.model_runner.spec_stats.num_drafts == 0
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
    )
    generate(engine, [loop] * 3, GREEDY)
    assert engine.model_runner.spec_stats.num_drafts > 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "suffix"}, "one of"),
        ({"num_speculative_tokens": 3}, "needs 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "k": 3}, "takes"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "<="),
    ],
)
def test_bad_speculative_config_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(num_kv_blocks=64, speculative_config=spec)


def test_metrics_and_server_flag(tiny):
    """/metrics carries the runner's counts under vLLM's names; the server's
    --speculative-config builds a speculating engine."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from minillm.metrics import EngineMetrics
    from minillm.server import build_engine, parse_args

    model, tokenizer = tiny
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=NGRAM)
    )
    metrics = EngineMetrics("tiny")
    engine.add_request("a", ([5, 6, 7, 8] * 10)[:30], GREEDY)
    while engine.has_unfinished_requests():
        metrics.record_step(engine.step(), engine)
    stats = engine.model_runner.spec_stats
    assert stats.num_drafts > 0
    text = generate_latest(metrics.registry).decode()
    for name, value in [
        ("num_drafts", stats.num_drafts),
        ("num_draft_tokens", stats.num_draft_tokens),
        ("num_accepted_tokens", stats.num_accepted_tokens),
    ]:
        assert (
            f'minillm:spec_decode_{name}_total{{model_name="tiny"}} {value:.1f}' in text
        )
    first = stats.num_accepted_tokens_per_pos[0]
    per_pos = 'minillm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny"'
    assert f'{per_pos},position="0"}} {first:.1f}' in text
    args = parse_args(
        [
            "--device",
            "cpu",
            "--num-kv-blocks",
            "64",
            "--speculative-config",
            '{"method": "ngram"}',
        ]
    )
    served, _ = build_engine(args)
    assert hasattr(served.model_runner, "spec_stats")


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(hf_checkpoint):
    """The draft-model path at full acceptance: the target as its own draft."""
    cls, config = LlamaForCausalLM, LlamaConfig(**SHAPE, num_key_value_heads=2)
    reference, path = hf_checkpoint(cls, config)
    prompts = repetitive_prompts(6, 384, seed=2)
    common = dict(device="cpu", num_kv_blocks=40, block_size=4, max_num_seqs=4)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}
    llm = LLM(path, **common, max_num_batched_tokens=24, speculative_config=spec)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    base = LLM(path, **common, max_num_batched_tokens=24)
    expected = base.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in expected
    ]
    stats = llm.engine.model_runner.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert all_blocks_free(llm.engine)
    assert not llm.engine.model_runner.proposer.tokens  # forgotten with the requests


def test_a_draft_with_another_vocabulary_is_refused(hf_checkpoint, tiny):
    _, path = hf_checkpoint(LlamaForCausalLM, LlamaConfig(**SHAPE))
    model, tokenizer = tiny
    spec = {"method": "draft_model", "model": str(path)}
    with pytest.raises(ValueError, match="another vocabulary"):
        LLMEngine(
            model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
        )


def test_penalties_and_min_tokens_see_the_proposals_before_each_row(tiny):
    """Each verified row is penalised with the output so far *and* the proposals
    before it, as one-token-at-a-time decoding would have penalised it."""
    model, tokenizer = tiny
    loop = ([5, 6, 7, 8] * 10)[:30]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **extra)
        for extra in (
            dict(repetition_penalty=1.3),
            dict(presence_penalty=0.8, frequency_penalty=0.4),
        )
    ]
    params.append(SamplingParams(temperature=0, max_tokens=16, min_tokens=8))
    spec = {**NGRAM, "prompt_lookup_min": 1}
    engine = LLMEngine(
        model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
    )
    outputs = generate(engine, [loop] * 3, params)
    base = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    expected = generate(base, [loop] * 3, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert engine.model_runner.spec_stats.num_drafts > 0
