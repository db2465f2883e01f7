"""Chapter 29's helpers that are not the lesson: when a part of a stored
`benchmarks/compare_vllm.py` record ran, its tables (offline and under load), the
split of its profiles, and the plot of the servers' latencies.

The chapter (chapters/29_vllm_comparison.md) and its lab notes
(chapters/lab_notes/29_vllm_comparison_lab.md) import them; the load generator
itself is in minillm/loadgen.py.
"""

from __future__ import annotations

__all__ = [
    "MATMUL",
    "load_table",
    "offline_table",
    "part_run",
    "plot_load",
    "plot_offline",
    "print_profile",
    "profile_split",
]

# the operators that are matrix products, in either engine's profile
MATMUL = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "onednn_mm")


def part_run(record: dict, part: str) -> dict:
    """When and where a part of a record ran: date, environment (machine, load)."""
    return record.get("part_runs", {}).get(part, record)


def offline_table(record: dict, label: str) -> None:
    """Offline throughput and batch-1 time per token, both engines, each model."""
    env, off = part_run(record, "offline")["environment"], record["offline"]
    versions = record["vllm_versions"]
    print(
        f"{label}: {env['date'][:10]}, {env.get('cpu_model')}, {env['threads']} "
        f"threads each; minillm: torch {env['torch']}; vLLM {versions['vllm']}: "
        f"torch {versions['torch']}; best of "
        f"{len(off['tiny']['minillm']['throughput_seconds'])}; load average "
        f"{env['loadavg_before'][0]:.1f} before, {env['loadavg_after'][0]:.1f} after"
    )
    print(f"{'':9s} {'output tok/s':>26s} {'batch 1, ms/token':>26s}")
    print(
        f"{'model':9s} {'minillm':>12s} {'vLLM':>12s}  {'minillm':>12s} {'vLLM':>12s}"
    )
    for name, r in off.items():
        a, b = r["minillm"], r["vllm"]
        print(
            f"{name:9s} {a['output_tokens_per_s']:12.0f} "
            f"{b['output_tokens_per_s']:12.0f}  "
            f"{a['batch1_ms_per_token']:12.1f} {b['batch1_ms_per_token']:12.1f}"
        )


def load_table(record: dict, label: str) -> None:
    """Both servers under load: throughput, TTFT, ITL and TPOT per concurrency."""
    env, levels = part_run(record, "load")["environment"], record["server_load"]
    print(f"{label}: {env['date'][:10]}, load average {env['loadavg_before'][0]:.1f}")
    print(
        f"{'':12s} {'tok/s':>14s} {'TTFT p50, ms':>18s} {'ITL p50, ms':>18s} "
        f"{'TPOT mean, ms':>18s}"
    )
    print(f"{'concurrency':12s}" + " {:>8s} {:>9s}".format("minillm", "vLLM") * 4)
    for ours, theirs in zip(levels["load"]["minillm"], levels["load"]["vllm"]):
        a, b = ours["summary"], theirs["summary"]
        cells = [
            (a["output_tokens_per_s"], b["output_tokens_per_s"]),
            (a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
            (a["itl_ms"]["p50"], b["itl_ms"]["p50"]),
            (a["tpot_ms"]["mean"], b["tpot_ms"]["mean"]),
        ]
        row = "".join(f" {x:8.1f} {y:9.1f}" for x, y in cells)
        print(f"{a['concurrency']:<12d}" + row)


def profile_split(prof: dict) -> tuple[float, float, float]:
    """A profile's share of wall time in operators, and the operators' own seconds
    split into matrix products and the rest."""
    ops, op_s = prof["top_ops"], prof["self_cpu_total_ms"] / 1e3
    mm = sum(o["self_cpu_pct"] for o in ops if o["name"].endswith(MATMUL)) / 100
    return op_s / prof["wall_seconds"], mm * op_s, (1 - mm) * op_s


def print_profile(name: str, side: str, prof: dict, top: int) -> None:
    """One engine's profile: the split, then its `top` operators by own time."""
    in_ops, mm_s, other_s = profile_split(prof)
    print(
        f"{name} {side}: {prof['wall_seconds']:.2f} s wall, {in_ops:.0%} in "
        f"operators: matrix products {mm_s:.2f} s, the rest {other_s:.2f} s"
    )
    for o in prof["top_ops"][:top]:
        print(f"   {o['self_cpu_pct']:5.1f}%  {o['calls']:6d} calls  {o['name'][:56]}")


def plot_load(record: dict) -> None:
    """Time to first token and time per output token against concurrency."""
    import matplotlib.pyplot as plt

    load, env = record["server_load"]["load"], part_run(record, "load")["environment"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for side, style in (("minillm", "o-"), ("vllm", "s--")):
        c = [lv["summary"]["concurrency"] for lv in load[side]]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            stat = "p50" if key == "ttft_ms" else "mean"
            ax.plot(
                c, [lv["summary"][key][stat] for lv in load[side]], style, label=side
            )
    titles = ("time to first token, p50", "time per output token, mean")
    for ax, title in zip(axes, titles):
        ax.set(xscale="log", xlabel="concurrent requests", ylabel="ms", title=title)
        ax.set_xticks(c, [str(x) for x in c])
        ax.legend()
    fig.suptitle(
        f"SmolLM2-135M on {env.get('cpu_model')}, 2 threads each, measured "
        f"{env['date'][:10]}, load average {env['loadavg_before'][0]:.1f} before",
        fontsize=9,
    )
    plt.tight_layout()
    plt.show()


def plot_offline(offline: dict, date: str):
    """The Measured figure: output tokens per second and batch-1 ms per token, each
    model, minillm beside vLLM (the baseline)."""
    import matplotlib.pyplot as plt

    models = list(offline)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    panels = (
        ("output_tokens_per_s", "output tokens / s (higher is better)"),
        ("batch1_ms_per_token", "batch 1, ms per token (lower is better)"),
    )
    for ax, (key, title) in zip(axes, panels):
        for k, (engine, color) in enumerate(
            (("vllm", "gray"), ("minillm", "tab:blue"))
        ):
            values = [offline[m][engine][key] for m in models]
            xs = [i + 0.4 * k for i in range(len(models))]
            ax.bar(
                xs, values, width=0.4, color=color, label=engine.replace("vllm", "vLLM")
            )
        ax.set_xticks([i + 0.2 for i in range(len(models))], models)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Offline, on a CPU, two threads each (stored run, {date})", fontsize=9
    )
    fig.tight_layout()
    return fig
