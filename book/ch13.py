"""Chapter 13's and 14's helpers that are not the lesson: a random paged batch for the
checkpoints, and the figures (the decode grid, the skinny product's programs, and the
Measured sections' stored runs).

The chapter (chapters/13_triton_decode.md) and its lab notes
(chapters/lab_notes/13_triton_decode_lab.md) import them; the kernels are in
minillm/kernels/.
"""

from __future__ import annotations

import random

import matplotlib.pyplot as plt
import torch


def random_batch(
    query_lens,
    seq_lens,
    block_size,
    n_heads,
    n_kv,
    head_dim,
    dtype=torch.float32,
    seed=0,
    device="cpu",
):
    """(q, key_cache, value_cache, metadata) of a random batch whose blocks come from a
    shuffled free list, laid out by chapter 5's build_attention_metadata."""
    from minillm.model import build_attention_metadata

    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    shape = (num_blocks, block_size, n_kv, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=g).to(device, dtype)
    return q, k_cache, v_cache, md


def plot_decode_grid(lens, block_size=16, splits=4, tile=32, seed=0):
    """The decode kernel's grid for sequences of `lens` tokens whose blocks come from a
    shuffled free list: each token coloured by the split (program) that reads it, each
    block labelled with its physical id."""
    rng = random.Random(seed)
    free = rng.sample(range(64), 64)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    colors = plt.cm.tab10.colors
    for s, (n, table) in enumerate(zip(lens, tables)):
        # as the kernel computes it: a multiple of the tile
        split_len = -(-(-(-n // splits)) // tile) * tile
        for t in range(n):
            color = colors[min(t // split_len, 9)]
            ax.add_patch(plt.Rectangle((t, s - 0.4), 1, 0.8, color=color, lw=0))
        for b, block in enumerate(table):  # in the middle of the block's used slots
            middle = (b * block_size + min((b + 1) * block_size, n)) / 2
            ax.text(middle, s, str(block), ha="center", va="center", fontsize=7)
    ax.set(
        xlim=(0, max(lens)),
        ylim=(len(lens) - 0.5, -0.5),
        yticks=range(len(lens)),
        yticklabels=[f"seq {i} ({n} tokens)" for i, n in enumerate(lens)],
        xlabel="token position",
        title="decode grid: colour = the split (program) that reads the token; "
        "numbers = physical block ids",
    )
    plt.show()


def skinny_programs(M, N, K):
    """The grid skinny_linear launches for an (M, N, K) product: (its knobs, bands of
    W's rows, slices of K, BLOCK_K steps per slice)."""
    from minillm.kernels.skinny_gemm import default_config

    cfg = default_config(M, N, K)
    k_steps = -(-K // cfg["block_k"])
    per_split = -(-k_steps // min(cfg["split_k"], k_steps))
    return cfg, -(-N // cfg["block_n"]), -(-k_steps // per_split), per_split


def _draw_programs(ax, name, N, K, shown):
    cfg, bands, splits, per_split = skinny_programs(1, N, K)
    slice_k = per_split * cfg["block_k"]
    for b in range(shown):
        for s in range(splits):
            width = min(slice_k, K - s * slice_k)
            box = plt.Rectangle(
                (s * slice_k, b + 0.06),
                width,
                0.88,
                lw=0.6,
                facecolor=plt.cm.Pastel1(s % 9),
                edgecolor="0.3",
            )
            ax.add_patch(box)
            ax.text(
                s * slice_k + width / 2,
                b + 0.5,
                f"program ({b}, {s})",
                ha="center",
                va="center",
                fontsize=7,
            )
            for step in range(1, per_split):  # the program's steps along K
                x = s * slice_k + step * cfg["block_k"]
                ax.plot([x, x], [b + 0.06, b + 0.3], color="0.3", lw=0.6)
    ax.set(
        xlim=(0, K),
        ylim=(shown + 0.3, 0),
        yticks=[b + 0.5 for b in range(shown)],
        yticklabels=[
            f"rows {b * cfg['block_n']}-{(b + 1) * cfg['block_n'] - 1}"
            for b in range(shown)
        ],
        xlabel=f"K (columns of W); ticks: steps of BLOCK_K = {cfg['block_k']}",
    )
    ax.set_title(
        f"{name} (N={N}, K={K}) at M=1, first {shown} bands:\n{bands} bands of "
        f"{cfg['block_n']} rows x {splits} slice(s) of K = {bands * splits} programs",
        fontsize=8,
    )
    ax.tick_params(axis="y", labelsize=7)


def plot_skinny_programs(shapes: dict[str, tuple[int, int]], shown: int = 6):
    """One panel per product {name: (N, K)}: a box per program of skinny_linear at one
    row, its part of W (a band of rows x a slice of K), for the first `shown` bands."""
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.4))
    for ax, (name, (N, K)) in zip(axes, shapes.items()):
        _draw_programs(ax, name, N, K, shown)
    plt.tight_layout()
    plt.show()


def _when(record) -> str:
    env = record["environment"]
    return f"{env['gpu']}, {env['date'][:10]}"


def _decode_panel(ax, record):
    rows, copy_bw = record["decode"], record["copy_bandwidth_bytes_per_s"]
    for i, ctx in enumerate(sorted({r["context"] for r in rows})):
        pts = [r for r in rows if r["context"] == ctx]
        batch = [r["batch"] for r in pts]
        ours = [r["bandwidth_bytes_per_s"] / 1e12 for r in pts]
        # the same bytes over the reference's time
        ref = [b * r["kernel_us"] / r["reference_us"] for b, r in zip(ours, pts)]
        ax.plot(batch, ours, "o-", color=f"C{i}", label=f"kernel, context {ctx}")
        ax.plot(batch, ref, "x:", color=f"C{i}", label=f"reference, context {ctx}")
    ax.axhline(copy_bw / 1e12, color="gray", ls="--", label="copy bandwidth (limit)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch (sequences)",
        ylabel="TB/s of K/V read",
        title=f"decode attention ({_when(record)})",
    )
    ax.legend(fontsize=6)


def _prefill_panel(ax, run, first, ours):
    limits = run["prefill"]["limits"]
    bars = {
        "first kernel": first["tflops"],
        "paged_prefill": ours["tflops"],
        "SDPA, dense": limits["sdpa_tflops"],
    }
    drawn = ax.barh(list(bars), list(bars.values()), color=["0.6", "C0", "0.8"])
    ax.bar_label(drawn, fmt="%.0f", fontsize=7)
    ax.axvline(
        limits["matmul_flops"] / 1e12,
        color="gray",
        ls="--",
        label="large bf16 matmul (limit)",
    )
    ax.invert_yaxis()
    ax.set(
        xlabel="TFLOP/s (causal FLOPs / time)",
        title=f"prefill attention ({_when(run)})",
    )
    ax.legend(fontsize=6, loc="lower right")


def _skinny_panel(ax, gemm, names):
    rs = [
        next(
            r
            for r in gemm["rows"]
            if r["M"] == 1 and (r["model"], r["name"]) == ("Qwen3-0.6B", n)
        )
        for n in names
    ]
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x],
        [r["cublas_us"] for r in rs],
        0.4,
        color="0.6",
        label="cuBLAS",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [r["skinny_us"] for r in rs],
        0.4,
        color="C0",
        label="skinny_linear",
    )
    bw = gemm["copy_bandwidth_bytes_per_s"]
    floor = [1e6 * r["weight_bytes"] / bw for r in rs]
    ax.scatter(list(x), floor, marker="_", s=400, color="k", label="weights at copy bw")
    ax.set_xticks(list(x), [n.replace("_proj", "") for n in names], fontsize=7)
    ax.set(ylabel="µs per call", title=f"Qwen3-0.6B products, M = 1 ({_when(gemm)})")
    ax.legend(fontsize=6)


def plot_measured(decode, prefill, first, ours):
    """Chapter 13's Measured figure, from stored GPU runs: decode attention's
    bandwidth against the reference and the copy bandwidth; prefill's TFLOP/s (rows
    `first` and `ours` of the prefill run) against dense SDPA and a large matmul."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _decode_panel(axes[0], decode)
    _prefill_panel(axes[1], prefill, first, ours)
    for ax in axes:
        ax.title.set_fontsize(8)
    plt.tight_layout()
    plt.show()


def plot_products(gemm, names):
    """Chapter 14's Measured figure: the one-row products `names` of the stored
    decode_gemm run against cuBLAS and the weights' stream at the copy bandwidth."""
    fig, ax = plt.subplots(figsize=(5, 3.6))
    _skinny_panel(ax, gemm, names)
    ax.title.set_fontsize(8)
    plt.tight_layout()
    plt.show()
