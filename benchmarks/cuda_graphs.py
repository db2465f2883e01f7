"""Decode-step time with and without CUDA graphs (chapter 15), over batch sizes.

For each batch size B, an engine on a Qwen3-0.6B-shaped bf16 model with random weights
(or a real checkpoint: --model /path or $MINILLM_MODEL) gets B requests of --context
random prompt tokens (seed 0); after their prefill, the benchmark times --steps whole
engine steps (schedule, persistent-batch preparation, forward, greedy sampling, update),
each a decode step of B sequences, with `cuda_graphs=False` and with `cuda_graphs=True`
(and then the engine's GPU defaults follow: async scheduling, and with --no-compile left
out a third variant adds merged projections and compiled layers), in the same run. All
use chapter 13's Triton attention and chapter 15's persistent batch. It also compares
their greedy tokens, as far as both have them: an async engine's token lists lack the
token still in flight (it is only counted, as a placeholder).

    # on a GPU; writes benchmarks/results/*.json
    python benchmarks/cuda_graphs.py
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from benchmarks.throughput import random_checkpoint  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.hf import load_model  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


def time_decode_steps(
    model,
    batch: int,
    context: int,
    steps: int,
    cuda_graphs: bool,
    max_num_seqs: int,
    repeats: int,
    torch_compile: bool = False,
) -> tuple[list[float], list[list[int]], float]:
    max_model_len = context + 2 * steps * repeats + 64
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(8192, batch),
            max_model_len=max_model_len,
            cuda_graphs=cuda_graphs,
            torch_compile=torch_compile,
            num_kv_blocks=max_num_seqs * (max_model_len // 16 + 1) + 1,
        ),
    )
    capture = engine.model_runner.graph_runner.capture_seconds if cuda_graphs else 0.0
    rng = random.Random(0)
    vocab = model.config.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=2 * steps * repeats + 8, ignore_eos=True
    )
    for i in range(batch):
        engine.add_request(
            str(i), [rng.randrange(min(vocab, 10000)) for _ in range(context)], params
        )
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token)
    for _ in range(3):
        engine.step()  # warm-up decode steps
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps * 1e3)
    tokens = [
        list(engine.scheduler.requests[str(i)].output_token_ids) for i in range(batch)
    ]
    assert engine.model_runner.num_graph_steps > 0 if cuda_graphs else True
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return times, tokens, capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MINILLM_MODEL"),
        help="a local HF folder (default: random Qwen3-0.6B shape)",
    )
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the graphs + torch.compile variant",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_graphs.py measures CUDA graphs: no CUDA device found")
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            random_checkpoint(folder)
        model = load_model(folder, dtype=torch.bfloat16, device="cuda")
        # its layers get compiled
        fused_model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    rows, capture_seconds = [], 0.0
    for batch in batches:
        eager, eager_tokens, _ = time_decode_steps(
            model, batch, args.context, args.steps, False, max(batches), args.repeats
        )
        graph, graph_tokens, _ = time_decode_steps(
            model, batch, args.context, args.steps, True, max(batches), args.repeats
        )
        row = {
            "batch": batch,
            "eager_ms": statistics.median(eager),
            "graph_ms": statistics.median(graph),
            "eager_ms_all": eager,
            "graph_ms_all": graph,
        }
        if not args.no_compile:
            fused, fused_tokens, capture_seconds = time_decode_steps(
                fused_model,
                batch,
                args.context,
                args.steps,
                True,
                max(batches),
                args.repeats,
                torch_compile=True,
            )
            row.update(
                graph_compile_ms=statistics.median(fused), graph_compile_ms_all=fused
            )
        # zip compares that many
        total = sum(min(len(a), len(b)) for a, b in zip(eager_tokens, graph_tokens))
        row["greedy_token_agreement_graph"] = (
            sum(
                a == b
                for ea, ga in zip(eager_tokens, graph_tokens)
                for a, b in zip(ea, ga)
            )
            / total
        )
        if not args.no_compile:
            row["greedy_token_agreement_graph_compile"] = (
                sum(
                    a == b
                    for ea, ga in zip(eager_tokens, fused_tokens)
                    for a, b in zip(ea, ga)
                )
                / total
            )
        rows.append(row)
        print(
            f"batch {batch:4d}: eager {row['eager_ms']:7.2f} ms/step, graphs "
            f"{row['graph_ms']:7.2f}, graphs+compile "
            f"{row.get('graph_compile_ms', float('nan')):7.2f}; agreement "
            f"{row['greedy_token_agreement_graph']:.4f} "
            f"{row.get('greedy_token_agreement_graph_compile', float('nan')):.4f}",
            flush=True,
        )
    from minillm.cuda_graph import default_capture_sizes

    num_graphs = len(default_capture_sizes(max(batches)))
    record = {
        "benchmark": "cuda_graphs",
        "environment": environment(),
        "workload": {
            "model": str(args.model or "Qwen3-0.6B shape, random weights"),
            "dtype": "bfloat16",
            "context": args.context,
            "steps_timed": args.steps,
            "repeats": args.repeats,
            "attention": "triton",
            "persistent_batch": True,
            "sampling": "greedy",
            "timed": "whole engine.step() calls, decode only",
            "variants": {
                "eager": "no graphs, no compile, synchronous steps",
                "graph": "CUDA graphs, async scheduling",
                "graph_compile": "CUDA graphs, async scheduling, merged projections, "
                "torch.compile'd layers",
            },
        },
        "steps": rows,
        "num_graphs": num_graphs,
        "capture_seconds": capture_seconds,
    }
    path = save(
        "cuda_graphs", record, args.out or Path(__file__).resolve().parent / "results"
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
