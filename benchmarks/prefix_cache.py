"""Prefix caching on a GPU: a shared-prefix workload with the cache off, "hash" (vLLM)
and "radix" (SGLang).

The workload: N requests (default 128) that all begin with the same system prompt
(default 1,000 random token ids), each followed by a question of its own (uniform in
[20, 200] tokens) and answered with a fixed number of tokens (default 128, ignore_eos),
seed 0, on a Qwen3-0.6B-shaped model in bf16 with random weights (or a real checkpoint:
--model /path or $MINILLM_MODEL). All requests are submitted at once, as an offline
batch, after one untimed request with the shared prefix alone (--no-warm-prefix: start
from a cold cache, so that the requests admitted in the first steps all miss).

For each mode it records throughput (output and total tokens/s), the time to first token
(from submission; mean, p50, p90), the prompt tokens actually prefilled and the
prefix-cache hit rate (hits / queries, in tokens). Chapter 11 plots the JSON it writes.

    # on a GPU; writes results/*.json
    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --num-requests 32   # a quick look
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
from benchmarks.common import engine_settings, environment, require_committed, save  # noqa: E402
from benchmarks.throughput import random_checkpoint  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

MODES = {"off": None, "hash": "hash", "radix": "radix"}


def workload(
    n: int, prefix_len: int, lo: int, hi: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randint(0, 9999) for _ in range(prefix_len)]
    return [
        system + [rng.randint(0, 9999) for _ in range(rng.randint(lo, hi))]
        for _ in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_mode(
    folder: Path, prompts: list[list[int]], output_len: int, impl: str | None, args
) -> dict:
    llm = LLM(
        folder,
        dtype=torch.bfloat16,
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prefix_len + args.max_suffix + output_len + 16,
        prefix_cache_impl=impl,
    )
    # warm-up on unrelated tokens (kernels, allocator); then, with --warm-prefix, one
    # untimed request with
    # the shared prefix alone, as a server that has seen the system prompt before
    # (chapter 11's measure)
    llm.generate(
        [[1] * 8] * 4,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    if args.warm_prefix:
        llm.generate(
            [prompts[0][: args.prefix_len]],
            SamplingParams(temperature=0, max_tokens=1),
            use_tqdm=False,
        )
    kv = llm.engine.kv_cache_manager
    kv.prefix_cache_queries = kv.prefix_cache_hits = 0
    prefilled, schedule = [0], llm.engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        for r in out.scheduled_requests:
            n = out.num_scheduled_tokens[r.request_id]
            prefilled[0] += max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
        return out

    llm.engine.scheduler.schedule = counting_schedule
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == len(prompts) * output_len, (
        "every request must produce exactly its output length"
    )
    result = {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
        "total_tokens_per_s": (produced + sum(map(len, prompts))) / seconds,
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": percentile(ttfts, 0.5),
        "p90_ttft_s": percentile(ttfts, 0.9),
        "prefilled_prompt_tokens": prefilled[0],
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries
        if kv.prefix_cache_queries
        else 0.0,
        "steps": llm.engine.num_steps,
        "preemptions": llm.engine.num_preemptions,
        "num_kv_blocks": kv.num_blocks,
        "prefix_cache_impl": impl,
        "engine": engine_settings(llm.engine),
        "token_ids": [o.outputs[0].token_ids for o in outputs[:4]],
    }
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MINILLM_MODEL"),
        help="a local HF folder (default: random Qwen3-0.6B shape)",
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--min-suffix", type=int, default=20)
    parser.add_argument("--max-suffix", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--modes", default="off,hash,radix")
    parser.add_argument(
        "--warm-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the shared prefix alone once, untimed, before the workload "
        "(default: yes)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/prefix_cache.py measures GPU throughput and TTFT: no CUDA "
            "device found"
        )

    prompts = workload(
        args.num_requests, args.prefix_len, args.min_suffix, args.max_suffix
    )
    record = {
        "benchmark": "prefix_cache",
        "environment": environment(),
        "workload": {
            "model": str(args.model or "Qwen3-0.6B shape, random weights"),
            "dtype": "bfloat16",
            "num_requests": args.num_requests,
            "shared_prefix_len": args.prefix_len,
            "suffix_len": [args.min_suffix, args.max_suffix],
            "output_len": args.output_len,
            "token_ids": "uniform in [0, 10000)",
            "ignore_eos": True,
            "seed": 0,
            "prompt_tokens": sum(map(len, prompts)),
            "submitted": "all at once (offline batch)",
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": 16,
            "warm_prefix": args.warm_prefix,
        },
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            random_checkpoint(folder)
        for name in args.modes.split(","):
            run = run_mode(folder, prompts, args.output_len, MODES[name], args)
            record["runs"][name] = run
            print(
                f"{name:>6}: {run['output_tokens_per_s']:,.0f} output tok/s, mean "
                f"TTFT {1e3 * run['mean_ttft_s']:.0f} ms, prefilled "
                f"{run['prefilled_prompt_tokens']:,} prompt tokens, hit rate "
                f"{run['hit_rate']:.0%}",
                flush=True,
            )
    reference = record["runs"].get("off", {}).get("token_ids")
    # the cache should not change greedy tokens (bf16: recorded, not asserted)
    for run in record["runs"].values():
        tokens = run.pop("token_ids")
        if reference is not None:
            run["first_outputs_same_as_off"] = tokens == reference
    path = save(
        "prefix_cache", record, args.out or Path(__file__).resolve().parent / "results"
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
