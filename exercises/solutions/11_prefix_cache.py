"""Worked solutions to chapter 11's exercises (chapters/11_prefix_cache.md).

Each answer is installed into minillm.prefix_cache the way a reader's exported cell
would put it there; the checks are exercises/test_11_prefix_cache.py.
"""

from __future__ import annotations

import hashlib
import pickle

from minillm import prefix_cache
from minillm.prefix_cache import PrefixCachingBlockPool
from minillm.request import Request


# 10.1
def sha256_hash(key: tuple) -> int:
    """SHA-256 of the pickled key, cut to 64 bits: the same in every process (pickle
    does not depend on PYTHONHASHSEED), and no accidental collisions."""
    return int.from_bytes(hashlib.sha256(pickle.dumps(key)).digest()[:8], "big")


# 10.2
def count_stranded(pool: PrefixCachingBlockPool) -> int:
    """Cached blocks no lookup can reach: somewhere up their chain of parents is a
    BlockHash that no cached block holds any more. Reads, never writes."""
    cached = [
        b for by_id in pool.cached_block_hash_to_block.values() for b in by_id.values()
    ]
    held = {id(b.block_hash) for b in cached}  # lookups compare parents by identity
    reachable: dict[int, bool] = {}

    def is_reachable(h) -> bool:
        chain = []  # walk up to a known answer, then fill the answers in going down
        while h is not None and id(h) not in reachable:
            if id(h) not in held:
                reachable[id(h)] = False
                break
            chain.append(h)
            h = h.parent
        answer = True if h is None else reachable[id(h)]
        for link in chain:
            reachable[id(link)] = answer
        return answer

    return sum(not is_reachable(b.block_hash) for b in cached)


# 10.3
def order_by_cached_prefix(kv_cache_manager, requests: list[Request]) -> list[Request]:
    """Most cached tokens first, ties in the given order (sorted is stable). Looking
    is not admitting: the hit counters are put back."""
    counters = kv_cache_manager.prefix_cache_queries, kv_cache_manager.prefix_cache_hits
    cached = {id(r): kv_cache_manager.get_computed_blocks(r)[1] for r in requests}
    kv_cache_manager.prefix_cache_queries, kv_cache_manager.prefix_cache_hits = counters
    return sorted(requests, key=lambda r: -cached[id(r)])


prefix_cache.sha256_hash = sha256_hash
prefix_cache.count_stranded = count_stranded
prefix_cache.order_by_cached_prefix = order_by_cached_prefix

SOLUTIONS = {
    "sha256": sha256_hash,
    "stranded": count_stranded,
    "order_by_cached_prefix": order_by_cached_prefix,
}
