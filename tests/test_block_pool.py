"""The block pool (minillm/block_pool.py, chapter 4): allocation, LRU free queue, ref
counts, fork, copy-on-write.

The unit tests read as the specification. The property test runs random operations
against a plain-Python model of the pool and checks every invariant after each step; the
last test shows that the same state machine catches deliberately broken allocators.
"""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from minillm.block_pool import (
    BlockCopy,
    BlockPool,
    DoubleFreeError,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NoFreeBlocksError,
    copy_on_write,
    fork,
)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def snapshot(pool: BlockPool) -> tuple:
    """A pool's whole state as plain values: (ref_cnt, hash, prev id, next id) per
    block, and the free count.
    """

    def link(b):
        return None if b is None else b.block_id

    return tuple(
        (b.ref_cnt, b.block_hash, link(b.prev_free_block), link(b.next_free_block))
        for b in pool.blocks
    ) + (pool.get_num_free_blocks(),)


# --------------------------------------------------------------------------------------
# -------
# The free queue


def test_free_queue_starts_in_the_given_order_and_links_both_ways():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3] and len(queue) == 4
    assert queue.fake_free_list_head.next_free_block is blocks[0]
    assert queue.fake_free_list_tail.prev_free_block is blocks[3]
    assert all(
        blocks[i].next_free_block is blocks[i + 1]
        and blocks[i + 1].prev_free_block is blocks[i]
        for i in range(3)
    )


def test_free_queue_matches_a_python_list_under_random_operations():
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(20)]
    queue, reference, taken = FreeKVCacheBlockQueue(blocks), list(range(20)), []
    for _ in range(2000):
        op = rng.choice(["popleft", "remove", "append"])
        if op == "popleft" and reference:
            taken.append(queue.popleft().block_id)
            assert taken[-1] == reference.pop(0)
        elif op == "remove" and reference:
            victim = rng.choice(reference)
            queue.remove(blocks[victim])
            reference.remove(victim)
            taken.append(victim)
        elif op == "append" and taken:
            back = taken.pop(rng.randrange(len(taken)))
            queue.append(blocks[back])
            reference.append(back)
        assert ids(queue) == reference and len(queue) == len(reference)
    for i in taken:
        assert blocks[i].prev_free_block is None and blocks[i].next_free_block is None


def test_free_queue_refuses_to_remove_a_block_it_does_not_hold_and_to_pop_when_empty():
    block = KVCacheBlock(0)
    queue = FreeKVCacheBlockQueue([block])
    assert queue.popleft() is block
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    with pytest.raises(IndexError):
        queue.popleft()
    assert len(queue) == 0 and ids(queue) == []


# --------------------------------------------------------------------------------------
# -------
# Allocation and free


def test_new_pool_has_every_block_free_in_id_order():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 5 and pool.get_usage() == 0.0
    assert ids(pool.free_block_queue) == [0, 1, 2, 3, 4]
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_takes_from_the_head_with_ref_cnt_one():
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0]
    assert pool.get_num_free_blocks() == 1 and pool.get_usage() == pytest.approx(5 / 6)
    assert pool.get_new_blocks(0) == []


def test_allocation_that_cannot_be_satisfied_raises_and_changes_nothing():
    pool = BlockPool(8)
    pool.get_new_blocks(5)
    before = snapshot(pool)
    with pytest.raises(
        NoFreeBlocksError, match=r"cannot allocate 4 .* only 3 of 8 are free"
    ) as info:
        pool.get_new_blocks(4)
    assert (info.value.num_requested, info.value.num_free, info.value.num_blocks) == (
        4,
        3,
        8,
    )
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert snapshot(pool) == before


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.free_blocks(b)
    pool.free_blocks(a)
    # least recently freed first
    assert ids(pool.free_block_queue) == [4, 5, 2, 3, 0, 1]
    assert ids(pool.get_new_blocks(3)) == [4, 5, 2]


def test_freeing_a_request_in_reverse_puts_its_tail_block_first_in_line_for_eviction():
    pool = BlockPool(4)
    request = pool.get_new_blocks(4)
    pool.free_blocks(reversed(request))
    assert ids(pool.free_block_queue) == [3, 2, 1, 0]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free_blocks([a[0]])
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError, match="block 0: it is already free"):
        pool.free_blocks([a[0]])
    # a valid block before the bad one is not freed either
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([a[1], a[0]])
    # one reference, given twice
    with pytest.raises(DoubleFreeError, match="held by 1 block table"):
        pool.free_blocks([a[1], a[1]])
    assert snapshot(pool) == before and a[1].ref_cnt == 1


def test_a_block_of_another_pool_is_rejected():
    pool, other = BlockPool(2), BlockPool(2)
    stranger = other.get_new_blocks(1)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.free_blocks(stranger)
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.touch(stranger)
    assert snapshot(pool) == before


def test_touch_adds_a_reference_and_takes_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(5)
    held = pool.get_new_blocks(1)
    pool.touch(held)
    assert held[0].ref_cnt == 2
    pool.touch([pool.blocks[3]])  # a "cache hit" on a free block
    assert pool.blocks[3].ref_cnt == 1 and ids(pool.free_block_queue) == [1, 2, 4]
    assert (
        pool.blocks[3].prev_free_block is None
        and pool.blocks[3].next_free_block is None
    )


def test_a_new_allocation_forgets_what_a_reused_block_cached():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    block.block_hash = ("tokens", 1, 2, 3)
    pool.free_blocks([block])
    # a free block keeps its contents (chapter 11 reuses them)
    assert block.block_hash is not None
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None


# --------------------------------------------------------------------------------------
# -------
# Sharing


def test_fork_shares_every_block_and_counts_the_new_holder():
    pool = BlockPool(6)
    parent = pool.get_new_blocks(3)
    child = fork(pool, parent)
    assert child == parent and child is not parent
    assert [b.ref_cnt for b in parent] == [2, 2, 2] and pool.get_num_free_blocks() == 3
    # the parent finishes: the child keeps every block
    pool.free_blocks(reversed(parent))
    assert [b.ref_cnt for b in child] == [1, 1, 1] and pool.get_num_free_blocks() == 3
    pool.free_blocks(reversed(child))
    assert pool.get_num_free_blocks() == 6


def test_fork_of_a_stale_block_table_is_rejected():
    pool = BlockPool(2)
    table = pool.get_new_blocks(2)
    pool.free_blocks(table)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="free block"):
        fork(pool, table)
    assert snapshot(pool) == before


def test_copy_on_write_copies_a_shared_block_and_leaves_a_private_one_alone():
    pool = BlockPool(6)
    parent = pool.get_new_blocks(2)
    child = fork(pool, parent)
    copy = copy_on_write(pool, child)
    assert copy == BlockCopy(src=1, dst=2)
    assert ids(child) == [0, 2] and ids(parent) == [0, 1]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [2, 1, 1]
    # block 1 is private again: write in place
    assert copy_on_write(pool, parent) is None
    assert copy_on_write(pool, child) is None
    # any index, not only the last
    assert copy_on_write(pool, child, index=0) == BlockCopy(src=0, dst=3)


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing():
    pool = BlockPool(2)
    parent = pool.get_new_blocks(2)
    child = fork(pool, parent)
    before, child_before = snapshot(pool), list(child)
    with pytest.raises(NoFreeBlocksError):
        copy_on_write(pool, child)
    assert snapshot(pool) == before and child == child_before


def test_copy_on_write_of_a_freed_block_is_rejected():
    pool = BlockPool(2)
    table = pool.get_new_blocks(1)
    pool.free_blocks(table)
    with pytest.raises(ValueError, match="stale"):
        copy_on_write(pool, table)


def test_four_samples_of_one_prompt_store_each_distinct_block_once():
    block_size, prompt_len, output_len, n = 16, 1000, 200, 4
    pool = BlockPool(400)
    parent = pool.get_new_blocks(-(-prompt_len // block_size))
    tables = [parent] + [fork(pool, parent) for _ in range(n - 1)]
    copies = []
    for position in range(prompt_len, prompt_len + output_len):
        for table in tables:
            if position % block_size == 0:
                table.extend(pool.get_new_blocks(1))
            elif (copy := copy_on_write(pool, table)) is not None:
                copies.append(copy)
    # 62 full prompt blocks shared; the partial one and 12 new blocks per sample private
    assert pool.num_blocks - pool.get_num_free_blocks() == 62 + n * (1 + 12)
    assert len(copies) == n - 1 and {c.src for c in copies} == {62}
    for table in tables:
        pool.free_blocks(reversed(table))
    assert pool.get_num_free_blocks() == pool.num_blocks


# --------------------------------------------------------------------------------------
# -------
# Random operations against a model


NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / write / free / double-free / revive against
    a plain-Python model.
    """

    pool_class: type[BlockPool] = BlockPool
    fork = staticmethod(fork)
    copy_on_write = staticmethod(copy_on_write)
    steps = teardowns = 0  # invariant checks and completed leak checks, over all runs

    def __init__(self):
        super().__init__()
        self.pool = self.pool_class(NUM_BLOCKS)
        # the block tables, as the pool returned them
        self.tables: dict[int, list[KVCacheBlock]] = {}
        # the model: block ids each sequence should hold...
        self.model_tables: dict[int, list[int]] = {}
        self.model_free = list(range(NUM_BLOCKS))  # ...and the free list, head first
        self.next_seq = 0

    def seq(self, i: int) -> int:
        return sorted(self.tables)[i % len(self.tables)]

    def model_take(self, n: int) -> list[int]:
        taken, self.model_free = self.model_free[:n], self.model_free[n:]
        return taken

    def add_sequence(self, table: list[KVCacheBlock], block_ids: list[int]) -> None:
        self.tables[self.next_seq], self.model_tables[self.next_seq] = table, block_ids
        self.next_seq += 1

    def expect_failure(self, error: type[Exception], call, *args) -> None:
        before = snapshot(self.pool)
        try:
            call(*args)
        except error:
            pass
        else:
            raise AssertionError(
                f"{call.__name__}{args} should have raised {error.__name__}"
            )
        assert snapshot(self.pool) == before, (
            f"a failed {call.__name__} changed the pool"
        )

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > len(self.model_free):
            return self.expect_failure(NoFreeBlocksError, self.pool.get_new_blocks, n)
        table = self.pool.get_new_blocks(n)
        assert ids(table) == self.model_free[:n], "allocation is not from the head"
        self.add_sequence(table, self.model_take(n))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 99))
    def append_block(self, i):
        s = self.seq(i)
        if not self.model_free:
            return self.expect_failure(NoFreeBlocksError, self.pool.get_new_blocks, 1)
        self.tables[s].extend(self.pool.get_new_blocks(1))
        self.model_tables[s].extend(self.model_take(1))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 99))
    def fork_sequence(self, i):
        s = self.seq(i)
        self.add_sequence(
            self.fork(self.pool, self.tables[s]), list(self.model_tables[s])
        )

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 99))
    def write_last_block(self, i):
        s = self.seq(i)
        last = self.model_tables[s][-1]
        holders = sum(block_ids.count(last) for block_ids in self.model_tables.values())
        if holders > 1 and not self.model_free:
            return self.expect_failure(
                NoFreeBlocksError, self.copy_on_write, self.pool, self.tables[s]
            )
        copy = self.copy_on_write(self.pool, self.tables[s])
        if holders == 1:
            assert copy is None, "copy-on-write copied a private block"
        else:
            (dst,) = self.model_take(1)
            assert copy == BlockCopy(src=last, dst=dst), (
                f"expected a copy {last} -> {dst}, got {copy}"
            )
            self.model_tables[s][-1] = dst

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 99))
    def free_sequence(self, i):
        s = self.seq(i)
        self.pool.free_blocks(reversed(self.tables.pop(s)))
        for block_id in reversed(self.model_tables.pop(s)):
            if not any(
                block_id in block_ids for block_ids in self.model_tables.values()
            ):
                self.model_free.append(block_id)

    @precondition(lambda self: self.model_free)
    @rule(j=st.integers(0, 99), with_valid_block=st.booleans())
    def double_free(self, j, with_valid_block):
        batch = [self.pool.blocks[self.model_free[j % len(self.model_free)]]]
        if with_valid_block and self.tables:
            batch.insert(0, self.tables[self.seq(j)][-1])
        self.expect_failure(DoubleFreeError, self.pool.free_blocks, batch)

    @precondition(lambda self: self.model_free)
    @rule(j=st.integers(0, 99))
    # a prefix-cache hit (chapter 11): touch a block waiting in the queue
    def revive_free_block(self, j):
        block_id = self.model_free.pop(j % len(self.model_free))
        self.pool.touch([self.pool.blocks[block_id]])
        self.add_sequence([self.pool.blocks[block_id]], [block_id])

    @invariant()
    def pool_matches_model(self):
        BlockPoolMachine.steps += 1
        check_pool(self.pool, self.tables, self.model_tables, self.model_free)

    def teardown(self):
        if sys.exc_info()[1] is not None:
            return  # a step already failed: report that, not its aftermath
        while self.tables:  # free every sequence: nothing may leak
            self.free_sequence(0)
            check_pool(self.pool, self.tables, self.model_tables, self.model_free)
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks, "blocks leaked"
        BlockPoolMachine.teardowns += 1


def check_pool(
    pool: BlockPool, tables: dict, model_tables: dict, model_free: list[int]
) -> None:
    """Every invariant of the pool, and agreement with the model."""
    assert {s: ids(t) for s, t in tables.items()} == model_tables, (
        "block tables differ from the model"
    )
    holders = Counter(
        block_id for block_ids in model_tables.values() for block_id in block_ids
    )
    ref_cnts = [b.ref_cnt for b in pool.blocks]
    expected = [holders[i] for i in range(pool.num_blocks)]
    assert ref_cnts == expected, f"ref_cnt {ref_cnts} != number of holders {expected}"
    in_use = sum(c > 0 for c in ref_cnts)
    assert pool.get_num_free_blocks() + in_use == pool.num_blocks, (
        "free + in use != total"
    )
    assert len(pool.free_block_queue) == ref_cnts.count(0) == len(model_free), (
        "free count is off"
    )
    queue, forward, block = (
        pool.free_block_queue,
        [],
        pool.free_block_queue.fake_free_list_head,
    )
    while block.next_free_block is not queue.fake_free_list_tail:
        nxt = block.next_free_block
        assert nxt is not None and nxt.prev_free_block is block, (
            "free queue links disagree"
        )
        forward.append(nxt.block_id)
        assert len(forward) <= pool.num_blocks, "free queue has a cycle"
        block = nxt
    assert queue.fake_free_list_tail.prev_free_block is block, (
        "tail sentinel is not linked to the last block"
    )
    backward, block = [], queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        backward.append(block.block_id)
        block = block.prev_free_block
    assert backward == forward[::-1], "free queue differs walked backwards"
    assert forward == model_free, (
        f"free queue {forward} is not the LRU order {model_free}"
    )
    assert all(
        b.prev_free_block is None and b.next_free_block is None
        for b in pool.blocks
        if b.ref_cnt
    ), "a block in use is still linked into the free queue"


def machine_for(
    pool_class=BlockPool, fork_fn=fork, cow_fn=copy_on_write
) -> type[BlockPoolMachine]:
    attrs = {
        "pool_class": pool_class,
        "fork": staticmethod(fork_fn),
        "copy_on_write": staticmethod(cow_fn),
    }
    return type(f"{pool_class.__name__}Machine", (BlockPoolMachine,), attrs)


def property_settings(max_examples: int, steps: int, derandomize: bool) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=derandomize,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_random_operations_keep_every_invariant():
    BlockPoolMachine.steps = BlockPoolMachine.teardowns = 0
    run_state_machine_as_test(
        BlockPoolMachine, settings=property_settings(150, 40, derandomize=False)
    )
    assert BlockPoolMachine.steps >= 2000, BlockPoolMachine.steps
    assert BlockPoolMachine.teardowns >= 150, (
        "the leak check at the end of each run did not run"
    )


# --------------------------------------------------------------------------------------
# -------
# Broken allocators the state machine must catch


class EagerFreePool(BlockPool):
    """A free returns the block to the queue at once, even if another sequence still
    holds it.
    """

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        self._check_can_free(blocks)
        for block in blocks:
            if block.ref_cnt > 0:
                block.ref_cnt = 0
                self.free_block_queue.append(block)


class LeakyPool(BlockPool):
    """A block whose last reference is dropped never goes back on the free queue."""

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        self._check_can_free(blocks)
        for block in blocks:
            block.ref_cnt -= 1


class NoDecrementPool(BlockPool):
    """free_blocks checks its input and then does nothing: ref_cnt never goes down."""

    def free_blocks(self, ordered_blocks):
        self._check_can_free(list(ordered_blocks))


class UncheckedFreePool(BlockPool):
    """No double-free check: a second free drives ref_cnt negative and queues the
    block twice.
    """

    def free_blocks(self, ordered_blocks):
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt <= 0:
                self.free_block_queue.append(block)


class HalfwayAllocationPool(BlockPool):
    """Allocates block by block and fails when the queue runs dry: a failed call
    keeps what it took.
    """

    def get_new_blocks(self, num_blocks):
        blocks = []
        for _ in range(num_blocks):
            if not len(self.free_block_queue):
                raise NoFreeBlocksError(num_blocks, len(blocks), self.num_blocks)
            block = self.free_block_queue.popleft()
            block.ref_cnt = 1
            blocks.append(block)
        return blocks


class MostRecentlyFreedFirstPool(BlockPool):
    """Freed blocks go to the head of the queue: reused first (MRU), breaking the LRU
    order.
    """

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        self._check_can_free(blocks)
        queue = self.free_block_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                first = queue.fake_free_list_head.next_free_block
                block.prev_free_block, block.next_free_block = (
                    queue.fake_free_list_head,
                    first,
                )
                queue.fake_free_list_head.next_free_block = first.prev_free_block = (
                    block
                )
                queue.num_free_blocks += 1


class TouchLeavesBlockQueuedPool(BlockPool):
    """touch revives a free block without taking it out of the queue: it can be
    handed out twice.
    """

    def touch(self, blocks):
        for block in blocks:
            block.ref_cnt += 1


def fork_without_counting(pool, block_table):
    return list(block_table)


def write_in_place(pool, block_table, index=-1):
    return None


BROKEN = {
    "free returns shared blocks": machine_for(EagerFreePool),
    "free leaks blocks": machine_for(LeakyPool),
    "free never decrements ref_cnt": machine_for(NoDecrementPool),
    "double free is not detected": machine_for(UncheckedFreePool),
    "failed allocation keeps blocks": machine_for(HalfwayAllocationPool),
    "free queue is MRU, not LRU": machine_for(MostRecentlyFreedFirstPool),
    "touch leaves the block queued": machine_for(TouchLeavesBlockQueuedPool),
    "fork does not count the child": machine_for(fork_fn=fork_without_counting),
    "a shared block is written in place": machine_for(cow_fn=write_in_place),
}


@pytest.mark.parametrize("bug", BROKEN)
def test_the_state_machine_catches_a_broken_allocator(bug):
    # one of the machine's checks, not a crash
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(
            BROKEN[bug], settings=property_settings(300, 30, derandomize=True)
        )
    failing_steps = [
        line
        for line in getattr(info.value, "__notes__", [])
        if line.startswith("state.")
    ]
    assert failing_steps, "hypothesis should report the failing sequence of rules"
