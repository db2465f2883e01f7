"""Stepping stones between chapter 13's first prefill kernel and its current one, for
`benchmarks/paged_attention.py --prefill` to measure what each change buys.

`_prefill_v1_kernel` is the kernel the 2026-11-29 result measured (commit 81c443a's
minillm/kernels/paged_prefill.py), with one switch added: EXP2 computes the softmax
with exp2 and log2(e) folded into the scale. `_prefill_one_loop_kernel` is the current
kernel with its key loop not split: every key tile takes the causal mask.
`prefill_longest_sequence_first` runs the current kernel with its tiles in another
order. None is used by the engine; the benchmark checks each against chapter 5's
reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from minillm.kernels.paged_prefill import _key_tiles, _prefill_kernel, prefill_tile_map
from minillm.model import AttentionMetadata


# the block table's width changes every step
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_v1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    EXP2: tl.constexpr,
):
    # (1) the program's tile: its sequence, first query and context
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    # the tile's first query, counted within its sequence's chunk
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk
    # (2) the tile's rows: BLOCK_M query tokens times the group's heads
    # one row per (query token, query head of the group)
    r = tl.arange(0, BLOCK_M * GROUP_P2)
    i, g = r // GROUP_P2, r % GROUP_P2
    row_ok = (q_first + i < q_len) & (g < GROUP)
    pos = context + q_first + i  # each row's position in its sequence
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    token, head = q_begin + q_first + i, kv_head * GROUP + g
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (R, D)
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, D_P2], tl.float32)
    # (3) how far the tile's keys go: causal, and nothing for a spare tile
    # the furthest key any row here may see
    last = tl.minimum(seq_len, context + q_first + BLOCK_M)
    # a tile past the last real one (see paged_prefill) skips the loop
    last = tl.where(q_first < q_len, last, 0)
    # (4) the key loop: as in the decode kernel, with a causal mask
    for t0 in range(0, last, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < last
        block = tl.load(
            block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=t_ok, other=0
        )
        slot = t % BLOCK_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr
            + block[:, None] * stride_kb
            + slot[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (N, D)
        # float32 inputs: exact products, not TF32, so tests can compare at 1e-5
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # (R, N) causal
        s = tl.where(
            (t[None, :] <= pos[:, None]) & t_ok[None, :], s * scale, float("-inf")
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # padding rows see nothing: keep them finite
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        if EXP2:  # scale carries log2(e)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
        else:
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v.dtype), v, input_precision="ieee"
            )
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # (5) normalise and store: no workspace, one program owns each row
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# the block table's width changes every step
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_one_loop_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seq_ptr, tile_start_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_bt, stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # (1) the program's tile; neighbouring programs share a tile, not a KV head
    tile = tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)  # within the sequence's chunk
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk
    # (2) the rows: BLOCK_M query tokens times the group's heads
    r = tl.arange(0, BLOCK_M * GROUP_P2)
    i, g = r // GROUP_P2, r % GROUP_P2
    row_ok = (q_first + i < q_len) & (g < GROUP)
    pos = context + q_first + i  # each row's position in its sequence
    d = tl.arange(0, D_P2)
    token, head = q_begin + q_first + i, kv_head * GROUP + g
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptrs + d[None, :], mask=q_mask, other=0.0)  # (R, D)
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, D_P2], tl.float32)
    # (3) keys every row sees need no mask; the diagonal's do
    real = q_first < q_len  # a spare tile (see the tile map) has no keys
    last = tl.where(real, tl.minimum(seq_len, context + q_first + BLOCK_M), 0)
    k_base, v_base = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + seq * stride_bt
    # (4) one loop, every tile masked
    acc, m_i, l_i = _key_tiles(
        acc, m_i, l_i, q, pos, k_base, v_base, bt_row, stride_kb, stride_ks,
        stride_vb, stride_vs, qk_scale, 0, last,
        HEAD_DIM, D_P2, BLOCK_SIZE, BLOCK_N, True, IEEE,
    )  # fmt: skip
    # (5) normalise and store the real rows (a spare tile's l_i is 0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptrs + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def prefill_v1(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    md: AttentionMetadata,
    block_m: int = 32,
    block_n: int = 32,
    exp2: bool = False,
    **launch,
) -> Tensor:
    """The first kernel; its defaults are what the engine ran (64 rows, block_n 32).
    launch: num_warps, num_stages.
    """
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    # the first tile map: in sequence order
    tile_seq, tile_start = prefill_tile_map(md, block_m, longest_first=False)
    out = torch.empty_like(q)
    scale = head_dim**-0.5 * (math.log2(math.e) if exp2 else 1.0)
    # fmt: off
    _prefill_v1_kernel[(tile_seq.shape[0], num_kv_heads)](
        q, key_cache, value_cache, out,
        md.block_tables, md.seq_lens, md.query_start_loc, tile_seq, tile_start,
        scale,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        md.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        D_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, EXP2=exp2,
        **launch,
    )
    # fmt: on
    return out


def _launch_current_grid(
    kernel,
    q,
    key_cache,
    value_cache,
    md,
    tile_seq,
    tile_start,
    block_m,
    block_n,
    num_warps,
    num_stages,
) -> Tensor:
    """Launches a kernel that takes the current kernel's arguments and grid (one
    program a tile and KV head) on the given tile map."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    # fmt: off
    kernel[(tile_seq.shape[0] * num_kv_heads,)](
        q, key_cache, value_cache, out,
        md.block_tables, md.seq_lens, md.query_start_loc, tile_seq, tile_start,
        head_dim**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        md.block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        D_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    # fmt: on
    return out


def prefill_one_loop(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    md: AttentionMetadata,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    longest_first: bool = True,
) -> Tensor:
    """The current kernel without the split of its key loop."""
    tile_seq, tile_start = prefill_tile_map(md, block_m, longest_first)
    return _launch_current_grid(
        _prefill_one_loop_kernel, q, key_cache, value_cache, md, tile_seq,
        tile_start, block_m, block_n, num_warps, num_stages,
    )  # fmt: skip


def prefill_longest_sequence_first(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    md: AttentionMetadata,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> Tensor:
    """The current kernel with another order of its tiles: the longest sequences
    first, each from its last tile down, so that the tiles that read the same keys
    run close together (their keys stay in L2)."""
    tile_seq, tile_start = prefill_tile_map(md, block_m, longest_first=False)
    q_lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).long()
    seq_len = md.seq_lens.long()[tile_seq]
    real = tile_start.long() < q_lens[tile_seq]
    keys = torch.where(real, seq_len * (1 << 24) + tile_start.long(), -1)
    order = torch.argsort(keys, descending=True, stable=True)
    return _launch_current_grid(
        _prefill_kernel, q, key_cache, value_cache, md, tile_seq[order],
        tile_start[order], block_m, block_n, num_warps, num_stages,
    )  # fmt: skip
