"""Chapter 21's EAGLE proposer: the batched chain against its reference, the feature
buffer's bookkeeping, and the engine with EAGLE against the engine without it
(greedy: identical tokens; sampling: the target's distribution)."""

import json
from dataclasses import asdict, replace

import pytest
import torch
from transformers import Qwen3ForCausalLM
from hf_models import MODELS
from test_speculative import greedy_then_a_stop, small_sizes

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.llm import LLM
from minillm.sampler_reference import chi_square_test
from minillm.sampling_params import SamplingParams
from minillm.speculative.eagle import (
    EagleDraft,
    EagleProposer,
    EagleRecipe,
    eagle_propose_ref,
    save_eagle,
    train_eagle,
)
from minillm.speculative.medusa import MedusaRecipe, train_medusa

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
QWEN3 = next(config for cls, config in MODELS if cls is Qwen3ForCausalLM)
QUICK = EagleRecipe(num_prompts=48, steps=40, batch_size=8)  # seconds, not a minute


@pytest.fixture(scope="module")
def quick_eagle(tiny, tmp_path_factory):
    """The folder of an EAGLE draft of the tiny model trained briefly: it guesses
    some tokens right and many wrong, so both paths run."""
    model, tokenizer = tiny
    folder = tmp_path_factory.mktemp("eagle")
    save_eagle(*train_eagle(model, tokenizer, QUICK), QUICK, folder)
    return folder


@pytest.fixture(scope="module")
def quick_medusa(tiny, tmp_path_factory):
    """Medusa heads of the tiny model, trained briefly on the same data."""
    from safetensors.torch import save_file

    model, tokenizer = tiny
    recipe = MedusaRecipe(data=QUICK, steps=60, batch_size=64)
    heads, _ = train_medusa(model, tokenizer, recipe)
    folder = tmp_path_factory.mktemp("medusa")
    save_file(heads.state_dict(), folder / "medusa.safetensors")
    (folder / "recipe.json").write_text(json.dumps(asdict(recipe)))
    return folder


def generate(engine, prompts, params, abort_after=None):
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, params[i] if isinstance(params, list) else params
        )
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == abort_after:
            engine.abort_request(["1", "4"])
    return [done.get(str(i)) for i in range(len(prompts))]


def prompts_of(tokenizer):
    code = tokenizer.encode("for x in range(10):\n    print(x)\n" * 3)
    g = torch.Generator().manual_seed(0)
    prompts = [code[: 10 + 7 * i] for i in range(6)]
    prompts += [torch.randint(2, 2048, (n,), generator=g).tolist() for n in (5, 40)]
    return prompts + [prompts[2]], code  # a shared prefix


def test_batched_chain_matches_the_reference(tiny):
    model, _ = tiny
    torch.manual_seed(0)
    proposer = EagleProposer(EagleDraft(model), window=8, k=4)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (2, 6, 30)]
    with torch.inference_mode():
        for i, c in enumerate(contexts):  # two chunks, as chunked prefill hands them
            hidden = model(torch.tensor(c[:-1]), torch.arange(len(c) - 1))
            proposer.observe(str(i), 0, hidden[: len(c) // 2])
            proposer.observe(str(i), len(c) // 2, hidden[len(c) // 2 :])
    ks = [4, 0, 2]
    out = proposer.propose(["0", "1", "2"], contexts, ks)
    width = 8 - max(ks) + 1
    for i, (c, k) in enumerate(zip(contexts, ks)):
        rows = proposer.features[str(i)][1][-width:]
        assert out[i] == eagle_propose_ref(proposer.draft, rows, c, k)
    assert [len(o) for o in out] == ks


def test_observe_keeps_only_settled_features(tiny):
    """Rows replace what they recompute; a gap or an earlier start drops the rest."""
    model, _ = tiny
    p = EagleProposer(EagleDraft(model), window=4, k=2)
    rows = torch.arange(12.0)[:, None].expand(12, 3)
    p.observe("a", 0, rows[:6])
    p.observe("a", 4, rows[6:9])  # a verification from position 4: 4, 5 replaced
    first, kept = p.features["a"]
    assert first + len(kept) == 7 and len(kept) == 6  # window + k rows at most
    assert kept[-1, 0] == 8 and kept[-3, 0] == 6
    p.observe("a", 20, rows[:2])  # a gap: start anew
    assert p.features["a"][0] == 20 and len(p.features["a"][1]) == 2
    p.observe("a", 0, rows[:3])  # preempted and recomputed
    assert p.features["a"][0] == 0 and p.features["a"][1][:, 0].tolist() == [0, 1, 2]
    p.forget("a")
    assert not p.features


@pytest.mark.parametrize(
    "options",
    [
        dict(prefix_cache_impl="hash"),
        dict(preemption_mode="swap", num_cpu_blocks=64),
        dict(enable_chunked_prefill=True, max_num_batched_tokens=9),
    ],
)
def test_greedy_is_unchanged_by_eagle(tiny, quick_eagle, options):
    model, tokenizer = tiny
    prompts, code = prompts_of(tokenizer)
    params = greedy_then_a_stop(prompts, code)
    small = small_sizes(28, options)
    base = LLMEngine(model, tokenizer, EngineConfig(**small, **options))
    expected = generate(base, prompts, params)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(quick_eagle)}
    engine = LLMEngine(
        model, tokenizer, EngineConfig(**small, **options, speculative_config=spec)
    )
    assert generate(engine, prompts, params) == expected
    stats = engine.model_runner.spec_stats
    assert engine.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both kinds
    assert (
        stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    )
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    kv = engine.kv_cache_manager
    assert not kv.req_to_blocks and not engine.model_runner.proposer.features


def test_steps_too_large_to_draft_keep_no_features(tiny, quick_eagle):
    """disable_by_batch_size: a step of that many requests drafts nothing and keeps
    no features; drafting resumes once the batch is smaller, tokens unchanged."""
    model, tokenizer = tiny
    prompts, _ = prompts_of(tokenizer)
    params = [
        SamplingParams(temperature=0, max_tokens=6 if i % 2 else 30, ignore_eos=True)
        for i in range(len(prompts))
    ]
    small = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8)
    expected = generate(
        LLMEngine(model, tokenizer, EngineConfig(**small)), prompts, params
    )
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(quick_eagle)}
    spec["disable_by_batch_size"] = 3
    engine = LLMEngine(model, tokenizer, EngineConfig(**small, speculative_config=spec))
    runner, seen = engine.model_runner, []
    execute = runner.execute_model

    def recording(output):
        result = execute(output)
        seen.append((len(output.scheduled_requests), len(runner.proposer.features)))
        return result

    runner.execute_model = recording
    assert generate(engine, prompts, params) == expected
    assert any(n >= 3 for n, _ in seen) and all(f == 0 for n, f in seen if n >= 3)
    assert any(f > 0 for n, f in seen if n < 3) and runner.spec_stats.num_drafts > 0


def test_aborted_requests_leave_no_blocks_or_features(tiny, quick_eagle):
    model, tokenizer = tiny
    prompts, _ = prompts_of(tokenizer)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(quick_eagle)}
    config = EngineConfig(num_kv_blocks=64, block_size=4, speculative_config=spec)
    engine = LLMEngine(model, tokenizer, config)
    out = generate(engine, prompts, GREEDY, abort_after=3)
    assert out[1] is None and out[4] is None and out[0] is not None
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not engine.model_runner.proposer.features


def test_sampling_with_eagle_follows_the_target(tiny, quick_eagle):
    """Tokens 2 and 3 come out of verifications; their counts over seeded requests
    must fit the target's exact distribution (top-k 3 makes it enumerable)."""
    from minillm.sampler import Sampler
    from minillm.sampling_metadata import SamplingMetadata

    model, tokenizer = tiny
    prompt = prompts_of(tokenizer)[1][:24]
    params = SamplingParams(temperature=0.9, top_k=3, max_tokens=4, ignore_eos=True)
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": str(quick_eagle)}
    spec["disable_by_batch_size"] = None  # verify in steps of 64 requests too
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=64, speculative_config=spec)
    engine = LLMEngine(model, tokenizer, config)
    n = 240
    outputs = generate(
        engine, [prompt] * n, [replace(params, seed=i) for i in range(n)]
    )
    stats = engine.model_runner.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens

    def probs(ids):
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            logits = model.compute_logits(hidden[-1:])
        md = SamplingMetadata.from_requests([params], [ids], [[]], logits.shape[-1])
        return Sampler().sampling_distribution(logits, md)[0]

    marginal = [torch.zeros(2048) for _ in range(3)]

    def walk(ids, weight, level):  # the exact law of tokens 1..3
        p = probs(ids)
        marginal[level] += weight * p
        for t in p.nonzero().flatten().tolist() if level < 2 else []:
            walk(ids + [t], weight * p[t].item(), level + 1)

    walk(prompt, 1.0, 0)
    for position in (1, 2):
        counts = torch.bincount(
            torch.tensor([o[position] for o in outputs]), minlength=2048
        )
        support = marginal[position].nonzero().flatten()
        assert counts.sum() == counts[support].sum()
        expected = marginal[position][support].tolist()
        assert chi_square_test(counts[support].tolist(), expected)[2] > 1e-3


def test_random_qwen3_with_a_random_draft(hf_checkpoint, tmp_path):
    """A draft that is almost always wrong, on a Qwen3 (q/k norm) checkpoint: the
    output is still the target's, under preemption and chunked prefill."""
    _, path = hf_checkpoint(Qwen3ForCausalLM, QWEN3)
    common = dict(device="cpu", num_kv_blocks=30, block_size=4, max_num_seqs=6)
    common["max_num_batched_tokens"] = 16
    base = LLM(path, **common)
    torch.manual_seed(0)
    folder = tmp_path / "draft"
    folder.mkdir()
    save_eagle(EagleDraft(base.engine.model), {}, EagleRecipe(window=8), folder)
    spec = {"method": "eagle", "num_speculative_tokens": 4, "model": str(folder)}
    llm = LLM(path, **common, speculative_config=spec)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(1, 384, (n,), generator=g).tolist() for n in (3, 9, 17, 30)
    ]
    prompts += [[7, 8, 9] * 8]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = base.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in want
    ]
    assert (
        llm.engine.num_preemptions > 0 and llm.engine.model_runner.spec_stats.num_drafts
    )


def test_a_draft_of_another_target_is_refused(tiny, hf_checkpoint, tmp_path):
    model, tokenizer = tiny
    _, path = hf_checkpoint(Qwen3ForCausalLM, QWEN3)
    other = LLM(path, device="cpu", num_kv_blocks=16).engine.model
    save_eagle(EagleDraft(other), {}, EagleRecipe(), tmp_path)
    spec = {"method": "eagle", "model": str(tmp_path)}
    with pytest.raises(ValueError, match="does not fit"):
        LLMEngine(
            model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
        )


@pytest.mark.parametrize(
    "options",
    [dict(prefix_cache_impl="hash"), dict(enable_chunked_prefill=True)],
)
def test_greedy_is_unchanged_by_medusa(tiny, quick_medusa, options):
    """Medusa's heads through the same runner hook: the same tokens, no leftovers,
    and aborted requests forgotten."""
    model, tokenizer = tiny
    prompts, _ = prompts_of(tokenizer)
    small = dict(num_kv_blocks=28, block_size=4, max_num_seqs=6)
    small["max_num_batched_tokens"] = 9 if "enable_chunked_prefill" in options else 24
    base = LLMEngine(model, tokenizer, EngineConfig(**small, **options))
    expected = generate(base, prompts, GREEDY)
    spec = {"method": "medusa", "num_speculative_tokens": 3, "model": str(quick_medusa)}
    config = EngineConfig(**small, **options, speculative_config=spec)
    engine = LLMEngine(model, tokenizer, config)
    assert generate(engine, prompts, GREEDY) == expected
    stats = engine.model_runner.spec_stats
    assert engine.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert not engine.kv_cache_manager.req_to_blocks
    assert not engine.model_runner.proposer.features
    aborted = generate(LLMEngine(model, tokenizer, config), prompts, GREEDY, 3)
    assert aborted[1] is None and aborted[0] == expected[0]


def test_more_speculative_tokens_than_medusa_heads_is_refused(tiny, quick_medusa):
    model, tokenizer = tiny
    spec = {"method": "medusa", "num_speculative_tokens": 5, "model": str(quick_medusa)}
    with pytest.raises(ValueError, match="4 Medusa heads"):
        LLMEngine(
            model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config=spec)
        )


def test_server_flag_builds_an_eagle_engine(quick_eagle):
    pytest.importorskip("prometheus_client")
    from minillm.server import build_engine, parse_args

    spec = json.dumps({"method": "eagle", "model": str(quick_eagle)})
    args = parse_args(
        ["--device", "cpu", "--num-kv-blocks", "64", "--speculative-config", spec]
    )
    served, _ = build_engine(args)
    assert isinstance(served.model_runner.proposer, EagleProposer)
