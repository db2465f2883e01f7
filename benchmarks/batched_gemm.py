"""The matrix products of a batched decode step (17 to 256 rows): cuBLAS against a plain
Triton tiled product, and both against the roofline.

For Qwen3-0.6B's projections (q/k/v and gate/up merged, as the engine runs them), bf16,
with M rows of x: F.linear (cuBLAS) and `tiled_linear` at a few tile shapes, timed as
decode_gemm.py times them (one CUDA graph of many calls in a row, each on another copy
of the weight, so that W comes from HBM). The roofline of a product is the larger of
its weight bytes over the copy bandwidth and its flops over a large product's rate
(8192^3, measured in the same run).

    python benchmarks/batched_gemm.py   # on a GPU; writes results/batched_gemm-*.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from benchmarks.decode_gemm import ROTATE_BYTES, graph_us  # noqa: E402

SHAPES = {
    "qkv_proj": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up_proj": (6144, 1024),
    "down_proj": (1024, 3072),
}
ROWS = (32, 64, 128, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (32, 64, 128, 4, 4),
]


@triton.jit
def _tiled_kernel(
    x_ptr, w_ptr, y_ptr, r_ptr, g_ptr, s_ptr, M, N, K, stride_xm, stride_wn,
    stride_ym, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PROLOGUE: tl.constexpr,
):  # fmt: skip
    """y = x @ w.T; PROLOGUE 1: of RMSNorm(r + x) with weights g (the sums r + x
    stored at s by the first band; the row scale applied to the sums at the end);
    2: of silu(x[:, :K]) * x[:, K:]."""
    # the M tiles of one band of W side by side, so that they share it in L2
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = tl.program_id(0) % num_m, tl.program_id(0) // num_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs = m[:, None] * stride_xm + (k0 + k)[None, :]
        x = tl.load(x_ptr + offs, mask=(m < M)[:, None], other=0.0)
        if PROLOGUE == 1:
            r = tl.load(r_ptr + offs, mask=(m < M)[:, None], other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if pid_n == 0:
                tl.store(s_ptr + offs, x, mask=(m < M)[:, None])
            x32 = x.to(tl.float32)
            sumsq += tl.sum(x32 * x32, axis=1)
            g = tl.load(g_ptr + k0 + k)
            x = (g.to(tl.float32)[None, :] * x32).to(x.dtype)
        if PROLOGUE == 2:
            up = tl.load(x_ptr + offs + K, mask=(m < M)[:, None], other=0.0)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        w = tl.load(
            w_ptr + n[:, None] * stride_wn + (k0 + k)[None, :],
            mask=(n < N)[:, None],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    if PROLOGUE == 1:
        acc = acc * (1.0 / tl.sqrt(sumsq / K + eps))[:, None]
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m < M)[:, None] & (n < N)[None, :],
    )


def tiled_linear(x, w, tile, prologue=0, r=None, g=None, s=None, eps=1e-6):
    bm, bn, bk, warps, stages = tile
    (M, _), (N, K) = x.shape, w.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _tiled_kernel[grid](
        x, w, y, y if r is None else r, y if g is None else g, y if s is None else s,
        M, N, K, x.stride(0), w.stride(0), y.stride(0), eps,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, PROLOGUE=prologue,
        num_warps=warps, num_stages=1,
    )  # fmt: skip
    return y


@triton.jit
def _add_rms_kernel(x_ptr, r_ptr, g_ptr, s_ptr, y_ptr, K, eps, K_P2: tl.constexpr):
    """One row: s = r + x, y = RMSNorm(s) * g (a stand-in for the compiled norm)."""
    row, k = tl.program_id(0), tl.arange(0, K_P2)
    x = tl.load(x_ptr + row * K + k, mask=k < K, other=0.0)
    r = tl.load(r_ptr + row * K + k, mask=k < K, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(s_ptr + row * K + k, s, mask=k < K)
    s32 = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=0) / K + eps)
    y = (s32 * rstd).to(x.dtype)
    y = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32) * y.to(tl.float32)
    tl.store(y_ptr + row * K + k, y.to(x.dtype), mask=k < K)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, K, K_P2: tl.constexpr):
    row, k = tl.program_id(0), tl.arange(0, K_P2)
    gate = tl.load(x_ptr + row * 2 * K + k, mask=k < K, other=0.0)
    up = tl.load(x_ptr + row * 2 * K + K + k, mask=k < K, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(y_ptr + row * K + k, y, mask=k < K)


def two_kernels(x, w, prologue, r=None, g=None, s=None, eps=1e-6):
    """The engine's path at M > 16: the prologue's own kernel, then cuBLAS."""
    M, K = x.shape[0], w.shape[1]
    h = torch.empty(M, K, dtype=x.dtype, device=x.device)
    if prologue == 1:
        _add_rms_kernel[(M,)](x, r, g, s, h, K, eps, K_P2=triton.next_power_of_2(K))
    else:
        _silu_mul_kernel[(M,)](x, h, K, K_P2=triton.next_power_of_2(K))
    return F.linear(h, w)


# the products whose input the engine makes in a kernel of its own at M > 16
FUSED = {"qkv_proj": 1, "gate_up_proj": 1, "down_proj": 2}
FUSED_TILES = [(64, 64, 64, 4, 4), (32, 64, 128, 4, 4)]


def fused_rows(name, w0, copies, calls, M, g) -> dict:
    """The prologue in its own kernel + cuBLAS, against the tiled product with the
    prologue fused, each tile of FUSED_TILES."""
    prologue, K = FUSED[name], w0.shape[1]
    width = 2 * K if prologue == 2 else K
    x = torch.randn(M, width, generator=g).to(w0.device, torch.bfloat16)
    r, s = torch.randn_like(x), torch.empty_like(x)
    gn = (1 + 0.1 * torch.randn(K, generator=g)).to(w0.device, torch.bfloat16)
    extra = dict(r=r, g=gn, s=s) if prologue == 1 else {}
    ref = two_kernels(x, w0, prologue, **extra).float()
    out = {"prologue": "rms_norm" if prologue == 1 else "silu_mul"}
    out["two_kernels_us"] = graph_us(
        [
            lambda w=copies[i % len(copies)]: two_kernels(x, w, prologue, **extra)
            for i in range(calls)
        ]
    )
    for tile in FUSED_TILES:
        try:
            y = tiled_linear(x, w0, tile, prologue, **extra).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            us = graph_us(
                [
                    lambda w=copies[i % len(copies)]: tiled_linear(
                        x, w, tile, prologue, **extra
                    )
                    for i in range(calls)
                ]
            )
        except Exception as e:
            print("skip fused", tile, type(e).__name__, e, flush=True)
            continue
        out["x".join(map(str, tile))] = {"us": us, "relative_error": err}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="batched_gemm")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    device = torch.device("cuda")
    copy_bw = copy_bandwidth()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rate = 2 * 8192**3 / (graph_us([lambda: a @ a] * 5) * 1e-6)
    del a
    record = {
        "benchmark": "batched_gemm",
        "environment": environment(),
        "workload": {
            "dtype": "bfloat16",
            "rows": list(ROWS),
            "tiles": TILES,
            "weights_rotated_bytes": ROTATE_BYTES,
        },  # fmt: skip
        "copy_bandwidth_bytes_per_s": copy_bw,
        "matmul_flops_per_s": rate,
        "rows": [],
    }
    print(f"copy {copy_bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s")
    for name, (N, K) in SHAPES.items():
        g = torch.Generator().manual_seed(N + K)
        w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
        n_copies = max(2, math.ceil(ROTATE_BYTES / w0.nbytes))
        copies = [w0] + [w0.roll(i, 0) for i in range(1, n_copies)]
        calls = max(20, len(copies))
        for M in ROWS:
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            ref = F.linear(x, w0).float()
            roof = max(w0.nbytes / copy_bw, 2 * M * N * K / rate) * 1e6
            row = {"name": name, "N": N, "K": K, "M": M, "roofline_us": roof}
            row["cublas_us"] = graph_us(
                [lambda w=copies[i % len(copies)]: F.linear(x, w) for i in range(calls)]
            )
            for tile in TILES:
                if tile[0] > max(32, triton.next_power_of_2(M)):
                    continue
                try:
                    y = tiled_linear(x, w0, tile).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(
                        [
                            lambda w=copies[i % len(copies)]: tiled_linear(x, w, tile)
                            for i in range(calls)
                        ]
                    )
                except Exception as e:  # a tile that does not fit
                    print("skip", tile, type(e).__name__, flush=True)
                    continue
                row["x".join(map(str, tile))] = {"us": us, "relative_error": err}
            tiled = [(v["us"], k) for k, v in row.items() if isinstance(v, dict)]
            best = min(tiled, default=(float("nan"), "none"))
            if name in FUSED and M >= 64:
                row["fused"] = fused_rows(name, w0, copies, calls, M, g)
                print(f"  fused {name} M {M}: {row['fused']}", flush=True)
            record["rows"].append(row)
            print(
                f"{name:12} M {M:3}: roofline {roof:5.2f} us, cuBLAS "
                f"{row['cublas_us']:5.2f}, best tiled {best[0]:5.2f} ({best[1]})",
                flush=True,
            )
    print("wrote", save(args.name, record, *([args.out] if args.out else [])))


if __name__ == "__main__":
    main()
