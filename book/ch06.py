"""Chapter 6's helpers that are not the lesson: the figure of where each rule cuts the
distribution, the random requests the checks draw, the batched-against-loop timing
workload (shared with the lab notes) and the Measured figure (issue 44).

    from book.ch06 import plot_cuts, random_params, random_batch, timing_workload
"""

from __future__ import annotations

import random

import matplotlib.pyplot as plt
import torch

from minillm.sampler import Sampler
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampling_params import SamplingParams


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
