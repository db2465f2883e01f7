"""Chapter 15: the persistent batch (and, on a GPU, CUDA graphs) give the tokens of
chapter 9's runner.
"""

import pytest
import torch
import transformers
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
)
from hf_models import MODELS, SHAPE
from helpers import TIGHT, mixed_prompts

from minillm.cuda_graph import default_capture_sizes
from minillm.config import EngineConfig
from minillm.llm import LLM
from minillm.logprobs import sampled_logprob, top_logprobs
from minillm.sampling_params import SamplingParams

transformers.logging.set_verbosity_error()
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts_with_shared_prefixes(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(
            1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g
        ).tolist()
        out.append(prefix + tail if i % 2 else tail)
    return out


def all_blocks_free(llm):
    """No request holds a block; a radix tree's cached blocks are all evictable."""
    manager = llm.engine.kv_cache_manager
    held_by_tree = manager.tree.evictable_size if hasattr(manager, "tree") else 0
    return (
        manager.block_pool.get_num_free_blocks() + held_by_tree == manager.num_blocks
        and not manager.req_to_blocks
    )


@pytest.mark.parametrize("cls, config", MODELS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"prefix_cache_impl": "hash"},
        {"prefix_cache_impl": "radix"},
        {"preemption_mode": "swap", "num_cpu_blocks": 64},
    ],
)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_persistent_batch_matches_chapter7_runner(
    hf_checkpoint, device, cls, config, options, async_scheduling
):
    """Greedy tokens under chunked prefill and preemption (and prefix caching or
    swapping), float32.

    On a GPU the fast engine also uses the defaults there: Triton attention and CUDA
    graphs; the reference is chapter 9's runner with chapter 5's PyTorch attention.
    """
    _, path = hf_checkpoint(cls, config)
    prompts = prompts_with_shared_prefixes(16, 384)
    common = dict(TIGHT, device=device, dtype=torch.float32, **options)
    reference = LLM(
        path,
        skip_tokenizer_init=True,
        attention_backend="torch",
        persistent_batch=False,
        cuda_graphs=False,
        **common,
    )
    fast = LLM(
        path,
        skip_tokenizer_init=True,
        persistent_batch=True,
        async_scheduling=async_scheduling,
        **common,
    )
    expected = [
        o.outputs[0].token_ids
        for o in reference.generate(prompts, GREEDY, use_tqdm=False)
    ]
    got = [
        o.outputs[0].token_ids for o in fast.generate(prompts, GREEDY, use_tqdm=False)
    ]
    assert got == expected
    assert fast.engine.num_preemptions > 0 and all_blocks_free(fast)
    assert type(fast.engine.model_runner).__name__ == "GPUModelRunner"
    assert (fast.engine.stepper is not None) == async_scheduling
    if async_scheduling:  # greedy throughout: every step runs ahead
        assert (
            fast.engine.stepper.num_ahead > 0 and fast.engine.stepper.num_in_step == 0
        )
    if device == "cuda":
        assert fast.engine.model_runner.cuda_graphs
        assert fast.engine.parts["attention_backend"] == "triton"
        assert fast.engine.model_runner.num_graph_steps > 0


def test_persistent_batch_samples_like_chapter7_runner(tiny, device):
    """Seeded random sampling and logprobs go through chapter 7's sampler unchanged
    (same attention).
    """
    common = dict(
        device=device,
        dtype=torch.float32,
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        attention_backend="torch",
        cuda_graphs=False,
    )
    params = [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=12, logprobs=2)
        for i in range(6)
    ]
    params[2] = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [1] * 30, [2, 3]]
    ref = LLM(persistent_batch=False, **common).generate(
        prompts, params, use_tqdm=False
    )
    got = LLM(persistent_batch=True, **common).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert (la is None) == (lb is None)
        if la is not None:
            assert [sampled_logprob(p)[1].logprob for p in la] == pytest.approx(
                [sampled_logprob(p)[1].logprob for p in lb]
            )
            assert top_logprobs(la[0], 1)[0][0] == top_logprobs(lb[0], 1)[0][0]


@pytest.mark.parametrize(
    "cls, config",
    MODELS + [(Qwen2ForCausalLM, Qwen2Config(**SHAPE, num_key_value_heads=2))],
)
def test_merged_projections_change_nothing(hf_checkpoint, cls, config):
    """merge_projections (qkv_proj, gate_up_proj; Qwen2's q/k/v biases too): same
    logits, same engine tokens.
    """
    import copy

    from minillm.engine import LLMEngine
    from minillm.hf import load_model
    from minillm.merged_projections import MergedAttention, MergedMLP, merge_projections

    _, path = hf_checkpoint(cls, config)
    model = load_model(path)
    merged = copy.deepcopy(model)
    merge_projections(merged)
    assert all(
        type(layer.self_attn) is MergedAttention and type(layer.mlp) is MergedMLP
        for layer in merged.model.layers
    )
    modules = {part for n, _ in merged.named_parameters() for part in n.split(".")}
    assert not modules & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert {"qkv_proj", "gate_up_proj"} <= modules
    ids = torch.randint(0, 384, (2, 30))
    positions = torch.arange(30).expand(2, 30)
    with torch.no_grad():
        assert torch.allclose(merged(ids, positions), model(ids, positions), atol=1e-5)
    prompts = prompts_with_shared_prefixes(6, 384)
    tokens = []
    for m in (model, merged):
        engine = LLMEngine(
            m,
            None,
            EngineConfig(
                num_kv_blocks=40,
                block_size=4,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                persistent_batch=m is merged,
            ),
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update(
                {
                    o.request_id: o.outputs[0].token_ids
                    for o in engine.step()
                    if o.finished
                }
            )
        tokens.append([done[str(i)] for i in range(len(prompts))])
    assert tokens[0] == tokens[1]
    merge_projections(merged)  # a second call finds nothing left to merge
    assert type(merged.model.layers[0].self_attn) is MergedAttention
    from minillm.hf import save_pretrained

    target = path.parent / "merged_copy"
    with pytest.raises(ValueError, match="merged for serving"):
        save_pretrained(merged, None, target)
    assert not target.exists()  # refused before anything was written


def compare_with_chapter7(prompts, params, **options):
    """Run both engines on the tiny model; assert equal tokens, finish reasons and
    text; return the fast LLM.
    """
    common = dict(TIGHT, **options)
    expected = LLM(persistent_batch=False, **common).generate(
        prompts, params, use_tqdm=False
    )
    fast = LLM(persistent_batch=True, async_scheduling=True, **common)
    got = fast.generate(prompts, params, use_tqdm=False)
    for a, b in zip(expected, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (b.outputs[0].finish_reason, b.outputs[0].text) == (
            a.outputs[0].finish_reason,
            a.outputs[0].text,
        )
    assert all_blocks_free(fast)
    return expected, fast


def overlapped_or_not(tiny, overlap, **sizes):
    """The tiny model's engine in blocks of 4 tokens: chapter 16's overlapped loop
    (persistent batch and async scheduling) if overlap, else chapter 9's loop."""
    from minillm.engine import LLMEngine

    config = EngineConfig(
        block_size=4, persistent_batch=overlap, async_scheduling=overlap, **sizes
    )
    return LLMEngine(*tiny, config)


def test_async_scheduling_stops_like_chapter7(tiny):
    """Stop tokens, EOS, max_tokens of 1, the model's context, preemption: the
    overlapped loop stops every request at the same token as chapter 9's loop, and
    the tokens computed past a stop are dropped.
    """
    prompts = mixed_prompts(16, 200, seed=0, longest=39)
    free_run = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    runs, _ = compare_with_chapter7(prompts, free_run)
    params = []
    # stop on a token the request really produces, at different depths
    for i, run in enumerate(runs):
        tokens = run.outputs[0].token_ids
        stop = [tokens[2 + i % 9]] if i % 3 == 0 else None
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=[1, None, 7, None][i % 4],
                stop_token_ids=stop,
                # EOS ends some requests; others run into the context cap
                ignore_eos=i % 4 != 3,
            )
        )
    expected, fast = compare_with_chapter7(prompts, params, max_model_len=48)
    reasons = [o.outputs[0].finish_reason for o in expected]
    assert "stop" in reasons and "length" in reasons
    # context cap
    assert any(
        len(p) + len(o.outputs[0].token_ids) == 48 for p, o in zip(prompts, expected)
    )
    assert fast.engine.num_preemptions > 0


def test_async_scheduling_computes_no_token_past_a_length_stop(tiny):
    """When every stop is known in advance (max_tokens, the context), the overlapped
    loop computes exactly the tokens chapter 9's loop computes: no step is spent on a
    request whose last token is pending.
    """

    prompts = [[5, 6, 7], [8] * 20, [9, 10, 11, 12, 13], [14, 15] * 9]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 9, 4)
    ]
    # until the context is full
    params.append(SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    scheduled = []
    for overlap in (False, True):
        engine = overlapped_or_not(tiny, overlap, num_kv_blocks=40, max_model_len=30)
        schedule, total = engine.scheduler.schedule, [0]

        def counting_schedule(schedule=schedule, total=total):
            output = schedule()
            total[0] += output.total_num_scheduled_tokens
            return output

        engine.scheduler.schedule = counting_schedule
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        while engine.has_unfinished_requests():
            engine.step()
        scheduled.append(total[0])
    assert scheduled[0] == scheduled[1]


def test_async_scheduling_streams_only_real_tokens(tiny):
    """Every step's outputs (cumulative, n=2, a request added mid-run, stop tokens) are
    a prefix of chapter 9's final tokens, the final ones are chapter 9's, and every
    placeholder count returns to 0.
    """

    late = [3, 4, 5, 6]
    prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12] * 9}
    params = {
        "a": SamplingParams(temperature=0, max_tokens=8, n=2),
        "b": SamplingParams(temperature=0, max_tokens=12),
        "c": SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[7, 9, 11]),
    }
    finals, streams = [], []
    for overlap in (False, True):
        engine = overlapped_or_not(tiny, overlap, num_kv_blocks=40, max_num_seqs=4)
        for rid, p in prompts.items():
            engine.add_request(rid, p, params[rid])
        requests = dict(engine.scheduler.requests)
        final, stream, calls = {}, [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                stream += [(out.request_id, c.index, c.token_ids) for c in out.outputs]
                if out.finished:
                    final[out.request_id] = [c.token_ids for c in out.outputs]
            calls += 1
            if calls == 3:
                engine.add_request(
                    "late", late, SamplingParams(temperature=0, max_tokens=6)
                )
                requests.update(engine.scheduler.requests)
        assert all(
            r.num_output_placeholders == 0 and r.is_finished for r in requests.values()
        )
        finals.append(final)
        streams.append(stream)
    assert finals[0] == finals[1] and len(finals[0]["a"]) == 2
    for stream in streams:
        for request_id, index, tokens in stream:
            assert tokens == finals[0][request_id][index][: len(tokens)]


def test_async_scheduling_preempts_a_request_with_a_token_in_flight(tiny, monkeypatch):
    """A request preempted while its token is still on the device (a placeholder count
    of 1) gets that token when the same engine step reads it, before anything can
    recompute the request, which then starts again from real tokens only; the tokens
    are chapter 9's (recompute with a hash prefix cache, and swap).
    """
    from minillm.async_scheduling import AsyncStepper
    from minillm.scheduler import Scheduler
    from minillm.swap import SwapScheduler

    # requests preempted with a token in flight, and their num_tokens then
    pending, num_in_flight = [], [0]
    take_tokens = AsyncStepper._take_tokens

    def checking_take_tokens(self, step):
        outputs = take_tokens(self, step)
        for request, num_tokens in pending:
            assert (request.num_output_placeholders, request.num_tokens) == (
                0,
                num_tokens + 1,
            )
            assert request in self.engine.scheduler.waiting or request in getattr(
                self.engine.scheduler, "swapped", ()
            )
        pending.clear()
        return outputs

    monkeypatch.setattr(AsyncStepper, "_take_tokens", checking_take_tokens)
    prompts = mixed_prompts(12, 200, seed=1, longest=29)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for base, options in [
        (Scheduler, {"prefix_cache_impl": "hash"}),
        (SwapScheduler, {"preemption_mode": "swap", "num_cpu_blocks": 64}),
    ]:
        preempt = base._preempt

        def recording_preempt(self, request, preempt=preempt):
            if request.num_output_placeholders:
                pending.append((request, request.num_tokens))
                num_in_flight[0] += 1
            preempt(self, request)

        with monkeypatch.context() as patch:
            patch.setattr(base, "_preempt", recording_preempt)
            num_in_flight[0] = 0
            compare_with_chapter7(prompts, params, **options)
        assert num_in_flight[0] > 0  # the case this test is about happened


@pytest.mark.parametrize("seed", range(4))
def test_async_scheduling_fuzz_add_abort_stop(tiny, seed):
    """Random arrivals, aborts, stop tokens, max_tokens, n=2 and a few requests that
    need the full sampler: the overlapped loop reports what chapter 9's loop reports
    for every request that is not aborted, an aborted request only ever reports a
    prefix of its tokens, and every placeholder count ends at 0.
    """
    import random

    rng = random.Random(seed)
    # engine step call -> request ids added / aborted before it
    arrivals, aborts = {}, {}
    prompts, free = {}, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    for i in range(14):
        rid = f"r{i}"
        prompts[rid] = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 26))]
        arrival = rng.randrange(12)
        arrivals.setdefault(arrival, []).append(rid)
        if rng.random() < 0.4:
            aborts.setdefault(arrival + rng.randrange(1, 10), []).append(rid)

    def run(params, overlap, with_aborts):
        sizes = dict(num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=16)
        engine = overlapped_or_not(tiny, overlap, **sizes, max_model_len=48)
        requests, reported, final, call = {}, {}, {}, 0
        while call <= max(*arrivals, *aborts) or engine.has_unfinished_requests():
            for rid in arrivals.get(call, []):
                engine.add_request(rid, prompts[rid], params[rid])
                requests.update(engine.scheduler.requests)
            for rid in aborts.get(call, []) if with_aborts else []:
                engine.abort_request(rid)
            for out in engine.step():
                reported.setdefault(out.request_id, []).append(
                    [c.token_ids for c in out.outputs]
                )
                if out.finished:
                    final[out.request_id] = [
                        (c.token_ids, c.finish_reason) for c in out.outputs
                    ]
            call += 1
        for _ in range(2):
            # nothing left to run: drains a step still in flight for an aborted request
            engine.step()
        assert all(
            r.num_output_placeholders == 0 and r.is_finished for r in requests.values()
        )
        assert not engine.kv_cache_manager.req_to_blocks
        return reported, final, engine

    free_run = run({rid: free for rid in prompts}, False, False)[1]
    params = {}
    # stop on tokens the request really produces; some need chapter 7's sampler
    for i, rid in enumerate(prompts):
        tokens = free_run[rid][0][0]
        stop = [rng.choice(tokens)] if rng.random() < 0.4 else None
        params[rid] = SamplingParams(
            temperature=0,
            max_tokens=rng.choice([1, 3, 9, None]),
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.7,
            n=2 if i % 5 == 0 else 1,
            repetition_penalty=1.3 if i % 7 == 5 else 1.0,  # runs ahead
            # a per-row processor needs chapter 7's sampler in step
            logits_processors=[ban_token_3] if i % 7 == 3 else None,
        )
    reference = run(params, False, False)[1]
    aborted = {rid for rids in aborts.values() for rid in rids}
    results = [run(params, overlap, True) for overlap in (False, True)]
    for reported, final, _ in results:
        for rid in prompts:
            if rid not in aborted or rid in final:
                assert final[rid] == reference[rid]
            for outputs in reported.get(rid, []):
                for index, tokens in enumerate(outputs):
                    assert tokens == reference[rid][index][0][: len(tokens)]
    stepper = results[1][2].stepper
    assert stepper.num_ahead > 0 and stepper.num_in_step > 0


def ban_token_3(output_ids, logits_row):
    """A per-row logits processor (chapter 7): what a step launched ahead cannot run."""
    logits_row[3] = float("-inf")
    return logits_row


def test_async_scheduling_falls_back_for_sampled_requests(tiny):
    """A batch with a per-row logits processor runs chapter 9's sampler in step; the
    other steps overlap (penalties among them).
    """
    prompts = [
        [5, 6, 7],
        [8],
        [9, 10, 11, 12, 13],
        [14, 15],
        [1] * 30,
        [2, 3],
        [4, 4, 4],
        [20, 21],
    ]
    params = [SamplingParams(temperature=0, max_tokens=12) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=5)
    params[4] = SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3)
    params[5] = SamplingParams(
        temperature=0, max_tokens=6, logits_processors=[ban_token_3]
    )
    _, fast = compare_with_chapter7(prompts, params)
    stepper = fast.engine.stepper
    assert stepper.num_in_step > 0 and stepper.num_ahead > 0  # both kinds of step ran


def test_async_scheduling_launches_sampled_batches_ahead(tiny):
    """Temperature, top-k, top-p, min-p and seeds next to greedy rows: every step
    launches ahead and draws chapter 9's tokens; fused_sampling=False falls back."""
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [1] * 30, [2, 3]]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=7),
        SamplingParams(temperature=0.6, min_p=0.1, top_p=0.9, seed=3, max_tokens=12),
        SamplingParams(temperature=1.3, seed=4, max_tokens=10),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.5, seed=5, max_tokens=12),
    ]
    _, fast = compare_with_chapter7(prompts, params)
    stepper = fast.engine.stepper
    assert stepper.num_ahead > 0 and stepper.num_in_step == 0
    _, slow = compare_with_chapter7(prompts, params, fused_sampling=False)
    assert slow.engine.stepper.num_in_step > 0


def test_unseeded_rows_take_the_same_path_as_seeded(tiny):
    """A request without a seed runs ahead and draws on the device exactly as a seeded
    one does (issue 46): as many steps launched ahead, none in step, and every draw
    through sample_on_device, whose keys come from the engine's stream."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    cuts = [dict(top_p=0.95), dict(top_k=20), dict(min_p=0.1), {}]
    counts = {}
    for seeded in (False, True):
        params = [
            SamplingParams(
                temperature=0.8,
                max_tokens=10,
                ignore_eos=True,
                **cut,
                **({"seed": i} if seeded else {}),
            )  # fmt: skip
            for i, cut in enumerate(cuts)
        ]
        llm = LLM(device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
                  persistent_batch=True, async_scheduling=True)  # fmt: skip
        runner, draws = llm.engine.model_runner, []
        draw = runner.sample_on_device

        def recorded(logits, md, draw=draw, draws=draws):
            draws.append(md.seeded.tolist())
            return draw(logits, md)

        runner.sample_on_device = recorded
        llm.generate(prompts, params, use_tqdm=False)
        stepper = llm.engine.stepper
        assert stepper.num_in_step == 0 and draws
        assert all(row == seeded for rows in draws for row in rows)
        counts[seeded] = (stepper.num_ahead, len(draws))
        llm.shutdown()
    assert counts[False] == counts[True]


def test_async_scheduling_logprobs_run_ahead(tiny):
    """Batches asking for logprobs run ahead, with chapter 9's logprobs."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=i,
            max_tokens=10,
            ignore_eos=True,
            logprobs=2,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(temperature=0, max_tokens=7, logprobs=4)
    params[3] = SamplingParams(temperature=0.5, seed=9, max_tokens=8)  # none asked
    common = dict(device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    ahead = LLM(**common, persistent_batch=True, async_scheduling=True)
    got = ahead.generate(prompts, params, use_tqdm=False)
    assert ahead.engine.stepper.num_in_step == 0  # every step ran ahead
    reference = LLM(**common, persistent_batch=False)
    expected = reference.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.outputs[0].logprobs is None) == (b.outputs[0].logprobs is None)
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            (xt, xl), (yt, yl) = sampled_logprob(x), sampled_logprob(y)
            assert (xt, xl.rank) == (yt, yl.rank)
            assert xl.logprob == pytest.approx(yl.logprob, abs=1e-5)
            assert [t for t, _ in top_logprobs(x, len(x))] == [
                t for t, _ in top_logprobs(y, len(y))
            ]


def test_async_scheduling_unseeded_rows_run_ahead(tiny):
    """Unseeded sampled rows draw a fresh key per step, on the fast path too."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
    fast = LLM(
        device="cpu", num_kv_blocks=40, block_size=4, persistent_batch=True,
        async_scheduling=True,
    )  # fmt: skip
    outs = fast.generate([[5, 6, 7], [8, 9]] * 2, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
    assert fast.engine.stepper.num_in_step == 0


def test_async_scheduling_abort_in_flight(tiny):
    """Aborting a request whose token is being computed: it never reports, the others
    are unaffected.
    """
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    model, tokenizer = tiny
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    expected = [
        o.outputs[0].token_ids
        for o in LLM(device="cpu", num_kv_blocks=40).generate(
            prompts, params, use_tqdm=False
        )
    ]
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(num_kv_blocks=40, persistent_batch=True, async_scheduling=True),
    )
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs = {}
    for _ in range(3):
        for o in engine.step():
            outputs[o.request_id] = o
    assert engine.stepper.in_flight is not None
    engine.abort_request("1")
    reported_after_abort = set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
            reported_after_abort.add(o.request_id)
    # its token in flight was dropped
    assert "1" in outputs and "1" not in reported_after_abort
    assert [outputs[k].outputs[0].token_ids for k in ("0", "2")] == [
        expected[0],
        expected[2],
    ]
    assert not engine.kv_cache_manager.req_to_blocks


def test_one_token_prompt_chunks_do_not_sample(tiny):
    """A step where every sequence has one token, but one of them is a piece of a
    longer prompt.
    """
    prompts = [[5], [6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(
        device="cpu",
        num_kv_blocks=32,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=2,
    )
    expected = [
        o.outputs[0].token_ids
        for o in LLM(persistent_batch=False, **common).generate(
            prompts, params, use_tqdm=False
        )
    ]
    llm = LLM(persistent_batch=True, **common)
    got = [
        o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    assert got == expected and all(len(t) == 6 for t in got)


def test_rows_are_reused_and_freed(tiny):
    llm = LLM(
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=3,
        persistent_batch=True,
    )
    for _ in range(3):  # more requests over time than the batch has rows
        llm.generate(
            [[1, 2, 3]] * 5,
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    batch = llm.engine.model_runner.input_batch
    assert not batch.req_to_row and sorted(batch.free_rows) == [0, 1, 2]


def test_configuration_errors():
    with pytest.raises(ValueError, match="persistent batch"):
        EngineConfig(cuda_graphs=True, persistent_batch=False)
    with pytest.raises(ValueError, match="triton"):
        EngineConfig(cuda_graphs=True, attention_backend="torch")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            LLM(
                device="cpu",
                num_kv_blocks=16,
                cuda_graphs=True,
                persistent_batch=True,
                attention_backend="triton",
            )
        with pytest.raises(ValueError, match="persistent batch"):
            LLM(device="cpu", num_kv_blocks=16, cuda_graphs=True)


def resolve(config: EngineConfig, device_type: str) -> tuple:
    """What an engine on device_type chooses for config: (attention backend,
    persistent batch, CUDA graphs, compiled layers, async scheduling)."""
    from minillm.gpu_model_runner import GPUModelRunner
    from minillm.registry import PART_CHECKS, REGISTRIES

    parts = {"device": device_type}
    for registry in REGISTRIES:
        parts[registry.option] = registry.resolve(
            getattr(config, registry.option), device_type
        )
    for check in PART_CHECKS:
        check(config, parts)
    persistent = parts["persistent_batch"]
    flags = GPUModelRunner.fast_path(config, parts) if persistent else (False,) * 3
    return (parts["attention_backend"], persistent, *flags)


def test_what_the_defaults_mean_on_each_device():
    assert resolve(EngineConfig(), "cuda") == ("triton", True, True, True, True)
    assert resolve(EngineConfig(), "cpu") == ("torch", False, False, False, False)
    assert resolve(EngineConfig(cuda_graphs=False), "cuda") == (
        "triton",
        True,
        False,
        False,
        False,
    )
    assert resolve(EngineConfig(attention_backend="torch"), "cuda") == (
        "torch",
        True,
        False,
        False,
        False,
    )
    assert resolve(EngineConfig(persistent_batch=True), "cpu") == (
        "torch",
        True,
        False,
        False,
        False,
    )
    assert resolve(
        EngineConfig(persistent_batch=True, async_scheduling=True), "cpu"
    ) == ("torch", True, False, False, True)
    with pytest.raises(ValueError, match="persistent batch"):
        resolve(EngineConfig(async_scheduling=True), "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        resolve(EngineConfig(persistent_batch=True, cuda_graphs=True), "cpu")
    with pytest.raises(ValueError, match="persistent batch"):
        resolve(EngineConfig(torch_compile=True), "cpu")
    # the engine runs the same lookup: a runner that cannot serve the options fails
    # before anything is built
    with pytest.raises(ValueError, match="persistent batch"):
        LLM(device="cpu", num_kv_blocks=16, async_scheduling=True)


def test_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 35


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_bf16_engine_with_graphs_agrees_with_transformers(tmp_path):
    """bf16 greedy tokens of the engine (Triton, CUDA graphs, compiled layers) against
    transformers in bf16.

    Rounding differs between the two, so a near-tie can flip a token, after which
    free-running sequences diverge for good. So we compare step by step: transformers
    reads the prompt plus the engine's output in one forward pass, and at every position
    its argmax must be the engine's next token, on at least 99% of positions (the rate
    is printed).
    """
    from minillm.hf import save_pretrained
    from minillm.tiny import tiny_model

    model, tokenizer = tiny_model(progress=False)
    save_pretrained(model, tokenizer, tmp_path)
    reference = (
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16
        )
        .cuda()
        .eval()
    )
    texts = [
        'The "for" statement',
        "A class definition",
        "Exceptions are raised when",
        "x = 1",
        "The import",
        "Assignment statements",
        "When a",
        "The while loop",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    llm = LLM(tmp_path, dtype=torch.bfloat16, max_num_seqs=8, num_kv_blocks=256)
    assert llm.engine.model_runner.cuda_graphs and llm.engine.model_runner.torch_compile
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    same = total = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            predicted = (
                reference(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
            )
        same += sum(a == b for a, b in zip(tokens, predicted))
        total += len(tokens)
    print(
        f"bf16 next-token agreement with transformers: {same / total:.4f} of {total} "
        "positions"
    )
    assert same / total >= 0.99


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the heap is frozen on the GPU path only"
)
def test_a_second_gpu_engine_gets_back_the_memory_of_the_first(tmp_path):
    """The runner freezes the heap after capture (gc.freeze); an engine dropped by its
    caller is then garbage the collector cannot see, until the next engine's memory
    profiling unfreezes and collects.
    """
    import gc

    from minillm.hf import save_pretrained
    from minillm.tiny import tiny_model

    model, tokenizer = tiny_model(progress=False)
    save_pretrained(model, tokenizer, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(
        tmp_path, dtype=torch.bfloat16, max_num_seqs=8, gpu_memory_utilization=0.3
    )
    assert llm.engine.model_runner.cuda_graphs and gc.get_freeze_count() > 0
    first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    held = torch.cuda.memory_allocated()
    del llm
    # with 30% of the GPU each, a second engine only fits if the first one's KV cache
    # was returned
    llm = LLM(
        tmp_path, dtype=torch.bfloat16, max_num_seqs=8, gpu_memory_utilization=0.3
    )
    assert torch.cuda.memory_allocated() <= held * 1.1
    assert (
        llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        == first
    )


def test_token_rules_ahead_with_graphs_match_sampling_in_step(hf_checkpoint, device):
    """On a GPU (MINILLM_TEST_DEVICE=cuda), the defaults there: bf16, Triton attention,
    CUDA graphs, compiled layers. Penalties, allowed and banned tokens and seeds
    launched ahead (the sampling kernel on float32 penalised logits, the device's
    counts) give the tokens of the same engine sampling in step with chapter 7's
    sampler; ignore_eos keeps both engines' batches the same step by step."""
    if device != "cuda":
        pytest.skip("needs MINILLM_TEST_DEVICE=cuda")
    _, path = hf_checkpoint(*MODELS[0])
    prompts = prompts_with_shared_prefixes(12, 384, seed=2)
    rules = [
        dict(repetition_penalty=1.3, temperature=0.8, top_p=0.95),
        dict(frequency_penalty=0.5, presence_penalty=0.5, temperature=0),
        dict(allowed_token_ids=list(range(50, 200)), temperature=0.7, top_k=20),
        dict(banned_token_ids=list(range(0, 150)), temperature=1.0),
        dict(temperature=0.8, top_p=0.9, presence_penalty=-0.5),
        dict(temperature=0),
    ]
    params = [
        SamplingParams(seed=i, max_tokens=24, ignore_eos=True, **rules[i % len(rules)])
        for i in range(len(prompts))
    ]
    common = dict(
        device="cuda", dtype=torch.bfloat16, num_kv_blocks=64, block_size=16,
        max_num_seqs=8, max_num_batched_tokens=64, skip_tokenizer_init=True,
    )  # fmt: skip
    tokens = []
    for overlap in (False, True):
        llm = LLM(path, persistent_batch=True, async_scheduling=overlap, **common)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.model_runner.cuda_graphs
        assert llm.engine.model_runner.num_graph_steps > 0
    assert tokens[0] == tokens[1]
    assert llm.engine.stepper.num_in_step == 0
    assert llm.engine.model_runner.penalties.output_counts.is_cuda


def test_warm_lm_head_runs_every_row_count_a_step_can_sample(tiny):
    """Start-up on a GPU runs the LM head at 1 to max_num_seqs rows, so that no
    cuBLAS kernel is loaded for the first time in the middle of a run."""
    from minillm.gpu_model_runner import warm_lm_head

    model = tiny[0]
    rows = []
    hook = model.lm_head.register_forward_hook(
        lambda module, args, out: rows.append((args[0].shape[0], out.shape[0]))
    )
    try:
        warm_lm_head(model, 12)
    finally:
        hook.remove()
    assert rows == [(n, n) for n in range(1, 13)]
