"""Chapter 24's harness: what the chapter and its lab notes share that is not the
lesson (issue 44).

    from book.ch24 import constrained, random_walk, gpu_table

The "random model" that the checks walk grammars with; greedy parameters under a
schema's processor; the tables and the figures of the stored runs
(benchmarks/results/); and, for the lab notes, the timing loops against xgrammar.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import numpy as np
import torch


def constrained(schema: dict, compiler, max_tokens: int):
    """Greedy SamplingParams under schema's processor (top-2 logprobs kept)."""
    from minillm import SamplingParams
    from minillm.structured.processor import StructuredOutputsParams

    proc = StructuredOutputsParams(json=schema).logits_processor(compiler, max_tokens)
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, logits_processors=[proc], logprobs=2
    )


def random_walk(params, compiler, rng: random.Random, max_tokens: int = 96) -> str:
    """The "random model": a uniform choice among the tokens the mask allows, until
    EOS; returns the text written."""
    index = compiler.index
    proc = params.logits_processor(compiler, max_tokens=max_tokens)
    out, eos = [], set(index.eos_token_ids)
    for _ in range(max_tokens + 1):
        logits = proc(out, torch.zeros(index.vocab_size))  # (vocab,)
        allowed = torch.nonzero(logits > float("-inf")).flatten().tolist()
        token = rng.choice(allowed)
        if token in eos:
            break
        out.append(token)
    return b"".join(index.token_bytes[t] for t in out).decode()


def plot_allowed(counts: list[int], labels: list[str], title: str):
    """Bars of the allowed tokens at each step of one output (log scale)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.bar(range(len(counts)), counts, color="tab:blue")
    ax.set_yscale("log")
    ax.set_xticks(range(len(counts)))
    ax.set_xticklabels(labels, rotation=60, fontsize=8)
    ax.set_ylabel("allowed tokens")
    ax.set_title(title)
    fig.tight_layout()
    return fig


GPU_CONDITIONS = {
    "unconstrained": "no constraint (baseline)",
    "constrained_warm_per_row": "masks row by row (reference)",
    "constrained_warm_in_order": "one bitmask, then the forward pass",
    "constrained_warm": "one bitmask, behind the forward pass",
}


def gpu_table(run: dict) -> dict:
    """Print the stored engine run's throughput and cost per condition; return
    {condition: (tokens/s, cost in %)} for the conditions the run has."""
    res, rows = run["results"], {}
    print(f"{'':38}{'tokens/s':>10}{'cost':>8}{'valid':>8}")
    for key, name in GPU_CONDITIONS.items():
        if key not in res:
            continue
        r = res[key]
        cost = 100 * (r.get("overhead") or 0.0)
        valid = r.get("valid")
        valid = "-" if valid is None else f"{valid}/{run['workload']['batch']}"
        print(f"{name:38}{r['output_tokens_per_s']:10.0f}{cost:7.1f}%{valid:>8}")
        rows[key] = (r["output_tokens_per_s"], cost)
    return rows


def plot_mask_times(jsb: dict):
    """Mask time per JSONSchemaBench subset (median, and the 99th percentile of CPU
    time), ours against xgrammar, from a stored coverage run."""
    import matplotlib.pyplot as plt

    from book.ch23 import jsb_subsets

    subs = jsb_subsets(jsb)
    fig, right = plt.subplots(figsize=(6, 3.6))
    names, at = list(subs), np.arange(len(subs))
    for i, (lib, q, label) in enumerate(
        [("ours", "mask_us_p50", "minillm p50"), ("xgr", "mask_us_p50", "xgrammar p50"),
         ("ours", "mask_cpu_us_p99", "minillm p99 (CPU)"),
         ("xgr", "mask_cpu_us_p99", "xgrammar p99 (CPU)")]
    ):  # fmt: skip
        values = [subs[n][lib].get(q) or np.nan for n in names]
        right.bar(at + (i - 1.5) * 0.2, values, 0.2, label=label)
    right.set_yscale("log")
    right.set_ylim(top=right.get_ylim()[1] * 20)  # room for the legend
    right.set_xticks(at)
    right.set_xticklabels([n.replace("_", " ") for n in names], rotation=45,
                          ha="right", fontsize=8)  # fmt: skip
    right.set(ylabel="µs per mask", title="mask time per subset")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


# --- the lab notes' timing loops ---------------------------------------------------


def time_ours(schema, ids, index, precompute: bool):
    """Compile schema afresh (not the compiler's cache), then time each next mask
    while replaying ids; precompute: every state's mask at compile time, and the
    per-stacks cache cleared before each mask so that none is simply looked up."""
    from minillm.structured.grammar import Grammar
    from minillm.structured.matcher import CompiledGrammar, GrammarMatcher
    from minillm.structured.processor import StructuredOutputsParams

    t0 = time.perf_counter()
    c = CompiledGrammar(Grammar(StructuredOutputsParams(json=schema).rules()), index)
    if precompute:
        c.precompute()
    compile_ms, m, times = 1e3 * (time.perf_counter() - t0), GrammarMatcher(c), []
    for t in ids:
        if precompute:
            c.masks.clear()
        t0 = time.perf_counter()
        m.next_token_mask()
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return compile_ms, times


def time_xgrammar(schema, ids, xgr_compiler, info):
    """xgrammar's compile time for schema and its time per mask replaying ids."""
    import xgrammar as xgr

    t0 = time.perf_counter()
    c = xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
    compile_ms, m, times = 1e3 * (time.perf_counter() - t0), xgr.GrammarMatcher(c), []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return compile_ms, times


def mask_step_us(procs, outs, vocab_size: int, steps: int = 16, passes: int = 3):
    """Median µs per step to fill and apply the rows' masks: one processor call per
    row, one `apply_batch`, and the mask lookups alone (pass 0 warms the caches)."""
    from minillm.structured.processor import StructuredOutputLogitsProcessor as Proc

    rows, logits = list(range(len(procs))), torch.zeros(len(procs), vocab_size)
    times = {"per row": [], "one bitmask": [], "lookups": []}
    for n in range(passes + 1):
        for t in range(steps):
            prefixes = [o[: min(t, len(o) - 1)] for o in outs]
            t0 = time.perf_counter()
            for row, p, ids in zip(rows, procs, prefixes):
                p(ids, logits[row])  # (vocab,) masked in place
            t1 = time.perf_counter()
            Proc.apply_batch(logits, rows, procs, prefixes)
            t2 = time.perf_counter()
            for p, ids in zip(procs, prefixes):
                p.next_token_mask(ids)
            t3 = time.perf_counter()
            if n:
                for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(1e6 * dt)
    return {k: statistics.median(v) for k, v in times.items()}


def gpu_numbers(run: dict, target_pct: float) -> dict:
    """The stored engine run's table (printed) and the chapter's numbers from it:
    {glue key: value}, the cost of each way of applying the masks included."""
    rows = gpu_table(run)
    warm, work = run["results"]["constrained_warm"], run["workload"]
    out = {
        "ch15_gpu_name": run["environment"]["gpu"],
        "ch15_gpu_free_tps": rows["unconstrained"][0],
        "ch15_gpu_warm_tps": rows["constrained_warm"][0],
        "ch15_gpu_overhead": rows["constrained_warm"][1],
        "ch15_gpu_vs_target": (
            "still above" if rows["constrained_warm"][1] > target_pct else "within"
        ),
        "ch15_gpu_valid": warm["valid"],
        "ch15_gpu_batch": work["batch"],
        "ch15_gpu_repeats": work["repeats"],
        "ch15_gpu_spread_lo": 100 * min(warm["overhead_per_repeat"]),
        "ch15_gpu_spread_hi": 100 * max(warm["overhead_per_repeat"]),
    }
    for key, name in (
        ("constrained_warm_per_row", "row"),
        ("constrained_warm_in_order", "inorder"),
    ):
        if key in rows:
            out[f"ch15_gpu_{name}_overhead"] = rows[key][1]
    return out
