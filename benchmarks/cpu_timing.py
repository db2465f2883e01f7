"""Timing and operator counting for the chapters' CPU measurements.

`best_of(fn)` is the shortest of a few wall-clock runs of `fn()`, in seconds;
`op_calls(fn)` counts the ATen operator calls `fn()` makes, through a torch dispatch
mode (chapter 5 explains it): a number that does not depend on the machine.
"""

from __future__ import annotations

import time

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Counts the ATen operator calls made inside a `with` block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def op_calls(fn) -> int:
    """The number of ATen operator calls `fn()` makes."""
    with CountOps() as counter:
        fn()
    return counter.calls


def best_of(fn, repeats: int = 3) -> float:
    """The shortest of `repeats` wall-clock runs of `fn()`, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
