"""Checks for chapter 30's exercises (chapters/30_parallelism.md, "Exercises")."""

import torch
from _check import answer

from minillm.kv_cache import PagedKVCache
from minillm.parallel import distributed, pp, tp
from minillm.parallel.distributed import Group
from minillm.tiny import TINY_CONFIG
from minillm.model import CausalLM


def test_peak_in_flight():
    """18.1: GPipe holds all m micro-batches; 1F1B at most p - stage."""
    peak_in_flight = answer(pp, "peak_in_flight", "30.1")
    for p, m in ((2, 4), (4, 8), (4, 2)):
        for stage in range(p):
            assert peak_in_flight(pp.gpipe_schedule(stage, p, m)) == m
            one_f = pp.one_f_one_b_schedule(stage, p, m)
            assert peak_in_flight(one_f) == min(m, p - stage)
    assert peak_in_flight([("F", 0), ("B", 0), ("F", 1), ("B", 1)]) == 1


def test_kv_cache_bytes_per_rank():
    """18.2: the bytes of a rank's share of the paged cache, as allocated."""
    kv_cache_bytes_per_rank = answer(tp, "kv_cache_bytes_per_rank", "30.2")
    for size in (1, 2, 4):
        shard = tp.shard_model(CausalLM(TINY_CONFIG), Group(list(range(size)), 0))
        cache = PagedKVCache(shard.config, 8, 16)
        got = kv_cache_bytes_per_rank(TINY_CONFIG, size, 8, 16, 4)
        assert got == cache.key_cache.nbytes + cache.value_cache.nbytes


def test_ring_all_reduce_bytes():
    """18.3: 2 (p - 1) / p of the tensor, per rank."""
    ring_all_reduce_bytes = answer(distributed, "ring_all_reduce_bytes", "30.3")
    assert ring_all_reduce_bytes(1024, 1) == 0
    assert ring_all_reduce_bytes(1024, 2) == 1024
    assert ring_all_reduce_bytes(1024, 4) == 1536
    assert ring_all_reduce_bytes(8 * 4096, 8) == 2 * 7 * 4096
    assert torch.is_tensor(torch.zeros(1))  # the module imports without a GPU
