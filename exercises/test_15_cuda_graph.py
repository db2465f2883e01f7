"""Checks for chapter 15's exercises (chapters/15_cuda_graph.md, "Exercises")."""

import pytest
import torch
from _check import answer

from minillm import cuda_graph
from minillm.config import EngineConfig
from minillm.kv_cache import reshape_and_cache


def test_padding_fraction():
    """11.1: the share of padded rows among the rows the replays compute."""
    padding_fraction = answer(cuda_graph, "padding_fraction", "15.1")
    assert padding_fraction([1, 2, 4, 8, 16], [3, 5, 13]) == pytest.approx(7 / 28)
    assert padding_fraction([1, 2, 4, 8, 16], [1, 2, 4, 8, 16]) == 0
    assert padding_fraction([4, 16], [1, 5]) == pytest.approx((3 + 11) / (4 + 16))
    batches = list(range(1, 257))
    default = padding_fraction(cuda_graph.default_capture_sizes(256), batches)
    powers = padding_fraction([2**k for k in range(9)], batches)
    print(
        f"padded rows, batches 1-256: default buckets {default:.1%}, powers of two "
        f"{powers:.1%}"
    )
    assert default < powers


def test_scratch_block_not_needed():
    """11.2: slot -1 writes nothing, and the runner keeps no block back."""
    from minillm.gpu_model_runner import GPUModelRunner

    key_cache = torch.zeros(3, 4, 2, 8)
    value_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, -1, 2])
    try:
        reshape_and_cache(key, value, key_cache, value_cache, slots)
    except (IndexError, RuntimeError):
        pytest.skip("exercise 15.2: reshape_and_cache does not skip slot -1 yet")
    flat_k = key_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[2], key[2])
    written = (flat_k != 0).any(-1).any(-1)
    assert written.sum() == 2, "slot -1 wrote somewhere (the last slot, say)"
    parts = {"device": "cuda", "attention_backend": "triton", "persistent_batch": True}
    assert GPUModelRunner.num_reserved_blocks(EngineConfig(), parts) == 0
