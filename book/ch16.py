"""Chapter 16's harness: what the chapter and its lab notes share that is not the
lesson (issue 44).

    from book.ch16 import SCHEMAS, validates, random_walk

The six schemas of the chapter's opening and their validity check (`jsonschema`,
formats included); the "random model" that the checks walk grammars with; the tables
and the figure of the stored runs (benchmarks/results/); and, for the lab notes, the
timing loops and the feature table against xgrammar.
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import time
import warnings

import jsonschema
import numpy as np
import torch

from benchmarks.structured_output import SCHEMAS  # the six the GPU run constrains

# formats checked as draft 2020-12 defines them (RFC 3339 times need an offset)
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def validates(text: str, schema: dict) -> bool:
    """Does text parse as JSON and validate against schema, formats included?"""
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def chat_prompts(tokenizer, schemas=SCHEMAS) -> list[str]:
    """One chat turn per schema, asking for nothing but a matching object."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": (
            "Reply with only a JSON object that matches this JSON Schema:\n"
            + json.dumps(s))}])
        for s in schemas
    ]  # fmt: skip


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


# --- stored runs -------------------------------------------------------------------

# benchmarks/structured_output.py's conditions, baseline first
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


def jsb_subsets(jsb: dict) -> dict:
    """Per JSONSchemaBench subset of a stored schema_coverage run: its summary for
    minillm ("ours") and xgrammar ("xgr")."""
    return {
        name: {"ours": s["summary"]["minillm"], "xgr": s["summary"]["xgrammar"],
               "schemas": s["summary"]["schemas"], "rows": s["rows"]}
        for name, s in jsb["subsets"].items()
    }  # fmt: skip


def jsb_totals(jsb: dict):
    """Totals over the subsets of a stored coverage run (counts for "ours" and
    "xgr", and how many subsets ours compiled more than twice as slowly), each
    timing's (lowest, highest) across the subsets, and our refusals by reason."""
    total, ranges = collections.Counter(), {}
    refusals = collections.Counter()
    for sub in jsb_subsets(jsb).values():
        total["schemas"] += sub["schemas"]
        for lib in ("ours", "xgr"):
            r = sub[lib]
            for k in ("compiled", "valid", "finished", "invalid", "approximated"):
                total[f"{lib}_{k}"] += r[k]
            for name, key in (("p50", "mask_us_p50"), ("p99", "mask_us_p99"),
                              ("cpu99", "mask_cpu_us_p99"),
                              ("ms", "compile_ms_median")):  # fmt: skip
                if r.get(key) is not None:
                    ranges.setdefault(f"{lib}_{name}", []).append(r[key])
        ours_ms, xgr_ms = (
            sub[lib]["compile_ms_median"] or 0 for lib in ("ours", "xgr")
        )
        total["slower"] += ours_ms > 2 * xgr_ms
        refusals.update(sub["ours"]["refusals"])
    ranges = {k: (min(v), max(v)) for k, v in ranges.items()}
    return total, ranges, refusals


def plot_schema_times(jsb: dict):
    """Compile time per schema (ours against xgrammar) and mask time per subset
    (median, and the 99th percentile of CPU time), from a stored coverage run."""
    import matplotlib.pyplot as plt

    subs = jsb_subsets(jsb)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    pairs = [
        (r["xgrammar"]["compile_ms"], r["minillm"]["compile_ms"])
        for s in subs.values()
        for r in s["rows"]
        if r["minillm"].get("compile_ms") and r["xgrammar"].get("compile_ms")
    ]
    x, y = np.array(pairs).T
    left.scatter(x, y, s=8, alpha=0.6)
    lim = [min(x.min(), y.min()), max(x.max(), y.max())]
    left.plot(lim, lim, color="grey", lw=1, label="equal")
    left.set(xscale="log", yscale="log", title="compile time, one dot a schema")
    left.set(xlabel="xgrammar compile (ms)", ylabel="minillm compile (ms)")
    left.legend(loc="upper left")
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


# --- the lab notes' comparisons with xgrammar ---------------------------------------

FEATURES = {
    "type list": {"type": ["integer", "null"]},
    "properties, required": {"type": "object", "properties": {"a": {"type": "integer"},
                             "b": {"type": "string"}}, "required": ["a"]},
    "additionalProperties false": {"type": "object", "properties": {
        "a": {"type": "boolean"}}, "additionalProperties": False},
    "additionalProperties schema": {"type": "object",
                                    "additionalProperties": {"type": "integer"}},
    "enum, const": {"type": "object", "properties": {"e": {"enum": ["x", 1, None]},
                    "c": {"const": "k"}}, "required": ["e", "c"]},
    "items, min/maxItems": {"type": "array", "items": {"type": "integer"},
                            "minItems": 2, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"},
                    {"type": "integer"}], "items": False},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
    "oneOf (disjoint)": {"oneOf": [{"type": "object", "properties": {
                         "k": {"const": "a"}},
                         "required": ["k"]}, {"type": "boolean"}]},
    "oneOf (required keys)": {"oneOf": [{"type": "object", "properties": {"a": {
                              "type": "null"}}, "required": ["a"]}, {"type": "object",
                              "properties": {"b": {"type": "null"}}, "required": [
                              "b"]}]},
    "allOf": {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]},
    "$ref, recursion": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"},
                          "b": {"type": "boolean"}}, "required": ["a"],
                          "dependentRequired": {"a": ["b"]}},
    "pattern": {"type": "string", "pattern": "^[a-c]+-[0-9]{2}$"},
    "format date, time": {"type": "array", "prefixItems": [{"type": "string",
                          "format": "date"}, {"type": "string", "format": "time"}],
                          "items": False, "minItems": 2},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format uri": {"type": "string", "format": "uri"},
    "integer min/max": {"type": "integer", "minimum": -20, "maximum": 300},
    "number exclusive bounds": {"type": "number", "exclusiveMinimum": 0.5,
                                "exclusiveMaximum": 2.25},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "not": {"not": {"type": "integer"}},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
    "patternProperties": {"type": "object",
                          "patternProperties": {"^x": {"type": "null"}}},
    "if / then": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                  "required": ["k"], "if": {"properties": {"k": {"const": 1}}},
                  "then": {"properties": {"v": {"type": "null"}}, "required": ["v"]}},
    "min/maxProperties": {"type": "object", "additionalProperties": {"type": "null"},
                          "minProperties": 1, "maxProperties": 2},
}  # fmt: skip


def xgr_walk(compiled, info, index, rng, max_tokens: int = 64) -> str | None:
    """The random model under xgrammar's mask; None when it did not finish."""
    import xgrammar as xgr

    m, out = xgr.GrammarMatcher(compiled), []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(max_tokens):
        m.fill_next_token_bitmask(bitmask)
        bits = (bitmask[0, :, None] >> shifts) & 1  # (words, 32)
        token = rng.choice(torch.nonzero(bits.flatten()).flatten().tolist())
        if token in index.eos_token_ids:
            return b"".join(index.token_bytes[t] for t in out).decode()
        assert m.accept_token(token)
        out.append(token)
    return None


def coverage(name, schema, compiler, xgr_compiler, info, walks: int = 2) -> dict:
    """One feature row: each library compiles schema (or refuses it) and the random
    model writes `walks` outputs under each one's mask, checked by jsonschema."""
    from minillm.structured.ir import GrammarError
    from minillm.structured.processor import StructuredOutputsParams
    from minillm.structured.schema_ops import SchemaWarning, guaranteed

    row, rng = {"feature": name}, random.Random(1)
    try:
        p = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        with warnings.catch_warnings(record=True) as approx:
            warnings.simplefilter("always", SchemaWarning)
            texts = [random_walk(p, compiler, rng) for _ in range(walks)]
        row["minillm"] = f"{sum(validates(t, schema) for t in texts)}/{walks} valid"
        row["minillm"] += " (warned)" if approx else ""
        row["minillm_exact"] = all(validates(t, guaranteed(schema)) for t in texts)
    except GrammarError as e:
        row["minillm"] = f"refused: {getattr(e, 'keyword', None) or e}"
        row["minillm_exact"] = True  # refused by name: not a looser grammar
    try:
        c = xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        walked = (xgr_walk(c, info, compiler.index, rng) for _ in range(walks))
        done = [t for t in walked if t is not None]
        valid = sum(validates(t, schema) for t in done)
        row["xgrammar"] = f"{valid}/{len(done)} valid"
        row["xgrammar_exact"] = valid == len(done)
    except RuntimeError as e:
        row["xgrammar"] = f"refused: {str(e).splitlines()[0][:40]}"
        row["xgrammar_exact"] = True
    return row


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
