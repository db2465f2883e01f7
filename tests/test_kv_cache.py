"""The paged KV cache of chapter 3: sizing, slot mapping, writing, reading, copying
blocks.
"""

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.kv_cache import (
    PagedKVCache,
    available_kv_cache_memory,
    compute_slot_mapping,
    copy_blocks,
    gather_kv,
    kv_cache_block_bytes,
    kv_cache_bytes_per_token,
    num_blocks_for_memory,
    reshape_and_cache,
)
from minillm.model import DenseKVCache, ModelConfig, build_attention_metadata

SMALL = ModelConfig(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)
QWEN3_0_6B = ModelConfig(
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128
)


def scattered_tables(lengths, block_size, num_blocks, seed=0):
    """Block tables for sequences of the given lengths, blocks drawn from a shuffled
    free list.
    """
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in lengths], free


# --- sizing
# ------------------------------------------------------------------------------------


def test_bytes_per_token_agrees_with_chapter_1_dense_cache():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        dense = DenseKVCache(QWEN3_0_6B, 1, 1, dtype, device="meta")
        assert kv_cache_bytes_per_token(QWEN3_0_6B, dtype) == dense.nbytes
    assert kv_cache_bytes_per_token(QWEN3_0_6B, torch.bfloat16) == 2 * 28 * 8 * 128 * 2


def test_cache_nbytes_is_num_blocks_times_block_bytes():
    cache = PagedKVCache(QWEN3_0_6B, 1000, 16, dtype=torch.bfloat16, device="meta")
    assert cache.nbytes == 1000 * kv_cache_block_bytes(QWEN3_0_6B, 16, torch.bfloat16)
    assert cache.num_slots == 16_000


@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(0, 2**40),
    block_size=st.sampled_from([1, 5, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_num_blocks_is_the_most_whole_blocks_that_fit_the_budget(
    budget, block_size, dtype
):
    n = num_blocks_for_memory(QWEN3_0_6B, block_size, dtype, budget)
    block = kv_cache_block_bytes(QWEN3_0_6B, block_size, dtype)
    assert n * block <= budget < (n + 1) * block


def test_num_blocks_refuses_a_negative_budget():
    with pytest.raises(ValueError, match=">= 0"):
        num_blocks_for_memory(SMALL, 16, torch.float32, -1)


def test_available_memory_follows_vllms_formula_and_refuses_when_nothing_is_left():
    assert available_kv_cache_memory(80 * 2**30, 0.9, 10 * 2**30) == int(
        80 * 2**30 * 0.9 - 10 * 2**30
    )
    with pytest.raises(ValueError, match="no memory left"):
        available_kv_cache_memory(16 * 2**30, 0.5, 9 * 2**30)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        available_kv_cache_memory(16 * 2**30, 1.5, 0)


# --- slots
# -------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 3, 5, 16]),
    seqs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6
    ),
    seed=st.integers(0, 1000),
)
def test_vectorised_slot_mapping_equals_chapter_1_builder(block_size, seqs, seed):
    query_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    tables, _ = scattered_tables(
        seq_lens, block_size, sum(-(-n // block_size) for n in seq_lens) + 2, seed
    )
    positions, md = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    req_indices = torch.repeat_interleave(
        torch.arange(len(seqs)), torch.tensor(query_lens)
    )
    slots = compute_slot_mapping(md.block_tables, req_indices, positions, block_size)
    assert torch.equal(slots, md.slot_mapping)
    for t, (seq, pos) in enumerate(zip(req_indices.tolist(), positions.tolist())):
        assert divmod(int(slots[t]), block_size) == (
            tables[seq][pos // block_size],
            pos % block_size,
        )


# --- writing and reading
# -----------------------------------------------------------------------


def test_cache_layout_per_layer_is_vllms_flash_layout():
    cache = PagedKVCache(SMALL, num_blocks=7, block_size=5)
    assert cache.key_cache.shape == (3, 7, 5, 2, 8) and cache.value_cache.shape == (
        3,
        7,
        5,
        2,
        8,
    )
    layer = cache.key_cache[1]
    # [num_blocks, block_size, n_kv_heads, head_dim]
    assert layer.shape == (7, 5, 2, 8) and layer.is_contiguous()


@settings(max_examples=50, deadline=None)
@given(num_tokens=st.integers(1, 40), seed=st.integers(0, 1000))
def test_reshape_and_cache_writes_exactly_the_given_slots(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache = torch.randn(2, 10, 4, 2, 8, generator=gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.randperm(40, generator=gen)[:num_tokens]
    key, value = torch.randn(2, num_tokens, 2, 8, generator=gen)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(key_cache[s // 4, s % 4], key[t]) and torch.equal(
            value_cache[s // 4, s % 4], value[t]
        )
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(
        key_cache.view(40, 2, 8)[untouched], before_k.view(40, 2, 8)[untouched]
    )
    assert torch.equal(
        value_cache.view(40, 2, 8)[untouched], before_v.view(40, 2, 8)[untouched]
    )


def test_write_then_gather_gives_back_each_sequence_and_free_blocks_stay_untouched():
    lengths, block_size = [9, 1, 14, 4], 4
    tables, free = scattered_tables(lengths, block_size, 12)
    cache = PagedKVCache(SMALL, 12, block_size)
    positions, md = build_attention_metadata(lengths, lengths, tables, block_size)
    for layer in range(3):
        k, v = torch.randn(2, md.num_tokens, 2, 8)
        cache.write(layer, k, v, md.slot_mapping)
        starts = md.query_start_loc.tolist()
        for i, n in enumerate(lengths):
            got_k, got_v = gather_kv(
                cache.key_cache[layer], cache.value_cache[layer], tables[i], n
            )
            assert torch.equal(got_k, k[starts[i] : starts[i + 1]]) and torch.equal(
                got_v, v[starts[i] : starts[i + 1]]
            )
    assert (
        cache.key_cache[:, free].abs().sum() == 0
        and cache.value_cache[:, free].abs().sum() == 0
    )


def test_gather_accepts_a_padded_table_tensor_and_ignores_the_padding():
    cache = PagedKVCache(SMALL, 6, 4)
    cache.key_cache.normal_()
    k, _ = gather_kv(
        cache.key_cache[0],
        cache.value_cache[0],
        torch.tensor([5, 2, 0, 0], dtype=torch.int32),
        6,
    )
    assert torch.equal(k, torch.cat([cache.key_cache[0, 5], cache.key_cache[0, 2, :2]]))


def test_bf16_cache_casts_what_it_stores():
    cache = PagedKVCache(SMALL, 4, 4, dtype=torch.bfloat16)
    key = torch.randn(3, 2, 8)
    cache.write(0, key, key, torch.tensor([0, 5, 15]))
    assert cache.key_cache.dtype == torch.bfloat16
    assert torch.equal(cache.key_cache[0, 1, 1], key[1].to(torch.bfloat16))


def test_cache_refuses_to_be_empty():
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(SMALL, 0, 16)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(SMALL, 4, 0)


# --- the attention backend hook
# ----------------------------------------------------------------


def test_attend_writes_the_new_kv_then_hands_the_layer_to_the_backend():
    seen = {}

    def spy_backend(q, key_cache, value_cache, attn_metadata):
        seen.update(
            key_cache=key_cache, value_cache=value_cache, metadata=attn_metadata
        )
        return torch.zeros_like(q)

    cache = PagedKVCache(SMALL, 4, 4, attn_backend=spy_backend)
    _, md = build_attention_metadata([3], [3], [[2]], 4)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = cache.attend(1, q, k, v, md)
    assert out.shape == q.shape and seen["metadata"] is md
    # a view of layer 1, not a copy
    assert seen["key_cache"].data_ptr() == cache.key_cache[1].data_ptr()
    assert torch.equal(seen["key_cache"][2, :3], k) and torch.equal(
        seen["value_cache"][2, :3], v
    )


def test_attend_without_a_backend_is_a_clear_error_and_writes_nothing():
    cache = PagedKVCache(SMALL, 4, 4)
    _, md = build_attention_metadata([2], [2], [[0]], 4)
    with pytest.raises(RuntimeError, match="paged_attention_ref"):
        cache.attend(
            0, torch.randn(2, 4, 8), torch.ones(2, 2, 8), torch.ones(2, 2, 8), md
        )
    assert cache.key_cache.abs().sum() == 0


# --- copying blocks
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Order:  # the shape of chapter 4's BlockCopy
    src: int
    dst: int


@pytest.mark.parametrize("orders", [[(1, 4), (3, 0)], [Order(1, 4), Order(3, 0)]])
def test_copy_blocks_copies_every_layer_and_nothing_else(orders):
    cache = PagedKVCache(SMALL, 6, 4)
    cache.key_cache.normal_()
    cache.value_cache.normal_()
    before_k, before_v = cache.key_cache.clone(), cache.value_cache.clone()
    cache.copy_blocks(orders)
    for src, dst in [(1, 4), (3, 0)]:
        assert torch.equal(cache.key_cache[:, dst], before_k[:, src])
        assert torch.equal(cache.value_cache[:, dst], before_v[:, src])
    for b in (1, 2, 3, 5):
        assert torch.equal(cache.key_cache[:, b], before_k[:, b]) and torch.equal(
            cache.value_cache[:, b], before_v[:, b]
        )


def test_copy_blocks_copies_every_pair_and_nothing_else():
    # (layers, blocks, block_size, n_kv, D): block b holds b
    key = torch.arange(4.0).view(1, 4, 1, 1, 1)
    value = key.clone()
    copy_blocks(key, value, [(0, 2), (1, 3)])
    assert key.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]
    copy_blocks(key, value, [])  # nothing to do
    assert key.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "orders, message",
    [
        ([(0, 6)], "outside"),
        ([(-1, 2)], "outside"),
        ([(0, 2), (1, 2)], "destination of one copy"),
        ([(0, 2), (2, 3)], "both a source and a destination"),
    ],
)
def test_copy_blocks_refuses_bad_orders_and_changes_nothing(orders, message):
    cache = PagedKVCache(SMALL, 6, 4)
    cache.key_cache.normal_()
    before = cache.key_cache.clone()
    with pytest.raises(ValueError, match=message):
        cache.copy_blocks(orders)
    assert torch.equal(cache.key_cache, before)
