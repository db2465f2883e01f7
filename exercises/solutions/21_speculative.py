"""Worked solutions to chapter 21's exercises (chapters/21_speculative.md).

Installed into minillm.speculative's modules the way a reader's exported cells would
put them there; the checks are exercises/test_21_speculative.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.speculative import eagle, ngram, rejection


# 20.1
def propose_latest(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n
    tokens, trying the longest n first."""
    L = len(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = token_ids[L - n :]
        # scan backwards from the latest start that is not the suffix itself
        for start in range(L - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


# 20.2
def expected_acceptance_length(alpha: float, k: int) -> float:
    """E[tokens per step] = sum_{i=0..k} alpha**i: the bonus token always, the i-th
    proposal if it and every one before it were accepted."""
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


# 20.3
def residual(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q), normalised: where a rejected token is drawn from. With p = q
    nothing is ever rejected; p itself is then a safe answer."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


# 20.4
def chain_acceptance(
    draft, tokens: Tensor, features: Tensor, W: int, depth: int
) -> list[float]:
    """For j = 1..depth, the fraction of sequences whose first j drafted tokens all
    equal the target's next j (what greedy verification accepts)."""
    N = tokens.shape[0]
    held = [0] * depth  # held[j]: sequences whose first j + 1 guesses all hold
    for i in range(N):
        seq = tokens[i].tolist()
        guesses = eagle.eagle_propose_ref(draft, features[i, :W], seq[: W + 1], depth)
        for j in range(depth):
            if guesses[j] != seq[W + 1 + j]:
                break  # the chain breaks here: nothing after counts
            held[j] += 1
    return [h / N for h in held]


ngram.propose_latest = propose_latest
rejection.expected_acceptance_length = expected_acceptance_length
rejection.residual = residual
eagle.chain_acceptance = chain_acceptance

SOLUTIONS = {
    "latest": propose_latest,
    "expected": expected_acceptance_length,
    "residual": residual,
    "chain": chain_acceptance,
}
