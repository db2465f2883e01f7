"""Worked solutions to chapter 4's exercises (chapters/04_block_allocator.md).

Each answer is installed into minillm.block_pool the way a reader's exported cell
would put it there; the checks are exercises/test_04_block_allocator.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import minillm.block_pool as block_pool
from minillm.block_pool import (
    BlockCopy,
    BlockPool,
    KVCacheBlock,
    NoFreeBlocksError,
    copy_on_write,
)


# 3.1
def prepare_decode(
    pool: BlockPool,
    block_tables: list[list[KVCacheBlock]],
    num_tokens: list[int],
    block_size: int,
) -> list[BlockCopy]:
    """Room for one more token in every table, all or nothing: count, then act."""
    full = [n == len(t) * block_size for t, n in zip(block_tables, num_tokens)]
    # a partly filled last block held by k tables of the batch and ref_cnt tables in
    # all: k copies if someone outside the batch holds it too, else k - 1 (the last
    # sharer writes in place)
    sharers = Counter(t[-1] for t, f in zip(block_tables, full) if not f)
    copies = sum(k if b.ref_cnt > k else k - 1 for b, k in sharers.items())
    needed = sum(full) + copies
    if needed > pool.get_num_free_blocks():
        raise NoFreeBlocksError(needed, pool.get_num_free_blocks(), pool.num_blocks)
    # from here on nothing can fail
    orders = []
    for table, is_full in zip(block_tables, full):
        if is_full:
            table.extend(pool.get_new_blocks(1))
        elif (copy := copy_on_write(pool, table)) is not None:
            orders.append(copy)
    return orders


# 3.2
class FreeKVCacheBlockQueue(block_pool.FreeKVCacheBlockQueue):
    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The n blocks at the head, in order and unlinked; the list is cut once."""
        if n > self.num_free_blocks:
            raise IndexError(f"popleft_n({n}) from a queue of {self.num_free_blocks}")
        head, blocks = self.fake_free_list_head, []
        block = head.next_free_block
        for _ in range(n):
            blocks.append(block)
            block = block.next_free_block
        head.next_free_block, block.prev_free_block = block, head  # the one cut
        for b in blocks:
            b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= n
        return blocks

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Link the run to itself, then splice it in before the tail sentinel."""
        if not blocks:
            return
        for a, b in zip(blocks, blocks[1:]):
            a.next_free_block, b.prev_free_block = b, a
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block, blocks[0].prev_free_block = blocks[0], last
        blocks[-1].next_free_block, tail.prev_free_block = tail, blocks[-1]
        self.num_free_blocks += len(blocks)


# 3.3
class NullBlockPool(BlockPool):
    """Block 0 is the null block: held by the pool itself, never handed out."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"a pool with a null block needs num_blocks >= 2, got {num_blocks}"
            )
        super().__init__(num_blocks)
        self.null_block = self.blocks[0]
        self.free_block_queue.remove(self.null_block)
        self.null_block.ref_cnt = 1

    def get_usage(self) -> float:
        # the null block is never usable: divide by the blocks that are
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        super().free_blocks(b for b in ordered_blocks if b is not self.null_block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        super().touch(b for b in blocks if b is not self.null_block)


block_pool.prepare_decode = prepare_decode
block_pool.FreeKVCacheBlockQueue = FreeKVCacheBlockQueue
block_pool.NullBlockPool = NullBlockPool

SOLUTIONS = {
    "prepare_decode": prepare_decode,
    "splice": FreeKVCacheBlockQueue,
    "null_block": NullBlockPool,
}
