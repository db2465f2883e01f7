"""Checks for chapter 12's exercises (swapping). See _check.py."""

from __future__ import annotations

import random

import torch
from _check import answer, attempted
from torch.overrides import TorchFunctionMode

from minillm import swap
from minillm.kv_cache_manager import KVCacheManager
from minillm.request import Request, RequestStatus
from minillm.scheduler import Scheduler, SchedulerConfig
from minillm.swap import SwapSpace, swap_blocks

# 11.1 ---------------------------------------------------------------------------------

MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    """The chapter's problem: 16 prompts of 3 to 60 tokens."""
    rng = random.Random(0)
    return [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(16)
    ]


def _serve(scheduler) -> int:
    """Run the scheduler to the end with a stand-in model whose next token is a
    function of the request and its length; returns the tokens computed twice.
    """
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt))
    computed, outputs = 0, {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        computed += out.total_num_scheduled_tokens
        sampled = {
            r.request_id: [(int(r.request_id) * 31 + r.num_tokens) % 1000]
            for r in out.scheduled_requests
            if out.samples(r)
        }
        done = []
        for r in scheduler.update_from_output(out, sampled):
            if r.num_output_tokens == MAX_TOKENS:
                outputs[r.request_id] = list(r.output_token_ids)
                done.append(r.request_id)
        scheduler.finish_requests(done, RequestStatus.FINISHED_LENGTH_CAPPED)
    needed = sum(len(p) + MAX_TOKENS - 1 for p in prompts)
    assert len(outputs) == len(prompts), "every request finishes"
    return computed - needed


def _parts(num_cpu_blocks=64):
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=20, max_model_len=96
    )
    return config, KVCacheManager(48, 4), SwapSpace(num_cpu_blocks)


def test_threshold_swap_scheduler():
    cls = answer(swap, "ThresholdSwapScheduler", "12.1")
    config, kv, _ = _parts()
    recompute_only = _serve(Scheduler(config, kv))
    recomputed = {}
    for threshold in (0, 17, 10**6):
        log = []

        class Recording(cls):
            def _preempt(self, request):
                before = request.num_computed_tokens
                super()._preempt(request)
                swapped = request in self.swapped
                log.append((before, swapped, request.num_computed_tokens))

        config, kv, space = _parts()
        scheduler = attempted(Recording, "12.1", config, kv, space, threshold)
        recomputed[threshold] = _serve(scheduler)
        assert log, "this workload preempts"
        if threshold == 17:  # the boundary: a victim with exactly 17 tokens swaps
            assert any(before == threshold for before, _, _ in log)
        for before, swapped, after in log:
            if before < threshold:
                assert not swapped and after == 0, (threshold, before, "recompute")
            else:
                assert swapped and after == before, (threshold, before, "swap")
        # nothing leaked, on either side
        assert not kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == 48
        assert not space.req_to_blocks and space.get_num_free_blocks() == 64
    # swapping everyone recomputes nothing; recomputing everyone is chapter 6's
    # scheduler, token for token
    assert recomputed[0] == 0 and recomputed[10**6] == recompute_only > 0
    assert 0 < recomputed[17] < recompute_only


# 11.2 ---------------------------------------------------------------------------------


class _Copies(TorchFunctionMode):
    """Records every Tensor.copy_ call: (destination, source)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.calls.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def test_swap_blocks_contiguous():
    fn = answer(swap, "swap_blocks_contiguous", "12.2")
    g = torch.Generator().manual_seed(0)
    layers = 3
    src = torch.randn(layers, 10, 4, 2, 8, generator=g)
    # runs (4, 0..2), (0, 3), (7, 4..5) and a lone block
    mapping = [(4, 0), (5, 1), (6, 2), (0, 3), (7, 4), (8, 5), (2, 7)]
    runs = 4
    expected = torch.zeros(layers, 8, 4, 2, 8)
    swap_blocks(src, expected, mapping)
    dst = torch.zeros(layers, 8, 4, 2, 8)
    with _Copies() as copies:
        attempted(fn, "12.2", src, dst, mapping)
    assert torch.equal(dst, expected), "the same blocks as swap_blocks"
    assert copies.calls, "copies with Tensor.copy_, as swap_blocks does"
    for d, s in copies.calls:
        assert d.is_contiguous() and s.is_contiguous(), "every copy is contiguous"
    assert len(copies.calls) <= layers * runs, "one copy per layer and run"
    # and back: an empty mapping copies nothing
    with _Copies() as none:
        fn(src, dst, [])
    assert not none.calls
