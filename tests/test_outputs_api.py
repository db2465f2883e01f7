"""Outputs shaped as vLLM 0.32's (vllm/outputs.py, vllm/logprobs.py): logprobs as
list[dict[int, Logprob]], cumulative_logprob, prompt_logprobs, finish and stop reasons
(issue 43). Logprobs are checked against the full-sequence forward pass of the same
model, through each runner and with the prompt split into chunks."""

import pytest
import torch

from minillm.llm import LLM
from minillm.logprobs import Logprob, sampled_logprob, top_logprobs
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams

PROMPT = "The value of the expression is computed from the operands, and then"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


@torch.inference_mode()
def full_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 log_softmax of the model's logits over the whole
    sequence at once: the reference."""
    model = llm.engine.model
    hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    return model.compute_logits(hidden).float().log_softmax(-1)


def check_positions(positions, ids, reference, k, first):
    """positions[i] scores token ids[first + i] given the tokens before it."""
    for i, pos in enumerate(positions):
        target, row = ids[first + i], reference[first + i - 1]
        token, lp = sampled_logprob(pos)
        assert token == target and isinstance(lp, Logprob)
        assert lp.logprob == pytest.approx(row[target].item(), abs=2e-4)
        assert lp.rank == int((row >= row[target]).sum())
        top = top_logprobs(pos, k)
        assert [t for t, _ in top] == row.topk(k).indices.tolist()
        assert [v.rank for _, v in top] == list(range(1, k + 1))
        assert len(pos) in (k, k + 1) and (len(pos) == k) == (lp.rank <= k)


def test_logprobs_shape_and_values(llm):
    k = 3
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=k)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and out.finished and out.metrics is not None
    assert out.prompt_logprobs is None
    c = out.outputs[0]
    assert c.finished and c.finished() is True  # vLLM's is a method
    assert isinstance(c.logprobs, list) and len(c.logprobs) == len(c.token_ids)
    assert all(isinstance(pos, dict) for pos in c.logprobs)
    ids = out.prompt_token_ids + c.token_ids
    reference = full_logprobs(llm, ids)
    check_positions(c.logprobs, ids, reference, k, len(out.prompt_token_ids))
    assert c.cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids))
    )
    tok = llm.tokenizer
    for pos in c.logprobs:
        for token, lp in pos.items():
            assert lp.decoded_token == tok.decode([token], skip_special_tokens=False)


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    with pytest.raises(ValueError, match="max_logprobs"):  # vLLM's cap: 20
        llm.generate(["A"], SamplingParams(logprobs=-1), use_tqdm=False)
    llm = LLM(device="cpu", max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1)
    c = llm.generate(["A"], params, use_tqdm=False)[0].outputs[0]
    vocab = llm.engine.vocab_size
    assert all(len(pos) == vocab for pos in c.logprobs)
    assert sum(lp.logprob for lp in c.logprobs[0].values()) < 0
    total = torch.tensor([lp.logprob for lp in c.logprobs[0].values()]).exp().sum()
    assert total.item() == pytest.approx(1.0, abs=1e-4)


def test_no_logprobs_asked(llm):
    c = llm.generate(["A"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


RUNNERS = {
    "chapter 9": dict(persistent_batch=False),
    "chapter 16": dict(persistent_batch=True),
    "chapter 16, async": dict(persistent_batch=True, async_scheduling=True),
}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("chunk", [1024, 7])
def test_prompt_logprobs_match_the_full_forward(runner, chunk):
    """The prompt scored by the runner, in one step or in chunks of 7 tokens (chunked
    prefill), equals log_softmax of one forward over the whole prompt."""
    llm = LLM(
        device="cpu", max_num_batched_tokens=chunk, max_num_seqs=4, **RUNNERS[runner]
    )
    k = 4
    prompts = [PROMPT, "A short one", PROMPT + " so on"]
    params = [
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k),
        SamplingParams(temperature=0, max_tokens=4),  # no prompt logprobs in the batch
        SamplingParams(temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=0),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for out, p in zip([outs[0], outs[2]], [params[0], params[2]]):
        ids = out.prompt_token_ids
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        check_positions(plp[1:], ids, full_logprobs(llm, ids), p.prompt_logprobs, 1)
    llm.engine.shutdown()


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_prompt_logprobs_with_the_prefix_cached(cache):
    """A prompt whose blocks are all cached is still scored at every position: a
    request asking for prompt_logprobs reads nothing from the prefix cache."""
    llm = LLM(device="cpu", block_size=4, prefix_cache_impl=cache)
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)  # cached
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    check_positions(out.prompt_logprobs[1:], ids, full_logprobs(llm, ids), 2, 1)
    (again,) = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0  # others still read it
    llm.engine.shutdown()


def test_prompt_logprobs_survive_preemption_and_n():
    """A cache so small that requests are preempted and recomputed: every prompt
    position is still reported once; n children share one list."""
    llm = LLM(
        device="cpu",
        num_kv_blocks=6,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=6, prompt_logprobs=1, ignore_eos=True
    )
    outs = llm.generate(
        ["The value of the", "A class definition is"] * 2, params, use_tqdm=False
    )
    assert llm.engine.num_preemptions > 0
    for out in outs:
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids)
        check_positions(out.prompt_logprobs[1:], ids, full_logprobs(llm, ids), 1, 1)


def test_prompt_logprobs_in_delta_outputs_come_once(llm):
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=4, prompt_logprobs=2, output_kind="delta"
    )
    engine.add_request("d", PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    assert len(seen[0]) == len(engine.tokenizer.encode(PROMPT))
    assert all(p == [] for p in seen[1:]) and len(seen) > 1


def test_finish_and_stop_reasons(llm):
    tok, gen = llm.tokenizer, llm.generate
    eos = tok.eos_token_id

    def one(**kwargs):
        return gen(["A"], SamplingParams(**kwargs), use_tqdm=False)[0].outputs[0]

    c = one(temperature=0, max_tokens=3, ignore_eos=True)
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    c = one(allowed_token_ids=[eos], max_tokens=5)  # EOS: stop, no stop_reason
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", None, [eos])
    c = one(allowed_token_ids=[7], stop_token_ids=[7], max_tokens=5)
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", 7, [7])
    text = one(temperature=0, max_tokens=8, ignore_eos=True).text
    c = one(temperature=0, max_tokens=8, ignore_eos=True, stop=[text[2:4]])
    assert (c.finish_reason, c.stop_reason) == ("stop", text[2:4])


def test_max_logprobs_cap():
    capped = LLM(device="cpu", max_logprobs=3)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            capped.generate(["A"], SamplingParams(**{name: 4}), use_tqdm=False)
    capped.generate(["A"], SamplingParams(logprobs=3, max_tokens=1), use_tqdm=False)


def test_without_a_tokenizer_tokens_have_no_text():
    bare = LLM(device="cpu", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    out = bare.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == "" and len(c.token_ids) == 3
    positions = c.logprobs + out.prompt_logprobs[1:]
    assert all(lp.decoded_token is None for pos in positions for lp in pos.values())
