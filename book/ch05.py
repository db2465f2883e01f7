"""Chapter 5's helpers that are not the lesson: the Measured figure (issue 44).

from book.ch05 import plot_decode
"""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_decode(results: dict[str, list[tuple[float, int]]], batch_sizes):
    """Two log-log panels against the batch size: ms per layer and ATen operator calls
    per layer, one line per backend (`results[name]`: (ms, calls) per batch size)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.3))
    for name, rows in results.items():
        axes[0].plot(batch_sizes, [r[0] for r in rows], "o-", label=name)
        axes[1].plot(batch_sizes, [r[1] for r in rows], "o-", label=name)
    for ax, ylabel, title in [
        (axes[0], "ms per layer", "Time, one CPU thread (measured)"),
        (axes[1], "ATen operator calls per layer", "ATen operator calls (counted)"),
    ]:
        xlabel = "sequences in the decode batch (context 256 each)"
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
