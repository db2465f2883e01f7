"""Greedy speculative decoding against plain greedy decoding, in float32 on the CPU
(identical) and in bfloat16 on a GPU (identical up to near-ties), chapter 21.

What greedy verification guarantees, exactly, in any precision: every token a
speculative run emits is the argmax of the target's logits that its verification step
computed at that position, and each step keeps the longest run of drafts that agree
with those argmaxes (`check_greedy_verification`). In float32 the verification's
logits agree with the plain decode's to float32 rounding, and the two runs write the
same tokens. In bfloat16 the rounding is 2^16 times coarser: verifying 1 + k rows
runs other products (other GEMM shapes, other attention rows) than decoding one row,
so the two runs' logits for one context differ by rounding, and the runs may part
where the plain run's best two tokens nearly tie.

The tolerance. A logit is the LM head's bfloat16 output, whose spacing at x is
ulp(x) = 2^(floor(log2 |x|) - 7) (8 significant bits). Where the runs first differ
they saw the same tokens, so the plain run's top-2 gap there is at most the amount by
which rounding moved that gap between the two runs. A bfloat16 forward keeps every gap
of the top five tokens within TOL_ULPS / 2 ulps of the top logit of the float32
forward's (`test_a_bfloat16_forward_moves_top_gaps_by_at_most_half_the_tolerance`,
on the CPU and, where there is one, on the GPU); two bfloat16 runs are then within
TOL_ULPS of each other, and a first difference is a near-tie: a plain top-2 gap of at
most TOL_ULPS ulps.

On the GPU box: MINILLM_TEST_DEVICE is not needed; the bfloat16 tests run wherever
CUDA is available and print, per proposer, the fraction of requests identical, each
first difference's gap in ulps and the largest rounding difference seen.
"""

import gc
import math

import pytest
import torch

import minillm.speculative.runner as spec_runner
from minillm.llm import LLM
from minillm.logprobs import top_logprobs
from minillm.sampling_params import SamplingParams
from benchmarks.spec_workloads import held_out_prompts
from minillm.tiny import tiny_model

TOL_ULPS = 8
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device: bfloat16 as the engine runs it there"
)


def ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x|."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def workload(tokenizer, num: int) -> list[list[int]]:
    """Held-out prompts that n-gram lookup guesses well and ones it guesses badly."""
    return held_out_prompts(tokenizer, "repetitive", num) + held_out_prompts(
        tokenizer, "open", num
    )


class VerificationLog:
    """Every greedy verification a speculative engine runs: per request, the logits
    row that decided each output position, and per step the drafts, the argmax of
    each row and the tokens emitted. It wraps the runner's verify_greedy and, inside
    it only, the model's compute_logits; nothing else changes."""

    def __init__(self, engine):
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.steps: list[tuple[str, list[int], list[int], list[int]]] = []
        runner = engine.model_runner
        model, verify, computed = runner.model, runner.verify_greedy, []
        own = "compute_logits" in vars(model)
        compute = model.compute_logits

        def recording_compute(hidden):
            computed.append(compute(hidden))
            return computed[-1]

        def recording_verify(chosen, hidden, rows, drafts):
            computed.clear()
            model.compute_logits = recording_compute
            try:
                out = verify(chosen, hidden, rows, drafts)
            finally:
                if own:
                    model.compute_logits = compute
                else:
                    del model.compute_logits
            (logits,) = computed  # (rows of all requests, vocab)
            logits, at = logits.float().cpu(), 0
            for r in chosen:
                d = list(drafts[r.request_id])
                block, at = logits[at : at + len(d) + 1], at + len(d) + 1
                tokens = list(out[r.request_id])
                row_of = self.rows.setdefault(r.request_id, {})
                for j in range(len(tokens)):
                    row_of[r.num_output_tokens + j] = block[j]
                self.steps.append((r.request_id, d, block.argmax(-1).tolist(), tokens))
            return out

        runner.verify_greedy = recording_verify


def check_greedy_verification(log: VerificationLog, outputs) -> int:
    """Greedy verification's guarantee: each step emitted the drafts that agree with
    its rows' argmaxes, up to the first that does not, then that row's argmax; every
    output token is the argmax of the row that decided it. Returns the drafts
    verified (so that a caller can see that there were some)."""
    for request_id, drafts, argmax, tokens in log.steps:
        n = 0
        while n < len(drafts) and drafts[n] == argmax[n]:
            n += 1
        assert tokens == drafts[:n] + [argmax[n]], (request_id, drafts, argmax, tokens)
    for out in outputs:
        rows = log.rows[out.request_id]
        for position, token in enumerate(out.outputs[0].token_ids):
            assert int(rows[position].argmax()) == token, (out.request_id, position)
    return sum(len(drafts) for _, drafts, _, _ in log.steps)


def compare_with_plain(plain, spec, log: VerificationLog) -> dict:
    """Where each speculative output first differs from the plain one (run with
    logprobs=2), the plain run's top-2 gap in ulps; and the largest difference of a
    top-2 gap between the two runs at the positions whose context they share."""
    firsts, noise = [], 0.0
    for p_out, s_out in zip(plain, spec):
        a, b = p_out.outputs[0].token_ids, s_out.outputs[0].token_ids
        assert len(a) == len(b)  # ignore_eos: both wrote max_tokens
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows = log.rows[s_out.request_id]
        for position in range(len(a) if first is None else first + 1):
            top = top_logprobs(p_out.outputs[0].logprobs[position], 2)
            (t0, lp0), (t1, lp1) = [(t, lp.logprob) for t, lp in top]
            row = rows[position]
            scale = ulp(max(abs(float(row[t0])), abs(float(row[t1]))))
            spec_gap = float(row[t0] - row[t1])
            noise = max(noise, abs((lp0 - lp1) - spec_gap) / scale)
            if position == first:
                assert a[first] == t0 or lp0 == lp1  # a tie may list either first
                scale = ulp(max(abs(float(row[a[first]])), abs(float(row[b[first]]))))
                firsts.append((lp0 - lp1) / scale)
    return {"identical": len(plain) - len(firsts), "firsts": firsts, "noise": noise}


PLAIN_RUNS = {}  # one plain run per device, dtype and workload, for every proposer


def run_both(device, dtype, method, prompts, max_tokens, **options):
    """(plain outputs with top-2 logprobs, speculative outputs, the log of the
    speculative run's verifications, drafts verified)."""
    common = dict(device=device, dtype=dtype, max_num_seqs=len(prompts), **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    key = (device, dtype, str(prompts), max_tokens, str(sorted(options.items())))
    if key not in PLAIN_RUNS:
        plain_llm = LLM(None, **common)
        with_top2 = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2
        )
        PLAIN_RUNS[key] = plain_llm.generate(prompts, with_top2, use_tqdm=False)
        del plain_llm
    plain = PLAIN_RUNS[key]
    # speculate at every batch size: every step verifies (none is launched ahead)
    spec = {
        "method": method,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
    }
    llm = LLM(None, **common, speculative_config=spec)
    log = VerificationLog(llm.engine)
    got = llm.generate(prompts, params, use_tqdm=False)
    del llm
    gc.collect()
    return plain, got, log, check_greedy_verification(log, got)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_in_float32_speculation_writes_the_plain_tokens(tiny, method):
    """On the CPU in float32: every token is its verification row's argmax, and the
    speculative run writes the plain run's tokens."""
    prompts = workload(tiny[1], 3)
    plain, spec, log, verified = run_both(
        "cpu", torch.float32, method, prompts, 24, num_kv_blocks=128
    )
    assert verified > 0
    assert [o.outputs[0].token_ids for o in spec] == [
        o.outputs[0].token_ids for o in plain
    ]
    result = compare_with_plain(plain, spec, log)
    assert result["identical"] == len(prompts)
    assert result["noise"] < 0.01  # the same gaps, to float32 rounding


def test_the_check_fails_when_verification_accepts_a_wrong_draft(tiny, monkeypatch):
    """The check is not vacuous: a verification that keeps every draft, right or
    wrong, is caught."""

    def accept_all(draft_token_ids, target_argmax):
        return list(draft_token_ids) + [target_argmax[len(draft_token_ids)]]

    monkeypatch.setattr(spec_runner, "greedy_accept", accept_all)
    prompts = workload(tiny[1], 3)
    with pytest.raises(AssertionError):
        run_both("cpu", torch.float32, "ngram", prompts, 24, num_kv_blocks=128)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_bfloat16_forward_moves_top_gaps_by_at_most_half_the_tolerance(device):
    """The tolerance's premise, on the held-out prompts: for each position, the gaps
    between the float32 forward's top token and its next four move by at most
    TOL_ULPS / 2 ulps of the top logit when the forward runs in bfloat16."""
    exact, tokenizer = tiny_model(device=device, progress=False)
    rounded, _ = tiny_model(device=device, dtype=torch.bfloat16, progress=False)
    prompts = held_out_prompts(tokenizer, "repetitive", 16)  # the longer contexts
    width = min(map(len, prompts))
    ids = torch.tensor([p[:width] for p in prompts], device=device)
    positions = torch.arange(width, device=device).expand_as(ids)
    with torch.inference_mode():
        logits = exact.compute_logits(exact(ids, positions))  # (B, T, vocab)
        moved = rounded.compute_logits(rounded(ids, positions)) - logits
    top, top_ids = logits.topk(5, dim=-1)  # (B, T, 5)
    shift = moved.gather(-1, top_ids)  # each top logit's rounding
    gap_moved = (shift[..., 1:] - shift[..., :1]).abs().amax(-1)  # (B, T)
    scale = 2.0 ** (torch.floor(torch.log2(top[..., 0].abs())) - 7)
    in_ulps = gap_moved / scale
    print(
        f"{device}: {in_ulps.numel()} positions, top-5 gaps moved by "
        f"{in_ulps.median():.2f} ulps (median), {in_ulps.max():.2f} (max)"
    )
    assert in_ulps.max() <= TOL_ULPS / 2


@needs_cuda
@pytest.mark.parametrize("method", ["ngram", "eagle", "medusa", "draft_model"])
def test_in_bfloat16_speculation_differs_only_at_near_ties(tiny, method):
    """On the GPU in bfloat16, the engine's defaults there: every token is its
    verification row's argmax, and where a request first differs from the plain run,
    the plain run's top-2 gap is within TOL_ULPS ulps."""
    prompts = workload(tiny[1], 16)
    plain, spec, log, verified = run_both(
        "cuda", torch.bfloat16, method, prompts, 64, num_kv_blocks=1024
    )
    assert verified > 0
    result = compare_with_plain(plain, spec, log)
    firsts = ", ".join(f"{g:.2f}" for g in result["firsts"]) or "none"
    print(
        f"bf16 {method}: {result['identical']}/{len(prompts)} requests identical; "
        f"first differences at plain top-2 gaps of {firsts} ulps; rounding moved a "
        f"top-2 gap by up to {result['noise']:.2f} ulps where the contexts agree"
    )
    assert all(g <= TOL_ULPS for g in result["firsts"]), result
