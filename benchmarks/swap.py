"""Swap or recompute: chapter 12's two preemption modes on a GPU, one request at a time
and end to end.

Both parts run on a Qwen3-0.6B-shaped model in bf16 with random weights (or a real
checkpoint: --model /path or $MINILLM_MODEL), blocks of 16, attention_backend="triton".

(a) The break-even. For a request whose first n tokens are computed (n = 128 ... 4096),
the time to swap its KV blocks out to the engine's pinned CPU swap space and back in,
through the engine's own copier (`Swapper.swap_out` / `swap_in`, chapter 12), against
the time to recompute them: one prefill forward of the n tokens through the engine's
`ModelRunner.execute_model` over the paged cache (one chunk: the best case for
recompute). Measured in the same run: host<->device copy bandwidth (pinned and pageable,
each direction) and the matmul rate, and from them each side's limit (K/V bytes / pinned
bandwidth; prefill FLOPs / matmul rate). It reports the prompt length where the faster
side changes (the crossover), and checks that a round trip returns the same bytes.

(b) End to end, under memory pressure: N requests (default 64) with prompts uniform in
[512, 2048] tokens, random token ids in [0, 10000), 128 output tokens each (ignore_eos,
seed 0), on a KV cache of 1,024 blocks (about ten of the requests at a time), run with
preemption_mode="recompute" and then "swap": wall time, output tokens/s, preemptions,
swaps, tokens computed and recomputed, prompt tokens prefilled, time spent in swap
copies. The record is saved, then the script asserts that both modes gave the same
greedy token ids (--no-assert-identical only records it).

    # on a GPU (2 to 3 minutes); writes results/swap-*.json
    python benchmarks/swap.py
    python benchmarks/swap.py --quick    # a smaller run (about a minute)
    # a smoke test on a tiny random Qwen3 in float32:
    python benchmarks/swap.py --device cpu --quick --out /tmp/swap

Chapter 12 ("Measure: recompute or copy?") plots the newest JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
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
from minillm.kv_cache import kv_cache_bytes_per_token  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.model import ModelConfig  # noqa: E402
from minillm.request import Request  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.scheduler import SchedulerOutput  # noqa: E402

BLOCK_SIZE = 16
TOKEN_RANGE = 10000  # token ids uniform in [0, TOKEN_RANGE), as in the other benchmarks

# A Qwen3 small enough to smoke-test the script on a CPU in seconds (--device cpu).
TINY_QWEN3 = dict(
    vocab_size=TOKEN_RANGE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# Defaults per (device, --quick); any option given on the command line wins. The end-to-
# end
# settings were chosen by running the schedulers alone (no model): every one preempts.
PRESETS = {
    ("cuda", False): dict(
        lengths="128,256,512,1024,2048,4096",
        repeats=10,
        num_requests=64,
        min_prompt=512,
        max_prompt=2048,
        output_len=128,
        num_kv_blocks=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    ),
    ("cuda", True): dict(
        lengths="128,512,2048",
        repeats=5,
        num_requests=24,
        min_prompt=256,
        max_prompt=1024,
        output_len=128,
        num_kv_blocks=256,
        max_num_seqs=24,
        max_num_batched_tokens=1024,
    ),
    ("cpu", False): dict(
        lengths="16,64,256,1024",
        repeats=5,
        num_requests=12,
        min_prompt=32,
        max_prompt=128,
        output_len=32,
        num_kv_blocks=24,
        max_num_seqs=12,
        max_num_batched_tokens=64,
    ),
    ("cpu", True): dict(
        lengths="16,64,256",
        repeats=3,
        num_requests=12,
        min_prompt=32,
        max_prompt=128,
        output_len=32,
        num_kv_blocks=24,
        max_num_seqs=12,
        max_num_batched_tokens=64,
    ),
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, warmup: int = 2) -> dict:
    """Median and minimum seconds of fn() over repeats calls, each between two
    synchronizations.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def host_copy_bandwidth(device: str, num_bytes: int, repeats: int = 5) -> dict:
    """Bytes/s of one large contiguous copy host->device and device->host, from
    pinned and pageable memory.
    """
    if device != "cuda":
        return {}
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    result = {}
    for pinned in (True, False):
        # ones: every page touched
        host = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        kind = "pinned" if pinned else "pageable"
        for direction, dst, src in (("h2d", on_device, host), ("d2h", host, on_device)):
            t = timed(lambda: dst.copy_(src), device, repeats, warmup=1)
            result[f"{direction}_{kind}_bytes_per_s"] = num_bytes / t["median_s"]
        del host
    del on_device
    torch.cuda.empty_cache()
    return result


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in dtype: what prefill's linear layers could
    reach at best.
    """
    n, repeats = (8192, 20) if device == "cuda" else (512, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = timed(lambda: a @ b, device, repeats)
    return 2 * n**3 / t["median_s"]


def prefill_flops(config: ModelConfig, n: int) -> float:
    """FLOPs of a prefill of n tokens from scratch: linear layers, causal attention,
    the last token's logits.
    """
    h = config.hidden_size
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    # per layer
    linear_params = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    # QK^T and PV over the causal half
    attention = 2 * config.num_attention_heads * config.head_dim * n * (n + 1)
    return (
        config.num_hidden_layers * (2 * linear_params * n + attention)
        + 2 * h * config.vocab_size
    )


def crossovers(rows: list[dict]) -> list[dict]:
    """Prompt lengths where the faster side changes, interpolated on log(n) against
    log(recompute / swap).
    """
    points = []
    for a, b in zip(rows, rows[1:]):
        ra, rb = (
            math.log(a["recompute_s"] / a["swap_s"]),
            math.log(b["recompute_s"] / b["swap_s"]),
        )
        if (ra > 0) != (rb > 0):
            t = ra / (ra - rb)
            n = math.exp(
                math.log(a["tokens"])
                + t * (math.log(b["tokens"]) - math.log(a["tokens"]))
            )
            points.append(
                {
                    "tokens": round(n),
                    "faster_below": a["faster"],
                    "faster_above": b["faster"],
                }
            )
    return points


def engine_options(args, **overrides) -> dict:
    return dict(
        device=args.device,
        dtype=args.torch_dtype,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        attention_backend=args.attention_backend,
        **overrides,
    )


def break_even(folder: Path, args) -> dict:
    """Part (a): swap out + in against recompute, for one request of n computed
    tokens.
    """
    lengths = sorted(int(n) for n in args.lengths.split(","))
    max_len = max(lengths)
    blocks = -(-max_len // BLOCK_SIZE)
    # one request at a time; two blocks to spare: a runner with CUDA graphs keeps one as
    # its scratch
    llm = LLM(
        folder,
        **engine_options(
            args,
            num_kv_blocks=blocks + 2,
            max_model_len=max_len + BLOCK_SIZE,
            max_num_seqs=1,
            max_num_batched_tokens=max_len,
            preemption_mode="swap",
            num_cpu_blocks=blocks,
        ),
    )
    engine = llm.engine
    runner, swapper, manager = (
        engine.model_runner,
        engine.scheduler.swapper,
        engine.kv_cache_manager,
    )
    config, kv_cache = engine.model.config, runner.kv_cache
    block_bytes = kv_cache.nbytes // kv_cache.num_blocks
    bandwidth = host_copy_bandwidth(
        args.device, 512 << 20 if args.device == "cuda" else 0
    )
    flops_rate = matmul_rate(args.device, args.torch_dtype)
    rng = random.Random(0)
    rows = []
    for n in lengths:
        request = Request(
            f"prefix-{n}",
            [rng.randrange(TOKEN_RANGE) for _ in range(n)],
            SamplingParams(temperature=0, max_tokens=1),
        )
        manager.allocate_slots(request, n)
        runner.add_request(request)
        # the step that (re)computes all n tokens
        device_ids = manager.get_block_ids(request.request_id)
        # the whole table each time (resumed): every call is the same first step
        step = SchedulerOutput(
            [request],
            {request.request_id: n},
            new_block_ids={request.request_id: device_ids},
            resumed_req_ids={request.request_id},
        )
        recompute = timed(lambda: runner.execute_model(step), args.device, args.repeats)

        # device block -> CPU block, as a swap-out
        out_pairs = [(d, c) for c, d in enumerate(device_ids)]
        in_pairs = [(c, d) for d, c in out_pairs]
        swapper.swap_out(out_pairs)  # a round trip must give back the same bytes
        before = (
            kv_cache.key_cache[:, device_ids].clone(),
            kv_cache.value_cache[:, device_ids].clone(),
        )
        kv_cache.key_cache[:, device_ids] = 0
        kv_cache.value_cache[:, device_ids] = 0
        swapper.swap_in(in_pairs)
        synchronize(args.device)
        assert torch.equal(kv_cache.key_cache[:, device_ids], before[0]), (
            "swap round trip changed K"
        )
        assert torch.equal(kv_cache.value_cache[:, device_ids], before[1]), (
            "swap round trip changed V"
        )
        del before
        swap_out = timed(lambda: swapper.swap_out(out_pairs), args.device, args.repeats)
        swap_in = timed(lambda: swapper.swap_in(in_pairs), args.device, args.repeats)

        manager.free(request)
        runner.remove_request(request.request_id)
        kv_bytes = len(device_ids) * block_bytes
        swap_s = swap_out["median_s"] + swap_in["median_s"]
        flops = prefill_flops(config, n)
        row = {
            "tokens": n,
            "blocks": len(device_ids),
            "kv_bytes": kv_bytes,
            "recompute_s": recompute["median_s"],
            "recompute_min_s": recompute["min_s"],
            "swap_out_s": swap_out["median_s"],
            "swap_in_s": swap_in["median_s"],
            "swap_s": swap_s,
            "swap_bytes_per_s": 2 * kv_bytes / swap_s,
            "prefill_flops": flops,
            "recompute_flops_per_s": flops / recompute["median_s"],
            "recompute_limit_s": flops / flops_rate,
            "faster": "swap" if swap_s < recompute["median_s"] else "recompute",
        }
        if bandwidth:
            row["swap_limit_s"] = (
                kv_bytes / bandwidth["d2h_pinned_bytes_per_s"]
                + kv_bytes / bandwidth["h2d_pinned_bytes_per_s"]
            )
        rows.append(row)
        print(
            f"{n:6d} tokens: recompute {1e3 * row['recompute_s']:8.2f} ms, swap "
            f"out+in {1e3 * swap_s:8.2f} ms ({row['swap_bytes_per_s'] / 1e9:6.1f} "
            f"GB/s)  -> {row['faster']} faster",
            flush=True,
        )
    points = crossovers(rows)
    if points:
        summary = "; ".join(
            f"{p['faster_below']} faster below about {p['tokens']} tokens, "
            f"{p['faster_above']} above"
            for p in points
        )
    else:
        summary = (
            f"{rows[0]['faster']} faster at every length measured ({lengths[0]} to "
            f"{max_len} tokens)"
        )
    print("crossover:", summary, flush=True)
    result = {
        "kv_bytes_per_token": kv_cache_bytes_per_token(config, args.torch_dtype),
        "block_bytes": block_bytes,
        "host_copy_bandwidth": bandwidth,
        "matmul_flops_per_s": flops_rate,
        "rows": rows,
        "crossovers": points,
        "summary": summary,
        "engine": engine_settings(engine),
        "method": {
            "recompute": "ModelRunner.execute_model of one step scheduling all n "
            "tokens (one prefill chunk; logits and greedy sampling of the last token)",
            "swap": "Swapper.swap_out then Swapper.swap_in of the request's blocks "
            "(the engine's copy path, pinned CPU swap space on a GPU)",
            "timing": f"median of {args.repeats} calls after 2 warm-up calls, "
            "synchronized",
        },
    }
    del llm, engine, runner, swapper, kv_cache
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(TOKEN_RANGE) for _ in range(rng.randint(lo, hi))]
        for _ in range(n)
    ]


def run_mode(
    folder: Path, prompts: list[list[int]], mode: str, args
) -> tuple[dict, list[list[int]]]:
    """Part (b) for one preemption mode: the workload under memory pressure, timed
    end to end.
    """
    options = dict(
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt + args.output_len + BLOCK_SIZE,
        preemption_mode=mode,
    )
    if mode == "swap":
        options["num_cpu_blocks"] = args.num_cpu_blocks or 2 * args.num_kv_blocks
    llm = LLM(folder, **engine_options(args, **options))
    engine = llm.engine
    # warm-up (kernels for decode and for prefill chunks of several sizes, the
    # allocator), untimed
    warm = [[1] * 8, [2] * 17, [3] * min(300, args.max_prompt), [4] * args.max_prompt]
    llm.generate(
        warm,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    synchronize(args.device)
    scheduler = engine.scheduler
    before = {
        "steps": engine.num_steps,
        "preemptions": engine.num_preemptions,
        "graph_steps": getattr(engine.model_runner, "num_graph_steps", 0),
        **{
            k: getattr(scheduler, k, 0)
            for k in ("num_swapped_out", "num_swapped_in", "num_swap_fallbacks")
        },
    }

    meter = {"computed": 0, "prefilled_prompt": 0, "swap_s": 0.0, "blocks_swapped": 0}
    schedule = scheduler.schedule

    def counting_schedule():  # the meter: what each step computes
        out = schedule()
        meter["computed"] += out.total_num_scheduled_tokens
        for r in out.scheduled_requests:
            n = out.num_scheduled_tokens[r.request_id]
            meter["prefilled_prompt"] += max(
                0, min(n, r.num_prompt_tokens - r.num_computed_tokens)
            )
        return out

    scheduler.schedule = counting_schedule
    swapper = getattr(engine.scheduler, "swapper", None)  # chapter 12's scheduler only
    if swapper is not None:
        execute = swapper.execute

        # the engine is synchronous per step: the GPU is idle when this starts
        def timed_execute(output):
            start = time.perf_counter()
            execute(output)
            synchronize(args.device)
            meter["swap_s"] += time.perf_counter() - start
            meter["blocks_swapped"] += len(output.blocks_to_swap_in) + len(
                output.blocks_to_swap_out
            )

        swapper.execute = timed_execute

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    synchronize(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(args.device)
    seconds = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    produced = sum(map(len, token_ids))
    assert produced == len(prompts) * args.output_len, (
        "every request must produce exactly its output length"
    )
    # each prompt token once, each fed-back token once
    needed = sum(len(p) + args.output_len - 1 for p in prompts)
    kv = engine.kv_cache_manager
    assert (
        not kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == kv.num_blocks
    ), "device blocks leaked"
    block_bytes = engine.model_runner.kv_cache.nbytes // kv.num_blocks
    result = {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
        "total_tokens_per_s": (produced + sum(map(len, prompts))) / seconds,
        "steps": engine.num_steps - before["steps"],
        "graph_steps": getattr(engine.model_runner, "num_graph_steps", 0)
        - before["graph_steps"],
        "preemptions": engine.num_preemptions - before["preemptions"],
        "swapped_out": getattr(scheduler, "num_swapped_out", 0)
        - before["num_swapped_out"],
        "swapped_in": getattr(scheduler, "num_swapped_in", 0)
        - before["num_swapped_in"],
        "swap_fallbacks_to_recompute": getattr(scheduler, "num_swap_fallbacks", 0)
        - before["num_swap_fallbacks"],
        "computed_tokens": meter["computed"],
        "needed_tokens": needed,
        "recomputed_tokens": meter["computed"] - needed,
        "prefilled_prompt_tokens": meter["prefilled_prompt"],
        "swap_copy_seconds": meter["swap_s"],
        "swapped_bytes": meter["blocks_swapped"] * block_bytes,
        "num_kv_blocks": kv.num_blocks,
        "num_cpu_blocks": options.get("num_cpu_blocks"),
        "engine": engine_settings(engine),
    }
    del llm, engine, scheduler, outputs
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result, token_ids


def end_to_end(folder: Path, args) -> dict:
    prompts = workload(args.num_requests, args.min_prompt, args.max_prompt)
    result = {
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": [args.min_prompt, args.max_prompt],
            "distribution": "uniform",
            "output_len": args.output_len,
            "token_ids": f"uniform in [0, {TOKEN_RANGE})",
            "ignore_eos": True,
            "seed": 0,
            "prompt_tokens": sum(map(len, prompts)),
            "submitted": "all at once (offline batch)",
            "num_kv_blocks": args.num_kv_blocks,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "runs": {},
    }
    tokens = {}
    for mode in ("recompute", "swap"):
        run, tokens[mode] = run_mode(folder, prompts, mode, args)
        result["runs"][mode] = run
        print(
            f"{mode:>9}: {run['seconds']:6.1f} s, {run['output_tokens_per_s']:8,.0f} "
            f"output tok/s, {run['preemptions']} preemptions ({run['swapped_out']} "
            f"swapped out), {run['recomputed_tokens']:,} tokens recomputed, "
            f"{run['prefilled_prompt_tokens']:,} prompt tokens prefilled, "
            f"{run['swap_copy_seconds']:.2f} s in swap copies",
            flush=True,
        )
    same = [a == b for a, b in zip(tokens["recompute"], tokens["swap"])]
    result["identical_token_ids"] = all(same)
    result["requests_with_identical_token_ids"] = sum(same)
    # the first request that differs, and its first differing output token
    result["first_difference"] = None
    for i, (a, b) in enumerate(zip(tokens["recompute"], tokens["swap"])):
        if a != b:
            position = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            result["first_difference"] = {"request": i, "position": position}
            break
    print(
        f"greedy token ids identical in {sum(same)} of {len(same)} requests", flush=True
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MINILLM_MODEL"),
        help="a local HF folder (default: random Qwen3-0.6B shape; a tiny random Qwen3 "
        "on CPU)",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="EngineConfig.attention_backend (default: triton on cuda, torch on cpu)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer lengths, repeats and requests"
    )
    parser.add_argument(
        "--lengths", default=None, help="comma-separated prompt lengths for part (a)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--min-prompt", type=int, default=None)
    parser.add_argument("--max-prompt", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="the device KV cache, small on purpose",
    )
    parser.add_argument(
        "--num-cpu-blocks",
        type=int,
        default=None,
        help="swap space (default: 2 x num-kv-blocks)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--skip-end-to-end", action="store_true", help="part (a) only")
    parser.add_argument(
        "--assert-identical",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fail (after saving) unless both modes give the same greedy token ids "
        "(default: yes)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    for key, value in PRESETS[(args.device, args.quick)].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.torch_dtype = getattr(torch, args.dtype)
    args.attention_backend = args.attention_backend or (
        "triton" if args.device == "cuda" else "torch"
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/swap.py measures host<->device copies: no CUDA device found "
            "(--device cpu to smoke-test)"
        )
    if args.device == "cpu":
        torch.manual_seed(0)

    record = {
        "benchmark": "swap",
        "device": args.device,
        "environment": environment(),
        "model": {
            "name": str(
                args.model
                or (
                    "Qwen3-0.6B shape, random weights"
                    if args.device == "cuda"
                    else "tiny Qwen3 (smoke test), random weights"
                )
            ),
            "dtype": args.dtype,
            "block_size": BLOCK_SIZE,
            "attention_backend": args.attention_backend,
        },
        "quick": args.quick,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            if args.device == "cuda":
                random_checkpoint(folder)
            else:
                from transformers import Qwen3Config, Qwen3ForCausalLM

                Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).save_pretrained(folder)
        record["break_even"] = break_even(folder, args)
        if not args.skip_end_to_end:
            record["end_to_end"] = end_to_end(folder, args)
    # a CPU smoke test on a GPU machine must not overwrite that day's GPU record
    path = save(
        "swap" if args.device == "cuda" else "swap-cpu",
        record,
        args.out or Path(__file__).resolve().parent / "results",
    )
    print("wrote", path)
    e2e = record.get("end_to_end")
    if args.assert_identical and e2e and not e2e["identical_token_ids"]:
        num = e2e["workload"]["num_requests"]
        hint = (
            "rerun with --dtype float32 to compare"
            if args.dtype != "float32"
            else "look at the first difference"
        )
        sys.exit(
            "greedy token ids differ between recompute and swap preemption in "
            f"{num - e2e['requests_with_identical_token_ids']} of {num} requests "
            f"(first: {e2e['first_difference']}). After the first preemption the two "
            f"modes batch requests differently, and in {args.dtype} batch-dependent "
            "rounding can flip a near-tie greedy choice of random weights. The record "
            f"is saved; {hint}, or pass --no-assert-identical to only record it."
        )


if __name__ == "__main__":
    main()
