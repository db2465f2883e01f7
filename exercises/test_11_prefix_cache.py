"""Checks for chapter 11's exercises (prefix caching). See _check.py."""

from __future__ import annotations

import os
import subprocess
import sys

from _check import answer, attempted

from minillm import prefix_cache
from minillm.prefix_cache import PrefixCachingKVCacheManager
from minillm.radix_cache import RadixKVCacheManager
from minillm.request import Request


def admit_and_compute(kv, request: Request) -> int:
    """Admit a request as the scheduler does, compute its whole prompt, cache it."""
    blocks, num_cached = kv.get_computed_blocks(request)
    kv.allocate_slots(
        request, request.num_tokens - num_cached, new_computed_blocks=blocks
    )
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    return num_cached


# 10.1 ---------------------------------------------------------------------------------

# a first block's key with a cache salt: a string, which the built-in hash salts per
# process
SALTED_KEY = ((), (1, 2, 3, 4), ("tenant-7",))


def _in_fresh_process(hashseed: str) -> int:
    code = (
        "from minillm.prefix_cache import sha256_hash\n"
        f"print(sha256_hash({SALTED_KEY!r}))"
    )
    env = {
        **os.environ,
        "PYTHONHASHSEED": hashseed,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_sha256_hash():
    sha256_hash = answer(prefix_cache, "sha256_hash", "11.1")
    value = attempted(sha256_hash, "11.1", SALTED_KEY)
    assert isinstance(value, int) and 0 <= value < 2**64, "an unsigned 64-bit int"
    # the same in every process, whatever Python's string-hash seed
    assert _in_fresh_process("1") == _in_fresh_process("2") == value
    # keys the built-in hash maps to one value (-1 and -2, 0 and 2**61 - 1) and a
    # few thousand others: no two alike
    keys = [((), (-1,), ()), ((), (-2,), ()), ((), (0,), ()), ((), (2**61 - 1,), ())]
    keys += [(h, (t, t + 1), ()) for h in range(50) for t in range(40)]
    assert len({sha256_hash(k) for k in keys}) == len(keys)
    # a drop-in for the manager: the same hits as the built-in hash
    hits = []
    for fn in (hash, sha256_hash):
        kv = PrefixCachingKVCacheManager(num_blocks=16, block_size=4, hash_function=fn)
        first = Request("a", list(range(13)))
        admit_and_compute(kv, first)
        kv.free(first)
        hits.append(admit_and_compute(kv, Request("b", list(range(9)) + [50, 51])))
        assert kv.block_pool.num_collisions == 0
    assert hits == [8, 8]


# 10.2 ---------------------------------------------------------------------------------


def test_count_stranded():
    count_stranded = answer(prefix_cache, "count_stranded", "11.2")
    kv = PrefixCachingKVCacheManager(num_blocks=10, block_size=4)
    pool = kv.block_pool
    chain = Request("chain", list(range(17)))  # 4 full blocks: 0 1 2 3, and a partial
    admit_and_compute(kv, chain)
    blocks = list(kv.req_to_blocks["chain"])
    kv.free(chain)
    assert attempted(count_stranded, "11.2", pool) == 0
    # blocks 2 and 3 used again (by a request that shares them, say): they move to
    # the tail of the free queue, behind their parent, block 1
    pool.touch(blocks[2:4])
    pool.free_blocks(blocks[2:4])
    # evict everything in front of block 1, and block 1 itself
    pool.get_new_blocks(list(pool.free_block_queue).index(blocks[1]) + 1)
    assert blocks[1].block_hash is None and blocks[3].block_hash is not None
    state = _state(kv)
    # 2's parent is gone; 3's parent, 2, is still cached but unreachable itself
    assert count_stranded(pool) == 2
    assert _state(kv) == state, "counting changed the pool"
    # a lookup indeed stops at the gap
    assert kv.get_computed_blocks(Request("again", list(range(17))))[1] == 4
    # block 0 is reachable; evicting it strands nothing more (it has no children left)
    pool.get_new_blocks(list(pool.free_block_queue).index(blocks[0]) + 1)
    assert count_stranded(pool) == 2


# 10.3 ---------------------------------------------------------------------------------


def _cache_a_prompt(kv) -> None:
    a = Request("a", list(range(13)))  # three full blocks of 4
    admit_and_compute(kv, a)
    kv.free(a)


def _state(kv):
    pool = kv.block_pool
    return (
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        getattr(getattr(kv, "tree", None), "evictable_size", None),
        getattr(getattr(kv, "tree", None), "protected_size", None),
    )


def test_order_by_cached_prefix():
    order = answer(prefix_cache, "order_by_cached_prefix", "11.3")
    for manager in (PrefixCachingKVCacheManager, RadixKVCacheManager):
        kv = manager(num_blocks=16, block_size=4)
        _cache_a_prompt(kv)
        waiting = [
            Request("none", [90, 91, 92, 93, 94]),  # 0 cached tokens
            Request("four", [0, 1, 2, 3, 94, 95]),  # 4
            Request("eight", list(range(8)) + [99]),  # 8
            Request("twelve", list(range(13))),  # 12: the whole of a but its last token
            Request("eight too", list(range(8)) + [98, 97]),  # 8, after "eight"
            Request("four too", [0, 1, 2, 3, 7]),  # 4
        ]
        state = _state(kv)
        ordered = attempted(order, "11.3", kv, list(waiting))
        assert [r.request_id for r in ordered] == [
            "twelve",
            "eight",
            "eight too",
            "four",
            "four too",
            "none",
        ], manager.__name__
        assert _state(kv) == state, f"{manager.__name__}: looking changed the cache"
        # still the same requests, the list given is not consumed
        assert sorted(map(id, ordered)) == sorted(map(id, waiting))
