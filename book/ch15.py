"""Chapter 15's helpers that are not the lesson: reading the stored H200 profiles, the
figures (the persistent batch's rows, the measured steps) and a timer.

The chapter (chapters/15_cuda_graph.md) and its lab notes
(chapters/lab_notes/15_cuda_graph_lab.md) import them; the engine itself is in minillm/.
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt


def kernel_ms(profile: dict, name: str) -> float:
    """GPU time per step of the kernels whose name starts with name."""
    found = [k for k in profile["top_kernels"] if k["name"].startswith(name)]
    return sum(k["calls_per_step"] * k["us_per_call"] for k in found) / 1e3


def lm_head_us(profile: dict) -> float:
    """The LM head: the one large product a step runs once."""
    once = [k for k in profile["top_kernels"] if k["calls_per_step"] == 1]
    return max(once, key=lambda k: k["us_per_call"])["us_per_call"]


def products_numbers(plain: dict, merged: dict, qwen3: dict, copy_bw: float) -> dict:
    """From the batch-1 profiles before and after merging the projections: the seven
    products of a layer against the bytes of their weights, the slowest product after
    merging, and the LM head."""
    layers = 28  # Qwen3-0.6B
    products_ms = plain["gpu_ms_per_step_by_kind"]["matmul"] - lm_head_us(plain) / 1e3
    layer_bytes = qwen3["roofline"]["linear_bytes"] / layers
    per_layer = [k for k in merged["top_kernels"] if k["calls_per_step"] == layers]
    slowest = max(k["us_per_call"] for k in per_layer if k["name"].startswith("nvjet"))
    return {
        "ch11_products_us": 1e3 * products_ms / layers,
        "ch11_layer_mb": layer_bytes / 1e6,
        "ch11_layer_us": 1e6 * layer_bytes / copy_bw,
        "ch11_slowest_us": slowest,
        "ch11_lm_head_us": lm_head_us(merged),
        "ch11_lm_head_mb": qwen3["roofline"]["lm_head_bytes"] / 1e6,
    }


def graphs_numbers(record: dict) -> dict:
    """The glued numbers of the stored benchmarks/cuda_graphs.py run: batch 1 and the
    largest batch, and how often each variant's greedy tokens agree with eager's."""
    rows = record["steps"]
    first, big = rows[0], rows[-1]
    numbers = {
        "ch11_graph_b1_ms": first["graph_ms"],
        "ch11_eager_big_ms": big["eager_ms"],
        "ch11_graph_big_ms": big["graph_ms"],
        "ch11_compile_b1_ms": first["graph_compile_ms"],
        "ch11_compile_big_ms": big["graph_compile_ms"],
        "ch11_big_batch": big["batch"],
    }
    for variant, short in (("graph", "graph"), ("graph_compile", "compile")):
        agree = [r[f"greedy_token_agreement_{variant}"] for r in rows]
        share = f"{min(agree):.1%} to {max(agree):.1%} of them"
        numbers[f"ch11_agree_{short}"] = "every one" if min(agree) == 1 else share
    return numbers


def print_graphs_run(record: dict) -> None:
    """The stored benchmarks/cuda_graphs.py run, batch by batch."""
    for r in record["steps"]:
        fused = r.get("graph_compile_ms")
        line = (
            f"batch {r['batch']:4d}: eager {r['eager_ms']:6.2f} ms, graphs "
            f"{r['graph_ms']:6.2f} ms ({r['eager_ms'] / r['graph_ms']:4.1f}x)"
        )
        if fused:
            line += (
                f", graphs + compile {fused:6.2f} ms ({r['eager_ms'] / fused:4.1f}x; "
                f"{r['batch'] / fused * 1e3:,.0f} tok/s)"
            )
        print(line)
    print(
        f"capturing {record['num_graphs']} graphs (compiled layers) took "
        f"{record['capture_seconds']:.1f} s"
    )


def timed(fn, repeats: int = 20) -> float:
    """The best wall time of repeats calls of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _draw_row(ax, batch, y: int, request_id: str, row: int) -> None:
    """One row's block table as a strip of numbered cells."""
    for j in range(batch.num_blocks[row]):
        color = plt.cm.tab20(int(request_id) % 20)
        ax.add_patch(plt.Rectangle((j, y), 0.95, 0.9, color=color))
        ax.text(j + 0.47, y + 0.45, str(batch.block_table[row, j]), ha="center",
                va="center", fontsize=7)  # fmt: skip


def draw_input_batch(batch, running: list[str], bucket: int, num_steps: int):
    """Left, every row of an InputBatch, used or free; right, the rows a decode step
    of the running requests copies into the graph's buffers, padding after them."""
    row_of, width = batch.req_to_row, max(batch.num_blocks) + 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 2.8))
    left = dict(ha="right", va="center", fontsize=8)  # the labels left of the rows
    for row in range(len(batch.num_blocks)):
        owner = next((rid for rid, r in row_of.items() if r == row), None)
        label = f"row {row}: " + (f"request {owner}" if owner else "free")
        axes[0].text(-0.3, row + 0.45, label, **left)
        if owner is not None:
            _draw_row(axes[0], batch, row, owner, row)
    for y, request_id in enumerate(running):
        axes[1].text(-0.3, y + 0.45, f"seq {y}: request {request_id}", **left)
        _draw_row(axes[1], batch, y, request_id, row_of[request_id])
    padding = "padding: seq_len 0, K/V to the scratch block"
    for y in range(len(running), bucket):
        axes[1].add_patch(plt.Rectangle((0, y), width - 0.05, 0.9, color="0.88"))
        axes[1].text(width / 2, y + 0.45, padding, ha="center", va="center", fontsize=7)
    for ax, title in [
        (axes[0], f"InputBatch rows after {num_steps} steps"),
        (axes[1], f"graph buffers: {len(running)} sequences in the bucket of {bucket}"),
    ]:
        top = max(len(batch.num_blocks), bucket) + 0.1
        ax.set(xlim=(-6, width), ylim=(top, -0.1), yticks=[], title=title)
        ax.set_xlabel("block-table column (block ids in the cells)")
    fig.suptitle("tiny model, real run", fontsize=9)
    plt.tight_layout()
    plt.show()


def plot_measured(record: dict, limit_ms: float | None):
    """ms per engine step against the decode batch: eager, CUDA graphs and graphs
    over compiled layers, with the batch-1 floor."""
    env, rows = record["environment"], record["steps"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["eager_ms"] for r in rows], "o-", label="eager")
    ax.plot(batches, [r["graph_ms"] for r in rows], "o-", label="CUDA graphs")
    if all("graph_compile_ms" in r for r in rows):
        compiled = [r["graph_compile_ms"] for r in rows]
        ax.plot(batches, compiled, "o-", label="CUDA graphs + compiled layers")
    if limit_ms is not None:  # the least time a batch-1 step can take
        ax.axhline(limit_ms, ls=":", color="grey", label="batch-1 floor (bytes)")
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences)",
           ylabel="ms per engine step")  # fmt: skip
    ax.set_title(
        f"decode step, Qwen3-0.6B shape, bf16, {env['gpu']} "
        f"(measured {env['date'][:10]})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
