"""Worked solutions to chapter 29's exercises (chapters/29_vllm_comparison.md).

Installed the way a reader's exported cells would be: two functions in
minillm.loadgen and a new module, minillm.agreement. The checks are
exercises/test_29_vllm_comparison.py.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import types

import minillm
from minillm import loadgen
from minillm.loadgen import RequestTiming


# 28.1
def goodput(
    timings: list[RequestTiming],
    seconds: float,
    ttft_ms: float | None,
    tpot_ms: float | None,
) -> float:
    """Requests per second that met every latency target (None: no target)."""

    def within(value: float | None, target_ms: float | None) -> bool:
        return target_ms is None or (value is not None and value * 1000 <= target_ms)

    good = [
        t
        for t in timings
        if t.ttft is not None and within(t.ttft, ttft_ms) and within(t.tpot, tpot_ms)
    ]
    return len(good) / seconds


# 28.2
def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times of n requests arriving as a Poisson process of request_rate per
    second: exponential gaps of mean 1 / rate, the first request at 0."""
    if math.isinf(request_rate):
        return [0.0] * n  # all at once
    rng = random.Random(seed)
    gaps = [0.0] + [rng.expovariate(request_rate) for _ in range(n - 1)]
    return list(itertools.accumulate(gaps))[:n]


# 28.3
def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: only the tokens before each pair's
    first difference count, since after it the two continue different texts."""
    matched, identical, first = 0, 0, None
    for pair, (x, y) in enumerate(zip(a, b)):
        common = sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(x, y)))
        matched += common
        if common == len(x) == len(y):
            identical += 1
        elif first is None:
            first = (pair, common)
    total = sum(len(x) for x in a)
    return {
        "matched": matched,
        "total": total,
        "rate": matched / total if total else 1.0,
        "identical": identical,
        "first_divergence": first,
    }


loadgen.goodput = goodput
loadgen.arrival_offsets = arrival_offsets
# a new module, minillm/agreement.py, as `#| export agreement` would tangle it
agreement = types.ModuleType("minillm.agreement", "Greedy agreement (chapter 29).")
agreement.greedy_agreement = greedy_agreement
sys.modules["minillm.agreement"] = minillm.agreement = agreement

SOLUTIONS = {
    "goodput": goodput,
    "arrival": arrival_offsets,
    "agreement": greedy_agreement,
}
