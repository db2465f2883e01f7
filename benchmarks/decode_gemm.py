"""The matrix products of a decode step: chapter 14's skinny Triton kernel against
cuBLAS.

For every projection of a Qwen3-0.6B and a Llama-3.2-1B decoder layer (q/k/v and gate/up
merged, as the engine runs them on a GPU), bf16, with 1, 2, 4, 8 and 16 rows of x: the
time of F.linear (cuBLAS) and of `skinny_linear` at its default configuration, and the
bandwidth each reaches (weight bytes / time) next to the device-to-device copy bandwidth
measured in the same run. Each product is checked against F.linear before it is timed.

Times are per call, from replaying a CUDA graph that makes the call many times in a row
(so launch costs are left out, as in the engine's graphs), each call on another copy of
the weight (200 MB of copies in rotation, four times the H200's L2), so that W comes
from HBM as in a real step.

    # on a GPU; writes benchmarks/results/decode_gemm-*.json
    python benchmarks/decode_gemm.py
    # also a grid of the kernel's knobs (where the defaults come from)
    python benchmarks/decode_gemm.py --sweep
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from minillm.kernels.skinny_gemm import default_config, num_sms, skinny_linear  # noqa: E402

# (model, projection) -> (N, K): out_features, in_features
SHAPES = {
    ("Qwen3-0.6B", "qkv_proj"): (4096, 1024),
    ("Qwen3-0.6B", "o_proj"): (1024, 2048),
    ("Qwen3-0.6B", "gate_up_proj"): (6144, 1024),
    ("Qwen3-0.6B", "down_proj"): (1024, 3072),
    ("Llama-3.2-1B", "qkv_proj"): (3072, 2048),
    ("Llama-3.2-1B", "o_proj"): (2048, 2048),
    ("Llama-3.2-1B", "gate_up_proj"): (16384, 2048),
    ("Llama-3.2-1B", "down_proj"): (2048, 8192),
}
# the same for Llama-3.1-8B (chapters 17 and 18's benchmarks add it to the above)
LLAMA_8B_SHAPES = {
    ("Llama-3.1-8B", "qkv_proj"): (6144, 4096),
    ("Llama-3.1-8B", "o_proj"): (4096, 4096),
    ("Llama-3.1-8B", "gate_up_proj"): (28672, 4096),
    ("Llama-3.1-8B", "down_proj"): (4096, 14336),
}
ROWS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 200 << 20
TOLERANCE = 2e-2  # max |y - F.linear| / max |F.linear| in bf16


def graph_us(calls: list) -> float:
    """Per-call microseconds: all `calls` captured in one CUDA graph, median of 5
    timed replays.
    """
    for fn in calls[:2]:
        fn()  # allocations (split-K counters) happen before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def grid(M: int) -> list[dict]:
    """The knobs --sweep tries: the CUDA-core path up to 4 rows, the tensor cores
    from 2.
    """
    out = []
    if M <= 4:
        out += [
            dict(
                use_dot=False,
                block_n=bn,
                block_k=bk,
                num_stages=st,
                num_warps=4,
                split_k=sk,
            )
            for bn in (16, 32, 64)
            for bk in (128, 256)
            for st in (1, 3)
            for sk in (1, 2, 4, 8)
        ]
    if M >= 2:
        out += [
            dict(
                use_dot=True,
                block_n=bn,
                block_k=bk,
                num_stages=st,
                num_warps=4,
                split_k=sk,
            )
            for bn in (32, 64, 128)
            for bk in (64, 128)
            for st in (2, 4)
            for sk in (1, 2, 4, 8)
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of knobs for every shape"
    )
    parser.add_argument(
        "--sweep-budget-s", type=float, default=240, help="time cap for the grid"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_gemm.py times GPU kernels: no CUDA device found")
    device = torch.device("cuda")
    record = {
        "benchmark": "decode_gemm",
        "environment": environment(),
        "workload": {
            "dtype": "bfloat16",
            "rows": list(ROWS),
            "weights_rotated_bytes": ROTATE_BYTES,
            "timing": "CUDA-graph replay of many calls, median of 5 replays, per call",
        },
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "rows": [],
        "sweep": [],
    }
    copy_bw = record["copy_bandwidth_bytes_per_s"]
    deadline = time.time() + args.sweep_budget_s
    for (model, name), (N, K) in SHAPES.items():
        g = torch.Generator().manual_seed(N + K)
        w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
        copies = [w0] + [
            w0.roll(i, 0) for i in range(1, max(2, math.ceil(ROTATE_BYTES / w0.nbytes)))
        ]
        calls = max(20, len(copies))
        for M in ROWS:
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            ref = F.linear(x, w0)
            err = (
                (skinny_linear(x, w0) - ref).float().abs().max()
                / ref.float().abs().max()
            ).item()
            if err > TOLERANCE:
                raise AssertionError(
                    f"{model} {name} M={M}: relative error {err:.3g} against F.linear"
                )
            cublas = graph_us(
                [lambda w=copies[i % len(copies)]: F.linear(x, w) for i in range(calls)]
            )
            ours = graph_us(
                [
                    lambda w=copies[i % len(copies)]: skinny_linear(x, w)
                    for i in range(calls)
                ]
            )
            row = {
                "model": model,
                "name": name,
                "N": N,
                "K": K,
                "M": M,
                "weight_bytes": w0.nbytes,
                "config": default_config(M, N, K, num_sms(device)),
                "relative_error": err,
                "cublas_us": cublas,
                "skinny_us": ours,
                "cublas_fraction_of_copy": w0.nbytes / (cublas * 1e-6) / copy_bw,
                "skinny_fraction_of_copy": w0.nbytes / (ours * 1e-6) / copy_bw,
            }
            record["rows"].append(row)
            print(
                f"{model:12} {name:12} N {N:5} K {K:4} M {M:2}: cuBLAS {cublas:6.2f} "
                f"us ({row['cublas_fraction_of_copy']:4.0%}), skinny {ours:6.2f} us "
                f"({row['skinny_fraction_of_copy']:4.0%})",
                flush=True,
            )
            if args.sweep:
                budget_left = (deadline - time.time()) / (
                    len(SHAPES) * len(ROWS) - len(record["rows"]) + 1
                )
                stop = time.time() + budget_left
                timed = []
                for knobs in grid(M):
                    if time.time() > stop:
                        break
                    try:
                        y = skinny_linear(x, w0, **knobs)
                        if (
                            (y - ref).float().abs().max() / ref.float().abs().max()
                        ).item() > TOLERANCE:
                            continue
                        us = graph_us(
                            [
                                lambda w=copies[i % len(copies)]: skinny_linear(
                                    x, w, **knobs
                                )
                                for i in range(calls)
                            ]
                        )
                    except Exception:  # noqa: BLE001 - e.g. a tile too large for shared memory
                        continue
                    timed.append({"knobs": knobs, "us": us})
                timed.sort(key=lambda r: r["us"])
                record["sweep"].append(
                    {
                        "model": model,
                        "name": name,
                        "M": M,
                        "tried": len(timed),
                        "default_us": ours,
                        "best": timed[:3],
                    }
                )
                if timed:
                    print(
                        f"{'':44}best of {len(timed)}: {timed[0]['us']:6.2f} us "
                        f"{timed[0]['knobs']}",
                        flush=True,
                    )
    for model in dict.fromkeys(m for m, _ in SHAPES):
        at1 = [r for r in record["rows"] if r["model"] == model and r["M"] == 1]
        print(
            f"{model} layer at batch 1: cuBLAS {sum(r['cublas_us'] for r in at1):.1f} "
            f"us, skinny {sum(r['skinny_us'] for r in at1):.1f} us"
        )
    print(
        "wrote",
        save(
            "decode_gemm",
            record,
            args.out or Path(__file__).resolve().parent / "results",
        ),
    )


if __name__ == "__main__":
    main()
