"""Checks for the exercises of chapter 4 ("The block allocator").

pytest exercises/test_04_block_allocator.py -k prepare_decode   # 3.1
pytest exercises/test_04_block_allocator.py -k splice           # 3.2
pytest exercises/test_04_block_allocator.py -k null_block       # 3.3
"""

from __future__ import annotations

import random

import pytest
from _check import answer

import minillm.block_pool as block_pool
from minillm.block_pool import (
    BlockCopy,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NoFreeBlocksError,
    fork,
)


def snapshot(pool: BlockPool) -> tuple:
    """A pool's whole state as plain values (the chapter's helper)."""

    def link(b):
        return None if b is None else b.block_id

    return tuple(
        (b.ref_cnt, b.block_hash, link(b.prev_free_block), link(b.next_free_block))
        for b in pool.blocks
    ) + (pool.get_num_free_blocks(),)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# --- 3.1 one step, all or nothing -------------------------------------------------

BLOCK_SIZE = 4


def decode_batch(num_blocks: int):
    """A pool and a batch that needs 5 blocks for its next decode step.

    Sequences 0-3 share a partly filled last block, which an idle sequence outside
    the batch holds too (4 copies); sequence 4's last block is full (1 new block);
    sequence 5 writes in place into its own block (nothing).
    """
    pool = BlockPool(num_blocks)
    parent = pool.get_new_blocks(2)  # 6 tokens: one full block and a partial one
    idle = fork(pool, parent)
    shared = [fork(pool, parent) for _ in range(4)]
    full = pool.get_new_blocks(2)  # 8 tokens: both blocks full
    private = pool.get_new_blocks(1)  # 3 tokens
    pool.free_blocks(reversed(parent))  # the parent finished; its fork stays idle
    tables = shared + [full, private]
    return pool, tables, [6, 6, 6, 6, 8, 3], idle


def test_prepare_decode_gives_every_sequence_room_for_its_next_token():
    prepare_decode = answer(block_pool, "prepare_decode", "4.1")
    pool, tables, num_tokens, idle = decode_batch(num_blocks=5 + 5)
    shared_last = tables[0][-1]
    assert pool.get_num_free_blocks() == 5
    copies = prepare_decode(pool, tables, num_tokens, BLOCK_SIZE)
    assert pool.get_num_free_blocks() == 0
    # four copies of the shared block, one per sharer: the idle fork still holds it
    assert [c.src for c in copies] == [shared_last.block_id] * 4
    assert all(isinstance(c, BlockCopy) for c in copies)
    assert sorted(c.dst for c in copies) == sorted(t[-1].block_id for t in tables[:4])
    assert idle[-1] is shared_last and shared_last.ref_cnt == 1
    for table, n in zip(tables, num_tokens):
        assert len(table) * BLOCK_SIZE > n, "no room for the next token"
        assert table[-1].ref_cnt == 1, "the block to write is still shared"
    assert len(tables[4]) == 3 and len(tables[5]) == 1


def test_prepare_decode_lets_the_last_sharer_write_in_place():
    prepare_decode = answer(block_pool, "prepare_decode", "4.1")
    pool = BlockPool(4)
    parent = pool.get_new_blocks(1)  # 2 tokens
    tables = [parent, fork(pool, parent), fork(pool, parent)]
    # three sharers and nobody else: two copies, the third writes in place
    assert pool.get_num_free_blocks() == 3
    copies = prepare_decode(pool, tables, [2, 2, 2], BLOCK_SIZE)
    assert len(copies) == 2 and pool.get_num_free_blocks() == 1
    assert len({t[-1].block_id for t in tables}) == 3


@pytest.mark.parametrize("short_by", [1, 2])
def test_prepare_decode_that_cannot_be_covered_changes_nothing(short_by):
    prepare_decode = answer(block_pool, "prepare_decode", "4.1")
    pool, tables, num_tokens, idle = decode_batch(num_blocks=5 + 5 - short_by)
    before, before_tables = snapshot(pool), [ids(t) for t in tables]
    with pytest.raises(NoFreeBlocksError):
        prepare_decode(pool, tables, num_tokens, BLOCK_SIZE)
    assert snapshot(pool) == before, "a failed step changed the pool"
    assert [ids(t) for t in tables] == before_tables, "a failed step changed a table"


# --- 3.2 splice, don't loop -------------------------------------------------------


def walk(queue: FreeKVCacheBlockQueue) -> list[int]:
    """The queue's ids head to tail, checking every link both ways."""
    out, block = [], queue.fake_free_list_head
    while block.next_free_block is not queue.fake_free_list_tail:
        nxt = block.next_free_block
        assert nxt.prev_free_block is block, "links disagree"
        out.append(nxt.block_id)
        block = nxt
        assert len(out) <= 10_000, "the queue has a cycle"
    assert queue.fake_free_list_tail.prev_free_block is block
    assert len(queue) == len(out)
    return out


def test_splice_popleft_n_and_append_n_match_one_at_a_time():
    answer(FreeKVCacheBlockQueue, "popleft_n", "4.2")
    answer(FreeKVCacheBlockQueue, "append_n", "4.2")
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(40)]
    queue, reference = FreeKVCacheBlockQueue(blocks[:20]), list(range(20))
    taken = list(range(20, 40))
    for _ in range(300):
        if rng.random() < 0.5 and reference:
            n = rng.randint(0, len(reference))
            got = queue.popleft_n(n)
            assert ids(got) == reference[:n]
            assert all(b.prev_free_block is b.next_free_block is None for b in got)
            reference, taken = reference[n:], taken + ids(got)
        else:
            rng.shuffle(taken)
            n = rng.randint(0, len(taken))
            run, taken = taken[:n], taken[n:]
            queue.append_n([blocks[i] for i in run])
            reference += run
        assert walk(queue) == reference


def test_splice_popleft_n_beyond_the_queue_raises_and_changes_nothing():
    answer(FreeKVCacheBlockQueue, "popleft_n", "4.2")
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(IndexError):
        queue.popleft_n(6)
    assert walk(queue) == [0, 1, 2, 3, 4]
    assert queue.popleft_n(0) == [] and walk(queue) == [0, 1, 2, 3, 4]
    assert ids(queue.popleft_n(5)) == [0, 1, 2, 3, 4] and walk(queue) == []
    queue.append_n([])
    assert walk(queue) == []


# --- 3.3 the null block -----------------------------------------------------------


def test_null_block_is_reserved_and_never_handed_out():
    NullBlockPool = answer(block_pool, "NullBlockPool", "4.3")
    pool = NullBlockPool(8)
    null = pool.null_block
    assert null is pool.blocks[0] and null.ref_cnt == 1
    assert null not in list(pool.free_block_queue)
    assert pool.get_num_free_blocks() == 7 and pool.get_usage() == 0.0
    taken = pool.get_new_blocks(7)
    assert null not in taken and pool.get_usage() == 1.0
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(taken))
    assert ids(pool.free_block_queue) == [7, 6, 5, 4, 3, 2, 1]


def test_null_block_is_passed_over_by_free_and_touch():
    NullBlockPool = answer(block_pool, "NullBlockPool", "4.3")
    pool = NullBlockPool(4)
    null = pool.null_block
    table = [null, *pool.get_new_blocks(2)]  # a table whose first place is empty
    child = fork(pool, table)
    assert null.ref_cnt == 1 and table[1].ref_cnt == 2
    pool.touch([null])
    assert null.ref_cnt == 1
    pool.free_blocks(reversed(child))
    pool.free_blocks(reversed(table))
    pool.free_blocks([null, null])  # any number of times: it is never freed
    assert null.ref_cnt == 1 and null.prev_free_block is None
    assert ids(pool.free_block_queue) == [3, 2, 1]
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.0


def test_null_block_pool_needs_a_block_besides_the_null_block():
    NullBlockPool = answer(block_pool, "NullBlockPool", "4.3")
    with pytest.raises(ValueError):
        NullBlockPool(1)
    assert BlockPool(8).get_num_free_blocks() == 8, "BlockPool itself must not change"
