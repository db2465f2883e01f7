"""Chapter 11's helpers that are not the lesson: the drawings of the prefix-cache pool
and of the radix tree, and the Measured figure (issue 44).

    from book.ch11 import draw_chains, draw_pool, draw_tree, plot_measured
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle


def draw_chains(chains: dict[str, list[int]]):
    """One row of boxes per prompt, one box per full block labelled with the last four
    hex digits of its hash, an arrow to the next block; equal hashes, equal colours."""
    palette = plt.get_cmap("tab20").colors
    unique = dict.fromkeys(h for c in chains.values() for h in c)
    colour = {h: palette[i % len(palette)] for i, h in enumerate(unique)}
    fig, ax = plt.subplots(figsize=(8, 1.9))
    for row, (name, hashes) in enumerate(chains.items()):
        ax.text(-0.2, -row + 0.35, name, ha="right", va="center", fontsize=9)
        for i, h in enumerate(hashes):
            box = Rectangle((1.6 * i, -row), 1.3, 0.7, facecolor=colour[h], ec="black")
            ax.add_patch(box)
            ax.text(1.6 * i + 0.65, -row + 0.35, f"…{h & 0xFFFF:04x}", ha="center",
                    va="center", fontsize=8, family="monospace")  # fmt: skip
            if i:
                arrow = FancyArrowPatch(
                    (1.6 * i - 0.3, -row + 0.35), (1.6 * i, -row + 0.35),
                    arrowstyle="-|>", mutation_scale=7, color="grey",
                )  # fmt: skip
                ax.add_patch(arrow)
    ax.set(xlim=(-2.2, 5.0), ylim=(-2.2, 0.9))
    ax.set_title("hash chains of three prompts (blocks of 4 tokens)")
    ax.axis("off")
    return fig


def _block(ax, x: float, y: float, blk) -> None:
    """One block of the pool: a square with its id, ref_cnt, hash and tokens."""
    h = blk.block_hash
    face, edge = ("#c6dbef" if h else "#f2f2f2"), ("black" if blk.ref_cnt else "grey")
    ax.add_patch(Rectangle((x, y), 1.1, 0.95, facecolor=face, edgecolor=edge))
    lines = [
        (0.76, f"#{blk.block_id}  ref {blk.ref_cnt}", None),
        (0.47, f"h …{h.hash_value & 0xFFFF:04x}" if h else "no hash", "monospace"),
        (0.17, " ".join(map(str, h.token_ids)) if h else "", None),
    ]
    for dy, text, family in lines:
        ax.text(x + 0.55, y + dy, text, ha="center", fontsize=7, family=family)


def draw_pool(kv, ax, title: str) -> None:
    """The pool of a PrefixCachingKVCacheManager, read from the pool itself: one row
    for the blocks some request holds, one for the free queue in its order (head,
    evicted next, on the left). Blue: a block that has a hash (cached)."""
    pool = kv.block_pool
    held = [blk for blk in pool.blocks if blk.ref_cnt > 0]
    rows = [("in use", held), ("free queue\n(head first)", list(pool.free_block_queue))]
    for r, (label, blocks) in enumerate(rows):
        y = -1.4 * r
        ax.text(-0.2, y + 0.45, label, ha="right", va="center", fontsize=9)
        for k, blk in enumerate(blocks):
            _block(ax, 1.25 * k, y, blk)
    ax.set(xlim=(-2.2, 12.6), ylim=(-1.6, 1.2), title=title)
    ax.axis("off")


def tree_positions(tree) -> dict[int, tuple[float, float]]:
    """node id -> (x, y): leaves one unit apart in the order of their first blocks,
    every inner node above the middle of its children, one row per depth."""
    positions, leaves = {}, []

    def layout(node, depth):
        kids = sorted(node.children.values(), key=lambda n: n.key[0])
        if not kids:
            leaves.append(node)
            positions[node.id] = (len(leaves) - 1, -depth)
            return
        for k in kids:
            layout(k, depth + 1)
        x = sum(positions[k.id][0] for k in kids) / len(kids)
        positions[node.id] = (x, -depth)

    layout(tree.root, 0)
    return positions


def draw_tree(tree, ax, decode) -> None:
    """A radix tree, read from the tree: each node a box with its blocks' text
    (`decode(token_ids) -> str`), block ids and lock_ref, joined to its parent by an
    arrow; leaves green, inner nodes orange."""
    positions = tree_positions(tree)
    for node in [tree.root, *tree.nodes()]:
        x, y = positions[node.id]
        label = "root"
        if node is not tree.root:
            text = decode([t for block in node.key for t in block])
            blocks = [b.block_id for b in node.value]
            label = f"{text!r}\nblocks {blocks}\nlock_ref {node.lock_ref}"
            px, py = positions[node.parent.id]
            arrow = FancyArrowPatch(
                (px, py - 0.12), (x, y + 0.28), arrowstyle="-|>", mutation_scale=8,
                color="grey",
            )  # fmt: skip
            ax.add_patch(arrow)
        color = "#fdd0a2" if node.children else "#c7e9c0"
        box = dict(boxstyle="round", facecolor=color)
        ax.text(x, y, label, ha="center", va="center", fontsize=7.5, bbox=box)
    xs, ys = [p[0] for p in positions.values()], [p[1] for p in positions.values()]
    ax.set(xlim=(min(xs) - 0.7, max(xs) + 0.7), ylim=(min(ys) - 0.5, 0.4))
    ax.axis("off")


def _bars(ax, rows: dict[str, float], colors: list[str], fmt: str) -> None:
    ax.barh(list(rows), list(rows.values()), color=colors)
    ax.set_xlim(0, max(rows.values()) * 1.3)
    for y, v in enumerate(rows.values()):
        ax.text(v, y, " " + format(v, fmt), va="center", fontsize=8)
    ax.invert_yaxis()


def plot_measured(cpu_rows: dict[str, float], record: dict):
    """The Measured figure: left, this notebook's prefilled tokens with the cache off,
    hash, radix and the limit (only the tokens no other request shares); right, the
    stored GPU run's mean time to first token, off / hash / radix."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.8))
    colors = ["grey", "tab:blue", "tab:orange", "lightgray"]
    _bars(left, cpu_rows, colors, ",.0f")
    left.set(xlabel="prompt tokens prefilled (this run, tiny model, CPU)")
    left.set_title("32 requests, 300-token shared prefix", fontsize=9)
    runs = record["runs"]
    ttft = {name: 1e3 * run["mean_ttft_s"] for name, run in runs.items()}
    _bars(right, ttft, colors[: len(ttft)], ",.0f")
    env, w = record["environment"], record["workload"]
    right.set(xlabel="mean time to first token, ms (stored)")
    right.set_title(
        f"{w['num_requests']} requests, {w['shared_prefix_len']}-token prefix, "
        f"{w['model'].split(',')[0]}, {env.get('gpu', 'cpu')}, {env['date'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
