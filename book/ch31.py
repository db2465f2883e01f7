"""Chapter 31's helpers that are not the lesson: the Measured figure (issue 44).

from book.ch31 import plot_throughput
"""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_throughput(runs: dict[str, dict], labels: list[str], title: str):
    """Output tokens/s of the stored runs `labels` (the first is the default engine,
    the baseline every bar's share is of); base runs red, adapter runs blue."""
    rates = [runs[k]["output_tokens_per_s"] for k in labels]
    colors = ["tab:red" if k.startswith("base") else "tab:blue" for k in labels]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.barh(labels, rates, color=colors, alpha=0.8)
    for y, r in enumerate(rates):
        ax.text(r, y, f" {r:,.0f} ({r / rates[0]:.0%})", va="center", fontsize=8)
    ax.set_xlim(0, max(rates) * 1.3)
    ax.invert_yaxis()
    ax.set(xlabel="output tokens/s (share of the default engine)", title=title)
    fig.tight_layout()
    return fig
