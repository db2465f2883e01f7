"""Chapter 25's helpers that are not the lesson: a timed caller of `AsyncLLM` and a
bar plot of output rates (chapter 27's Measured section draws it too).

The chapter (chapters/25_server.md) imports them; the engine thread itself is in
minillm/async_llm.py.
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt


async def timed_stream(
    llm, request_id: str, prompt: str, params
) -> tuple[float, float]:
    """One request through an AsyncLLM, read as it streams: (time to its first
    output, end to end) in seconds."""
    start, first = time.perf_counter(), None
    stream = await llm.generate([(request_id, prompt, params)])
    async for output in stream:
        if first is None and output.outputs[0].token_ids:
            first = time.perf_counter()
    return first - start, time.perf_counter() - start


def plot_rates(rates: dict[str, float], title: str) -> None:
    """Output tokens per second of each way of running the same requests, as bars."""
    fig, ax = plt.subplots(figsize=(9, 2.2))
    bars = ax.barh(list(rates), list(rates.values()), color=["C1", "C0", "gray"])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set(xlabel="output tokens/s", title=title, xlim=(0, 1.2 * max(rates.values())))
    ax.invert_yaxis()
    plt.tight_layout()
    plt.show()
