"""Checks for chapter 13's exercises (Triton kernels). See _check.py.

On a CPU the kernels run under TRITON_INTERPRET=1 (conftest.py sets it before triton
is imported), on small grids.
"""

from __future__ import annotations


import pytest
import torch
from _check import answer, attempted

triton = pytest.importorskip("triton")

from minillm.kernels import paged_decode, paged_prefill  # noqa: E402
from minillm.kernels.paged_prefill import (  # noqa: E402
    PREFILL_KNOBS,
    prefill_block_m,
    prefill_tile_map,
)
from minillm.model import build_attention_metadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(query_lens, seq_lens, block_size, n_heads, n_kv, head_dim, seed=0):
    """Random queries and a paged cache whose blocks come from a shuffled free list."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(DEVICE)
    v = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(DEVICE)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=g).to(DEVICE)
    return q, k, v, tables, md


# 12.1 --------------------------------------------------------------------------------


def _windowed_reference(q, k_cache, v_cache, tables, seq_lens, window):
    """Each sequence's last query over its last `window` keys, gathered one by one."""
    block_size, n_kv, head_dim = k_cache.shape[1:]
    group = q.shape[1] // n_kv
    out = []
    for s, (table, seq_len) in enumerate(zip(tables, seq_lens)):
        t = torch.arange(max(0, seq_len - window), seq_len)
        blocks = torch.tensor(table)[t // block_size].to(k_cache.device)
        slots = (t % block_size).to(k_cache.device)
        k = k_cache[blocks, slots].repeat_interleave(group, dim=1)  # (T, heads, D)
        v = v_cache[blocks, slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s], k) / head_dim**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def test_paged_decode_window():
    fn = answer(paged_decode, "paged_decode_window", "13.1")
    seq_lens = [70, 23, 130, 5]
    q, k, v, tables, md = _batch([1] * 4, seq_lens, 16, n_heads=8, n_kv=2, head_dim=32)
    for window in (1, 17, 64, 1000):
        expected = _windowed_reference(q, k, v, tables, seq_lens, window)
        for splits in (1, 4):
            out = attempted(
                fn,
                "13.1",
                q,
                k,
                v,
                md.block_tables,
                md.seq_lens,
                md.max_seq_len,
                window,
                num_splits=splits,
            )
            assert out.shape == q.shape
            assert torch.allclose(out, expected, atol=1e-5), (window, splits)


# 12.2 --------------------------------------------------------------------------------


def _occupancy(md, num_heads, num_kv_heads, block_m=None):
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    rows = PREFILL_KNOBS[2]["rows"]  # a bf16 batch's
    block_m = block_m or prefill_block_m(md.max_query_len, group_p2, rows)
    programs = prefill_tile_map(md, block_m)[0].shape[0]  # per KV head
    return md.num_tokens * group / (programs * block_m * group_p2)


def test_prefill_row_occupancy():
    fn = answer(paged_prefill, "prefill_row_occupancy", "13.2")
    decodes = [1] * 256
    batches = [
        (decodes, [50 + i for i in range(256)]),  # a decode step
        ([1, 20, 7, 300, 1], [31, 20, 40, 300, 9]),  # chunks and decodes
    ]
    for query_lens, seq_lens in batches:
        tables = [[0] * -(-n // 16) for n in seq_lens]
        _, md = build_attention_metadata(query_lens, seq_lens, tables, 16, DEVICE)
        for heads, kv, block_m in ((16, 8, None), (6, 2, None), (4, 4, 8), (8, 2, 3)):
            got = attempted(fn, "13.2", md, heads, kv, block_m)
            assert got == pytest.approx(_occupancy(md, heads, kv, block_m)), (
                len(query_lens),
                heads,
                kv,
                block_m,
            )
    # a decode step with Qwen3-0.6B's heads: 2 real rows in a program's 16, and spare
    # programs on top
    seq_lens = batches[0][1]
    tables = [[0] * -(-n // 16) for n in seq_lens]
    _, md = build_attention_metadata(decodes, seq_lens, tables, 16, DEVICE)
    assert fn(md, 16, 8) < 2 / 16
