"""Chapter 7's helpers that are not the lesson: the problem's two scores, the figure of
where each rule cuts the distribution, the random requests the checks draw, the
checkpoints' loops and printing, a minimal decoding loop, the batched-against-loop
timing workload (shared with the lab notes) and the Measured figure (issue 44).

    from book.ch07 import plot_cuts, random_params, random_batch, timing_workload
"""

from __future__ import annotations

import dataclasses
import random

import matplotlib.pyplot as plt
import torch

from benchmarks.cpu_timing import best_of, op_calls
from minillm.model import DenseKVCache, build_attention_metadata
from minillm.sampler import Sampler
from minillm.sampler_reference import reference_probs
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampling_params import SamplingParams, SamplingParamsError

# the problem section's prompts, continued by the tiny model
PROMPTS = [
    'The "for" statement',
    "A class definition",
    "Exceptions are",
    "The following",
    "The import statement",
    "A function",
    "The value of",
    "When an exception",
]


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    """Fraction of the n-grams of tokens that already occurred earlier in tokens."""
    seen, repeats = set(), 0
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(tokens) - n + 1)


@torch.inference_mode()
def tail_share(
    model, prompt: list[int], output: list[int], top_p: float = 0.9
) -> float:
    """Fraction of output's tokens that lie outside the model's top_p nucleus at their
    step (the likelier tokens already hold top_p of the probability)."""
    seq = torch.tensor(prompt + output)
    logits = model.compute_logits(model(seq, torch.arange(len(seq))))
    probs = logits[len(prompt) - 1 : -1].softmax(-1)  # (len(output), vocab)
    chosen = probs.gather(1, torch.tensor(output)[:, None])  # (len(output), 1)
    mass_above = torch.where(probs > chosen, probs, 0.0).sum(-1)  # (len(output),)
    return (mass_above >= top_p).float().mean().item()


def mean_scores(model, prompts, outputs) -> tuple[float, float]:
    """The mean repetition rate and tail share of outputs (continuing prompts)."""
    rep = sum(map(repetition_rate, outputs)) / len(outputs)
    tail = sum(tail_share(model, p, o) for p, o in zip(prompts, outputs))
    return rep, tail / len(outputs)


def refused(make, *args, **kwargs) -> SamplingParamsError | None:
    """The SamplingParamsError that make(*args, **kwargs) raises, or None."""
    try:
        make(*args, **kwargs)
    except SamplingParamsError as e:
        return e
    return None


def ks_distance_exp1(sample: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between a 1-d float64 sample and Exp(1)."""
    n = sample.numel()
    cdf = 1 - torch.exp(-sample.sort().values)  # (n,)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max().item()


def show_sampled(result, md: SamplingMetadata, tokenizer) -> None:
    """Print a SamplerOutput: each row's token, and the logprobs rows asked for."""
    tokens = result.sampled_token_ids.tolist()
    print("sampled", tokens, [tokenizer.decode([t]) for t in tokens])
    for row, lp in enumerate(result.logprobs_tensors.tolists(md.num_logprobs)):
        if lp is not None:
            top = ", ".join(
                f"{tokenizer.decode([t])!r} {v:.2f}" for t, v in lp.top_logprobs
            )
            print(f"row {row}: chosen {tokenizer.decode([lp.token_id])!r} logprob "
                  f"{lp.logprob:.2f} rank {lp.rank}; top: {top}")  # fmt: skip


def kept_by_definition(sorted_p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Which positions of a distribution sorted by probability (descending) top-k 10,
    min-p 0.1 and top-p 0.9 keep, each from its definition."""
    return {
        "top-k, k = 10": torch.arange(sorted_p.numel()) < 10,
        "min-p, min_p = 0.1": sorted_p >= 0.1 * sorted_p[0],
        # the likelier tokens hold less than p
        "top-p, p = 0.9": (sorted_p.cumsum(0) - sorted_p) < 0.9,
    }


def plot_cuts(next_logits: torch.Tensor, kept: dict[str, torch.Tensor], title: str):
    """Left: the sorted distribution of `next_logits` at three temperatures; right: its
    cumulative probability at T = 1, with a line where each rule's kept set ends
    (`kept`: rule name -> which sorted positions it keeps)."""
    vocab = next_logits.numel()
    rank = torch.arange(1, vocab + 1)
    sorted_p = next_logits.softmax(-1).sort(descending=True).values
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    for T, style in [(0.5, ":"), (1.0, "-"), (1.5, "--")]:
        probs = (next_logits / T).softmax(-1).sort(descending=True).values
        ax0.loglog(rank, probs, style, label=f"T = {T}")
    ax0.set(xlabel="rank of the token", ylabel="probability")
    ax0.set_title("Temperature reshapes, never reorders")
    ax0.legend()
    label = "probability of the top r tokens (T = 1)"
    ax1.semilogx(rank, sorted_p.cumsum(0), "k-", lw=1.5, label=label)
    for (name, keep), color in zip(kept.items(), ["tab:blue", "tab:green", "tab:red"]):
        n_kept, mass = int(keep.sum()), sorted_p[keep].sum()
        label = f"{name}: keeps {n_kept} tokens, {mass:.0%}"
        ax1.axvline(n_kept, color=color, ls="--", label=label)
    ax1.set(xlabel="rank r", ylabel="cumulative probability", ylim=(0, 1.02))
    ax1.set_title("Where each rule cuts the tail")
    ax1.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def forbid_odd_tokens_after_three(
    output_token_ids: list[int], logits: torch.Tensor
) -> torch.Tensor:
    """A toy logits processor: once three tokens exist, only even token ids may
    follow."""
    if len(output_token_ids) >= 3:
        logits = logits.clone()
        logits[1::2] = float("-inf")
    return logits


def _maybe(rng: random.Random, chance: float, make):
    return make() if rng.random() < chance else None


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """One random request: each field from a few values that include its default, so
    that most requests combine some rules and leave others off."""
    kind, choice = rng.random(), rng.choice
    return SamplingParams(
        temperature=0.0 if kind < 0.25 else choice([0.3, 0.7, 1.0, 1.5]),
        seed=_maybe(rng, 0.4, lambda: rng.randrange(1000)),
        top_k=choice([0, 0, 1, 3, 10, vocab + 5]),
        top_p=choice([1.0, 1.0, 0.5, 0.8, 0.95]),
        min_p=choice([0.0, 0.0, 0.05, 0.2]),
        repetition_penalty=choice([1.0, 1.0, 0.8, 1.3]),
        frequency_penalty=choice([0.0, 0.0, -0.5, 0.7]),
        presence_penalty=choice([0.0, 0.0, -0.3, 1.1]),
        min_tokens=choice([0, 0, 2, 6]),
        stop_token_ids=_maybe(rng, 0.3, lambda: rng.sample(range(vocab), 2)),
        ignore_eos=rng.random() < 0.2,
        # even ids: the toy processor keeps those, so no row is left without a token
        allowed_token_ids=_maybe(
            rng, 0.2, lambda: rng.sample(range(0, vocab, 2), max(8, vocab // 4))
        ),
        banned_token_ids=_maybe(rng, 0.3, lambda: rng.sample(range(vocab), 3)),
        logits_processors=_maybe(rng, 0.2, lambda: [forbid_odd_tokens_after_three]),
        logprobs=choice([None, None, 0, 2, 5]),
        logit_bias=_maybe(
            rng, 0.3, lambda: {rng.randrange(vocab): rng.uniform(-5, 5) for _ in "abc"}
        ),
        # a one-token word (always banned), a two-token one (banned after its first)
        bad_words_token_ids=_maybe(
            rng, 0.3, lambda: [[rng.randrange(vocab)], rng.sample(range(vocab), 2)]
        ),
    )


def random_batch(rng: random.Random, vocab: int, num_seqs: int, eos: int = 1):
    """num_seqs random requests, each with a prompt, a few tokens already produced
    and a row of logits: (params, prompts, outputs, logits, [eos])."""
    params = [random_params(rng, vocab) for _ in range(num_seqs)]
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        for _ in range(num_seqs)
    ]
    outputs = [
        [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        for _ in range(num_seqs)
    ]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(num_seqs, vocab, generator=gen) * 3
    return params, prompts, outputs, logits, [eos]


def timing_workload(vocab: int, top_p: bool = True):
    """The Measured section's requests: 256 prompts of 200 random tokens with 100
    output tokens each, and four kinds of settings repeated to fill a batch (with or
    without top-p rows). Returns (prompts, outputs, mix)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(200)] for _ in range(256)]
    outputs = [[rng.randrange(vocab) for _ in range(100)] for _ in range(256)]
    p = {"top_p": 0.9} if top_p else {"top_k": 50}
    mix = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, **p),
        SamplingParams(temperature=1.0, top_k=50, seed=3),
        SamplingParams(temperature=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.3, **({"top_p": 0.95} if top_p else {})),
    ]  # fmt: skip
    return prompts, outputs, mix


def step_functions(vocab: int):
    """(step, step_per_request): one sampling step, metadata included, for a batch;
    and the same step taken with a batch of one, request after request."""
    sampler = Sampler(generator=torch.Generator().manual_seed(0))

    def step(params, prompts, outputs, logits):
        md = SamplingMetadata.from_requests(params, prompts, outputs, vocab)
        return sampler(logits, md).sampled_token_ids

    def step_per_request(params, prompts, outputs, logits):
        return [
            step(params[i : i + 1], prompts[i : i + 1], outputs[i : i + 1],
                 logits[i : i + 1])
            for i in range(len(params))
        ]  # fmt: skip

    return step, step_per_request


def plot_measured(results: dict, us: dict, sizes: list[int], vocab: int):
    """The Measured figure. Left: each setting's repetition rate and share of tokens
    from outside the 90% nucleus (`results`: name -> (rep, tail)); right: microseconds
    per request of one sampling step, batched and one at a time (`us`: (way, size) ->
    µs)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=[1.3, 1])
    names, y = list(results), torch.arange(len(results)).float()
    for shift, k, label, color in [
        (-0.2, 0, "4-grams repeated", "tab:blue"),
        (0.2, 1, "tokens from outside the 90% nucleus", "tab:red"),
    ]:
        values = [100 * results[n][k] for n in names]
        left.barh(y + shift, values, height=0.4, label=label, color=color)
    left.set_yticks(y, names, fontsize=8)
    left.invert_yaxis()
    left.set(xlabel="% (tiny model, 8 prompts x 64 tokens each)")
    left.set_title("Six settings, one batch of 48 rows", fontsize=9)
    left.legend(fontsize=8, loc="lower right")
    for how, style in [("batched", "o-"), ("one request at a time", "s--")]:
        right.semilogx(sizes, [us[how, n] for n in sizes], style, label=how)
    right.set(xlabel="requests in the batch", ylabel="µs per request", ylim=(0, None))
    right.set_title(f"One sampling step, vocab {vocab:,} (CPU, 1 thread)", fontsize=9)
    right.legend()
    fig.tight_layout()
    return fig


def reference_rows(rng: random.Random, trials: int):
    """For `trials` random batches (random_batch, vocabularies 16 and 64): per row
    (trial, params, the batched sampling_distribution's row, the reference's (float64),
    the token the batched Sampler drew)."""
    for trial in range(trials):
        vocab, num_seqs = rng.choice([16, 64]), rng.randrange(1, 9)
        params, prompts, outputs, logits, eos = random_batch(rng, vocab, num_seqs)
        md = SamplingMetadata.from_requests(params, prompts, outputs, vocab, eos)
        ours = Sampler().sampling_distribution(logits, md)  # (num_seqs, vocab)
        sampler = Sampler(generator=torch.Generator().manual_seed(trial))
        sampled = sampler(logits, md).sampled_token_ids.tolist()
        for row in range(num_seqs):
            ref = reference_probs(
                logits[row].tolist(), params[row], prompts[row], outputs[row], eos
            )
            expected = torch.tensor(ref, dtype=torch.float64)
            yield trial, params[row], ours[row], expected, sampled[row]


def run_in_batch(
    request: SamplingParams, logits: torch.Tensor, row: int, num_seqs: int, others: int
) -> list[int]:
    """len(logits) steps of `request` (its logits per step: (steps, vocab)) at `row`
    of a batch of num_seqs whose other rows are random requests with random logits,
    all drawn from the seed `others`; nothing kept between steps but the outputs."""
    vocab, rng = logits.shape[1], random.Random(others)
    params = [random_params(rng, vocab) for _ in range(num_seqs)]
    params[row] = request
    outputs = [[] for _ in range(num_seqs)]
    sampler = Sampler(generator=torch.Generator().manual_seed(others))
    for step in range(len(logits)):
        gen = torch.Generator().manual_seed(others * 100 + step)
        batch_logits = torch.randn(num_seqs, vocab, generator=gen)
        batch_logits[row] = logits[step]
        md = SamplingMetadata.from_requests(params, [[0]] * num_seqs, outputs, vocab)
        tokens = sampler(batch_logits, md).sampled_token_ids.tolist()
        for out, token in zip(outputs, tokens):
            out.append(token)
    return outputs[row]


def reference_logprobs(logits_row, params, prompt, output, eos, mode: str):
    """(vocab,) float64: the log-distribution a row's logprobs must come from in
    `mode` — the model's own (raw), or the one drawn from (processed; a greedy row
    took its argmax at temperature 1)."""
    if mode == "raw_logprobs":
        return logits_row.double().log_softmax(-1)
    if params.temperature == 0:
        params = dataclasses.replace(params, temperature=1.0)
    probs = reference_probs(logits_row.tolist(), params, prompt, output, eos)
    return torch.tensor(probs, dtype=torch.float64).log()


def draw_counts(
    logits_row: torch.Tensor,
    params: SamplingParams,
    draws: int = 20_000,
    chunk: int = 1_000,
    seed: int = 0,
) -> list[int]:
    """Token counts of `draws` draws for one request through the whole Sampler, as
    chunks of identical rows of one batch; a seeded request gets a seed per row (other
    ones for another `seed`), so that its rows are independent draws."""
    vocab = logits_row.shape[-1]
    sampler = Sampler(generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(vocab, dtype=torch.int64)
    for start in range(0, draws, chunk):
        rows = [params] * chunk
        if params.seed is not None:
            first = params.seed + seed * draws + start
            rows = [dataclasses.replace(params, seed=first + i) for i in range(chunk)]
        md = SamplingMetadata.from_requests(
            rows, [[0]] * chunk, [[] for _ in range(chunk)], vocab
        )
        tokens = sampler(logits_row.expand(chunk, vocab), md).sampled_token_ids
        counts += torch.bincount(tokens, minlength=vocab)
    return counts.tolist()


@torch.inference_mode()
def decode(model, prompts, params, max_tokens: int, sampler: Sampler, eos=()):
    """A minimal step loop over chapter 1's dense KV cache: one batch, every row its
    own SamplingParams, the sampler once per step, max_tokens tokens each (stop
    conditions are the engine's business, chapter 9)."""
    n, max_len = len(prompts), max(map(len, prompts)) + max_tokens
    vocab = model.config.vocab_size
    cache = DenseKVCache(model.config, n, max_len)
    outputs, pending = [[] for _ in prompts], [list(p) for p in prompts]
    cached = [0] * n  # tokens in the cache, per row
    for _ in range(max_tokens):
        query_lens = [len(p) for p in pending]
        seq_lens = [c + q for c, q in zip(cached, query_lens)]
        positions, attn_md = build_attention_metadata(
            query_lens, seq_lens, [[i] for i in range(n)], max_len, "cpu"
        )
        tokens = torch.tensor([t for p in pending for t in p])
        hidden = model(tokens, positions, attn_md, cache)  # (tokens, hidden)
        last = attn_md.query_start_loc[1:].long() - 1
        logits = model.compute_logits(hidden[last])  # (n, vocab)
        md = SamplingMetadata.from_requests(params, prompts, outputs, vocab, eos)
        for i, token in enumerate(sampler(logits, md).sampled_token_ids.tolist()):
            outputs[i].append(token)
            cached[i], pending[i] = seq_lens[i], [token]
    return outputs


# the Measured section's six settings: greedy, greedy with each penalty, pure sampling,
# and the cutters with a light repetition penalty (seeded: the same text every build)
KNOB_SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "greedy, repetition_penalty 1.3": SamplingParams(
        temperature=0, repetition_penalty=1.3
    ),
    "greedy, frequency_penalty 0.5": SamplingParams(
        temperature=0, frequency_penalty=0.5
    ),
    "greedy, presence_penalty 1.0": SamplingParams(temperature=0, presence_penalty=1.0),
    "pure sampling (T 1)": SamplingParams(temperature=1.0, seed=0),
    "T 0.8, top-p 0.9, min-p 0.05, rep 1.1": SamplingParams(
        temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=0
    ),
}


def decode_knobs(model, prompt_ids, eos, max_tokens: int = 64):
    """Every prompt under each of KNOB_SETTINGS (a seed per row for seeded settings),
    all rows in one batch. Returns ({setting: its rows' outputs}, {setting:
    (mean repetition rate, mean tail share)})."""
    prompts = [p for _ in KNOB_SETTINGS for p in prompt_ids]
    params = [
        dataclasses.replace(s, seed=None if s.seed is None else s.seed + i)
        for s in KNOB_SETTINGS.values()
        for i in range(len(prompt_ids))
    ]
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    out = decode(model, prompts, params, max_tokens, sampler, eos)
    n = len(prompt_ids)
    outputs = {name: out[k * n : (k + 1) * n] for k, name in enumerate(KNOB_SETTINGS)}
    results = {
        name: mean_scores(model, prompt_ids, rows) for name, rows in outputs.items()
    }
    return outputs, results


def time_sampling_step(vocab: int, sizes: list[int]):
    """One sampling step, metadata included, batched and one request at a time, on the
    timing workload: ({(way, size): µs per request}, {(way, size): operator calls})."""
    prompts, outputs, mix = timing_workload(vocab)
    ways = dict(zip(["batched", "one request at a time"], step_functions(vocab)))
    us, calls = {}, {}
    for size in sizes:
        gen = torch.Generator().manual_seed(size)
        args = (
            [mix[i % len(mix)] for i in range(size)],
            prompts[:size],
            outputs[:size],
            torch.randn(size, vocab, generator=gen) * 3,
        )
        for how, fn in ways.items():
            us[how, size] = 1e6 * best_of(lambda: fn(*args), 5) / size
            calls[how, size] = op_calls(lambda: fn(*args))
    return us, calls


def logprobs_batch():
    """The logprobs checkpoint's batch: eight random requests over a vocabulary of 64
    that ask for None, 0, 1, 2, 3, 5, 5 and 10 alternatives. Returns (params,
    prompts, outputs, logits, eos, metadata)."""
    params, prompts, outputs, logits, eos = random_batch(random.Random(5), 64, 8)
    params = [
        dataclasses.replace(p, logprobs=n)
        for p, n in zip(params, [None, 0, 1, 2, 3, 5, 5, 10])
    ]
    md = SamplingMetadata.from_requests(params, prompts, outputs, 64, eos)
    return params, prompts, outputs, logits, eos, md


def logprobs_rows(out, mode: str, params, prompts, outputs, logits, eos, md):
    """Per row of a SamplerOutput: (its SampleLogprobs or None, the n it asked for,
    its sampled token, the reference log-distribution of `mode`)."""
    entries = out.logprobs_tensors.tolists(md.num_logprobs)
    for row, entry in enumerate(entries):
        ref = reference_logprobs(
            logits[row], params[row], prompts[row], outputs[row], eos, mode
        )
        token = out.sampled_token_ids[row].item()
        yield entry, md.num_logprobs[row], token, ref
