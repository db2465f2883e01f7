"""Chapter 6's helpers that are not the lesson: the timeline of a scheduler run, the
time of a forward pass, and the Measured figure (issue 44).

    from book.ch06 import draw_timeline, forward_timer, plot_stalls
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch


def draw_timeline(log, request_ids, title, ax):
    """Steps across, requests down: an orange box for a prompt chunk, blue for a
    generated token (darker: more tokens), x where a request was preempted."""
    row = {rid: i for i, rid in enumerate(request_ids)}
    for step, (entry, preempted) in enumerate(log):
        for rid, (n, sampled, prompt_part) in entry.items():
            color = "tab:orange" if prompt_part else "tab:blue"
            alpha = 0.35 + 0.65 * min(n, 64) / 64
            box = plt.Rectangle((step, row[rid] - 0.4), 1, 0.8, color=color, lw=0)
            box.set_alpha(alpha)
            ax.add_patch(box)
        for rid in preempted:
            ax.plot(step + 0.5, row[rid], "kx", ms=6)
    ax.set(
        xlim=(0, len(log)),
        ylim=(-0.6, len(request_ids) - 0.4),
        yticks=range(len(request_ids)),
        yticklabels=request_ids,
        xlabel="step",
        title=title,
    )
    ax.invert_yaxis()


def forward_timer(model, vocab_size: int = 2048):
    """seconds(num_tokens): the best of 3 forward passes of `model` over one sequence
    of num_tokens random tokens, after a warm-up; memoized."""
    cache: dict[int, float] = {}

    def seconds(num_tokens: int) -> float:
        if num_tokens not in cache:
            ids = torch.randint(0, vocab_size, (1, num_tokens))
            pos = torch.arange(num_tokens)[None]
            with torch.inference_mode():
                model(ids, pos)  # warm-up
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    model(ids, pos)
                    best = min(best, time.perf_counter() - t0)
            cache[num_tokens] = best
        return cache[num_tokens]

    return seconds


def _bars(ax, rows: dict[str, float], xlabel: str) -> None:
    colors = ["tab:red", "tab:blue", "lightgray"][: len(rows)]
    ax.barh(list(rows), list(rows.values()), color=colors)
    ax.set_xlim(0, max(rows.values()) * 1.3)
    for y, v in enumerate(rows.values()):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)


def plot_stalls(gaps_ms: dict[str, float], first_steps: dict[str, int]):
    """The Measured figure: left, the longest gap between two tokens of a generating
    request (baseline, chunked, limit); right, the steps from the long prompt's
    arrival to its first token."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.4))
    _bars(left, gaps_ms, "longest gap between two tokens, ms (CPU, tiny model)")
    _bars(right, first_steps, "steps from the long prompt's arrival to its token 1")
    left.set_title("what the generating requests see", fontsize=9)
    right.set_title("what the long prompt pays", fontsize=9)
    fig.tight_layout()
    return fig
