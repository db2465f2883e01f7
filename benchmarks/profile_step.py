"""Where an engine step's time goes: GPU kernels by kind, and the CPU time the GPU waits
for.

The workload is the standard one of benchmarks/throughput.py (256 requests, prompt and
output lengths uniform in [100, 1024], random ids, seed 0) on a Qwen3-0.6B-shaped bf16
model with random weights, with the engine's GPU defaults. After --warm-steps steps
(every prompt admitted), it times --steps decode steps, then profiles --profile-steps
more with torch.profiler and writes:

- wall time per step, and GPU time per step (sum of kernel times), so their difference
  is time the GPU sat idle, waiting for the CPU (scheduling, input preparation,
  sampling, update);
- GPU time per step by kind of kernel: attention (our Triton decode/prefill/reduce
  kernels), matrix products (cuBLAS/nvjet), everything else (element-wise, norms,
  copies);
- the number of kernels a step launches, the 40 with the most GPU time, and the CPU
  functions with the most own time (cProfile).

    python benchmarks/profile_step.py     # on a GPU; writes results/profile_step-*.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    KNOBS_BEFORE,
    engine_settings,
    environment,
    require_committed,
    kernel_knobs,
    knobs_set,
    save,
)
from benchmarks.throughput import random_checkpoint, workload  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


def kernel_kind(name: str) -> str:
    if any(k in name for k in ("_decode_kernel", "_reduce_kernel", "_prefill_kernel")):
        return "attention"
    if any(
        k in name
        for k in ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas", "_skinny_kernel")
    ):
        # chapter 14's skinny kernel (profile_step_batch1_skinny-* predates this and
        # files it under other)
        return "matmul"
    return "other"


def step_floor(engine) -> dict:
    """The memory floor of the next decode step: every weight and the running
    requests' cached K/V read once, at the copy bandwidth (measured here)."""
    from benchmarks.common import copy_bandwidth
    from minillm.kv_cache import kv_cache_bytes_per_token

    model = engine.model_runner.model
    # tied embeddings are one tensor: count each storage once
    storages = {p.untyped_storage().data_ptr(): p.nbytes for p in model.parameters()}
    weight_bytes = sum(storages.values())
    dtype = next(model.parameters()).dtype
    kv_per_token = kv_cache_bytes_per_token(model.config, dtype)
    context = sum(r.num_computed_tokens for r in engine.scheduler.running)
    bandwidth = copy_bandwidth()
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "context_tokens": context,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weights_ms": weight_bytes / bandwidth * 1e3,
        "kv_ms": context * kv_per_token / bandwidth * 1e3,
        "ms_per_step": (weight_bytes + context * kv_per_token) / bandwidth * 1e3,
    }


def ms_per_step(engine, warm: int, steps: int) -> float:
    """Wall time of one engine step in ms: the mean of `steps` after `warm` untimed."""
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def ab_decode_order(engine, args, record, out) -> list[dict]:
    """Wall ms per decode step under chapter 13's decode choices, one after the other
    and back (the contexts shrink meanwhile, hence the repeats): programs in batch
    order or longest sequence first (from --ab-decode-order sequences), with the
    default knobs or others. The graphs of the batch's bucket are captured again for
    each. The record is saved after each setting."""
    from minillm.kernels import paged_attention as backend

    graphs = engine.model_runner.graph_runner
    sizes = graphs.sizes
    saved = backend.ORDER_DECODES_FROM, backend.ORDERED_DECODE_KNOBS
    # the bucket the batch replays now, captured again alone (the others are kept)
    graphs.sizes = [graphs.bucket(len(engine.scheduler.running))]
    on = args.ab_decode_order
    wide = {"block_n": 128, "num_stages": 3}
    settings = [
        ("base", 0, {}),
        ("order", on, {}),
        ("order, block_n 128, 3 stages", on, wide),
        ("order, combined in the kernel", on, {"combine": True}),
        ("base", 0, {}),
        ("order", on, {}),
        ("order, block_n 128, 3 stages", on, wide),
        ("order, combined in the kernel", on, {"combine": True}),
        ("base", 0, {}),
        ("order", on, {}),
    ]
    rows = record["ab"] = []
    for name, order_from, knobs in settings:
        backend.ORDER_DECODES_FROM, backend.ORDERED_DECODE_KNOBS = order_from, knobs
        start = time.perf_counter()
        graphs.capture(graphs.pool)
        capture_s = time.perf_counter() - start
        ms = ms_per_step(engine, 3, args.steps)
        running = len(engine.scheduler.running)
        rows.append({"setting": name, "order_decodes_from": order_from,
                     "knobs": knobs, "wall_ms_per_step": ms,
                     "running_requests": running, "capture_s": capture_s})  # fmt: skip
        print(f"{name:30}: {ms:.3f} ms/step, {running} running (capture "
              f"{capture_s:.1f} s)", flush=True)  # fmt: skip
        save(args.name, record, out)
    backend.ORDER_DECODES_FROM, backend.ORDERED_DECODE_KNOBS = saved
    graphs.capture(graphs.pool)
    graphs.sizes = sizes
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("MINILLM_MODEL"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=40)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="give every request this many output tokens (default: the standard "
        "workload's)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument(
        "--ab-decode-order",
        type=int,
        default=0,
        help="after the profile, time --steps decode steps with ORDER_DECODES_FROM "
        "set to this (graphs captured again), then without it, then with it again",
    )
    parser.add_argument(
        "--knobs-before",
        default=None,
        choices=sorted(KNOBS_BEFORE),
        help="profile with these earlier kernel choices (benchmarks/common.py's "
        "KNOBS_BEFORE) instead of today's",
    )
    parser.add_argument("--name", default="profile_step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/profile_step.py profiles the GPU engine: no CUDA device found"
        )
    from torch.profiler import ProfilerActivity, profile

    stack = contextlib.ExitStack()  # earlier kernel choices, for the whole run
    if args.knobs_before:
        stack.enter_context(knobs_set(KNOBS_BEFORE[args.knobs_before]))

    prompts, output_lens = workload(args.num_requests, 100, 1024)
    if args.output_len is not None:
        output_lens = [args.output_len] * len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            random_checkpoint(folder)
        llm = LLM(
            folder,
            dtype=torch.bfloat16,
            skip_tokenizer_init=True,
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=0.5,
            max_model_len=2 * 1024 + 16,
        )
    engine = llm.engine
    for i, (p, o) in enumerate(zip(prompts, output_lens)):
        engine.add_request(
            str(i),
            p,
            SamplingParams(
                temperature=0, max_tokens=o, ignore_eos=True, output_kind="final_only"
            ),
        )
    wall_ms = ms_per_step(engine, args.warm_steps, args.steps)
    running = len(engine.scheduler.running)

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)

    floor = step_floor(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kernel_kind(e.key)] = (
            by_kind.get(kernel_kind(e.key), 0.0) + e.self_device_time_total
        )
    gpu_ms = sum(by_kind.values()) / 1e3 / args.profile_steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]
    # launches per step, memcpy/memset included: at batch 1 a graph replay costs
    # about a microsecond per kernel whatever the kernel does
    launches = sum(e.count for e in kernels) / args.profile_steps
    record = {
        "benchmark": "profile_step",
        "environment": environment(),
        "workload": {
            "model": str(args.model or "Qwen3-0.6B shape, random weights"),
            "dtype": "bfloat16",
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "warm_steps": args.warm_steps,
            "steps": args.steps,
            "profile_steps": args.profile_steps,
            "running_requests": running,
            "engine": engine_settings(engine),
            "kernel_knobs": kernel_knobs(),
        },
        "wall_ms_per_step": wall_ms,
        # the profiled steps' bandwidth floor: weights + KV read at the copy bandwidth
        "floor": floor,
        "gpu_ms_per_step": gpu_ms,
        "gpu_idle_ms_per_step": wall_ms - gpu_ms,
        "kernels_per_step": launches,
        "gpu_ms_per_step_by_kind": {
            k: v / 1e3 / args.profile_steps for k, v in by_kind.items()
        },
        "top_kernels": [
            {
                "name": e.key[:120],
                "calls_per_step": e.count / args.profile_steps,
                "us_per_call": e.self_device_time_total / max(e.count, 1),
            }
            for e in top
        ],
        "cpu_profile": text.getvalue().splitlines()[:60],
    }
    by_kind = record["gpu_ms_per_step_by_kind"].items()
    print(
        f"{running} running: {wall_ms:.2f} ms per step, of which the GPU computes "
        f"{gpu_ms:.2f} ms ({', '.join(f'{k} {v:.2f}' for k, v in by_kind)}); floor "
        f"{floor['ms_per_step']:.2f} ms (weights {floor['weights_ms']:.2f}, KV "
        f"{floor['kv_ms']:.2f})"
    )
    out = args.out or Path(__file__).resolve().parent / "results"
    if args.ab_decode_order:
        save(args.name, record, out)  # the profile, kept if the A/B runs out of time
        ab_decode_order(engine, args, record, out)
    path = save(args.name, record, out)
    print("wrote", path)


if __name__ == "__main__":
    main()
