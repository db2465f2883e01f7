"""Decode attention over the paged KV cache: the Triton kernel of chapter 13 against the
memory roofline.

For a Qwen3-0.6B attention layer (16 query heads, 8 KV heads of 128, bf16 cache, blocks
of 16, blocks shuffled as after a long-running server), over batch sizes and context
lengths: kernel time (triton.testing.do_bench), achieved bandwidth = bytes of K/V read /
time, the device-to-device copy bandwidth measured in the same run, and chapter 5's
PyTorch reference on the same batch.

    # on a GPU; writes benchmarks/results/paged_attention-*.json
    python benchmarks/paged_attention.py
    # also the mixed lengths of the standard workload
    python benchmarks/paged_attention.py --mixed
    # also the prefill kernels on a prompt step (--prefill-sweep: and a grid of knobs)
    python benchmarks/paged_attention.py --prefill
    # only that; writes benchmarks/results/paged_prefill-*.json (or _sweep-*.json)
    python benchmarks/paged_attention.py --prefill-only

--mixed times a batch shaped like the middle of the standard throughput workload: 256
sequences, each a prompt of 100-1024 tokens plus part of its 100-1024 output tokens, so
contexts from about 100 to 2,000 tokens; it compares ways of cutting the contexts into
pieces (equal splits per sequence, or pieces of a fixed number of tokens) and the
kernel's tile knobs, timed as CUDA-graph replays (triton.testing.do_bench_cudagraph) as
the engine runs them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from minillm.attention import paged_attention_ref  # noqa: E402
from minillm.kernels.paged_decode import (  # noqa: E402
    DECODE_KERNEL_VERSION,
    decode_num_splits,
    paged_decode,
)
from minillm.kernels.paged_prefill import PREFILL_KNOBS  # noqa: E402
from minillm.model import build_attention_metadata  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def decode_batch(batch: int, context: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(
        num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [
        order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)
    ]
    _, md = build_attention_metadata(
        [1] * batch, [context] * batch, tables, BLOCK_SIZE, "cuda"
    )
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, md


def sweep(do_bench) -> list[dict]:
    """Tuning knobs of the decode kernel at batch 64 x context 4096; returns every
    setting's result.
    """
    q, k_cache, v_cache, md = decode_batch(64, 4096)
    kv_bytes = 2 * 64 * 4096 * N_KV * HEAD_DIM * 2
    rows = []
    for block_n in (64, 128):
        for num_warps in (4, 8):
            for num_stages in (1, 2):
                for programs_per_sm in (2, 4, 8, 16):
                    knobs = dict(
                        block_n=block_n,
                        num_warps=num_warps,
                        num_stages=num_stages,
                        programs_per_sm=programs_per_sm,
                    )
                    try:
                        ms = do_bench(
                            lambda: paged_decode(
                                q,
                                k_cache,
                                v_cache,
                                md.block_tables,
                                md.seq_lens,
                                md.max_seq_len,
                                **knobs,
                            ),
                            warmup=10,
                            rep=40,
                        )
                    # a setting that does not compile (too many registers, say)
                    except Exception as e:
                        print("skip", knobs, type(e).__name__)
                        continue
                    rows.append(
                        {
                            **knobs,
                            "kernel_us": 1e3 * ms,
                            "bandwidth_bytes_per_s": kv_bytes / (ms / 1e3),
                        }
                    )
    rows.sort(key=lambda r: r["kernel_us"])
    for r in rows[:5]:
        print("sweep best:", r)
    return rows


def mixed_batch(batch: int = 256, seed: int = 0):
    """Contexts of the standard workload halfway through its outputs, blocks
    shuffled.
    """
    import random

    rng = random.Random(seed)
    lens = [
        rng.randint(100, 1024) + rng.randint(0, rng.randint(100, 1024))
        for _ in range(batch)
    ]
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(per_seq)
    k_cache = torch.randn(
        num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(order[at : at + n])
        at += n
    _, md = build_attention_metadata([1] * batch, lens, tables, BLOCK_SIZE, "cuda")
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, md, lens


def prefill_workload(
    lens: list[int] | None = None, seed: int = 0, device: str = "cuda"
):
    """A prompt step of the standard workload: prompts of 100-1024 tokens, no cached
    context, up to 16,384 tokens in all (or the given lengths); blocks shuffled.
    """
    import random

    if lens is None:
        rng = random.Random(seed)
        lens = []
        while sum(lens) < 16384 - 1024:
            lens.append(rng.randint(100, 1024))
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    k_cache = torch.randn(
        sum(per_seq), BLOCK_SIZE, N_KV, HEAD_DIM, device=device, dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(
        sum(per_seq), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(order[at : at + n])
        at += n
    _, md = build_attention_metadata(lens, lens, tables, BLOCK_SIZE, device)
    q = torch.randn(sum(lens), N_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return lens, q, k_cache, v_cache, md


def prefill_variants(sweep: bool) -> list[dict]:
    """The kernels and knobs to time: the first kernel as the engine ran it (the
    baseline), the stepping stones of benchmarks/prefill_steps.py, the current kernel
    at its defaults, and with sweep a grid of its knobs.
    """
    # paged_prefill's defaults for this workload (groups of 2 heads), spelled out
    knobs = PREFILL_KNOBS[2]
    tile = dict(
        block_m=knobs["rows"] // (N_HEADS // N_KV),
        block_n=knobs["block_n"],
        num_warps=knobs["num_warps"],
        num_stages=knobs["num_stages"],
    )
    variants = [
        {"kernel": "v1", "block_m": 32, "block_n": 32},  # what the engine ran
        {"kernel": "v1", "block_m": 32, "block_n": 32, "exp2": True},
        {"kernel": "v1", **tile},
        {"kernel": "one_loop", **tile, "longest_first": False},
        {"kernel": "current", **tile, "longest_first": False},
        {"kernel": "current"},  # paged_prefill's defaults: what the engine runs
        {"kernel": "by_sequence", **tile},  # another order of the same tiles
    ]
    # each knob moved one step from the defaults, the others kept
    for name, values in (
        ("block_m", (tile["block_m"] // 2, tile["block_m"] * 2)),
        ("block_n", (64 if tile["block_n"] == 32 else 32,)),
        ("num_warps", (12 - tile["num_warps"],)),
        ("num_stages", (tile["num_stages"] - 1, tile["num_stages"] + 1)),
    ):
        for value in values:
            variants.append({"kernel": "current", **tile, name: value})
    if sweep:
        grid = [
            (32, (32, 64), (4,), (2, 3)),  # 64 rows
            (64, (32, 64, 128), (4, 8), (2, 3, 4)),  # 128 rows
            (128, (64, 128), (8,), (2, 3)),  # 256 rows
        ]
        for block_m, block_ns, warps, stages in grid:
            for block_n in block_ns:
                for num_warps in warps:
                    for num_stages in stages:
                        knobs = dict(
                            block_m=block_m,
                            block_n=block_n,
                            num_warps=num_warps,
                            num_stages=num_stages,
                        )
                        if {"kernel": "current", **knobs} not in variants:
                            variants.append({"kernel": "current", **knobs})
    return variants


# the padding rows moved to a chunk's first tile, smaller diagonal key tiles, a
# register cap: each against the defaults, timed first and last
# key tiles of 64 in two stages, registers capped for two programs per multiprocessor
WIDE = {"block_n": 64, "num_stages": 2, "maxnreg": 128}
PREFILL_CANDIDATES = [
    {"kernel": "current"},
    {"kernel": "current", **WIDE, "align_end": True},
    {"kernel": "current", **WIDE},
    {"kernel": "current", **WIDE, "align_end": True, "diag_n": 64},
    {"kernel": "current", **WIDE, "align_end": True, "diag_n": 16},
    {"kernel": "current", **WIDE, "align_end": True, "maxnreg": 120},
    {"kernel": "current", **WIDE, "align_end": True, "num_stages": 3},
    {"kernel": "current", "align_end": True, "maxnreg": 128},
    {"kernel": "current", "block_m": 32, **WIDE, "num_warps": 4, "align_end": True},
    {"kernel": "current", "repeat": 2},
    {"kernel": "current", **WIDE, "align_end": True, "repeat": 2},
    {"kernel": "current", **WIDE, "repeat": 2},
]


# the final run: the first kernel as the engine ran it, the defaults before this
# change, each change alone, and the defaults now (PREFILL_KNOBS), the last two twice
BEFORE = dict(block_m=64, block_n=32, num_warps=8, num_stages=3, diag_n=32,
              align_end=False, maxnreg=0)  # fmt: skip
PREFILL_FINAL = [
    {"kernel": "v1", "block_m": 32, "block_n": 32},
    {"kernel": "current", **BEFORE},
    {"kernel": "current", **BEFORE, "align_end": True},
    {"kernel": "current", **BEFORE, "maxnreg": 128},
    {"kernel": "current", **BEFORE, "block_n": 64, "num_stages": 2},
    {"kernel": "current", **BEFORE, "block_n": 64, "num_stages": 2, "maxnreg": 128},
    {"kernel": "current"},
    {"kernel": "current", **BEFORE, "repeat": 2},
    {"kernel": "current", "repeat": 2},
]


# a verify step of speculative decoding (chapter 21): 4 query tokens per sequence
VERIFY_VARIANTS = [
    {"kernel": "v1", "block_m": 32, "block_n": 32},  # what the engine ran
    {
        "kernel": "current",
        "block_m": 64,
        "block_n": 64,
        "num_warps": 4,
        "num_stages": 3,
    },
    {"kernel": "current", "block_m": 8},  # what paged_prefill picks for 4 tokens
]


def verify_workload(batch: int = 128, query_len: int = 4, seed: int = 0):
    """batch sequences adding query_len tokens each after 100-2,000 cached ones."""
    import random

    rng = random.Random(seed)
    seq_lens = [rng.randint(100, 2000) + query_len for _ in range(batch)]
    per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    k_cache = torch.randn(
        sum(per_seq), BLOCK_SIZE, N_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(sum(per_seq)).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(order[at : at + n])
        at += n
    _, md = build_attention_metadata(
        [query_len] * batch, seq_lens, tables, BLOCK_SIZE, "cuda"
    )
    q = torch.randn(batch * query_len, N_HEADS, HEAD_DIM, device="cuda").bfloat16()
    return q, k_cache, v_cache, md


def run_prefill(variant: dict, q, k_cache, v_cache, md):
    from benchmarks.prefill_steps import (
        prefill_longest_sequence_first,
        prefill_one_loop,
        prefill_v1,
    )
    from minillm.kernels.paged_prefill import paged_prefill

    kernel = {
        "v1": prefill_v1,
        "one_loop": prefill_one_loop,
        "current": paged_prefill,
        "by_sequence": prefill_longest_sequence_first,
    }
    knobs = {k: v for k, v in variant.items() if k not in ("kernel", "repeat")}
    return kernel[variant["kernel"]](q, k_cache, v_cache, md, **knobs)


def _compile_prefill(variants: list[dict]) -> int:
    """Compile the variants in a process of its own (Triton caches on disk), on a
    small batch with the large one's strides; returns how many compiled.
    """
    _, q, k_cache, v_cache, md = prefill_workload([300, 200])
    done = 0
    for variant in variants:
        try:
            run_prefill(variant, q, k_cache, v_cache, md)
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # a tile that does not fit: the timing skips it
            print("compile skip", variant, type(e).__name__, flush=True)
    return done


def prefill_limits(lens: list[int], flops: float) -> dict:
    """What bounds the kernel: a large bf16 matmul's FLOP/s, and PyTorch's attention
    (SDPA, its default and its FlashAttention backend) on the same prompts laid out
    densely, one call per prompt, no paging.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from triton.testing import do_bench, do_bench_cudagraph

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    limits = {"matmul_flops": 2 * 8192**3 / (do_bench(lambda: a @ a, rep=100) / 1e3)}
    del a
    # (1, n_heads, n, D) each; K and V with the query heads' count (GQA repeated)
    qs = [torch.randn(1, N_HEADS, n, HEAD_DIM, device="cuda").bfloat16() for n in lens]
    ks = [torch.randn_like(x) for x in qs]
    vs = [torch.randn_like(x) for x in qs]

    def attend(backend):
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            for q, k, v in zip(qs, ks, vs):
                sdpa(q, k, v, is_causal=True)

    for name, backend in (("sdpa", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            us = 1e3 * do_bench_cudagraph(lambda: attend(backend), rep=50)
            limits[f"{name}_us"], limits[f"{name}_tflops"] = us, flops / us / 1e6
        except Exception as e:
            print("skip", name, type(e).__name__, flush=True)
    print("limits:", limits, flush=True)
    return limits


def prefill(
    sweep: bool = False,
    workers: int = 8,
    wait_for: Path | None = None,
    wait_max: float = 60,
    candidates: bool | str = False,
):
    """The prefill kernels on a prompt step of the standard workload, timed by
    CUDA-graph replay (as the engine's steps run); each checked against chapter 5's
    reference over the whole batch.
    """
    import multiprocessing
    import time

    from triton.testing import do_bench_cudagraph

    variants = prefill_variants(sweep)
    if candidates:
        variants = PREFILL_FINAL if candidates == "final" else PREFILL_CANDIDATES
    t0 = time.perf_counter()
    # compiling dominates a sweep: do it in parallel, then time one by one
    to_compile = variants + VERIFY_VARIANTS[2:]
    chunks = [to_compile[i::workers] for i in range(workers)]
    try:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            compiled = sum(pool.map(_compile_prefill, [c for c in chunks if c]))
        print(
            f"compiled {compiled}/{len(variants)} in {time.perf_counter() - t0:.0f} s"
        )
    except Exception as e:  # the timing loop compiles what is missing
        print("parallel compile failed:", type(e).__name__, e, flush=True)
    # wait for other GPU work of the same job (the tests) before timing
    while wait_for is not None and not wait_for.exists():
        if time.perf_counter() - t0 > wait_max:
            break
        time.sleep(0.5)
    lens, q, k_cache, v_cache, md = prefill_workload()
    # causal: QK^T and PV, half the square
    flops = sum(4 * n * (n + 1) / 2 * HEAD_DIM * N_HEADS for n in lens)
    expected = paged_attention_ref(q, k_cache, v_cache, md).float()
    rows = []
    for variant in variants:
        try:
            out = run_prefill(variant, q, k_cache, v_cache, md)
            diff = (out.float() - expected).abs().max().item()
            us = 1e3 * do_bench_cudagraph(
                lambda: run_prefill(variant, q, k_cache, v_cache, md),
                rep=20 if sweep else 50,
            )
        except Exception as e:  # a tile that does not fit
            print("skip", variant, type(e).__name__, flush=True)
            continue
        rows.append(
            {
                **variant,
                "kernel_us": us,
                "tflops": flops / us / 1e6,
                "max_abs_diff": diff,
            }
        )
        print(
            f"{variant}: {us:7.1f} us, {flops / us / 1e6:6.1f} TFLOP/s, "
            f"diff {diff:.1e}",
            flush=True,
        )
    del q, k_cache, v_cache, md, expected
    if candidates is True:
        defaults = dict(PREFILL_KNOBS[2])
        return {"num_seqs": len(lens), "tokens": sum(lens), "lens": lens,
                "flops": flops, "defaults": defaults, "rows": rows}  # fmt: skip
    verify = []
    q, k_cache, v_cache, md = verify_workload()
    expected = paged_attention_ref(q, k_cache, v_cache, md).float()
    for variant in VERIFY_VARIANTS:
        try:
            diff = run_prefill(variant, q, k_cache, v_cache, md).float() - expected
            us = 1e3 * do_bench_cudagraph(
                lambda: run_prefill(variant, q, k_cache, v_cache, md), rep=20
            )
        except Exception as e:
            print("skip verify", variant, type(e).__name__, flush=True)
            continue
        verify.append(
            {**variant, "kernel_us": us, "max_abs_diff": diff.abs().max().item()}
        )
        print(f"verify step {variant}: {us:7.1f} us", flush=True)
    return {
        "num_seqs": len(lens),
        "tokens": sum(lens),
        "lens": lens,
        "verify": {
            "batch": md.num_seqs,
            "query_len": md.max_query_len,
            "context": "uniform 100-2000 tokens",
            "rows": verify,
        },
        "limits": prefill_limits(lens, flops),
        "flops": flops,
        "defaults": dict(PREFILL_KNOBS[2]),
        "rows": rows,
    }


def mixed(copy_bw: float, max_model_len: int = 2064) -> dict:
    """Split policies and tile knobs on mixed context lengths; max_seq_len is fixed
    as under CUDA graphs.
    """
    from triton.testing import do_bench_cudagraph

    q, k_cache, v_cache, md, lens = mixed_batch()
    kv_bytes = 2 * sum(lens) * N_KV * HEAD_DIM * 2
    expected = paged_attention_ref(q, k_cache, v_cache, md)

    def measure(knobs: dict) -> dict | None:
        def call():
            return paged_decode(
                q,
                k_cache,
                v_cache,
                md.block_tables,
                md.seq_lens,
                max_model_len,
                **knobs,
            )

        try:
            diff = (call().float() - expected.float()).abs().max().item()
            us = 1e3 * do_bench_cudagraph(call, rep=50)
        # a setting that does not compile (too many registers, say)
        except Exception as e:
            print("skip", knobs, type(e).__name__, flush=True)
            return None
        row = {
            **knobs,
            "kernel_us": us,
            "bandwidth_bytes_per_s": kv_bytes / (us / 1e6),
            "fraction_of_copy": kv_bytes / (us / 1e6) / copy_bw,
            "max_abs_diff_vs_reference": diff,
        }
        print(
            f"{knobs}: {us:7.1f} us, {row['fraction_of_copy']:4.0%} of copy, diff "
            f"{diff:.1e}",
            flush=True,
        )
        return row

    rows = []
    base = dict(block_n=64, num_warps=4, num_stages=1)
    policies = [{"num_splits": n} for n in (1, 2, 4)] + [
        {"split_tokens": t} for t in (128, 256, 512, 1024)
    ]
    for policy in policies:
        rows.append(measure({**base, **policy}))
    best_policies = sorted((r for r in rows if r), key=lambda r: r["kernel_us"])[:2]
    for best in best_policies:
        policy = {k: best[k] for k in ("num_splits", "split_tokens") if k in best}
        for block_n in (32, 64, 128):
            for num_warps in (2, 4, 8):
                for num_stages in (1, 2, 3):
                    if "split_tokens" in policy and policy["split_tokens"] % block_n:
                        continue
                    rows.append(
                        measure(
                            dict(
                                block_n=block_n,
                                num_warps=num_warps,
                                num_stages=num_stages,
                                **policy,
                            )
                        )
                    )
    rows = sorted((r for r in rows if r), key=lambda r: r["kernel_us"])
    return {
        "batch": len(lens),
        "context_tokens": sum(lens),
        "min_len": min(lens),
        "max_len": max(lens),
        "max_model_len": max_model_len,
        "kv_bytes": kv_bytes,
        "rows": rows,
    }


def decode_order_rows(copy_bw: float, max_model_len: int = 2064) -> list[dict]:
    """The decode kernel on the mixed batch: programs in batch order (the default)
    or longest sequence first (order=decode_order), over split counts and tiles."""
    from triton.testing import do_bench_cudagraph

    from minillm.kernels.paged_attention import decode_order

    q, k_cache, v_cache, md, lens = mixed_batch()
    kv_bytes = 2 * sum(lens) * N_KV * HEAD_DIM * 2
    expected = paged_decode(
        q, k_cache, v_cache, md.block_tables, md.seq_lens, max_model_len
    )
    order = decode_order(md)
    # the grid of the ordered kernel (KV heads side by side), sequences in batch order
    same_order = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    variants = [{}, {"ordered": True}, {"transposed": True}, {}, {"ordered": True}]
    rows = []
    for v in variants:
        knobs = {k: x for k, x in v.items() if k not in ("ordered", "transposed")}
        if v.get("ordered"):
            knobs["order"] = order
        if v.get("transposed"):
            knobs["order"] = same_order

        def call():
            return paged_decode(
                q, k_cache, v_cache, md.block_tables, md.seq_lens, max_model_len,
                **knobs,
            )  # fmt: skip

        try:
            same = torch.equal(call(), expected)
            us = 1e3 * do_bench_cudagraph(call, rep=50)
        except Exception as e:
            print("skip", v, type(e).__name__, e, flush=True)
            continue
        frac = kv_bytes / (us / 1e6) / copy_bw
        rows.append({**v, "kernel_us": us, "fraction_of_copy": frac,
                     "same_bits_as_default": same})  # fmt: skip
        print(f"{v}: {us:7.1f} us, {frac:4.0%} of copy, same bits {same}", flush=True)
    return rows


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="first time the tuning knobs, then use the best",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="also time split policies on mixed context lengths",
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="also time the prefill kernels on a prompt step",
    )
    parser.add_argument(
        "--prefill-sweep",
        action="store_true",
        help="with --prefill: also a grid of the prefill kernel's knobs",
    )
    parser.add_argument(
        "--prefill-only",
        action="store_true",
        help="time the prefill kernels only; write paged_prefill-*.json",
    )
    parser.add_argument(
        "--prefill-candidates",
        action="store_true",
        help="with --prefill-only: only the defaults and PREFILL_CANDIDATES",
    )
    parser.add_argument(
        "--prefill-final",
        action="store_true",
        help="with --prefill-only: PREFILL_FINAL (each change of this stop alone), "
        "the verify step and the limits",
    )
    parser.add_argument(
        "--decode-order",
        action="store_true",
        help="only the decode kernel on the mixed batch, its programs in the batch's "
        "order or longest sequence first; writes paged_decode_order-*.json",
    )
    parser.add_argument("--name", default=None, help="the stored result's name")
    parser.add_argument(
        "--wait-for",
        type=Path,
        default=None,
        help="a file whose existence says other GPU work is done (time after it)",
    )
    parser.add_argument(
        "--wait-max",
        type=float,
        default=60,
        help="seconds to wait for --wait-for at most",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the JSON (default benchmarks/results)",
    )
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/paged_attention.py measures a GPU kernel: no CUDA device found"
        )
    from triton.testing import do_bench

    if args.decode_order:
        bw = copy_bandwidth()
        record = {
            "benchmark": "paged_decode_order",
            "environment": environment(),
            "workload": "mixed_batch(): 256 decodes, contexts of the standard "
            "workload halfway through; max_seq_len 2064 as under CUDA graphs",
            "copy_bandwidth_bytes_per_s": bw,
            "rows": decode_order_rows(bw),
        }
        name = args.name or "paged_decode_order"
        print("wrote", save(name, record, *([args.out] if args.out else [])))
        return
    if args.prefill_only:
        record = {
            "benchmark": "paged_prefill",
            "environment": environment(),
            "workload": {
                "layer": "Qwen3-0.6B attention",
                "n_heads": N_HEADS,
                "n_kv_heads": N_KV,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
                "dtype": "bfloat16",
                "prompts": "uniform 100-1024 tokens up to 16,384, no cached context",
                "flops": "causal: 4 n(n+1)/2 D H per sequence",
                "timing": "triton.testing.do_bench_cudagraph",
                "baseline": "kernel v1, block_m 32, block_n 32: what the engine ran",
            },
            "prefill": prefill(
                args.prefill_sweep,
                wait_for=args.wait_for,
                wait_max=args.wait_max,
                candidates="final" if args.prefill_final else args.prefill_candidates,
            ),
        }
        name = "paged_prefill_sweep" if args.prefill_sweep else "paged_prefill"
        name = args.name or name
        out = save(name, record, *([args.out] if args.out else []))
        print("wrote", out)
        return
    record = {
        "benchmark": "paged_attention",
        "environment": environment(),
        "workload": {
            "layer": "Qwen3-0.6B attention",
            "n_heads": N_HEADS,
            "n_kv_heads": N_KV,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
            "blocks": "shuffled",
        },
        "kernel_version": DECODE_KERNEL_VERSION,
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "decode": [],
    }
    knobs: dict = {}
    if args.sweep:
        record["sweep"] = sweep(do_bench)
        best = record["sweep"][0]
        knobs = {
            k: best[k]
            for k in ("block_n", "num_warps", "num_stages", "programs_per_sm")
        }
    record["kernel_settings"] = knobs or "defaults"
    if args.mixed:
        record["mixed"] = mixed(record["copy_bandwidth_bytes_per_s"])
    if args.prefill:
        record["prefill"] = prefill(args.prefill_sweep)
    for context in (512, 4096):
        for batch in (1, 8, 64, 256):
            q, k_cache, v_cache, md = decode_batch(batch, context)
            expected = paged_attention_ref(q, k_cache, v_cache, md)
            out = paged_decode(
                q,
                k_cache,
                v_cache,
                md.block_tables,
                md.seq_lens,
                md.max_seq_len,
                **knobs,
            )
            max_diff = (out.float() - expected.float()).abs().max().item()
            kernel_ms = do_bench(
                lambda: paged_decode(
                    q,
                    k_cache,
                    v_cache,
                    md.block_tables,
                    md.seq_lens,
                    md.max_seq_len,
                    **knobs,
                ),
                warmup=25,
                rep=100,
            )
            reference_ms = do_bench(
                lambda: paged_attention_ref(q, k_cache, v_cache, md), warmup=5, rep=30
            )
            kv_bytes = 2 * batch * context * N_KV * HEAD_DIM * 2
            row = {
                "batch": batch,
                "context": context,
                "kernel_us": 1e3 * kernel_ms,
                "reference_us": 1e3 * reference_ms,
                "kv_bytes": kv_bytes,
                "bandwidth_bytes_per_s": kv_bytes / (kernel_ms / 1e3),
                "num_splits": decode_num_splits(
                    batch,
                    N_KV,
                    context,
                    knobs.get("block_n", 64),
                    knobs.get("programs_per_sm", 16),
                ),
                "max_abs_diff_vs_reference": max_diff,
            }
            record["decode"].append(row)
            copy_bw = record["copy_bandwidth_bytes_per_s"]
            print(
                f"batch {batch:4d} context {context:5d}: {row['kernel_us']:8.1f} us "
                f"{row['bandwidth_bytes_per_s'] / 1e12:5.2f} TB/s "
                f"({row['bandwidth_bytes_per_s'] / copy_bw:4.0%} of copy), reference "
                f"{row['reference_us']:9.1f} us, max diff {max_diff:.2e}",
                flush=True,
            )
            del q, k_cache, v_cache, md, expected, out
            torch.cuda.empty_cache()
    print("wrote", save("paged_attention", record, *([args.out] if args.out else [])))


if __name__ == "__main__":
    main()
