"""Speculative decoding (chapter 21): what a step costs per query token, and what the
proposers buy at batch 1 to 128, against the same engine without them.

Two measurements, in one run:

1. Step time against the number of query tokens of one request (1, 2, 4, 8, 16) with
   512 tokens cached: one forward pass plus the logits of every query row, on a
   Qwen3-0.6B-shaped model with random weights (bf16 on a GPU; the time does not
   depend on the weights), through the attention backend the engine picks (chapter
   13's Triton kernels on a GPU). Median of 20 after 3 warm-ups.
2. The chapter's two workloads (benchmarks/spec_workloads.py: prompts from the
   corpus's held-out topics, "repetitive" and "open") on the course's tiny trained model
   (float32), 64 greedy tokens per request (ignore_eos), at batch 1, 8, 32 and 128 (all
   requests submitted at once, max_num_seqs = batch): without speculation, with the
   n-gram proposer (k = 3 and k = 5; lookup 2..4), with the EAGLE proposer (k = 3, 5 and
   8; the tiny model's draft, minillm/speculative/eagle.py, trained on the CPU first if
   the cache lacks it), with the draft model and Medusa (k = 3) when --methods names
   them ("draft k=3", "medusa k=3"; their cached checkpoints, trained likewise), and
   at batch >= 32 with k = 3 and disable_by_batch_size = 32
   (n-gram and EAGLE). All on the engine's default runner — on a GPU chapter 15's fast
   path: persistent batch, CUDA graphs (for verification steps and EAGLE's draft too),
   compiled layers, async scheduling for the steps that neither verify nor propose —
   and, at batch 1, without speculation on the same fast path with every step run in
   step (async_scheduling=False: a second baseline, faster at batch 1 on the tiny
   model), and without speculation, with n-gram k = 3 and with EAGLE k = 3 on chapter
   9's runner as well (a third baseline; its own copy of the model; --no-chapter9 leaves
   it out). Each engine runs the prompts once untimed, then --repeats times timed (the
   median counts). Reported per run: the runner and its flags, output tokens/s, the mean
   acceptance length tau and the acceptances per position, steps and how many replayed a
   graph (verification and draft graphs apart), the speed-up over the fast path without
   speculation at the same batch and workload, the speed-up over the same runner without
   speculation and over the fastest baseline measured before it in the same run, whether
   the tokens equal the baseline's, and at batch 1 on a GPU the device time of the
   step's parts (step_parts_ms: the decode graph, the verification graph, EAGLE's draft
   chain replayed and eager), timed with CUDA events after the run.

    # on a GPU; writes benchmarks/results/speculative_decode_rows-*.json
    python benchmarks/speculative.py
    # a CPU smoke test: small sizes
    python benchmarks/speculative.py --quick --out /tmp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from benchmarks.throughput import QWEN3_0_6B  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.hf import config_from_hf  # noqa: E402
from minillm.kv_cache import PagedKVCache  # noqa: E402
from minillm.model import CausalLM, build_attention_metadata  # noqa: E402
from minillm.registry import ATTENTION_BACKENDS, load_plugins  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.speculative.draft_model import draft_model_path  # noqa: E402
from minillm.speculative.eagle import eagle_path  # noqa: E402
from minillm.speculative.medusa import medusa_path  # noqa: E402
from benchmarks.spec_workloads import held_out_prompts  # noqa: E402
from minillm.tiny import tiny_model  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_vs_query_tokens(device: str, quick: bool) -> tuple[list[dict], str]:
    load_plugins()
    shape = dict(QWEN3_0_6B, architectures=["Qwen3ForCausalLM"])
    if quick:
        shape.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256)
        shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        shape.update(vocab_size=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(config_from_hf(shape)).to(dtype).eval()
    backend = ATTENTION_BACKENDS.resolve("auto", device)
    attend, writer = ATTENTION_BACKENDS[backend]()
    context, block_size, rows = 512, 16, []
    for q in (1, 2, 4, 8, 16):
        num_blocks = (context + q) // block_size + 1
        cache = PagedKVCache(
            model.config, num_blocks, block_size, attend, dtype, device,
            cache_writer=writer,
        )  # fmt: skip
        table = list(range(num_blocks))
        ids = torch.randint(0, model.config.vocab_size, (context + q,), device=device)
        times = []
        with torch.inference_mode():
            pos, md = build_attention_metadata(
                [context], [context], [table], 16, device
            )
            model(ids[:context], pos, md, cache)
            pos, md = build_attention_metadata([q], [context + q], [table], 16, device)
            for i in range(3 if quick else 23):
                sync(device)
                start = time.perf_counter()
                model.compute_logits(model(ids[context:], pos, md, cache))
                sync(device)
                if i >= 3 or quick:
                    times.append(1e3 * (time.perf_counter() - start))
        rows.append({"query_tokens": q, "ms": statistics.median(times)})
        print(f"step, {q:2} query tokens: {rows[-1]['ms']:.3f} ms", flush=True)
    return rows, backend


METHODS = {  # proposers measured: (method, k)
    "ngram k=3": ("ngram", 3),
    "ngram k=5": ("ngram", 5),
    "eagle k=3": ("eagle", 3),
    "eagle k=5": ("eagle", 5),
    "eagle k=8": ("eagle", 8),
    "draft k=3": ("draft_model", 3),  # not in the default run: --methods names them
    "medusa k=3": ("medusa", 3),
}
DEFAULT_METHODS = ("ngram k=3", "ngram k=5", "eagle k=3", "eagle k=5", "eagle k=8")
RUNNERS = {  # engine options of each runner measured
    "fast path": {},  # the engine's defaults: on a GPU, chapter 15's fast path
    "chapter 9": {"persistent_batch": False},
    # the fast path with every step run in step (no async scheduling): a second
    # baseline at batch 1, where the CPU's work per step is what counts
    "in step": {"async_scheduling": False},
}


def run(
    model, tokenizer, prompts, spec, batch: int, max_tokens: int, runner, options,
    repeats: int = 1,
):  # fmt: skip
    """One engine, a warm-up pass over the prompts and `repeats` timed ones: the
    median pass's time; the counts are the last pass's (greedy: every pass the
    same)."""
    config = EngineConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=max(1024, batch * 8),
        num_kv_blocks=batch * 20 + 64,
        speculative_config=spec,
        **options,
    )
    built = time.perf_counter()
    engine = LLMEngine(model, tokenizer, config)
    built = time.perf_counter() - built  # graphs captured, layers compiled
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    device = model.lm_head.weight.device.type
    runner_ = engine.model_runner
    stats = getattr(runner_, "spec_stats", None)
    draft_graphs = getattr(getattr(runner_, "proposer", None), "graphs", None)
    all_seconds = []
    for timed in [False] + [True] * repeats:
        tag = f"{len(all_seconds)}-{timed}"
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        if timed:  # counts from here on
            steps0 = engine.num_steps
            drafts0 = stats.num_drafts if stats else 0
            accepted0 = stats.num_accepted_tokens if stats else 0
            per_pos0 = list(stats.num_accepted_tokens_per_pos) if stats else []
            graphs0 = getattr(runner_, "num_graph_steps", 0)
            verify = getattr(runner_, "verify_graphs", None)
            verify0 = verify.num_replays if verify else 0
            draft0 = draft_graphs.num_replays if draft_graphs else 0
        tokens = {}
        sync(device)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        sync(device)
        if timed:
            all_seconds.append(time.perf_counter() - start)
    seconds = statistics.median(all_seconds)
    num_drafts = stats.num_drafts - drafts0 if stats else 0
    accepted = stats.num_accepted_tokens - accepted0 if stats else 0
    return {
        "seconds": seconds,
        "seconds_all": all_seconds,
        "engine_build_seconds": built,
        "steps": engine.num_steps - steps0,
        "output_tok_s": sum(map(len, tokens.values())) / seconds,
        "tau": 1 + accepted / max(1, num_drafts) if stats else 1.0,
        "num_drafts": num_drafts,
        "accepted_per_pos": [
            a - b for a, b in zip(stats.num_accepted_tokens_per_pos, per_pos0)
        ]
        if stats
        else [],
        "runner": runner,
        "runner_class": type(runner_).__name__,
        "cuda_graphs": bool(getattr(runner_, "cuda_graphs", False)),
        "async_scheduling": engine.stepper is not None,
        "graph_steps": getattr(runner_, "num_graph_steps", 0) - graphs0,
        "verify_graph_replays": verify.num_replays - verify0 if verify else 0,
        "draft_graph_replays": draft_graphs.num_replays - draft0 if draft_graphs else 0,
        "step_parts_ms": step_parts(runner_) if device == "cuda" and batch == 1 else {},
        "tokens": [
            tokens[f"{len(all_seconds) - 1}-True-{i}"] for i in range(len(prompts))
        ],
    }


def replay_ms(fn, n: int = 50) -> float:
    """GPU time of fn() (a replay), by CUDA events: the median of n."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def step_parts(runner) -> dict:
    """The GPU time of the parts of a batch-1 step, replayed after the run (the
    buffers hold its last step; the graphs write only the scratch block or slots of
    finished requests): chapter 15's decode graph, the verification graph of 1 + k
    tokens, EAGLE's draft chain from its graph and eagerly."""
    parts = {}
    graphs = getattr(runner, "graph_runner", None)
    if graphs is not None and 1 in graphs.graphs:
        parts["decode_graph"] = replay_ms(graphs.graphs[1].replay)
    verify = getattr(runner, "verify_graphs", None)
    if verify is not None and verify.graphs:  # the smallest: one sequence's 1 + k
        parts["verify_graph"] = replay_ms(verify.graphs[verify.sizes[0]].replay)
    draft = getattr(getattr(runner, "proposer", None), "graphs", None)
    if draft is not None and 1 in draft.graphs:
        parts["draft_graph"] = replay_ms(draft.graphs[1].replay)
        parts["draft_eager"] = replay_ms(lambda: runner.proposer.chain(*draft.args(1)))
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke test, small sizes")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine")
    p.add_argument("--methods", nargs="+", default=None, help="a subset of METHODS")
    p.add_argument("--no-step-curve", action="store_true", help="skip measurement 1")
    p.add_argument("--no-chapter9", action="store_true", help="fast path only")
    p.add_argument("--workloads", nargs="+", default=["repetitive", "open"])
    p.add_argument("--name", default="speculative_decode_rows", help="JSON's name")
    p.add_argument(
        "--switch-off-too",
        action="store_true",
        help="each proposer also without the acceptance switch "
        "(disable_by_acceptance=None), beside the default",
    )
    args = p.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    runners = dict(RUNNERS)
    if device == "cpu":  # the defaults there are chapter 9's: smoke-test the batch
        runners["fast path"] = {"persistent_batch": True}
    load_plugins()
    steps, backend = [], ATTENTION_BACKENDS.resolve("auto", device)
    if not args.no_step_curve:
        steps, backend = step_vs_query_tokens(device, args.quick)
    # one model per runner: chapter 15's fast path rewrites its model's layers
    models = {
        name: tiny_model(device=device, dtype=torch.float32, progress=False)
        for name in ("fast path", "chapter 9")
    }
    models["in step"] = models["fast path"]  # the same fast path, rewritten once
    tokenizer = models["fast path"][1]
    batches, max_tokens = ((1, 4), 16) if args.quick else (tuple(args.batches), 64)
    methods = {m: METHODS[m] for m in args.methods or DEFAULT_METHODS}
    eagle_folder = eagle_path()
    runs = []
    for kind in args.workloads:
        for batch in batches:
            prompts = held_out_prompts(tokenizer, kind, batch)
            configs = {"none": None}
            configs.update(
                {m: {"method": method, "num_speculative_tokens": k,
                     "disable_by_batch_size": None}  # at every batch size
                 for m, (method, k) in methods.items()}
            )  # fmt: skip
            for m, (method, k) in methods.items() if args.switch_off_too else ():
                configs[f"{m}, switch off"] = {
                    "method": method, "num_speculative_tokens": k,
                    "disable_by_batch_size": None, "disable_by_acceptance": None,
                }  # fmt: skip
            for method in ("ngram", "eagle") if batch >= 32 else ():
                configs[f"{method} k=3, disable_by_batch_size=32"] = {
                    "method": method,
                    "num_speculative_tokens": 3,
                    "disable_by_batch_size": 32,
                }
            # chapter 9's runner, the second baseline: batch 1, three configurations
            plan = [("fast path", m) for m in configs]
            if batch == 1 and device == "cuda":
                plan.insert(1, ("in step", "none"))
            if batch == 1 and not args.no_chapter9:
                c7 = [m for m in ("none", "ngram k=3", "eagle k=3") if m in configs]
                plan += [("chapter 9", m) for m in c7]
            base_tokens, base_rate = None, {}
            for runner, method in plan:
                model = models[runner][0]
                spec, options = configs[method], runners[runner]
                result = run(
                    model, tokenizer, prompts, spec, batch, max_tokens, runner,
                    options, args.repeats,
                )  # fmt: skip
                tokens = result.pop("tokens")
                if base_tokens is None:  # the first: the fast path without speculation
                    base_tokens = tokens
                if method == "none":
                    base_rate[runner] = result["output_tok_s"]
                same = sum(a == b for a, b in zip(tokens, base_tokens))
                result.update(
                    workload=kind,
                    batch=batch,
                    method=method,
                    # against the engine's default without speculation (fast path)
                    speedup=result["output_tok_s"] / base_rate["fast path"],
                    # against the same runner without speculation
                    speedup_same_runner=result["output_tok_s"] / base_rate[runner],
                    # against the fastest engine without speculation measured so far
                    # (at batch 1: the fast path with or without async scheduling)
                    speedup_best_baseline=result["output_tok_s"]
                    / max(base_rate.values()),
                    same_tokens_as_baseline=f"{same}/{len(tokens)}",
                )
                runs.append(result)
                print(
                    f"{kind:10} batch {batch:3} {runner:9} {method:36} "
                    f"tau {result['tau']:.2f} {result['output_tok_s']:8.0f} tok/s "
                    f"{result['speedup']:.2f}x (same runner "
                    f"{result['speedup_same_runner']:.2f}x, best baseline "
                    f"{result['speedup_best_baseline']:.2f}x) "
                    f"same {same}/{len(tokens)} "
                    f"graphs {result['graph_steps']}/{result['steps']} "
                    f"verify {result['verify_graph_replays']} "
                    f"draft {result['draft_graph_replays']} {result['step_parts_ms']} "
                    f"build {result['engine_build_seconds']:.1f}s",
                    flush=True,
                )
    record = {
        "benchmark": args.name,
        "model": "Qwen3-0.6B shape" if not args.quick else "tiny Qwen3 shape",
        "workload_model": "course tiny model (float32)",
        "attention_backend": backend,
        "runners": {
            "fast path": "the engine's defaults (on a GPU: chapter 15's persistent "
            "batch, CUDA graphs, compiled layers, async scheduling for steps that "
            "neither verify nor propose; speculation verifies in step, from graphs "
            "of 1 + k tokens per sequence)",
            "chapter 9": "chapter 9 ModelRunner (persistent_batch=False), batch 1",
            "in step": "the fast path with async_scheduling=False (every step run "
            "in step), batch 1, without speculation",
        },
        "max_tokens": max_tokens,
        "repeats": args.repeats,
        "eagle_draft": {
            "folder": eagle_folder.name,
            "recipe": json.loads((eagle_folder / "recipe.json").read_text()),
            "held_out_top1": json.loads(
                (eagle_folder / "training_log.json").read_text()
            )["held_out_top1"],
        },
        "other_drafts": {  # the draft model's and Medusa's folders, when measured
            method: path().name
            for method, path in [("draft_model", draft_model_path)]
            + [("medusa", medusa_path)]
            if any(m == method for m, _ in methods.values())
        },
        "step_vs_query_tokens": steps,
        "runs": runs,
        "environment": environment(),
    }
    path = save(args.name, record, *([args.out] if args.out else []))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
