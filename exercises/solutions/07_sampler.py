"""Worked solutions to chapter 7's exercises (chapters/07_sampler.md).

New functions are installed into minillm.logits_processors and minillm.sampler the
way a reader's exported cell would put them there; the checks are
exercises/test_07_sampler.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

import minillm.logits_processors as logits_processors
import minillm.sampler as sampler
from minillm.sampler import MASK32


# 6.1
def bias_order_prediction() -> dict[str, list[float]]:
    """logits [1, 0, 0, 0], prompt [0], repetition_penalty 2, logit_bias {0: 1}.

    The penalty divides a positive logit of a seen token by 2. Bias first (the
    chapter's order, vLLM's): (1 + 1) / 2 = 1. Bias after the penalty: 1 / 2 + 1 =
    1.5. Only token 0's logit differs, so its probability moves from
    e / (e + 3) = 0.475 to e**1.5 / (e**1.5 + 3) = 0.599, and the other three share
    the rest; the check's order case catches the moved bias.
    """
    bias_first = torch.tensor([(1.0 + 1.0) / 2, 0.0, 0.0, 0.0]).softmax(-1)
    bias_after = torch.tensor([1.0 / 2 + 1.0, 0.0, 0.0, 0.0]).softmax(-1)
    return {"bias first": bias_first.tolist(), "bias after": bias_after.tolist()}


# 6.2
def apply_top_p_bisection(logits: Tensor, p: Tensor, steps: int = 32) -> Tensor:
    """Top-p with no sort: per row, the largest threshold tau whose kept mass
    sum(p_i >= tau) is still at least p, found by halving [0, max p_i]. In place."""
    probs = logits.float().softmax(dim=-1)  # (num_seqs, vocab)
    lo = torch.zeros(probs.shape[0], 1)  # kept mass >= p here: every token is kept
    hi = probs.amax(dim=-1, keepdim=True)  # and here only the likeliest few
    for _ in range(steps):  # each step one pass over the vocabulary, all rows at once
        mid = (lo + hi) / 2
        mass = (probs * (probs >= mid)).sum(dim=-1, keepdim=True)
        enough = mass >= p[:, None]
        lo = torch.where(enough, mid, lo)  # the mass only grows as tau falls
        hi = torch.where(enough, hi, mid)
    cut = (probs < lo) & (p[:, None] < 1)  # a row with p = 1 keeps every token
    return logits.masked_fill_(cut, float("-inf"))


# 6.3
def another_spelling(tokenizer, word: str) -> tuple[list[int], list[int]] | None:
    """The word's own tokens, and a different token sequence that decodes to it.

    bad_words bans the first spelling only; a model that writes the second one has
    written the banned word. Closing the gap at the token level means banning every
    token sequence whose text contains the word, and those are too many to list
    (any split, any longer token that covers a piece), so it needs a check on the
    decoded text, which can only be done after a token has been chosen.
    """
    ids = tokenizer.encode(word)
    for i in range(1, len(word)):
        pieces = tokenizer.encode(word[:i]) + tokenizer.encode(word[i:])
        if pieces != ids and tokenizer.decode(pieces) == word:
            return ids, pieces
    return None


# 6.4
def _float32_cells(words: Tensor) -> Tensor:
    """(words + 1/2) * 2**-32 in float32 with one rounding: each 16-bit half converts
    exactly, and so does each product by a power of two."""
    high, low = (words >> 16).to(torch.float32), (words & 0xFFFF).to(torch.float32)
    return high * 2.0**-16 + (low + 0.5) * 2.0**-32


def exponential_from_bits32(bits: Tensor) -> Tensor:
    """E = -log(1 - V), V = (bits + 1/2) 2**-32, to float32 rounding for every word."""
    bits = bits.long()
    v = _float32_cells(bits)  # accurate where V is small: log1p keeps it
    # where V is near 1, 1 - V is the complement word's cell: no cancellation
    one_minus_v = _float32_cells(MASK32 - bits)
    return torch.where(v < 0.5, -torch.log1p(-v), -torch.log(one_minus_v))


logits_processors.apply_top_p_bisection = apply_top_p_bisection
sampler.exponential_from_bits32 = exponential_from_bits32

SOLUTIONS = {
    "logit_bias": bias_order_prediction,
    "bisection": apply_top_p_bisection,
    "bad_words": another_spelling,
    "bits32": exponential_from_bits32,
}
