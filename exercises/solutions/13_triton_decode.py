"""Worked solutions to chapter 13's exercises (chapters/13_triton_decode.md).

Installed into minillm.kernels' modules the way a reader's exported cells would put
them there; the checks are exercises/test_13_triton_decode.py (under
TRITON_INTERPRET=1 on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minillm.kernels import paged_decode, paged_prefill
from minillm.kernels.paged_decode import decode_num_splits, reduce_splits
from minillm.kernels.paged_prefill import (
    PREFILL_KNOBS,
    prefill_block_m,
    prefill_tile_map,
)
from minillm.model import AttentionMetadata


# 12.1
@triton.jit
def _decode_window_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr,
    scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Chapter 13's decode kernel (its plain launch), where the split (its
    _decode_split) covers only the last `window` tokens: nothing before them is read."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)  # the window's first token
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, ROWS)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_P2)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_P2], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        block = tl.load(block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE,
                        mask=t_ok, other=0)  # fmt: skip
        slot = t % BLOCK_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        at_k = block[:, None] * stride_kb + slot[:, None] * stride_ks
        k = tl.load(k_ptr + at_k + kv_head * stride_kh + d[None, :], mask=kv_mask,
                    other=0.0)  # fmt: skip
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        at_v = block[:, None] * stride_vb + slot[:, None] * stride_vs
        v = tl.load(v_ptr + at_v + kv_head * stride_vh + d[None, :], mask=kv_mask,
                    other=0.0)  # fmt: skip
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # an empty split: m = -inf
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc,
             mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)


def paged_decode_window(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
    seq_lens: Tensor, max_seq_len: int, window: int, num_splits: int | None = None,
    block_n: int = 64,
) -> Tensor:  # fmt: skip
    """Decode attention over each sequence's last `window` keys (sliding window)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if num_splits is None:  # splits of the window, not of the whole context
        num_splits = decode_num_splits(
            num_seqs, num_kv_heads, min(window, max_seq_len), block_n
        )
    shape = (num_seqs, num_heads, num_splits)
    acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(shape, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741 (the papers' name)
    _decode_window_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, acc, m, l,
        head_dim**-0.5, window, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), NUM_HEADS=num_heads, GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return reduce_splits(acc, m, l, torch.empty_like(q))


# 12.2
def prefill_row_occupancy(
    attn_metadata: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    block_m: int | None = None,
) -> float:
    """Of the BLOCK_M x GROUP_P2 rows of every program paged_prefill launches for a
    bfloat16 batch (spare programs included), the share holding a real query token of
    a real head."""
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    md = attn_metadata
    block_m = block_m or prefill_block_m(
        md.max_query_len, group_p2, PREFILL_KNOBS[2]["rows"]
    )
    programs = prefill_tile_map(md, block_m)[0].shape[0]  # per KV head
    real = md.num_tokens * group  # every token, every query head of the group
    return real / (programs * block_m * group_p2)


paged_decode.paged_decode_window = paged_decode_window
paged_prefill.prefill_row_occupancy = prefill_row_occupancy

SOLUTIONS = {
    "window": (_decode_window_kernel, paged_decode_window),
    "occupancy": prefill_row_occupancy,
}
