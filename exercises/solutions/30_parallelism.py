"""Worked solutions to chapter 30's exercises (chapters/30_parallelism.md).

Installed into minillm.parallel's modules the way a reader's exported cells would put
them there; the checks are exercises/test_30_parallelism.py.
"""

from __future__ import annotations

from minillm.model import ModelConfig
from minillm.parallel import distributed, pp, tp


# 29.1
def peak_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward has run and whose backward has not: a
    stage's activation memory, in micro-batches."""
    in_flight = peak = 0
    for kind, _ in order:
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    return peak


# 29.2
def kv_cache_bytes_per_rank(
    config: ModelConfig,
    tp_size: int,
    num_blocks: int,
    block_size: int,
    dtype_bytes: int,
) -> int:
    """One rank's paged cache: keys and values of its KV heads (at least one: with
    fewer KV heads than ranks, each is replicated), every layer."""
    n_kv = max(1, config.num_key_value_heads // tp_size)
    per_cache = config.num_hidden_layers * num_blocks * block_size * n_kv
    return 2 * per_cache * config.head_dim * dtype_bytes  # keys and values


# 29.3
def ring_all_reduce_bytes(num_bytes: int, p: int) -> int:
    """Bytes each rank sends: a reduce-scatter and an all-gather, each p - 1 steps
    of a 1/p chunk, so 2 (p - 1) / p of the tensor."""
    return 2 * (p - 1) * num_bytes // p


pp.peak_in_flight = peak_in_flight
tp.kv_cache_bytes_per_rank = kv_cache_bytes_per_rank
distributed.ring_all_reduce_bytes = ring_all_reduce_bytes

SOLUTIONS = {
    "peak_in_flight": peak_in_flight,
    "kv_cache_bytes": kv_cache_bytes_per_rank,
    "ring": ring_all_reduce_bytes,
}
