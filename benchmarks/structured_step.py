"""Structured output's per-step CPU cost: what the engine's thread pays per
constrained row per decode step, on SmolLM2's 49,152-token vocabulary.

No model runs: a batch of rows replays random walks (at each step a uniform choice
among the tokens the mask allows, as chapter 24's `random_walk`), compact JSON
(`disable_any_whitespace`) under chapter 22's six schemas, row i under schema i % 6,
with the finish budget of max_tokens = steps. A first batch of walks (seed 0) fills
the grammars' caches, as a server that has seen the schemas before; the timed walks
are new ones (seeds 1 and 2: other tokens, other states), and the warm walks are
timed once more ("seen": every state and step met before). Per row per step, in µs:

- advance: the processor's matcher for the row's output (fork the parent prefix's
  matcher, accept the sampled token);
- mask: the row's mask from its matcher, the grammar's alone and with the finish
  budget (what the processor returns);
- fill: copying the rows' masks into the step's host bitmask;
- inlined: what the engine calls, `next_masks` (advance and mask, the common case
  written out in one loop) and the fill, on walks of its own.

Each is timed for the reference path (advance over the token's bytes, the budget's
mask computed and checked every step, one row copy at a time: chapter 24's code
before its per-step caches) and the fast path, in the same run, each path on its own
new walks. A cProfile of one fast pass (and one reference pass) says where the rest
goes. The masks of both paths are compared on every walk.

    python benchmarks/structured_step.py            # writes benchmarks/results/*.json
    python benchmarks/structured_step.py --quick    # 8 rows, 64 steps, no file
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from benchmarks.structured_output import SCHEMAS  # noqa: E402
from minillm.structured.matcher import allowed_tokens  # noqa: E402
from minillm.structured.processor import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
    next_masks,
    reference_next_token_mask,
    reference_step,
)


def processors(compiler, batch: int, steps: int) -> list:
    return [
        StructuredOutputsParams(
            json=SCHEMAS[i % len(SCHEMAS)], disable_any_whitespace=True
        ).logits_processor(compiler, max_tokens=steps)
        for i in range(batch)
    ]


def walks(walker, batch: int, steps: int, seed: int) -> list[list[int]]:
    """batch random walks of steps tokens (EOS repeated once the document ends).
    walker: a GrammarCompiler of its own, so that walking fills no cache of the
    compiler being timed."""
    rng, vocab = random.Random(seed), walker.index.vocab_size
    out = []
    for p in processors(walker, batch, steps):
        ids = []
        for _ in range(steps):
            ids.append(rng.choice(allowed_tokens(p.next_token_mask(ids), vocab)))
        out.append([int(t) for t in ids])
    return out


def time_fast(compiler, seqs, steps: int) -> dict:
    """µs per row per step of the fast path's parts."""
    procs, n = processors(compiler, len(seqs), steps), len(seqs) * steps
    host = np.empty((len(seqs), procs[0].compiled.num_words), np.uint32)
    t = {"advance": 0.0, "mask_grammar": 0.0, "mask": 0.0, "fill": 0.0}
    for s in range(steps):
        prefixes = [q[:s] for q in seqs]
        t0 = time.perf_counter()
        matchers = [p.matcher(ids) for p, ids in zip(procs, prefixes)]
        t1 = time.perf_counter()
        for m in matchers:
            m.next_token_mask()
        t2 = time.perf_counter()
        masks = [p.mask_after(m, s) for p, m in zip(procs, matchers)]
        t3 = time.perf_counter()
        np.concatenate(masks, out=host.reshape(-1))
        t4 = time.perf_counter()
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k] += dt
    return {k: 1e6 * v / n for k, v in t.items()}


def time_inlined(compiler, seqs, steps: int) -> dict:
    """µs per row per step of what the engine calls: next_masks (the advance and the
    mask, the common case inlined) and the fill."""
    procs, n = processors(compiler, len(seqs), steps), len(seqs) * steps
    host = np.empty((len(seqs), procs[0].compiled.num_words), np.uint32)
    t = {"rows": 0.0, "fill": 0.0}
    for s in range(steps):
        prefixes = [q[:s] for q in seqs]
        t0 = time.perf_counter()
        masks = next_masks(procs, prefixes)
        t1 = time.perf_counter()
        np.concatenate(masks, out=host.reshape(-1))
        t2 = time.perf_counter()
        t["rows"] += t1 - t0
        t["fill"] += t2 - t1
    return {k: 1e6 * v / n for k, v in t.items()}


def time_reference(compiler, seqs, steps: int) -> dict:
    """µs per row per step of the reference path's parts (chapter 24's code before
    the per-step caches): the same work, without the caches."""
    procs, n = processors(compiler, len(seqs), steps), len(seqs) * steps
    host = np.empty((len(seqs), procs[0].compiled.num_words), np.uint32)
    initial = {(): (procs[0].compiled.initial, False)}
    prefixes = [dict(initial) for _ in procs]  # output prefix -> state, as before
    states = [st[()] for st in prefixes]
    t = {"advance": 0.0, "mask_grammar": 0.0, "mask": 0.0, "fill": 0.0}
    for s in range(steps):
        t0 = time.perf_counter()
        if s:
            states = [
                reference_matcher(p.compiled, known, q[:s])
                for p, known, q in zip(procs, prefixes, seqs)
            ]
        t1 = time.perf_counter()
        for p, st in zip(procs, states):
            reference_next_token_mask(p, st, None)
        t2 = time.perf_counter()
        masks = [
            reference_next_token_mask(p, st, steps - s) for p, st in zip(procs, states)
        ]
        t3 = time.perf_counter()
        for k, mask in enumerate(masks):
            host[k] = mask
        t4 = time.perf_counter()
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k] += dt
    return {k: 1e6 * v / n for k, v in t.items()}


def reference_matcher(compiled, known: dict, ids: list[int]):
    """The processor's prefix lookup before the caches: the parent prefix's state,
    advanced by the last token over its bytes."""
    key = tuple(ids)
    if key not in known:
        known[key] = reference_step(compiled, known[key[:-1]], key[-1])
    return known[key]


def same_masks(compiler, seqs, steps: int) -> int:
    """Every step's mask of every walk: fast path == reference path (asserted)."""
    procs, checked = processors(compiler, len(seqs), steps), 0
    for p, q in zip(procs, seqs):
        state = (p.compiled.initial, False)
        for s in range(steps):
            if s:
                state = reference_step(p.compiled, state, q[s - 1])
            ref = reference_next_token_mask(p, state, steps - s)
            assert np.array_equal(p.next_token_mask(q[:s]), ref), (q[:s], s)
            checked += 1
    return checked


def profile(fn, *args, top: int = 12) -> list[dict]:
    prof = cProfile.Profile()
    prof.runcall(fn, *args)
    stats = pstats.Stats(prof, stream=io.StringIO()).sort_stats("tottime")
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(path).name}:{line}({name})" if line else name
        rows.append({"function": where, "calls": calls, "tottime_s": tottime,
                     "cumtime_s": cumtime})  # fmt: skip
    return sorted(rows, key=lambda r: -r["tottime_s"])[:top]


def measure(compiler, walker, batch: int, steps: int) -> dict:
    """Both paths' µs per row per step, each on new walks after warm ones."""
    warm = walks(walker, batch, steps, seed=0)
    time_fast(compiler, warm, steps)  # the schemas' states, masks and steps cached
    time_reference(compiler, warm, steps)
    ref_walks = walks(walker, batch, steps, seed=1)
    fast_walks = walks(walker, batch, steps, seed=2)
    reference = time_reference(compiler, ref_walks, steps)
    fast = time_fast(compiler, fast_walks, steps)
    inlined = time_inlined(compiler, walks(walker, batch, steps, seed=5), steps)
    # the warm walks again: every state, mask and step seen before
    seen = {"reference": time_reference(compiler, warm, steps),
            "fast": time_fast(compiler, warm, steps),
            "inlined": time_inlined(compiler, warm, steps)}  # fmt: skip
    checked = same_masks(compiler, fast_walks[:6], steps)
    for r in (reference, fast, seen["reference"], seen["fast"]):
        r["total"] = r["advance"] + r["mask"] + r["fill"]
    for r in (inlined, seen["inlined"]):
        r["total"] = r["rows"] + r["fill"]
    return {"reference": reference, "fast": fast, "inlined": inlined, "seen": seen,
            "masks_compared": checked}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2's converted folder")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="8 rows, 64 steps")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if args.quick:
        args.batch, args.steps = 8, 64  # a schema needs up to 44 tokens to finish
    from minillm.convert import resolve_model
    from minillm.tokenizer import Tokenizer

    folder = args.smollm2 or resolve_model("smollm2")
    tokenizer = Tokenizer.from_pretrained(folder)
    compiler, walker = GrammarCompiler(tokenizer), GrammarCompiler(tokenizer)
    results = measure(compiler, walker, args.batch, args.steps)
    for path in ("reference", "fast", "inlined"):
        print(path, {k: round(v, 2) for k, v in results[path].items()})
        print("  seen", {k: round(v, 2) for k, v in results["seen"][path].items()})
    prof_walks = walks(walker, args.batch, args.steps, seed=3)
    results["profile_fast"] = profile(time_fast, compiler, prof_walks, args.steps)
    prof_walks = walks(walker, args.batch, args.steps, seed=4)
    results["profile_reference"] = profile(
        time_reference, compiler, prof_walks, args.steps
    )
    for row in results["profile_fast"][:8]:
        print(f"{row['tottime_s']:8.3f} s {row['calls']:7} {row['function']}")
    record = {
        "benchmark": "structured_step",
        "environment": environment(),
        "workload": {"tokenizer": "SmolLM2-135M-Instruct", "batch": args.batch,
                     "steps": args.steps, "max_tokens": args.steps,
                     "walks": "uniform over allowed tokens, compact JSON",
                     "schemas": SCHEMAS, "vocab_size": compiler.index.vocab_size},
        "results": results,
    }  # fmt: skip
    if not args.quick:
        print(
            "wrote",
            save("structured_step", record, args.out or Path("benchmarks/results")),
        )


if __name__ == "__main__":
    main()
