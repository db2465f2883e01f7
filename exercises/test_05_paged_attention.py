"""Checks for chapter 5's exercises (chapters/05_paged_attention.md, "Exercises").

Each test skips until its answer exists in minillm/attention.py, then checks it.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minillm.attention as attention
from _check import answer
from minillm.attention import paged_attention_ref, visibility_mask
from minillm.model import build_attention_metadata


def random_step(context_lens, query_lens, block_size=4, n_heads=8, n_kv=2, D=8, seed=0):
    """q, a NaN-poisoned paged cache holding random K/V for every sequence's tokens,
    and the metadata of the step.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3  # a few blocks nobody owns
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in per_seq]
    key_cache = torch.full((num_blocks, block_size, n_kv, D), float("nan"))
    value_cache = torch.full((num_blocks, block_size, n_kv, D), float("nan"))
    for table, seq_len in zip(tables, seq_lens):
        for pos in range(seq_len):  # the slots past seq_len stay NaN
            block, offset = table[pos // block_size], pos % block_size
            key_cache[block, offset] = torch.randn(n_kv, D, generator=gen)
            value_cache[block, offset] = torch.randn(n_kv, D, generator=gen)
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), n_heads, D, generator=gen)
    return q, key_cache, value_cache, md


def random_batches(num=12, seed=0):
    rng = random.Random(seed)
    for trial in range(num):
        n = rng.randint(1, 6)
        kinds = [rng.choice(["decode", "prefill", "chunk"]) for _ in range(n)]
        context = [0 if k == "prefill" else rng.randint(1, 40) for k in kinds]
        query = [1 if k == "decode" else rng.randint(1, 12) for k in kinds]
        yield random_step(context, query, block_size=rng.choice([1, 4, 5]), seed=trial)


class LargestFloatTensor(TorchDispatchMode):
    """The element count of the largest floating-point tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(fn, *args) -> int:
    with LargestFloatTensor() as mode:
        fn(*args)
    return mode.numel


def assert_matches_reference(fn, atol=1e-5):
    for q, key_cache, value_cache, md in random_batches():
        expected = paged_attention_ref(q, key_cache, value_cache, md)
        out = fn(q, key_cache, value_cache, md)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert torch.isfinite(out).all(), "a NaN from a slot no table maps got through"
        assert (out - expected).abs().max() < atol


def test_split_batch():
    """4.1: decodes and prefills attended separately, stitched back in batch order."""
    split = answer(attention, "paged_attention_split", "5.1")
    assert_matches_reference(split)
    for context, query in [([30] * 5, [1] * 5), ([0, 0], [7, 9])]:  # one half empty
        args = random_step(context, query, seed=1)
        assert (split(*args) - paged_attention_ref(*args)).abs().max() < 1e-5
    # 7 decodes after 200 tokens each, and one 200-token prefill
    args = random_step([200] * 7 + [0], [1] * 7 + [200], seed=2)
    assert (split(*args) - paged_attention_ref(*args)).abs().max() < 1e-5
    padded, unpadded = (
        largest_tensor(paged_attention_ref, *args),
        largest_tensor(split, *args),
    )
    assert unpadded * 4 <= padded, (
        f"the largest tensor has {unpadded} elements, the padded reference's "
        f"{padded}: are the decodes still padded to the prefill?"
    )


def test_online_softmax():
    """4.2: one block of scores at a time, rescaled as the running maximum grows."""
    online = answer(attention, "paged_attention_online", "5.2")
    assert_matches_reference(online)
    # long contexts, small blocks: the full score matrix dwarfs one block of it
    args = random_step([90, 40, 0, 70], [1, 1, 6, 3], block_size=4, seed=3)
    assert (online(*args) - paged_attention_ref(*args)).abs().max() < 1e-5
    q, _, _, md = args
    full_scores = md.num_seqs * q.shape[1] * md.max_query_len * md.max_seq_len
    largest = largest_tensor(online, *args)
    assert largest * 2 < full_scores, (
        f"a tensor of {largest} elements, the full score matrix has {full_scores}: "
        "hold one block of scores at a time"
    )


def test_sliding_window():
    """4.3: a query at position p sees keys p - W < l <= p, and none past seq_len."""
    if "sliding_window" not in inspect.signature(visibility_mask).parameters:
        pytest.skip("exercise 5.3: visibility_mask has no sliding_window argument yet")
    for _, _, _, md in random_batches(num=8, seed=4):
        assert torch.equal(
            visibility_mask(md, sliding_window=None), visibility_mask(md)
        )
        starts, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        for window in (1, 2, 5, 17):
            mask = visibility_mask(md, sliding_window=window)
            assert mask.shape == (md.num_seqs, md.max_query_len, md.max_seq_len)
            for i, seq_len in enumerate(seq_lens):
                n = starts[i + 1] - starts[i]
                for j in range(n):  # the real rows; padded rows are dropped anyway
                    p = seq_len - n + j
                    expected = [p - window < k <= p for k in range(md.max_seq_len)]
                    assert mask[i, j].tolist() == expected, (i, j, window)
