"""Checks for the exercises of chapter 3 ("The paged KV cache").

pytest exercises/test_03_paged_kv.py -k token_positions   # 2.1
pytest exercises/test_03_paged_kv.py -k fp8               # 2.2
pytest exercises/test_03_paged_kv.py -k pad_slot          # 2.3
"""

from __future__ import annotations

import random

import torch
from _check import answer, attempted

import minillm.kv_cache as kv_cache
from minillm.kv_cache import compute_slot_mapping, gather_kv
from minillm.model import build_attention_metadata

N_KV, HEAD_DIM = 2, 8


def random_batch(rng: random.Random, block_size: int):
    """A mixed batch: prompts, single decode tokens and chunks, in shuffled blocks."""
    num_seqs = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 40) for _ in range(num_seqs)]
    query_lens = [rng.choice([s, 1, rng.randint(1, s)]) for s in seq_lens]
    need = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start : start + n])
        start += n
    return query_lens, seq_lens, tables


# --- 2.1 positions on the device --------------------------------------------------


def test_token_positions_agree_with_the_builder_on_random_batches():
    token_positions = answer(kv_cache, "token_positions", "3.1")
    rng = random.Random(0)
    for _ in range(200):
        block_size = rng.choice([1, 2, 4, 16])
        query_lens, seq_lens, tables = random_batch(rng, block_size)
        positions, md = build_attention_metadata(
            query_lens, seq_lens, tables, block_size
        )
        req_indices, got = token_positions(md.query_start_loc, md.seq_lens)
        expected_req = [i for i, q in enumerate(query_lens) for _ in range(q)]
        assert req_indices.dtype == got.dtype == torch.int64
        assert req_indices.tolist() == expected_req, (query_lens, seq_lens)
        assert torch.equal(got, positions), (query_lens, seq_lens)
        slots = compute_slot_mapping(md.block_tables, req_indices, got, block_size)
        assert torch.equal(slots, md.slot_mapping)


# --- 2.2 an fp8 cache -------------------------------------------------------------


def write_through_reshape_and_cache(dtype, exercise=None):
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 5, N_KV, HEAD_DIM, generator=g)
    key_cache = torch.zeros(4, 4, N_KV, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros(4, 4, N_KV, HEAD_DIM, dtype=dtype)
    slots = torch.tensor([13, 2, 7, 0, 9])
    args = (key, value, key_cache, value_cache, slots)
    if exercise:
        attempted(kv_cache.reshape_and_cache, exercise, *args)
    else:
        kv_cache.reshape_and_cache(*args)
    return key, value, key_cache, value_cache, slots


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fp8_cache_stores_exactly_the_fp8_keys_and_values():
    fp8 = torch.float8_e4m3fn
    key, value, key_cache, value_cache, slots = write_through_reshape_and_cache(
        fp8, "3.2"
    )
    written = torch.zeros(16, dtype=torch.bool)
    written[slots] = True
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, N_KV, HEAD_DIM)
        assert flat.dtype == fp8
        assert torch.equal(as_bytes(flat[slots]), as_bytes(new.to(fp8)))
        assert not as_bytes(flat[~written]).any(), "a slot outside slot_mapping changed"
    # what the cache reads back is the fp8 rounding of what was written
    k, _ = gather_kv(key_cache, value_cache, [0], 4)
    assert torch.equal(k[2].float(), key[1].to(fp8).float())


def test_fp8_answer_leaves_other_dtypes_as_they_were():
    write_through_reshape_and_cache(torch.float8_e4m3fn, "3.2")  # skips until answered
    for dtype in (torch.float32, torch.bfloat16):
        key, value, key_cache, value_cache, slots = write_through_reshape_and_cache(
            dtype
        )
        written = torch.zeros(16, dtype=torch.bool)
        written[slots] = True
        for new, cache in ((key, key_cache), (value, value_cache)):
            flat = cache.view(-1, N_KV, HEAD_DIM)
            assert flat.dtype == dtype
            assert torch.equal(flat[slots], new.to(dtype))
            assert not flat[~written].any()


# --- 2.3 padding slots ------------------------------------------------------------


def test_pad_slot_tokens_are_skipped_and_nothing_else_changes():
    pad = answer(kv_cache, "PAD_SLOT_ID", "3.3")
    assert pad == -1, "vLLM's PAD_SLOT_ID is -1"
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 6, N_KV, HEAD_DIM, generator=g)
    key_cache = torch.randn(3, 4, N_KV, HEAD_DIM, generator=g)
    value_cache = torch.randn(3, 4, N_KV, HEAD_DIM, generator=g)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    # real tokens go to slots 5, 0 and 10; three padding tokens go nowhere
    slots = torch.tensor([5, pad, 0, pad, 10, pad])
    kv_cache.reshape_and_cache(key, value, key_cache, value_cache, slots)
    real = slots != pad
    expected_k, expected_v = before_k.clone(), before_v.clone()
    expected_k.view(-1, N_KV, HEAD_DIM)[slots[real]] = key[real]
    expected_v.view(-1, N_KV, HEAD_DIM)[slots[real]] = value[real]
    # the last slot (what index -1 would reach) is unchanged, like every other
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_pad_slot_a_batch_of_padding_only_writes_nothing():
    pad = answer(kv_cache, "PAD_SLOT_ID", "3.3")
    key = torch.ones(3, N_KV, HEAD_DIM)
    key_cache = torch.zeros(2, 4, N_KV, HEAD_DIM)
    value_cache = torch.zeros(2, 4, N_KV, HEAD_DIM)
    kv_cache.reshape_and_cache(
        key, key, key_cache, value_cache, torch.tensor([pad, pad, pad])
    )
    assert not key_cache.any() and not value_cache.any()
