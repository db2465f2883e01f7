"""Checks for chapter 29's exercises (beside vLLM). See _check.py."""

from __future__ import annotations

import importlib
import math
import statistics

import pytest
from minillm import loadgen
from minillm.loadgen import RequestTiming

from _check import answer, attempted


def timing(start, first, end, tokens):
    """A request sent at `start`, its first token at `first`, done at `end`."""
    step = (end - first) / max(tokens - 1, 1)
    chunks = [first + i * step for i in range(tokens)]
    return RequestTiming(
        start=start, chunk_times=chunks, end=end, completion_tokens=tokens
    )


# --- 17.1 Goodput


def test_goodput_counts_the_requests_within_both_targets():
    goodput = answer(loadgen, "goodput", "29.1")
    timings = [
        timing(0.0, 0.100, 0.100 + 9 * 0.020, 10),  # TTFT 100 ms, TPOT 20 ms
        timing(0.0, 0.300, 0.300 + 9 * 0.020, 10),  # TTFT 300 ms: too slow to start
        timing(0.0, 0.100, 0.100 + 9 * 0.050, 10),  # TPOT 50 ms: too slow to stream
        timing(1.0, 1.150, 1.150 + 4 * 0.010, 5),  # TTFT 150 ms, TPOT 10 ms
    ]
    got = attempted(goodput, "29.1", timings, 2.0, ttft_ms=200, tpot_ms=30)
    assert got == pytest.approx(2 / 2.0)
    assert goodput(timings, 2.0, ttft_ms=200, tpot_ms=None) == pytest.approx(3 / 2.0)
    assert goodput(timings, 4.0, ttft_ms=None, tpot_ms=30) == pytest.approx(3 / 4.0)
    assert goodput(timings, 1.0, ttft_ms=None, tpot_ms=None) == pytest.approx(4.0)
    assert goodput(timings, 1.0, ttft_ms=50, tpot_ms=None) == 0


# --- 17.2 Open-loop arrivals


def test_arrival_offsets_are_a_poisson_process_of_the_rate():
    arrival_offsets = answer(loadgen, "arrival_offsets", "29.2")
    offsets = attempted(arrival_offsets, "29.2", 20_000, 4.0, seed=0)
    assert len(offsets) == 20_000 and offsets[0] == 0
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.05)
    # exponential gaps: the standard deviation equals the mean (constant or uniform
    # gaps at the same rate would not)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1, abs=0.05)
    assert arrival_offsets(100, 4.0, seed=0) == offsets[:100]
    assert arrival_offsets(100, 4.0, seed=1) != offsets[:100]
    assert arrival_offsets(5, math.inf) == [0.0] * 5


# --- 17.3 Agreement once outputs diverge


def test_greedy_agreement_counts_tokens_before_the_first_difference():
    try:
        module = importlib.import_module("minillm.agreement")
    except ModuleNotFoundError:
        pytest.skip("exercise 29.3: minillm/agreement.py does not exist yet")
    greedy_agreement = answer(module, "greedy_agreement", "29.3")
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    b = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9, 9, 1]]  # re-aligned after a difference
    got = attempted(greedy_agreement, "29.3", a, b)
    # the second pair matches 1 token (not 3: after position 1 the texts differ)
    assert got["matched"] == 4 + 1 + 3 and got["total"] == 12
    assert got["rate"] == pytest.approx(8 / 12)
    assert got["identical"] == 1
    assert tuple(got["first_divergence"]) == (1, 1)
    same = greedy_agreement(a, a)
    assert same["rate"] == 1 and same["identical"] == 3
    assert same["first_divergence"] is None
