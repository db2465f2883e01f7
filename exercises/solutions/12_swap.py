"""Worked solutions to chapter 12's exercises (chapters/12_swap.md).

Each answer is installed into minillm.swap the way a reader's exported cell would put
it there; the checks are exercises/test_12_swap.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from minillm import swap
from minillm.scheduler import Scheduler
from minillm.swap import SwapScheduler


# 11.1
class ThresholdSwapScheduler(SwapScheduler):
    """Swap a victim with at least min_swap_tokens computed tokens; recompute the
    others, whose few blocks are cheaper to compute again than to copy twice."""

    def __init__(self, config, kv_cache_manager, swap_space, min_swap_tokens: int = 0):
        super().__init__(config, kv_cache_manager, swap_space)
        self.min_swap_tokens = min_swap_tokens

    def _preempt(self, request) -> None:
        if request.num_computed_tokens < self.min_swap_tokens:
            Scheduler._preempt(self, request)  # chapter 6's: drop and recompute
        else:
            super()._preempt(request)  # SwapScheduler's swap (or its own fallback)


# 11.2
def swap_blocks_contiguous(
    src: Tensor, dst: Tensor, block_mapping: Iterable[tuple[int, int]]
) -> None:
    """swap_blocks, one copy per layer and run: within a layer a run of blocks is
    one contiguous piece of memory, so each copy is a single DMA transfer."""
    runs: list[list[int]] = []  # [first src, first dst, length], as swap_blocks
    for s, d in block_mapping:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    for s, d, n in runs:
        for layer in range(src.shape[0]):
            dst[layer, d : d + n].copy_(src[layer, s : s + n], non_blocking=True)


swap.ThresholdSwapScheduler = ThresholdSwapScheduler
swap.swap_blocks_contiguous = swap_blocks_contiguous

SOLUTIONS = {
    "threshold": ThresholdSwapScheduler,
    "contiguous": swap_blocks_contiguous,
}
