"""Chapter 3's helpers that are not the lesson: the Measured figure (issue 44).

from book.ch03 import plot_batches
"""

from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = ["tab:red", "tab:blue", "lightgray"]


def plot_batches(batches: dict[str, dict[str, float]], title: str):
    """Horizontal bars, one group per workload: `batches[workload][kind]` requests in
    flight, kinds in the order baseline, mechanism, limit (red, blue, grey)."""
    rows = [(f"{name}\n{kind}", v) for name, kinds in batches.items()
            for kind, v in kinds.items()]  # fmt: skip
    colors = [COLORS[i % 3] for i in range(len(rows))]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1))
    ax.barh(range(len(rows)), [v for _, v in rows], color=colors, alpha=0.8)
    for i, (_, v) in enumerate(rows):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xlim(0, max(v for _, v in rows) * 1.12)
    ax.invert_yaxis()
    ax.set(xlabel="requests in flight", title=title)
    fig.tight_layout()
    return fig
