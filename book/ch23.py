"""Chapter 23's harness: JSONSchemaBench's stored coverage run (benchmarks/results/)
as totals and a figure of compile times, and, for the lab notes, the feature table
against xgrammar (issue 44).

    from book.ch23 import jsb_totals, plot_compile_times
"""

from __future__ import annotations

import collections
import json
import random
import warnings

import numpy as np
import torch

from book.ch22 import validates


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


def plot_compile_times(jsb: dict):
    """Compile time per schema, ours against xgrammar, from a stored coverage run
    (one dot a schema)."""
    import matplotlib.pyplot as plt

    subs = jsb_subsets(jsb)
    fig, left = plt.subplots(figsize=(5, 3.6))
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
    fig.tight_layout()
    return fig


# --- the lab notes' comparison with xgrammar, feature by feature ------------------

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
    from book.ch24 import random_walk  # chapter 24's random model
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
