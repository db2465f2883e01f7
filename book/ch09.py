"""Chapter 9's helpers that are not the lesson: a batch run to completion, the
drawing of the package's import graph (the graph itself is chapter 8's,
book/ch08.py), and the plots of the Measured section and of the lab notes (issue 44).

    from book.ch09 import import_graph, draw_module_map, plot_measured
    from book.ch09 import run_to_completion
"""

from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt

from book.ch08 import import_graph, module_imports  # noqa: F401  (the lab notes')


def run_to_completion(engine, prompts: list, params) -> list:
    """Each prompt's final RequestOutput, in the prompts' order: every prompt added as
    a request (output_kind="final_only"), then engine steps until none is left. The
    loop chapter 10's `LLM.generate` wraps, for chapter 9's checks."""
    params = replace(params, output_kind="final_only")
    ids = [f"run-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[i] for i in ids]


def _place(chapter_of: dict[str, str]) -> tuple[dict, list[str]]:
    """module -> (x, y): a column per chapter, its modules in name order."""
    columns, place = sorted(set(chapter_of.values())), {}
    for x, chapter in enumerate(columns):
        names = sorted(n for n in chapter_of if chapter_of[n] == chapter)
        for y, name in enumerate(names):
            place[name] = (1.5 * x, -y)
    return place, columns


def _arrow(seam: bool, same_chapter: bool) -> dict:
    return {
        "arrowstyle": "->",
        "lw": 0.7 if seam else 0.5,
        "color": "tab:blue" if seam else "gray",
        "alpha": 0.6 if seam else 0.3,
        "shrinkA": 9,
        "shrinkB": 9,
        "connectionstyle": f"arc3,rad={0.5 if same_chapter else 0.08}",
    }


def draw_module_map(chapter_of: dict[str, str], imports: dict[str, set[str]]):
    """One box per module in its chapter's column, an arrow per import (blue: into
    chapter 8's registry, the seam)."""
    place, columns = _place(chapter_of)
    fig, ax = plt.subplots(figsize=(12, 5.2))
    for a in imports:
        for b in imports[a]:
            arrow = _arrow(b == "registry", chapter_of[a] == chapter_of[b])
            ax.annotate("", place[b], place[a], arrowprops=arrow)
    box = {"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.6", "lw": 0.5}
    for name, (x, y) in place.items():
        label = name.replace("kernels.", "kernels.\n") if len(name) > 15 else name
        ax.text(x, y, label, ha="center", va="center", fontsize=6, bbox=box)
    ticks = [1.5 * x for x in range(len(columns))]
    ax.set_xticks(ticks, [f"ch. {c.lstrip('0')}" for c in columns])
    lowest = min(y for _, y in place.values())
    ax.set(ylim=(lowest - 0.6, 0.6), xlim=(-0.9, ticks[-1] + 0.9), yticks=[])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        "minillm's modules by chapter; arrows: imports (blue: into chapter 8's "
        "registry)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def stored_rows(record: dict) -> dict[str, float]:
    """Output tokens/s of a stored benchmarks/throughput.py run: the baseline, this
    chapter's engine, and the memory-bandwidth limit."""
    return {
        "HF transformers generate\n(static batches of 64)": record["hf_transformers"][
            "output_tokens_per_s"
        ],
        "minillm, chapter 9\n(PyTorch attention, eager)": record["minillm"][
            "output_tokens_per_s"
        ],
        "memory-bandwidth limit": record["bandwidth_limit"]["output_tokens_per_s"],
    }


def _bars(ax, rows: dict[str, float], colors: list[str], log: bool = False) -> None:
    ax.barh(list(rows), list(rows.values()), color=colors)
    top = max(rows.values())
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(rows.values()) / 2, top * 5)  # room for the labels
    else:
        ax.set_xlim(0, top * 1.25)
    for y, v in enumerate(rows.values()):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()


def plot_measured(cpu_rows: dict[str, float], record: dict, device: str):
    """The Measured figure: left, this notebook's run (one request at a time against
    the engine); right, the stored GPU run against its baseline and its limit."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.8), width_ratios=[1, 1.4])
    _bars(left, cpu_rows, ["gray", "tab:blue"])
    left.set(xlabel=f"generated tokens / s (tiny model, {device}, this run)")
    _bars(right, stored_rows(record), ["gray", "tab:blue", "lightgray"], log=True)
    env, w = record["environment"], record["workload"]
    right.set(
        xlabel="output tokens / s (log scale)",
        title=f"{w['num_requests']} requests, {w['model'].split(',')[0]}, "
        f"{env['gpu']}, {env['date'][:10]} (stored)",
    )
    left.set_title("sixteen prompts, 32 tokens each")
    for ax in (left, right):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def plot_stored_run(record: dict, later: dict | None = None):
    """The stored run on a log scale, and the same workload after chapters 13-15
    (`later`, the newest throughput run) when there is one."""
    rows = stored_rows(record)
    colors = ["gray", "tab:blue", "lightgray"]
    if later is not None:  # before the limit
        *ours, (name, limit) = rows.items()
        latest = later["minillm"]["output_tokens_per_s"]
        rows = dict([*ours, ("minillm, latest\n(chapters 13-15 on)", latest)])
        rows[name] = limit
        colors.insert(2, "tab:green")
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(rows) + 0.8))
    _bars(ax, rows, colors, log=True)
    env = record["environment"]
    ax.set(
        xlabel="output tokens / s (log scale)",
        title=f"{record['workload']['model']}, {env['gpu']} (stored)",
    )
    fig.tight_layout()
    return fig
