"""The scheduler of chapter 6: continuous batching, token budget, chunked prefill,
preemption.
"""

from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minillm.kv_cache_manager import KVCacheManager
from minillm.model_runner import ModelRunner
from minillm.request import Request, RequestStatus
from minillm.scheduler import Scheduler, SchedulerConfig


def token_for(request_id: str, position: int) -> int:
    """A stand-in model: the token at a position depends only on the request and the
    position.
    """
    return (hash(request_id) * 31 + position * 7) % 997


def step(scheduler, output_lens, finished, runner=None):
    out = scheduler.schedule()
    if runner is not None:  # a runner's tables, kept from the outputs alone
        ModelRunner.update_block_tables(runner, out)
        manager = scheduler.kv_cache_manager
        for r in out.scheduled_requests:
            assert runner.block_tables[r.request_id] == manager.get_block_ids(
                r.request_id
            )
    sampled = {
        r.request_id: [token_for(r.request_id, r.num_tokens)]
        for r in out.scheduled_requests
        if out.samples(r)
    }
    for r in scheduler.update_from_output(out, sampled):
        if r.num_output_tokens == output_lens[r.request_id]:
            finished[r.request_id] = list(r.output_token_ids)
            scheduler.finish_requests(
                r.request_id, RequestStatus.FINISHED_LENGTH_CAPPED
            )
    return out


def expected_output(request_id, prompt_len, n):
    return [token_for(request_id, prompt_len + i) for i in range(n)]


def make(num_blocks=64, block_size=4, **config):
    config = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 128,
        **config,
    }
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), kv), kv


def test_decodes_are_never_starved_by_a_long_prompt():
    scheduler, _ = make(max_num_batched_tokens=8, max_num_seqs=4)
    lens, done = {"a": 50, "b": 50, "long": 1}, {}
    scheduler.add_request(Request("a", [1, 2]))
    scheduler.add_request(Request("b", [1, 2]))
    step(scheduler, lens, done)  # both prompts in one step
    scheduler.add_request(Request("long", [1] * 100))
    for _ in range(5):
        out = step(scheduler, lens, done)
        assert out.num_scheduled_tokens["a"] == 1 and out.num_scheduled_tokens["b"] == 1
        # the rest of the budget, one chunk per step
        assert out.num_scheduled_tokens["long"] == 6


def test_chunked_prefill_splits_a_prompt_by_the_budget_and_samples_once():
    scheduler, _ = make(max_num_batched_tokens=16)
    scheduler.add_request(Request("r", [1] * 40))
    chunks, samples = [], []
    for _ in range(3):
        out = scheduler.schedule()
        r = out.scheduled_requests[0]
        chunks.append(out.num_scheduled_tokens["r"])
        samples.append(out.samples(r))
        scheduler.update_from_output(out, {"r": [7]} if out.samples(r) else {})
    assert chunks == [16, 16, 8] and samples == [False, False, True]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler, _ = make(max_num_batched_tokens=128, enable_chunked_prefill=False)
    scheduler.add_request(Request("a", [1] * 100))
    scheduler.add_request(Request("b", [1] * 100))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 100}


def test_max_num_seqs_and_fcfs_admission():
    scheduler, _ = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3]))
    out = scheduler.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["r0", "r1"]


def test_preemption_takes_the_newest_and_it_resumes_with_identical_output():
    scheduler, kv = make(
        num_blocks=8,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=32,
    )
    lens, done = {"old": 12, "new": 12}, {}
    scheduler.add_request(Request("old", [1] * 8))
    scheduler.add_request(Request("new", [2] * 8))
    preempted = []
    while scheduler.has_unfinished_requests():
        preempted += step(scheduler, lens, done).preempted_req_ids
    assert preempted and set(preempted) == {"new"}
    assert done["old"] == expected_output("old", 8, 12) and done[
        "new"
    ] == expected_output("new", 8, 12)
    assert kv.block_pool.get_num_free_blocks() == 8


def test_outputs_carry_the_blocks_a_runner_needs():
    """A runner that keeps its tables from the outputs alone (never reading the
    manager) has each scheduled request's table, through growth and a preemption
    that hands the request other blocks; finished requests leave it."""
    scheduler, _ = make(num_blocks=6, block_size=2, max_num_seqs=2, max_model_len=12)
    runner, lens, finished = SimpleNamespace(block_tables={}), {}, {}
    for rid in ("a", "b"):
        lens[rid] = 6
        scheduler.add_request(Request(rid, [1] * 4))
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, lens, finished, runner))
    assert any(o.preempted_req_ids for o in outputs)  # the cache was short
    resumed = [o.resumed_req_ids for o in outputs]
    assert sum(rid in ids for ids in resumed for rid in "ab") >= 3  # 2 new + 1 back
    # the finished ids reach the runner with the next step's output
    ModelRunner.update_block_tables(runner, scheduler.schedule())
    assert not runner.block_tables


def test_finish_frees_blocks_at_once_and_is_idempotent():
    scheduler, kv = make()
    scheduler.add_request(Request("r", [1] * 10))
    scheduler.update_from_output(scheduler.schedule(), {"r": [5]})
    assert kv.block_pool.get_num_free_blocks() < kv.num_blocks
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    # no error, nothing happens
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"r"}


def test_abort_while_waiting():
    scheduler, kv = make(max_num_seqs=1)
    scheduler.add_request(Request("a", [1]))
    scheduler.add_request(Request("b", [1]))
    scheduler.schedule()
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in scheduler.waiting] == [] and len(
        scheduler.running
    ) == 1


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "every running request"),
        (
            dict(
                max_num_batched_tokens=64,
                max_model_len=128,
                enable_chunked_prefill=False,
            ),
            "without chunked prefill",
        ),
        (dict(max_num_seqs=0), ">= 1"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


def test_cache_too_small_for_one_request_is_refused():
    with pytest.raises(ValueError, match="cannot hold one request"):
        Scheduler(
            SchedulerConfig(max_model_len=128),
            KVCacheManager(num_blocks=4, block_size=16),
        )


def test_bad_requests_are_refused_and_change_nothing():
    scheduler, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(Request("long", [1] * 16))
    scheduler.add_request(Request("x", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("x", [2]))
    with pytest.raises(ValueError, match="at least one token"):
        Request("empty", [])
    assert scheduler.get_num_unfinished_requests() == 1


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps and aborts; invariants checked after every rule."""

    @initialize(
        num_blocks=st.integers(8, 40),
        block_size=st.sampled_from([1, 2, 4, 16]),
        max_num_seqs=st.integers(1, 6),
        extra_budget=st.integers(0, 40),
        chunked=st.booleans(),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, extra_budget, chunked):
        max_model_len = min(num_blocks * block_size, 64)
        budget = (
            max_num_seqs + extra_budget
            if chunked
            else max(max_model_len, max_num_seqs + extra_budget)
        )
        self.kv = KVCacheManager(num_blocks, block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, budget, max_model_len, chunked), self.kv
        )
        self.output_lens, self.prompt_lens, self.finished, self.aborted = (
            {},
            {},
            {},
            set(),
        )
        self.last_output = None
        self.runner = SimpleNamespace(block_tables={})

    @rule(prompt_len=st.integers(1, 40), output_len=st.integers(1, 20))
    def add(self, prompt_len, output_len):
        cfg = self.scheduler.config
        prompt_len = min(prompt_len, cfg.max_model_len - 1)
        output_len = min(output_len, cfg.max_model_len - prompt_len)
        rid = f"r{len(self.prompt_lens)}"
        self.prompt_lens[rid], self.output_lens[rid] = prompt_len, output_len
        self.scheduler.add_request(Request(rid, [1] * prompt_len))

    @rule()
    def run_step(self):
        self.last_output = step(
            self.scheduler, self.output_lens, self.finished, self.runner
        )

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)

    @invariant()
    def step_limits(self):
        out, cfg = self.last_output, self.scheduler.config
        if out is not None:
            assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
            assert len(out.scheduled_requests) <= cfg.max_num_seqs

    @invariant()
    def every_request_in_one_place_with_its_blocks(self):
        s, kv = self.scheduler, self.kv
        running, waiting = (
            {r.request_id for r in s.running},
            {r.request_id for r in s.waiting},
        )
        assert not running & waiting and running | waiting == set(s.requests)
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
            assert len(kv.req_to_blocks.get(r.request_id, [])) >= kv.blocks_needed(
                r.num_computed_tokens
            )
        for r in s.waiting:
            assert r.num_computed_tokens == 0 and r.request_id not in kv.req_to_blocks
        held = sum(len(b) for b in kv.req_to_blocks.values())
        assert held == kv.num_blocks - kv.block_pool.get_num_free_blocks()

    @invariant()
    def outputs_are_exact(self):
        for rid, out in self.finished.items():
            assert out == expected_output(
                rid, self.prompt_lens[rid], self.output_lens[rid]
            )

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests():
                break
            step(self.scheduler, self.output_lens, self.finished, self.runner)
        assert not self.scheduler.has_unfinished_requests(), (
            "the scheduler stopped making progress"
        )
        assert set(self.finished) | self.aborted == set(self.prompt_lens)
        self.outputs_are_exact()
        assert (
            self.kv.block_pool.get_num_free_blocks() == self.kv.num_blocks
            and not self.kv.req_to_blocks
        )


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
