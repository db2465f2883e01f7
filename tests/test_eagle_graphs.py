"""Chapter 21's EAGLE draft on CUDA graphs: the persistent-buffer chain
(EagleGraphRunner) drafts what the eager chain and the one-request reference draft,
in padded buckets and as the batch changes; on a GPU (MINILLM_TEST_DEVICE=cuda) the
captured graphs replay the eager chain's drafts exactly, and the engine with them
writes the tokens of the engine without speculation.
"""

import pytest
import torch
from test_eagle import QUICK
from test_speculative import all_blocks_free, generate

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams
from minillm.speculative.eagle import (
    EagleDraft,
    EagleProposer,
    eagle_propose_ref,
    save_eagle,
    train_eagle,
)
from minillm.speculative.eagle_graphs import EagleGraphRunner
from minillm.tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def random_rows(model, g, lens, device, dtype):
    """Per request: (rows (n, hidden) of features, tokens (n,), context) as propose
    gathers them, n = lens[i] (at most the window's width)."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    out = []
    for n in lens:
        rows = torch.randn(n, hidden, generator=g).to(device, dtype)
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append((rows, tokens))
    return out


def check_batches(proposer, runner, model, device, against_reference=True):
    """Batches of changing sizes through runner.run: the drafts of the same chain
    run eagerly over the same buffers; against_reference: also those of the eager
    chain over propose's own batch and of the one-request reference."""
    g = torch.Generator().manual_seed(0)
    W = proposer.width
    # batch sizes that change from step to step, most padded to a larger bucket
    for lens in ([W], [3, W, 1], [W, W], [1], [5, 2, W, 7, 1], [W] * 8, [2, 4]):
        batch = random_rows(model, g, lens, device, model.lm_head.weight.dtype)
        feats, tokens = [f for f, _ in batch], [t for _, t in batch]
        bucket = min(s for s in runner.sizes if s >= len(lens))
        with torch.inference_mode():
            got = runner.run(feats, tokens).tolist()
            again = proposer.chain(*runner.args(bucket))[: len(lens)].tolist()
            eager = proposer.chain(*proposer.batch(feats, tokens), proposer.k)
        assert got == again and len(got) == len(lens)
        if not against_reference:
            continue
        assert got == eager.tolist()
        for (f, t), chain in zip(batch, got):  # one request at a time, unpadded
            assert chain == eagle_propose_ref(proposer.draft, f, t, proposer.k)


def test_persistent_buffers_draft_what_the_eager_chain_drafts(tiny):
    """On the CPU (nothing captured) the runner runs the chain over its persistent
    buffers: padding rows and stale buffer contents change no request's drafts."""
    model, _ = tiny
    torch.manual_seed(0)
    proposer = EagleProposer(EagleDraft(model), window=10, k=3)
    runner = EagleGraphRunner(proposer, [1, 2, 4, 8])
    check_batches(proposer, runner, model, "cpu")
    assert runner.num_replays == 0


def test_propose_through_the_runner_gives_the_same_drafts(tiny):
    """propose with an (uncaptured) graph runner attached: the drafts of propose
    without it, cut per request to ks, for a batch larger than every bucket too."""
    model, _ = tiny
    torch.manual_seed(1)
    proposer = EagleProposer(EagleDraft(model), window=8, k=4)
    g = torch.Generator().manual_seed(2)
    contexts = [
        torch.randint(0, 2048, (n,), generator=g).tolist() for n in (2, 6, 30, 9, 12)
    ]
    with torch.inference_mode():
        for i, c in enumerate(contexts):
            hidden = model(torch.tensor(c[:-1]), torch.arange(len(c) - 1))
            proposer.observe(str(i), 0, hidden)
    ids = [str(i) for i in range(len(contexts))]
    for ks in ([4, 0, 2, 4, 1], [4, 4, 4, 4, 4], [0, 0, 3, 0, 0]):
        proposer.graphs = None
        want = proposer.propose(ids, contexts, ks)
        for sizes in ([1, 2, 4], [8]):  # 4 live rows: padded or too many
            proposer.graphs = EagleGraphRunner(proposer, sizes)
            assert proposer.propose(ids, contexts, ks) == want
    assert [len(w) for w in want] == ks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_chain_replays_the_eager_drafts(tiny, device, dtype):
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    model = tiny_model(device="cuda", dtype=dtype, progress=False)[0]
    torch.manual_seed(0)
    proposer = EagleProposer(EagleDraft(model), window=12, k=3)
    runner = EagleGraphRunner(proposer, [1, 2, 4, 8])
    runner.capture()
    # bfloat16: the graph against the same shapes run eagerly; other shapes may
    # round differently, and bfloat16 rounds coarsely enough to flip an argmax
    check_batches(proposer, runner, model, "cuda", dtype == torch.float32)
    assert runner.num_replays == 7


@pytest.fixture(scope="module")
def trained_eagle(tiny, tmp_path_factory, device):
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("eagle")
    save_eagle(*train_eagle(model, tokenizer, QUICK), QUICK, folder)
    return folder


def staggered_requests(tokenizer, first, step):
    """7 prefixes of a repeated piece of code, greedy, the i-th running first + i *
    step tokens: requests finish at different steps."""
    code = tokenizer.encode("for x in range(10):\n    print(x)\n" * 3)
    prompts = [code[: 8 + 5 * i] for i in range(7)]
    params = [
        SamplingParams(temperature=0, max_tokens=first + step * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.mark.parametrize("limit", [None, 4])
def test_engine_with_draft_graphs_is_lossless(tiny, trained_eagle, device, limit):
    """The tiny model on the GPU's fast path: with EAGLE's draft on graphs the tokens
    are the engine's without speculation and the eager draft's; requests finish at
    different steps (the batch changes, buckets are padded); with
    disable_by_batch_size = 4 only the buckets below it are captured."""
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    _, tokenizer = tiny
    prompts, params = staggered_requests(tokenizer, 16, 4)
    # graphs and async scheduling as on the fast path; uncompiled layers (quicker)
    common = dict(num_kv_blocks=200, block_size=16, max_num_seqs=8, torch_compile=False)

    def run(spec, eager_draft=False):
        model = tiny_model(device="cuda", dtype=torch.float32, progress=False)[0]
        engine = LLMEngine(model, tokenizer, EngineConfig(**common, **spec))
        runner = engine.model_runner
        if eager_draft and getattr(runner, "proposer", None) is not None:
            runner.proposer.graphs = None
        tokens = [o.token_ids for o in generate(engine, prompts, params)]
        assert all_blocks_free(engine)
        return tokens, runner

    want, plain = run({})
    assert plain.cuda_graphs
    spec = {
        "method": "eagle", "model": str(trained_eagle), "num_speculative_tokens": 3,
        "disable_by_batch_size": limit,
    }  # fmt: skip
    eager, _ = run({"speculative_config": spec}, eager_draft=True)
    got, runner = run({"speculative_config": spec})
    assert got == want and eager == want
    graphs = runner.proposer.graphs
    assert graphs.num_replays > 0 and runner.spec_stats.num_accepted_tokens > 0
    assert graphs.sizes == ([1, 2, 4, 8] if limit is None else [1, 2, 4])


def test_drafts_read_a_step_late_change_no_token(tiny):
    """With a graph runner attached (here uncaptured, on the CPU) EAGLE's drafts
    stay on the device: placeholders on the host, written into the next step's
    token ids on the device (patch_for_pending, which would fail on a placeholder
    left in), read after its forward pass; the tokens are the plain engine's,
    under preemption and batches larger than every bucket."""
    model, tokenizer = tiny
    prompts, params = staggered_requests(tokenizer, 12, 3)
    small = dict(num_kv_blocks=40, block_size=4, max_num_seqs=6)
    expected = generate(
        LLMEngine(model, tokenizer, EngineConfig(**small)), prompts, params
    )
    spec = {"method": "eagle", "num_speculative_tokens": 3}
    config = EngineConfig(**small, persistent_batch=True, speculative_config=spec)
    engine = LLMEngine(model, tokenizer, config)
    runner = engine.model_runner
    runner.proposer.graphs = EagleGraphRunner(runner.proposer, [1, 2, 4])
    settle, late = runner.settle_proposals, []

    def recording():
        late.append(runner.pending is not None)
        settle()

    runner.settle_proposals = recording
    got = generate(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert sum(late) > 0 and runner.spec_stats.num_accepted_tokens > 0
    assert engine.num_preemptions > 0 and all_blocks_free(engine)
