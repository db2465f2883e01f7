"""Swap preemption (chapter 12): outputs equal to recompute's, no recomputation, no
block leaks.
"""

import logging
import random

import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from hf_models import MODELS
from helpers import TIGHT, mixed_prompts

from minillm.block_pool import NoFreeBlocksError
from minillm.config import EngineConfig
from minillm.kv_cache import PagedKVCache
from minillm.kv_cache_manager import KVCacheManager
from minillm.llm import LLM
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler, SchedulerConfig
from minillm.swap import SwapScheduler, SwapSpace, Swapper

transformers.logging.set_verbosity_error()
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def assert_no_leaks(llm):
    kv, sched = llm.engine.kv_cache_manager, llm.engine.scheduler
    assert not kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    if isinstance(sched, SwapScheduler):
        space = sched.swap_space
        assert (
            not sched.swapped
            and not space.req_to_blocks
            and space.get_num_free_blocks() == space.num_blocks
        )


def run_counting(llm, prompts, params=GREEDY):
    """Greedy outputs, and the total number of tokens the model computed (every
    step's scheduled tokens).
    """
    total = [0]
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        total[0] += out.total_num_scheduled_tokens
        return out

    llm.engine.scheduler.schedule = counting
    outputs = [
        o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    return outputs, total[0]


def compare_modes(model_path, prompts, **kwargs):
    needed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    recompute = LLM(model_path, **TIGHT, **kwargs)
    swap = LLM(model_path, **TIGHT, **kwargs, preemption_mode="swap")
    assert (
        isinstance(recompute.engine.scheduler, Scheduler)
        and not hasattr(recompute.engine.scheduler, "swapper")
        and swap.engine.scheduler.swapper is not None
    )
    expected, recomputed_total = run_counting(recompute, prompts)
    got, swapped_total = run_counting(swap, prompts)
    sched = swap.engine.scheduler
    assert got == expected
    assert recompute.engine.num_preemptions > 0 and sched.num_swapped_out > 0
    assert (
        sched.num_swapped_in == sched.num_swapped_out and sched.num_swap_fallbacks == 0
    )
    # with swap, nothing is computed twice
    assert swapped_total == needed < recomputed_total
    assert_no_leaks(recompute), assert_no_leaks(swap)


def test_config_validates_preemption_mode():
    assert EngineConfig().preemption_mode == "recompute"
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="offload")
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(preemption_mode="swap", prefix_cache_impl="hash")


def test_swap_matches_recompute_on_tiny_model_and_computes_fewer_tokens(tiny):
    compare_modes(None, mixed_prompts(16, tiny[1].vocab_size, seed=1))


@pytest.mark.parametrize("cls, config", MODELS)
def test_swap_matches_recompute_on_hf_models(hf_checkpoint, cls, config):
    _, folder = hf_checkpoint(cls, config)
    compare_modes(folder, mixed_prompts(16, 384))


def test_full_swap_space_falls_back_to_recompute(tiny, caplog):
    prompts = mixed_prompts(16, tiny[1].vocab_size, seed=1)
    expected, _ = run_counting(LLM(**TIGHT), prompts)
    llm = LLM(**TIGHT, preemption_mode="swap", num_cpu_blocks=6)
    with caplog.at_level(logging.WARNING, logger="minillm.swap"):
        got, _ = run_counting(llm, prompts)
    sched = llm.engine.scheduler
    assert (
        got == expected and sched.num_swap_fallbacks > 0 and sched.num_swapped_out > 0
    )
    assert "preempted by recompute" in caplog.text
    assert_no_leaks(llm)


def test_abort_of_a_swapped_request_frees_its_swap_blocks(tiny):
    llm = LLM(**TIGHT, preemption_mode="swap")
    engine, sched = llm.engine, llm.engine.scheduler
    for i, prompt in enumerate(mixed_prompts(16, tiny[1].vocab_size, seed=1)):
        engine.add_request(str(i), prompt, GREEDY)
    while not sched.swapped:
        engine.step()
    victim = sched.swapped[0].request_id
    held = len(sched.swap_space.req_to_blocks[victim])
    free_before = sched.swap_space.get_num_free_blocks()
    engine.abort_request(victim)
    assert (
        victim not in sched.swap_space.req_to_blocks
        and sched.swap_space.get_num_free_blocks() == free_before + held
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_swapper_round_trip_and_swap_space_all_or_nothing(tiny):
    cache = PagedKVCache(tiny[0].config, num_blocks=6, block_size=4)
    cache.key_cache.normal_(), cache.value_cache.normal_()
    k, v = cache.key_cache[:, [4, 1]].clone(), cache.value_cache[:, [4, 1]].clone()
    swapper = Swapper(cache, num_cpu_blocks=2)
    swapper.swap_out([(4, 1), (1, 0)])
    cache.key_cache.zero_(), cache.value_cache.zero_()
    swapper.swap_in([(1, 0), (0, 5)])
    assert torch.equal(cache.key_cache[:, [0, 5]], k) and torch.equal(
        cache.value_cache[:, [0, 5]], v
    )
    space = SwapSpace(3)
    space.allocate("a", 2)
    with pytest.raises(NoFreeBlocksError):
        space.allocate("b", 2)
    with pytest.raises(ValueError):
        space.allocate("a", 1)
    assert space.get_num_free_blocks() == 1 and list(space.req_to_blocks) == ["a"]


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_device=st.integers(8, 24),
    num_cpu=st.integers(1, 16),
    chunked=st.booleans(),
)
def test_swap_accounting_and_block_contents_under_random_workloads(
    seed, num_device, num_cpu, chunked
):
    """A fake model writes (request, block index) labels into the blocks it fills; swaps
    move the labels.

    After every step: each block is free or owned once, on the device and in the swap
    space; every unfinished request is in exactly one queue; a swapped request holds
    blocks_needed(num_computed_tokens) swap blocks and no device blocks; every block of
    every request holds that request's own data.
    """
    rng = random.Random(seed)
    block_size, max_len = 4, 4 * num_device
    kv = KVCacheManager(num_device, block_size)
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=max_len if not chunked else 8,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
    )
    sched = SwapScheduler(config, kv, SwapSpace(num_cpu))
    device, cpu = [None] * num_device, [None] * num_cpu  # what each block holds
    limits, next_id, steps = {}, 0, 0
    while steps < 60 and (next_id < 8 or sched.has_unfinished_requests()):
        if next_id < 8 and rng.random() < 0.4:
            rid = str(next_id)
            prompt = [1] * rng.randint(1, max_len // 3)
            limits[rid] = rng.randint(1, max_len - len(prompt) - 1)
            sched.add_request(Request(rid, prompt))
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests(
                rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED
            )
        out = sched.schedule()
        steps += 1
        for c, d in out.blocks_to_swap_in:
            device[d] = cpu[c]
        for d, c in out.blocks_to_swap_out:
            cpu[c] = device[d]
        # the "forward": label every block the computed tokens reach
        for r in out.scheduled_requests:
            table = kv.get_block_ids(r.request_id)
            end = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
            for i in range(kv.blocks_needed(r.num_computed_tokens)):
                assert device[table[i]] == (r.request_id, i), (
                    "a resumed request lost its K/V"
                )
            for i in range(r.num_computed_tokens // block_size, kv.blocks_needed(end)):
                device[table[i]] = (r.request_id, i)
        sampled = {r.request_id: [2] for r in out.scheduled_requests if out.samples(r)}
        for r in sched.update_from_output(out, sampled):
            if r.num_output_tokens >= limits[r.request_id]:
                sched.finish_requests(
                    r.request_id, RequestStatus.FINISHED_LENGTH_CAPPED
                )

        queues = [
            r.request_id for r in [*sched.waiting, *sched.running, *sched.swapped]
        ]
        assert sorted(queues) == sorted(sched.requests)
        held = [b for bs in kv.req_to_blocks.values() for b in bs]
        assert (
            len(held) + kv.block_pool.get_num_free_blocks()
            == num_device
            == len({id(b) for b in held}) + kv.block_pool.get_num_free_blocks()
        )
        space = sched.swap_space
        cpu_held = [b for bs in space.req_to_blocks.values() for b in bs]
        assert len({id(b) for b in cpu_held}) + space.get_num_free_blocks() == num_cpu
        assert set(space.req_to_blocks) == {r.request_id for r in sched.swapped}
        for r in sched.swapped:
            assert (
                r.request_id not in kv.req_to_blocks
                and r.status is RequestStatus.PREEMPTED
            )
            assert (
                len(space.req_to_blocks[r.request_id])
                == kv.blocks_needed(r.num_computed_tokens)
                > 0
            )
            for i, b in enumerate(space.req_to_blocks[r.request_id]):
                assert cpu[b.block_id] == (r.request_id, i)
    while sched.has_unfinished_requests():  # abort the rest: everything must come back
        sched.finish_requests(sorted(sched.requests), RequestStatus.FINISHED_ABORTED)
    assert kv.block_pool.get_num_free_blocks() == num_device and not kv.req_to_blocks
    assert sched.swap_space.get_num_free_blocks() == num_cpu and not sched.swapped
