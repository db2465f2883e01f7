"""Decode attention over a bf16 KV cache and over an FP8 (E4M3) one (chapter 20, "An
FP8 KV cache").

One Qwen3-0.6B attention layer (16 query heads, 8 KV heads of 128, blocks of 16,
shuffled as after a long-running server), a decode batch of --num-seqs sequences with
contexts uniform in [--context / 2, 3 --context / 2] (seed 0): the same keys and values
written once into a bf16 cache and once, through chapter 3's scaled write, into an FP8
cache with per-tensor scales (max |x| / 448). Each cache is read by chapter 13's
attention backend (`triton_paged_attention`, as the engine calls it), timed as
CUDA-graph replays (triton.testing.do_bench_cudagraph); with the bytes of K/V each call
reads, the achieved bandwidth and the copy bandwidth measured in the same run. Checks
in the same run: the FP8 kernel against chapter 5's reference on the same FP8 cache,
and the FP8 output against the bf16 one. On a CPU the queries are float32 (the
interpreter's bf16 products are not the GPU's).

    # on a GPU; writes benchmarks/results/kv_fp8_attention-*.json
    python benchmarks/kv_fp8_attention.py
    # a tiny run on the CPU (Triton's interpreter), not stored
    TRITON_INTERPRET=1 python benchmarks/kv_fp8_attention.py --num-seqs 3 \
        --context 40 --out /tmp/kv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment  # noqa: E402
from benchmarks.common import require_committed, save  # noqa: E402
from minillm.attention import paged_attention_ref  # noqa: E402
from minillm.kernels.paged_attention import triton_paged_attention  # noqa: E402
from minillm.kv_cache import reshape_and_cache  # noqa: E402
from minillm.model import build_attention_metadata  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn


def batch(num_seqs: int, context: int, device: str, seed: int = 0):
    """q, bf16 K/V (one per slot), metadata, and the number of cached tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, 3 * context // 2 + 1, (num_seqs,), generator=g)
    blocks = [-(-int(n) // BLOCK_SIZE) for n in lens]
    order = torch.randperm(sum(blocks), generator=g).tolist()
    tables = [[order.pop() for _ in range(b)] for b in blocks]
    _, md = build_attention_metadata(
        [1] * num_seqs, lens.tolist(), tables, BLOCK_SIZE, device
    )
    shape = (sum(blocks) * BLOCK_SIZE, N_KV, HEAD_DIM)
    # keys a few units large, values below one, as a trained model's are
    k = (torch.randn(shape, generator=g) * 3).to(device, torch.bfloat16)
    v = (torch.randn(shape, generator=g) / 4).to(device, torch.bfloat16)
    q_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(num_seqs, N_HEADS, HEAD_DIM, generator=g).to(device, q_dtype)
    return q, k, v, md, int(lens.sum())


def caches(k, v, dtype):
    """One layer's caches of dtype holding k, v (slot i = row i), and the scales."""
    slots = torch.arange(len(k), device=k.device)
    shape = (len(k) // BLOCK_SIZE, BLOCK_SIZE, N_KV, HEAD_DIM)
    kc = torch.zeros(shape, dtype=dtype, device=k.device)
    vc = torch.zeros_like(kc)
    scales = {}
    if dtype == FP8:
        fp8_max = torch.finfo(FP8).max
        scales = {"k_scale": k.abs().amax().float() / fp8_max,
                  "v_scale": v.abs().amax().float() / fp8_max}  # fmt: skip
    reshape_and_cache(k, v, kc, vc, slots, **scales)
    return kc, vc, scales


def timed_ms(fn, on_gpu: bool) -> float:
    if on_gpu:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=200)
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--name", default="kv_fp8_attention")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    require_committed()  # before measuring: stored runs are of committed code
    env = environment()  # refuses uncommitted code unless forced
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    q, k, v, md, tokens = batch(args.num_seqs, args.context, device)
    record = {
        "benchmark": "kv_fp8_attention",
        "environment": env,
        "workload": {
            "layer": "Qwen3-0.6B attention: 16 query heads, 8 KV heads of 128",
            "num_seqs": args.num_seqs,
            "context": [args.context // 2, 3 * args.context // 2],
            "cached_tokens": tokens,
            "block_size": BLOCK_SIZE,
            "scales": "per tensor, max |x| / 448",
            "timing": "do_bench_cudagraph" if on_gpu else "one call, wall time",
        },
        "copy_bandwidth_bytes_per_s": copy_bandwidth() if on_gpu else None,
        "rows": {},
    }
    outputs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        kc, vc, scales = caches(k, v, dtype)
        outputs[name] = triton_paged_attention(q, kc, vc, md, **scales)
        ms = timed_ms(lambda: triton_paged_attention(q, kc, vc, md, **scales), on_gpu)
        read = 2 * tokens * N_KV * HEAD_DIM * kc.element_size()  # K and V, once
        row = {"ms": ms, "kv_bytes_read": read, "bytes_per_s": read / (ms / 1e3)}
        if record["copy_bandwidth_bytes_per_s"]:
            row["floor_ms"] = 1e3 * read / record["copy_bandwidth_bytes_per_s"]
        if dtype == FP8:  # the kernel against the reference, on this FP8 cache
            ref = paged_attention_ref(q.float(), kc, vc, md, **scales)
            row["max_abs_diff_vs_reference"] = float(
                (outputs[name].float() - ref).abs().max()
            )
            del ref
        record["rows"][name] = row
        print(name, {k_: f"{x:.4g}" for k_, x in row.items()}, flush=True)
        del kc, vc
    record["speedup"] = record["rows"]["bf16"]["ms"] / record["rows"]["fp8"]["ms"]
    diff = (outputs["fp8"].float() - outputs["bf16"].float()).abs()
    record["fp8_vs_bf16"] = {
        "max_abs_diff": float(diff.max()),
        "max_abs_output": float(outputs["bf16"].float().abs().max()),
        "mean_abs_diff": float(diff.mean()),
    }
    print(f"fp8 / bf16 speed-up: {record['speedup']:.2f}x;", record["fp8_vs_bf16"])
    print("wrote", save(args.name, record, *([args.out] if args.out else [])))


if __name__ == "__main__":
    main()
