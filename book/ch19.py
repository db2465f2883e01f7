"""Chapter 19's helpers that are not the lesson: bits stored per weight, the paired
verdicts of the quality tables, and the tables and figures of the stored quality runs
(chapter 20's speed runs are book/ch20.py's; chapter 18's rotation checks are
book/ch18.py's).

The chapter (chapters/19_quantized_serving.md), its lab notes
(chapters/lab_notes/19_quantized_serving_lab.md) and chapter 20 import them; the
table itself is minillm/quantization/quality.py.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch

from minillm.quantization.quality import interval, ppl_ratio, resampled_means

FAMILY = {  # method -> (legend label, colour)
    None: ("bf16", "grey"),
    "rtn": ("RTN", "C0"),
    "gptq": ("GPTQ one-shot", "C1"),
    "gptq-seq": ("GPTQ sequential", "C2"),
    "awq": ("AWQ", "C3"),
    "w8a8": ("W8A8 int8", "C4"),
    "fp8": ("FP8 W8A8", "C5"),
}


def bits_per_weight(method: str | None, settings: dict) -> float:
    """Bits stored per weight: 4-bit codes and a 16-bit scale and zero per group;
    8-bit codes (with one scale a row, too few to count); bf16."""
    if method in ("rtn", "gptq", "gptq-seq", "awq"):
        return 4 + 2 * 16 / settings["group_size"]
    return 16.0 if method is None else 8.0


def versus(table: dict, a: str, b: str) -> tuple[str, str]:
    """How row a's perplexity compares with row b's, decided by the interval of
    their paired ratio: (the words, the ratio and its interval)."""
    r, lo, hi = ppl_ratio(table, a, b)
    word = "lower than" if hi < 1 else "higher than" if lo > 1 else "not separable from"
    return word, f"ratio {r:.3f}, 95% interval {lo:.3f}-{hi:.3f}"


def target(table: dict, rows: list[str], limit: float = 1.05) -> tuple[str, str]:
    """Whether the rows' perplexity (their mean log-loss, per window) is within
    `limit` times the unquantized one: met when the whole interval is."""
    by = {r["label"]: torch.tensor(r["window_nll"]) for r in table["rows"]}
    diff = torch.stack([by[r] for r in rows]).mean(0) - by["unquantized"]
    lo, hi = (math.exp(v) for v in interval(resampled_means(diff)))
    word = "met" if hi <= limit else "missed" if lo > limit else "undecided"
    return word, f"ratio {math.exp(float(diff.mean())):.3f}, interval {lo:.3f}-{hi:.3f}"


def _cell(row: dict) -> str:
    lo, hi = row["ppl_interval"]
    return f"{row['ppl']:7.2f} [{lo:6.2f}, {hi:6.2f}] {row['agreement']:6.1%}"


def print_quality_tables(tiny: dict, smol: dict) -> None:
    """The two quality tables side by side: perplexity [95% interval], agreement."""
    print(f"\n{'':51} {'tiny model':^31} {'SmolLM2-135M':^31}")
    print(f"{'':51}" + f" {'ppl [95% interval]':>23} {'agree':>7}" * 2)
    for a, b in zip(tiny["rows"], smol["rows"]):
        label = a["label"].replace(" g128", " g128/g64", 1)
        print(f"{label:51} {_cell(a)} {_cell(b)}")


def _ratio_points(table: dict, setup: dict) -> list[tuple]:
    """(bits, percent over bf16, low, high, method, label) of every quantized row."""
    base = table["rows"][0]["label"]
    points = []
    for row in table["rows"][1:]:
        method, settings = setup[row["label"]]
        r, lo, hi = ppl_ratio(table, row["label"], base)
        pct = [100 * (x - 1) for x in (r, lo, hi)]
        points.append((bits_per_weight(method, settings), *pct, method, row["label"]))
    return points


def plot_quality_vs_bits(table: dict, setup: dict, grid: dict | None = None):
    """Perplexity over bf16's (paired 95% interval) against bits stored per weight,
    one point a row of table (setup: label -> (method, settings)); grid: the stored
    gptq_quality run, its rows as open squares."""
    fig, ax = plt.subplots(figsize=(8, 4))
    seen = set()
    points = _ratio_points(table, setup)
    for i, (bits, pct, lo, hi, method, _) in enumerate(sorted(points)):
        name, colour = FAMILY[method]
        x = bits + 0.06 * (i % 5 - 2)  # rows at the same bits side by side
        label = None if name in seen else name
        ax.errorbar(x, pct, yerr=[[pct - lo], [hi - pct]], fmt="o", color=colour,
                    ms=4, capsize=2, lw=1, label=label)  # fmt: skip
        seen.add(name)
    if grid is not None:
        for i, row in enumerate(grid["rows"][1:]):
            lo, hi = (100 * (x - 1) for x in row["ratio_interval"])
            pct, bits = (
                100 * (row["ratio"] - 1),
                bits_per_weight(row["method"], row["settings"]),
            )
            ax.errorbar(bits + 0.06 * (i % 5 - 2), pct, yerr=[[pct - lo], [hi - pct]],
                        fmt="s", mfc="none", color="k", ms=5, capsize=2, lw=0.8,
                        label=None if i else "GPTQ knobs (gptq_quality)")  # fmt: skip
    ax.axhline(0, color="grey", ls="--", lw=1)
    ax.axhline(5, color="grey", ls=":", lw=1, label="+5% target")
    ax.set_xlabel("bits stored per weight (codes, scales and zeros)")
    ax.set_ylabel("held-out perplexity over bf16, %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


SEQ_AO = "GPTQ int4 g64 act-order sequential"  # AutoGPTQ's defaults, SmolLM2's g64
ROW_KEYS = {  # glue key -> SmolLM2's row label
    "base": "unquantized", "rtn32": "RTN int4 g32", "rtn64": "RTN int4 g64",
    "gptq": "GPTQ int4 g64 one-shot", "gptq_ao": "GPTQ int4 g64 act-order one-shot",
    "seq": "GPTQ int4 g64 sequential", "seq_ao": SEQ_AO,
    **{f"had{k}": f"{SEQ_AO}, Hadamard {k}" for k in range(3)},
    "rtn_had": "RTN int4 g64, Hadamard 0", "awq": "AWQ int4 g64",
    "w8": "W8A8 int8, no smoothing", "sq": "W8A8 SmoothQuant a=0.5",
    "fp8": "FP8 W8A8 (E4M3)",
}  # fmt: skip
COMPARISONS = {  # glue key -> (row a, row b), in SmolLM2's labels
    "gptq_rtn": (SEQ_AO, "RTN int4 g64"),
    "gptq_rtn32": (SEQ_AO, "RTN int4 g32"),
    "awq_rtn": ("AWQ int4 g64", "RTN int4 g64"),
    "gptq_awq": (SEQ_AO, "AWQ int4 g64"),
    "ao_one": ("GPTQ int4 g64 act-order one-shot", "GPTQ int4 g64 one-shot"),
    "seq_ao": (SEQ_AO, "GPTQ int4 g64 act-order one-shot"),
    "seq_plain": ("GPTQ int4 g64 sequential", "GPTQ int4 g64 one-shot"),
    **{f"had{k}": (f"{SEQ_AO}, Hadamard {k}", SEQ_AO) for k in range(3)},
    "rtn_had": ("RTN int4 g64, Hadamard 0", "RTN int4 g64"),
    "sq_w8": ("W8A8 SmoothQuant a=0.5", "W8A8 int8, no smoothing"),
    "fp8_w8": ("FP8 W8A8 (E4M3)", "W8A8 int8, no smoothing"),
    "fp8_sq": ("FP8 W8A8 (E4M3)", "W8A8 SmoothQuant a=0.5"),
}  # fmt: skip


def build_s(table: dict) -> float:
    """The seconds a quality table took to compute: calibration and every row."""
    return table["calibration_s"] + sum(r["seconds"] for r in table["rows"])


def table_numbers(smol_table: dict, tiny_table: dict | None = None) -> dict:
    """The numbers the prose quotes from the quality tables (SmolLM2's, and the tiny
    model's spread where given), by glue key."""
    smol = {r["label"]: r for r in smol_table["rows"]}
    base = smol["unquantized"]["ppl"]
    out = {}
    for key, label in ROW_KEYS.items():
        out[f"ch13_smol_{key}_ppl"] = smol[label]["ppl"]
        out[f"ch13_smol_{key}_pct"] = 100 * (smol[label]["ppl"] / base - 1)
        out[f"ch13_smol_{key}_agree"] = 100 * smol[label]["agreement"]
    out["ch13_smol_base_lo"], out["ch13_smol_base_hi"] = smol["unquantized"][
        "ppl_interval"
    ]
    out["ch13_smol_build_min"] = build_s(smol_table) / 60
    rotated = [out[f"ch13_smol_had{k}_pct"] for k in range(3)]
    out["ch13_smol_had_min_pct"], out["ch13_smol_had_max_pct"] = (
        min(rotated),
        max(rotated),
    )
    out["ch13_smol_had_mean_pct"] = sum(rotated) / len(rotated)
    out["ch13_smol_had_spread"] = max(rotated) - min(rotated)
    out["ch13_smol_had_n"] = len(rotated)
    n_windows, window = smol_table["held_out"]
    out["ch13_smol_windows"] = n_windows
    out["ch13_smol_split_tokens"] = smol_table["held_out_tokens"]
    out["ch13_smol_scored"] = n_windows * smol_table["scored_per_window"]
    out["ch13_smol_context"] = window - smol_table["scored_per_window"]
    out["ch13_smol_calib"] = smol_table["calib"][0] * smol_table["calib"][1]
    if tiny_table is not None:
        tiny_ppl = [r["ppl"] for r in tiny_table["rows"]]
        out["ch13_tiny_spread"] = 100 * (max(tiny_ppl) / min(tiny_ppl) - 1)
    w8, sq = smol[ROW_KEYS["w8"]]["ppl"], smol[ROW_KEYS["sq"]]["ppl"]
    out["ch13_sq_share"] = 100 * (w8 - sq) / (w8 - base)
    return out
