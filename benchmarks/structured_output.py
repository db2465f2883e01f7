"""The cost of structured output in the engine: a batch of 32 requests decoding with
and without a JSON Schema constraint each, on the same model in the same run.

The workload: 32 requests, each a prompt of 64 random token ids (seed 0) and 128
output tokens, greedy, ignore_eos (so every request writes exactly 128 tokens: a
constrained one finishes its document within the budget, then writes EOS), on a
SmolLM2-135M-shaped model (its config and its tokenizer, 49,152 tokens) with random
bf16 weights. Request i is constrained by schema i % 6 of chapter 22's six. Measured
in one run:

- unconstrained: the same requests without constraints (the baseline);
- constrained, cold: the first run, compiling each schema and computing each grammar
  state's mask when it is first reached;
- constrained, warm: the same again, the compiled grammars cached (as a server that
  has seen the schemas before);
- constrained, warm, in order: the same on chapter 16's reference order
  (`overlap_masks=False`): each step's grammar masks are filled before its forward
  pass is launched, instead of while it runs;
- constrained, warm, per row: the same with each processor hidden behind a plain
  function, so the sampler masks one row at a time and the steps are not launched
  ahead (chapter 24's reference path, what the engine did before `apply_batch`).

Output tokens/s for each, the overhead against the baseline, the time spent in the
logits processors (mask computation and application, on the engine's thread) and the
time the engine's thread spent waiting for the device (CUDA event waits). With
--profile, each condition also runs once under torch.profiler (the device's busy time:
the sum of its kernels and copies) and once under cProfile (the engine thread's
functions with the most own time).

One batch takes a quarter of a second on the H200, and whole runs of the script differ
by more than the overhead measured (a baseline from 11k to 19k tok/s on one machine),
so the cold run is done once, then one untimed pass of the warm conditions (the
first batches after start-up are slower, whatever their condition), and then the
warm conditions are interleaved `--repeats` times in one process: each repeat's
overhead is against the baseline of the same repeat, and the figures stored are the
medians (every repeat is kept too).

    # on a GPU, from the repository root; writes benchmarks/results/*.json
    python benchmarks/structured_output.py --smollm2 PATH_TO_SMOLLM2_FOLDER
    # a smoke test on the CPU: the tiny model, 4 requests, 24 tokens
    python benchmarks/structured_output.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import engine_settings, environment, require_committed, save  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.structured.processor import (  # noqa: E402
    StructuredOutputsParams,
    compiler_for,
)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"},
     "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string"},
     "population": {"type": "integer"}, "country": {"type": "string"}},
     "required": ["city", "population", "country"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "tags": {
     "type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
     "event": {"type": "string", "maxLength": 40}}, "required": ["date", "event"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
     "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
     "active": {"type": "boolean"}}, "required": ["id", "active"]},
]  # fmt: skip


class TimedRow:
    """A logits processor that adds its time to a shared counter; a plain function to
    the sampler, so it is called one row at a time (chapter 24's reference path)."""

    def __init__(self, processor, clock: dict):
        self.processor, self.clock = processor, clock

    def __call__(self, output_token_ids, logits):
        t0 = time.perf_counter()
        out = self.processor(output_token_ids, logits)
        self.clock["seconds"] += time.perf_counter() - t0
        self.clock["calls"] += 1
        return out


class Timed(TimedRow):
    """The same, batch-level (chapter 7's apply_batch, in chapter 16's two halves):
    one bitmask per step, and the requests stay on chapter 16's run-ahead path. The
    device half's time (the masked fill's launch) is also counted apart."""

    @staticmethod
    def apply_batch(logits, rows, processors, output_token_ids):
        apply = Timed.prepare_batch(rows, processors, output_token_ids, logits.device)
        return apply(logits)

    @staticmethod
    def prepare_batch(rows, processors, output_token_ids, device):
        t0 = time.perf_counter()
        inner = [p.processor for p in processors]
        apply = type(inner[0]).prepare_batch(rows, inner, output_token_ids, device)
        clock = processors[0].clock
        clock["seconds"] += time.perf_counter() - t0
        clock["calls"] += len(rows)

        def timed_apply(logits):
            t0 = time.perf_counter()
            out = apply(logits)
            dt = time.perf_counter() - t0
            clock["seconds"] += dt
            clock["apply_seconds"] += dt
            return out

        return timed_apply


def random_smollm2(smollm2: Path, folder: Path, device: str) -> None:
    """SmolLM2-135M's config and tokenizer, random bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((smollm2 / "config.json").read_text())
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, folder / name)


WAITS = {"seconds": 0.0}  # time in CUDA event waits, on the engine's thread


def count_waits() -> None:
    """Add every torch.cuda.Event.synchronize's time to WAITS."""
    sync = torch.cuda.Event.synchronize

    def timed(event):
        t0 = time.perf_counter()
        sync(event)
        WAITS["seconds"] += time.perf_counter() - t0

    torch.cuda.Event.synchronize = timed


def run(
    llm, prompts, max_tokens, constrained: bool, clock: dict, per_row: bool = False
) -> dict:
    params = []
    for i in range(len(prompts)):
        processors = []
        if constrained:
            so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])
            proc = so.logits_processor(compiler_for(llm.tokenizer), max_tokens)
            processors = [(TimedRow if per_row else Timed)(proc, clock)]
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=max_tokens,
                ignore_eos=True,
                logits_processors=processors,
            )  # fmt: skip
        )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    WAITS["seconds"] = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    waited = WAITS["seconds"]
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    ids = str([o.outputs[0].token_ids for o in outputs]).encode()
    digest = hashlib.sha256(ids).hexdigest()[:16]  # the outputs, to compare runs
    assert produced == len(prompts) * max_tokens
    valid = None
    if constrained:
        import jsonschema

        valid = 0
        for i, o in enumerate(outputs):
            text = llm.tokenizer.decode(
                o.outputs[0].token_ids, skip_special_tokens=True
            )
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"seconds": seconds, "output_tokens": produced,
            "output_tokens_per_s": produced / seconds, "valid": valid,
            "wait_seconds": waited, "outputs_sha256": digest}  # fmt: skip


def summarize(runs: dict) -> dict:
    """Per condition, the median repeat's figures and every repeat. The first baseline
    pairs with the cold run, the others with the warm repeats in order; an overhead is
    1 - tokens/s over the tokens/s of the baseline of its own repeat."""
    base = [r["output_tokens_per_s"] for r in runs["unconstrained"]]
    results = {}
    for name, rs in runs.items():
        keys = ("seconds", "output_tokens_per_s", "processor_seconds", "wait_seconds",
                "processor_apply_seconds")  # fmt: skip
        results[name] = {k: statistics.median(r[k] for r in rs) for k in keys}
        results[name]["output_tokens"] = rs[0]["output_tokens"]
        results[name]["processor_calls"] = rs[0]["processor_calls"]
        results[name]["valid"] = min(
            (r["valid"] for r in rs if r["valid"] is not None), default=None
        )
        if name != "unconstrained":
            pair = base[:1] if name == "constrained_cold" else base[1:]
            over = [1 - r["output_tokens_per_s"] / b for r, b in zip(rs, pair)]
            results[name]["overhead"] = statistics.median(over)
            results[name]["overhead_per_repeat"] = over
        results[name]["outputs_sha256"] = sorted({r["outputs_sha256"] for r in rs})
        results[name]["repeats"] = rs
    return results


def profile(llm, prompts, max_tokens, constrained: bool, per_row: bool) -> dict:
    """One batch under torch.profiler (the device's busy seconds: its kernels and
    copies), then one under cProfile (the 30 functions with the most own time)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    clock = {"seconds": 0.0, "calls": 0, "apply_seconds": 0.0}
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        r = run(llm, prompts, max_tokens, constrained, clock, per_row)
    busy_us = sum(  # each kernel's or copy's own interval, on one stream
        e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA"
    )
    cpu = cProfile.Profile()
    cpu.enable()
    run(llm, prompts, max_tokens, constrained, clock, per_row)
    cpu.disable()
    stats = pstats.Stats(cpu).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
    top = [{"function": f"{Path(f).name}:{line}({fn})", "calls": calls,
            "tottime_s": tt, "cumtime_s": ct}
           for (f, line, fn), (_, calls, tt, ct, _) in rows]  # fmt: skip
    return {"seconds_profiled": r["seconds"], "device_busy_seconds": busy_us / 1e6,
            "top": top}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2's converted folder")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, CPU smoke test"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9, help="warm repeats")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--name", default="structured_output", help="results name")
    parser.add_argument(
        "--no-per-row", action="store_true", help="skip the per-row run"
    )
    parser.add_argument(
        "--profile", action="store_true", help="device busy time, cProfile"
    )
    parser.add_argument(
        "--wait-for", type=Path, help="a file to wait for (60 s at most) before timing"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="no profile started after this (s)"
    )
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    started = time.monotonic()
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp())
    if args.quick:
        llm, model_name = LLM(device=args.device, max_num_seqs=8), "tiny"
        args.batch, args.max_tokens, args.repeats = 4, 24, 2
    else:
        smollm2 = args.smollm2
        if smollm2 is None:
            from minillm.convert import resolve_model

            smollm2 = resolve_model("smollm2")
        random_smollm2(smollm2, tmp, args.device)
        llm = LLM(tmp, device=args.device, dtype=torch.bfloat16, max_num_seqs=64)
        model_name = "SmolLM2-135M-shaped, random bf16 weights"
    vocab = llm.tokenizer.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(64)] for _ in range(args.batch)
    ]
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:4], [warm] * 4, use_tqdm=False)  # warm-up, untimed
    if torch.cuda.is_available():
        count_waits()
    if args.wait_for is not None:  # another job sharing the device, finishing first
        deadline = time.monotonic() + 60
        while not args.wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    # name: (constrained, per row, chapter 16's overlap_masks)
    conditions = {"unconstrained": (False, False, True),
                  "constrained_cold": (True, False, True),
                  "constrained_warm": (True, False, True),
                  "constrained_warm_in_order": (True, False, False),
                  "constrained_warm_per_row": (True, True, True)}  # fmt: skip
    warm_names = ["unconstrained", "constrained_warm", "constrained_warm_in_order"]
    if args.no_per_row:
        del conditions["constrained_warm_per_row"]
    else:
        warm_names.append("constrained_warm_per_row")
    # one untimed pass of the warm conditions after the cold run: the first batches
    # after start-up run slower on the device's host, whatever their condition
    order = ["unconstrained", "constrained_cold", *warm_names]
    order += warm_names * args.repeats
    untimed = len(warm_names)
    runs = {name: [] for name in conditions}
    runner = llm.engine.model_runner
    for i, name in enumerate(order):
        clock = {"seconds": 0.0, "calls": 0, "apply_seconds": 0.0}
        constrained, per_row, runner.overlap_masks = conditions[name]
        r = run(llm, prompts, args.max_tokens, constrained, clock, per_row)
        if 2 <= i < 2 + untimed:
            continue
        r["processor_seconds"], r["processor_calls"] = clock["seconds"], clock["calls"]
        r["processor_apply_seconds"] = clock["apply_seconds"]
        runs[name].append(r)
        print(name, r, flush=True)
    runner.overlap_masks = True
    results = summarize(runs)
    record = {
        "benchmark": "structured_output",
        "environment": environment(),
        "workload": {
            "model": model_name,
            "batch": args.batch,
            "prompt_tokens": 64,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "schemas": SCHEMAS,
            "vocab_size": vocab,
            "repeats": args.repeats,
            "untimed_warm_passes": 1,
        },  # fmt: skip
        "engine": engine_settings(llm.engine),
        "results": results,
    }
    # the greedy outputs of the two orders, in every repeat: one digest between them
    orders = ("constrained_warm", "constrained_warm_in_order")
    record["orders_identical"] = (
        len({d for name in orders for d in results[name]["outputs_sha256"]}) == 1
    )
    out = args.out or Path("benchmarks/results")
    if not args.quick:
        print("wrote", save(args.name, record, out), flush=True)
    if args.profile:  # then again with the profiles, as far as the budget goes
        record["profiles"] = profiles = {}
        # the in-order reference before the overlap: the baseline and the
        # reference are the two whose device time a short budget must keep
        for name in sorted(warm_names, key="constrained_warm".__eq__):
            if args.budget and time.monotonic() - started > args.budget:
                break
            constrained, per_row, runner.overlap_masks = conditions[name]
            profiles[name] = profile(
                llm, prompts, args.max_tokens, constrained, per_row
            )
            print(name, {k: v for k, v in profiles[name].items() if k != "top"})
            if not args.quick:
                save(args.name, record, out)
        runner.overlap_masks = True
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
