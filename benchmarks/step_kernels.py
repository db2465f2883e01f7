"""Small kernels of a decode step at a large batch, and of a prompt step: chapter 15's
q/k norm, rotation and cache write (`qk_norm_rope_write`) by tokens and warps per
program, at 1 to 16,384 tokens.

Timed as CUDA-graph replays (triton.testing.do_bench_cudagraph), Qwen3-0.6B's heads
(16 query, 8 KV, 128 wide), bf16, a cache of shuffled slots. Each setting is checked
against one token and 4 warps a program (the kernel before tiles of tokens), bit for
bit; the bytes it moves are set against the copy bandwidth measured in the same run.

    python benchmarks/step_kernels.py   # on a GPU; writes results/step_kernels-*.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from minillm.kernels import qk_norm_rope as qk  # noqa: E402
from minillm.kernels.qk_norm_rope import qk_norm_rope_write  # noqa: E402

N_HEADS, N_KV, D, BLOCK = 16, 8, 128, 16


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="step_kernels")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    g = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = []
    for T in (1, 16, 64, 256, 1024, 16384):
        qkv = torch.randn(T, (N_HEADS + 2 * N_KV) * D, device="cuda", generator=g)
        qkv = qkv.bfloat16()
        weight = (1 + 0.1 * torch.randn(N_HEADS + N_KV, D, device="cuda")).bfloat16()
        cos, sin = (torch.rand(T, D, device="cuda").bfloat16() for _ in range(2))
        blocks = T // BLOCK + 2
        caches = [
            torch.zeros(blocks, BLOCK, N_KV, D, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        ]
        slots = torch.randperm(blocks * BLOCK, device="cuda")[:T]
        # qkv and cos/sin read; queries, keys and values written
        moved = qkv.nbytes + 2 * cos.nbytes + T * (N_HEADS + 2 * N_KV) * D * 2

        def call(warps, tokens):
            return qk_norm_rope_write(
                qkv, weight, 1e-6, cos, sin, *caches, slots, N_HEADS,
                num_warps=warps, tokens=tokens,
            )  # fmt: skip

        expected = call(4, 1)
        for tokens in (1, 2, 4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                if tokens > T:
                    continue
                same = torch.equal(call(warps, tokens), expected)
                us = 1e3 * do_bench_cudagraph(lambda: call(warps, tokens), rep=30)
                rows.append({"tokens": T, "tokens_per_program": tokens,
                             "num_warps": warps, "us": us, "bytes": moved,
                             "fraction_of_copy": moved / (us * 1e-6) / bandwidth,
                             "same_bits": same})  # fmt: skip
                print(f"qk_norm_rope_write T {T:5d}, {tokens:2d} tokens, {warps} "
                      f"warps: {us:7.2f} us, same bits {same}", flush=True)  # fmt: skip
    record = {
        "benchmark": "step_kernels",
        "environment": environment(),
        "workload": {
            "heads": [N_HEADS, N_KV],
            "head_dim": D,
            "dtype": "bfloat16",
            "timing": "triton.testing.do_bench_cudagraph",
        },  # fmt: skip
        "copy_bandwidth_bytes_per_s": bandwidth,
        "defaults": {
            "one_token_up_to": qk.ONE_TOKEN_UP_TO,
            "tokens_per_program": qk.TOKENS_PER_PROGRAM,
        },  # fmt: skip
        "qk_norm_rope_write": rows,
    }
    print("wrote", save(args.name, record, *([args.out] if args.out else [])))


if __name__ == "__main__":
    main()
