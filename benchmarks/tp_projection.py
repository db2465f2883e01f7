"""The single-GPU times behind chapter 30's projection of tensor-parallel decode steps.

For Llama-3.1-8B and Llama-3.1-70B shapes, bf16, at TP = 1, 2, 4, 8: the time of each
projection of one rank's shard of a decoder layer (q/k/v and gate/up merged, as vLLM
runs them), of the LM head's shard, and of decode attention over the rank's heads
(PyTorch SDPA, one query token per sequence, a context of CONTEXT tokens), with M = 1
and 64 sequences a step. Also the cost of one NCCL all-reduce call on a group of one
rank (this machine has one GPU): the launch and bookkeeping a call costs before any
byte crosses a link, a floor under the real multi-GPU latency.

Times are per call, from replaying a CUDA graph that makes the call many times in a
row (chapter 14's method, benchmarks/decode_gemm.py), each call on another copy of the
weights (at least 256 MB in rotation), so that weights come from HBM as in a real step.

    python benchmarks/tp_projection.py      # on a GPU; writes benchmarks/results/
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from benchmarks.decode_gemm import graph_us  # noqa: E402

# hidden, intermediate, layers, query heads, KV heads, head_dim, vocab
MODELS = {
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, 128, 128256),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8, 128, 128256),
}
TP_SIZES = (1, 2, 4, 8)
ROWS = (1, 64)
CONTEXT = 1024
ROTATE_BYTES = 256 << 20


def shard_shapes(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """One rank's (N, K) of every product of a layer, and of the LM head."""
    h, inter, _, nq, nkv, d, vocab = MODELS[model]
    kv_local = max(1, nkv // tp)  # replicated when tp > nkv
    return {
        "qkv_proj": ((nq // tp + 2 * kv_local) * d, h),
        "o_proj": (h, nq // tp * d),
        "gate_up_proj": (2 * inter // tp, h),
        "down_proj": (h, inter // tp),
        "lm_head": (math.ceil(vocab / tp), h),
    }


def gemm_us(n: int, k: int, m: int, device) -> float:
    copies = max(2, math.ceil(ROTATE_BYTES / (2 * n * k)))
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)
    ]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    calls = [lambda w=w: F.linear(x, w) for w in weights] * max(1, 16 // copies)
    us = graph_us(calls)
    del weights
    return us


def attention_us(model: str, tp: int, m: int, device) -> float:
    """Decode attention of m sequences over CONTEXT cached tokens, this rank's heads."""
    _, _, _, nq, nkv, d, _ = MODELS[model]
    q_heads, kv_heads = nq // tp, max(1, nkv // tp)
    kv_bytes = 2 * m * kv_heads * CONTEXT * d * 2
    copies = max(2, math.ceil(ROTATE_BYTES / kv_bytes))
    q = torch.randn(m, q_heads, 1, d, device=device, dtype=torch.bfloat16)
    caches = [
        (
            torch.randn(m, kv_heads, CONTEXT, d, device=device, dtype=torch.bfloat16),
            torch.randn(m, kv_heads, CONTEXT, d, device=device, dtype=torch.bfloat16),
        )
        for _ in range(copies)
    ]
    calls = [
        lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for k, v in caches
    ] * max(1, 16 // copies)
    return graph_us(calls)


def nccl_one_rank_us(numel: int, device, repeats: int = 200) -> float:
    """Per-call time of an NCCL all-reduce on a world of one rank (eager calls)."""
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / repeats


def main() -> None:
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tp_projection.py times GPU kernels: no CUDA device found")
    device = torch.device("cuda")
    fd, store = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    record = {
        "benchmark": "tp_projection",
        "environment": environment(),
        "workload": {
            "dtype": "bfloat16",
            "rows": list(ROWS),
            "context_tokens": CONTEXT,
            "tp_sizes": list(TP_SIZES),
            "weights_rotated_bytes": ROTATE_BYTES,
            "timing": "CUDA-graph replay of many calls, median of 5 replays, per call",
        },
        "models": {
            name: dict(
                zip(
                    (
                        "hidden",
                        "intermediate",
                        "layers",
                        "heads",
                        "kv_heads",
                        "head_dim",
                        "vocab",
                    ),
                    shape,
                )
            )
            for name, shape in MODELS.items()
        },
        "rows": [],
        "nccl_one_rank_us": {},
    }
    for model, (hidden, *_rest) in MODELS.items():
        for m in ROWS:
            key = f"{model}/{m}"
            record["nccl_one_rank_us"][key] = nccl_one_rank_us(m * hidden, device)
            for tp in TP_SIZES:
                row = {"model": model, "tp": tp, "rows": m}
                for name, (n, k) in shard_shapes(model, tp).items():
                    row[f"{name}_us"] = gemm_us(n, k, m, device)
                try:
                    row["attention_us"] = attention_us(model, tp, m, device)
                except RuntimeError as e:  # recorded, not fatal: the GEMMs stand
                    row["attention_error"] = str(e)[:200]
                record["rows"].append(row)
                print(row, flush=True)
    dist.destroy_process_group()
    out = Path(os.environ.get("OUT", "")) if os.environ.get("OUT") else None
    print("saved", save("tp_projection", record))
    if out:
        save("tp_projection", record, out)


if __name__ == "__main__":
    main()
