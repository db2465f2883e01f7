"""Worked solutions to chapter 15's exercises (chapters/15_cuda_graph.md).

Installed the way a reader's exported cells would be: a new function in
minillm.cuda_graph, changed kernels, and the graph runner and reserved blocks of
chapter 16's GPUModelRunner. The checks are exercises/test_15_cuda_graph.py.
"""

from __future__ import annotations

import bisect

import triton
import triton.language as tl

import minillm.gpu_model_runner as gpu_model_runner
import minillm.kernels.qk_norm_rope as qk_norm_rope
import minillm.kernels.reshape_and_cache as triton_write
from minillm import cuda_graph
from minillm.gpu_model_runner import GPUModelRunner
from minillm.kernels.paged_decode import _launched_early
from minillm.kernels.qk_norm_rope import _normed


# 14.1
def padding_fraction(sizes: list[int], batch_sizes: list[int]) -> float:
    """Padded rows / rows computed, when each step replays the smallest bucket that
    holds it (CUDAGraphRunner.bucket's bisect)."""
    sizes = sorted(sizes)
    replayed = [sizes[bisect.bisect_left(sizes, n)] for n in batch_sizes]
    return (sum(replayed) - sum(batch_sizes)) / sum(replayed)


# 14.2: padding rows write to PAD_SLOT_ID (-1), every cache write skips it, and no
# block is kept back. Chapter 3's reshape_and_cache skips it already (exercise 15.3,
# exercises/solutions/03_paged_kv.py); the two Triton writes skip it here.
PAD_SLOT_ID = -1


class PadSlotGraphRunner(cuda_graph.CUDAGraphRunner):
    """Chapter 15's graph runner, whose padding rows write nowhere."""

    def __init__(self, *args, scratch_block: int, **kwargs):
        # padding rows have seq_len 0 and read no block: any id does for their tables
        super().__init__(*args, scratch_block=0, **kwargs)
        self.pad_slot = PAD_SLOT_ID  # run() fills the padding rows' slots with it
        self.slot_mapping.fill_(PAD_SLOT_ID)  # and capture() writes with these


def num_reserved_blocks(cls, config, parts) -> int:
    return 0  # no scratch block


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_vt, ROW: tl.constexpr, ROW_P2: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """Chapter 13's cache write; a token whose slot is PAD_SLOT_ID writes nothing."""
    _launched_early(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # a padding row: the one change
    i = tl.arange(0, ROW_P2)
    ok = i < ROW
    k = tl.load(k_ptr + t * stride_kt + i, mask=ok)
    tl.store(key_cache_ptr + slot * ROW + i, k, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + i, mask=ok)
    tl.store(value_cache_ptr + slot * ROW + i, v, mask=ok)


@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_write_kernel(
    qkv_ptr, g_ptr, cos_ptr, sin_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    slot_ptr, eps, T, stride_t, stride_cos,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """Chapter 15's fused norm, rotation and cache write; the key branch's stores
    skip PAD_SLOT_ID (the one change)."""
    _launched_early(PDL)
    h = tl.program_id(1)
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None]
    ok = t < T
    d = tl.arange(0, D)[None, :]
    row = t * stride_t + h * D
    rstd = 1.0
    if NORM:
        x = tl.load(qkv_ptr + row + d, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / D + eps)
    y = _normed(qkv_ptr, g_ptr, row, h, d, rstd, ok, D, NORM)
    partner = _normed(qkv_ptr, g_ptr, row, h, (d + D // 2) % D, rstd, ok, D, NORM)
    rotated = tl.where(d < D // 2, -partner, partner)
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=ok).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cos + d, mask=ok).to(tl.float32)
    a = (y.to(tl.float32) * cos).to(y.dtype)
    b = (rotated.to(tl.float32) * sin).to(y.dtype)
    out = (a.to(tl.float32) + b.to(tl.float32)).to(y.dtype)
    if h < N_HEADS:
        tl.store(q_ptr + (t * N_HEADS + h) * D + d, out, mask=ok)
    else:
        slot = tl.load(slot_ptr + t, mask=ok, other=0).to(tl.int64)
        real = ok & (slot >= 0)  # 11.2: a padding row's key and value go nowhere
        kv = h - N_HEADS
        at = (slot * N_KV + kv) * D + d
        tl.store(key_cache_ptr + at, out, mask=real)
        v = tl.load(qkv_ptr + t * stride_t + (N_HEADS + N_KV + kv) * D + d, mask=ok)
        tl.store(value_cache_ptr + at, v, mask=real)


cuda_graph.padding_fraction = padding_fraction
GPUModelRunner.num_reserved_blocks = classmethod(num_reserved_blocks)
gpu_model_runner.CUDAGraphRunner = PadSlotGraphRunner
triton_write._write_kv_kernel = _write_kv_kernel
qk_norm_rope._qk_norm_rope_write_kernel = _qk_norm_rope_write_kernel

SOLUTIONS = {
    "padding": padding_fraction,
    "scratch": (PadSlotGraphRunner, num_reserved_blocks, _write_kv_kernel),
}
