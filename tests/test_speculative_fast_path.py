"""Chapter 21 on chapter 15's fast path: speculation on the persistent batch gives the
tokens of the engine without it (every proposer, preemption, chunked prefill, async
scheduling for the steps too large to speculate); padded verification rows leave the
real tokens alone; greedy verification builds no sampling metadata; and on a GPU
(MINILLM_TEST_DEVICE=cuda) verification steps replay CUDA graphs.
"""

import copy

import numpy as np
import pytest
import torch
from hf_models import MODELS
from test_speculative import (
    all_blocks_free,
    code_prompts,
    generate,
    greedy_then_a_stop,
    repetitive_prompts,
)

from minillm.attention import paged_attention_ref
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.input_batch import StepInputs
from minillm.kv_cache import PagedKVCache
from minillm.llm import LLM
from minillm.model import build_attention_metadata
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampling_params import SamplingParams
from minillm.speculative.eagle import EagleDraft, EagleRecipe, save_eagle
from minillm.speculative.verify_graphs import as_decode_rows

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = dict(num_kv_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
# where the Triton kernels run: the GPU if there is one, else Triton's interpreter
KERNELS_ON = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_on(tiny):
    """{backend: the tiny model where that backend runs} (a copy on a GPU)."""
    model = tiny[0]
    on_gpu = copy.deepcopy(model).to(KERNELS_ON) if KERNELS_ON != "cpu" else model
    return {"torch": model, "triton": on_gpu}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "medusa"])
@pytest.mark.parametrize(
    "options",
    [
        dict(prefix_cache_impl="hash"),
        dict(enable_chunked_prefill=True, max_num_batched_tokens=9, num_kv_blocks=24),
    ],
)
def test_every_proposer_is_lossless_on_the_persistent_batch(tiny, method, options):
    model, tokenizer = tiny
    prompts, code = code_prompts(tokenizer)
    params = greedy_then_a_stop(prompts, code)
    small = {**SMALL, **options}
    expected = generate(
        LLMEngine(model, tokenizer, EngineConfig(**small)), prompts, params
    )
    spec = {"method": method, "num_speculative_tokens": 3}
    config = EngineConfig(**small, persistent_batch=True, speculative_config=spec)
    engine = LLMEngine(model, tokenizer, config)
    assert type(engine.model_runner).__name__ == "SpeculativeGPUModelRunner"
    assert engine.stepper is None  # no async scheduling on a CPU by default
    got = generate(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert engine.num_preemptions > 0
    assert engine.model_runner.spec_stats.num_accepted_tokens > 0
    assert all_blocks_free(engine) and not engine.model_runner.input_batch.req_to_row
    assert not getattr(engine.model_runner.proposer, "features", None)


def test_steps_launched_ahead_neither_verify_nor_propose(tiny):
    """With async scheduling, a step small enough to speculate, or carrying
    proposals, runs in step; the others are launched ahead; the tokens are the
    plain engine's."""
    model, tokenizer = tiny
    prompts, _ = code_prompts(tokenizer)
    expected = generate(
        LLMEngine(model, tokenizer, EngineConfig(**SMALL)), prompts, GREEDY
    )
    # the batch-size switch alone (the acceptance switch's: test_acceptance_switch.py)
    spec = {**NGRAM, "disable_by_batch_size": 4, "disable_by_acceptance": None}
    config = EngineConfig(
        **SMALL, persistent_batch=True, async_scheduling=True, speculative_config=spec
    )
    engine = LLMEngine(model, tokenizer, config)
    runner, launched = engine.model_runner, []
    launch = runner.launch

    def recording(output):
        requests = output.scheduled_requests
        step = launch(output)
        if step is not None:
            launched.append(
                (len(requests), sum(len(r.spec_token_ids) for r in requests))
            )
        return step

    runner.launch = recording
    got = generate(engine, prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert launched and engine.stepper.num_in_step > 0
    assert all(n >= 4 and proposals == 0 for n, proposals in launched)
    assert runner.spec_stats.num_drafts > 0 and all_blocks_free(engine)


def test_greedy_verification_builds_no_sampling_metadata(tiny, monkeypatch):
    """Plainly greedy steps are verified by one argmax: chapter 7's metadata is never
    built (the tokens stay the plain engine's)."""
    model, tokenizer = tiny
    prompts, _ = code_prompts(tokenizer)
    expected = generate(
        LLMEngine(model, tokenizer, EngineConfig(**SMALL)), prompts, GREEDY
    )

    def refuse(*args, **kwargs):
        raise AssertionError("SamplingMetadata built for a greedy step")

    monkeypatch.setattr(SamplingMetadata, "from_requests", refuse)
    for persistent_batch in (False, True):
        config = EngineConfig(
            **SMALL, persistent_batch=persistent_batch, speculative_config=NGRAM
        )
        engine = LLMEngine(model, tokenizer, config)
        got = generate(engine, prompts, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert engine.model_runner.spec_stats.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_on_the_persistent_batch_draws_what_chapter7_runner_draws(
    tiny, method
):
    """Seeded sampled requests (some greedy beside them) draw the same tokens on both
    runners: rejection sampling is the same code on the same logits, and chapter 9's
    runner's draws follow the target's distribution (test_speculative.py,
    test_eagle.py)."""
    model, tokenizer = tiny
    prompts, _ = code_prompts(tokenizer)
    params = [
        SamplingParams(
            temperature=0 if i % 3 == 0 else 0.8, top_k=20, seed=i, max_tokens=16,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    # every step verifies: the acceptance switch would pause sampled rows' lookups
    spec = {"method": method, "num_speculative_tokens": 3}
    spec["disable_by_acceptance"] = None
    tokens = []
    for persistent_batch in (False, True):
        config = EngineConfig(
            **SMALL, persistent_batch=persistent_batch, speculative_config=spec
        )
        engine = LLMEngine(model, tokenizer, config)
        tokens.append([o.token_ids for o in generate(engine, prompts, params)])
        assert engine.model_runner.spec_stats.num_draft_tokens > 0  # verified
    assert tokens[0] == tokens[1]


def step_inputs(query_lens, seq_lens, tables, block_size, ids) -> StepInputs:
    positions, md = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    return StepInputs(
        np.array(ids), positions.numpy(), md.slot_mapping.numpy(),
        md.query_start_loc.numpy(), md.seq_lens.numpy(), md.block_tables.numpy(),
        True,
    )  # fmt: skip


def chunked_batch(model, backend, seed, block_size, q):
    """A random step of 5 chunks of 1..q tokens over contexts of their own (blocks 0
    to 62), and two caches of 64 blocks holding the same random context."""
    g = torch.Generator().manual_seed(seed)
    query_lens = torch.randint(1, q + 1, (5,), generator=g).tolist()
    seq_lens = [n + int(torch.randint(0, 14, (1,), generator=g)) for n in query_lens]
    tables, free = [], iter(range(64))
    for s in seq_lens:
        tables.append([next(free) for _ in range(-(-s // block_size))])
    if backend == "triton":
        from minillm.kernels.paged_attention import triton_paged_attention as attend
    else:
        attend = paged_attention_ref
    caches, on = [], next(model.parameters()).device
    for _ in range(2):
        cache = PagedKVCache(model.config, 64, block_size, attend, torch.float32, on)
        context = torch.Generator().manual_seed(seed)  # the same context in both
        for part in (cache.key_cache, cache.value_cache):
            part.copy_(torch.randn(part.shape, generator=context))
        caches.append(cache)
    ids = torch.randint(2, 2048, (sum(query_lens),), generator=g).tolist()
    inputs = step_inputs(query_lens, seq_lens, tables, block_size, ids)
    return inputs, caches


def hidden_states(model, steps, caches):
    """The model's hidden states for each step, on its own cache."""
    hidden = []
    for step, cache in zip(steps, caches):
        ids, positions, md = step.to_device(cache.key_cache.device)
        with torch.inference_mode():
            hidden.append(model(ids, positions, md, cache))
    return hidden


def test_cuda_graphs_replay_verification_steps(hf_checkpoint, tmp_path, device):
    """On a GPU, the defaults there (Triton attention, CUDA graphs, compiled layers),
    float32: greedy tokens with n-gram lookup and with an EAGLE draft equal the fast
    engine's without speculation, under preemption and chunked prefill; verification
    steps replayed graphs of 1 + k tokens per sequence, padded ones included."""
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    _, path = hf_checkpoint(*MODELS[1])
    common = dict(
        device="cuda", dtype=torch.float32, num_kv_blocks=40, block_size=4,
        max_num_seqs=8, max_num_batched_tokens=32, skip_tokenizer_init=True,
    )  # fmt: skip
    prompts = repetitive_prompts(12, 384, seed=4)
    plain = LLM(path, **common)
    want = [
        o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)
    ]
    assert plain.engine.model_runner.cuda_graphs
    folder = tmp_path / "eagle"
    folder.mkdir()
    torch.manual_seed(0)
    save_eagle(EagleDraft(plain.engine.model), {}, EagleRecipe(window=8), folder)
    del plain
    for spec in (NGRAM, {"method": "eagle", "model": str(folder)}):
        llm = LLM(path, **common, speculative_config=spec)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        runner = llm.engine.model_runner
        assert runner.cuda_graphs and runner.verify_graphs.q == 4
        assert runner.verify_graphs.num_replays > 0
        assert runner.spec_stats.num_drafts > 0
        assert llm.engine.num_preemptions > 0 and all_blocks_free(llm.engine)
        del llm


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_decode_rows_give_the_chunks_hidden_states(tiny_on, backend, seed):
    """A batch of chunks of 1..q tokens run as one decode row per token
    (as_decode_rows, what the verification graphs replay): the hidden states and
    the K/V written are the chunked batch's."""
    model = tiny_on[backend]
    inputs, caches = chunked_batch(model, backend, seed, block_size=4, q=4)
    rows = as_decode_rows(inputs)
    assert rows.max_query_len == 1 and rows.num_seqs == len(inputs.input_ids)
    hidden = hidden_states(model, (inputs, rows), caches)
    assert torch.allclose(hidden[1], hidden[0], atol=1e-4)
    for name in ("key_cache", "value_cache"):
        a, b = (getattr(c, name) for c in caches)
        assert torch.allclose(a, b, atol=1e-4)
