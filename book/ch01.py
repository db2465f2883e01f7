"""Chapter 1's helpers that are not the lesson: the timing of one generation step
and the Measured section's figure (issue 44).

    from book.ch01 import time_generation_step, plot_kv_measured
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from benchmarks.cpu_timing import best_of
from minillm.model import DenseKVCache, build_attention_metadata


@torch.inference_mode()
def time_generation_step(model, lengths: list[int], device) -> tuple[list, list]:
    """ms of one generation step at each context length L, both ways: the whole
    sequence recomputed, and the newest token fed to a dense cache that holds the
    first L - 1 (filled by one prefill first)."""
    recompute_ms, cached_ms = [], []
    for L in lengths:
        seq = torch.randint(0, model.config.vocab_size, (L,), device=device)
        everything = torch.arange(L, device=device)
        recompute_ms.append(
            1e3 * best_of(lambda: model.compute_logits(model(seq, everything)[-1]), 5)
        )
        cache = DenseKVCache(model.config, 1, L, device=device)
        positions, md = build_attention_metadata([L - 1], [L - 1], [[0]], L, device)
        model(seq[:-1], positions, md, cache)  # the first L - 1 tokens, cached
        positions, md = build_attention_metadata([1], [L], [[0]], L, device)
        cached_ms.append(
            1e3
            * best_of(
                lambda: model.compute_logits(model(seq[-1:], positions, md, cache)), 5
            )
        )
    return recompute_ms, cached_ms


def plot_kv_measured(lengths, recompute_ms, cached_ms, device: str):
    """The Measured figure. Left: ms per generated token, recomputing against the
    cache. Right: the speed-up, against its limit, the ratio of positions each step
    pushes through the model (L to 1)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.plot(lengths, recompute_ms, "o-", color="gray", label="recompute the sequence")
    left.plot(lengths, cached_ms, "o-", color="tab:blue", label="KV cache")
    left.set(
        xlabel="context length L (tokens)",
        ylabel="ms per generated token",
        title=f"One generation step, tiny model ({device}, this run)",
    )
    left.legend(fontsize=8)
    speedup = [r / c for r, c in zip(recompute_ms, cached_ms)]
    right.plot(lengths, speedup, "o-", color="tab:blue", label="measured speed-up")
    right.plot(
        lengths, lengths, "--", color="lightgray", label="limit: L positions to 1"
    )
    right.set(
        xlabel="context length L (tokens)",
        ylabel="recompute / cached (log scale)",
        yscale="log",
        title="What the cache buys, and its limit",
    )
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig
