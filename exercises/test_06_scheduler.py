"""Checks for chapter 6's exercises (chapters/06_scheduler.md, "Exercises").

Each test skips until its answer exists (a new field of SchedulerConfig or Request),
then drives the scheduler with the chapter's stand-in model: a request's k-th output
token is a function of its id and k only, so any correct schedule gives the same
outputs, and every block must be free again at the end.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from minillm.kv_cache_manager import KVCacheManager
from minillm.request import Request, RequestStatus
from minillm.scheduler import Scheduler, SchedulerConfig


def needs_field(cls, name: str, exercise: str) -> None:
    if name not in {f.name for f in dataclasses.fields(cls)}:
        pytest.skip(f"exercise {exercise}: {cls.__name__}.{name} does not exist yet")


def fake_token(request_id: str, position: int) -> int:
    return random.Random(f"{request_id}/{position}").randrange(1000)


def drive(scheduler, arrivals, output_lens, on_step=None, max_steps=5_000):
    """The chapter's driver: arrivals[step] lists the requests added before that step.
    Calls on_step(step, output, running_before) after each schedule(). Returns
    {request id: output tokens} and {request id: step of its first token}.
    """
    outputs, first_token, step = {}, {}, 0
    while step < len(arrivals) or scheduler.has_unfinished_requests():
        assert step < max_steps, "the scheduler stopped making progress"
        for request in arrivals[step] if step < len(arrivals) else []:
            scheduler.add_request(request)
        running_before = {r.request_id for r in scheduler.running}
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(out.scheduled_requests) <= scheduler.config.max_num_seqs
        if on_step is not None:
            on_step(step, out, running_before)
        sampled = {
            r.request_id: [fake_token(r.request_id, r.num_tokens)]
            for r in out.scheduled_requests
            if out.samples(r)
        }
        for r in scheduler.update_from_output(out, sampled):
            first_token.setdefault(r.request_id, step)
            if r.num_output_tokens == output_lens[r.request_id]:
                outputs[r.request_id] = list(r.output_token_ids)
                scheduler.finish_requests(
                    r.request_id, RequestStatus.FINISHED_LENGTH_CAPPED
                )
        step += 1
    return outputs, first_token


def assert_exact(scheduler, outputs, prompt_lens, output_lens):
    for rid, n in output_lens.items():
        expected = [fake_token(rid, prompt_lens[rid] + i) for i in range(n)]
        assert outputs[rid] == expected, f"{rid}'s output changed"
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks and not kv.req_to_blocks


def chapter_workload():
    """The checkpoint's run: twelve requests over 40 steps, a cache of 40 blocks of 16
    that cannot hold them all.
    """
    rng = random.Random(1)
    arrivals, output_lens, prompt_lens = [[] for _ in range(40)], {}, {}
    for i in range(12):
        rid = f"r{i}"
        prompt_lens[rid] = rng.randint(5, 300)
        output_lens[rid] = rng.randint(5, 60)
        arrivals[rng.randrange(40)].append(Request(rid, [1] * prompt_lens[rid]))
    return arrivals, output_lens, prompt_lens


def test_prefill_cap():
    """5.1: long_prefill_token_threshold caps every request's tokens per step."""
    needs_field(SchedulerConfig, "long_prefill_token_threshold", "6.1")
    # two long prompts: without the cap the first takes the whole budget
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
        long_prefill_token_threshold=24,
    )
    scheduler = Scheduler(config, KVCacheManager(64, 16))
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, [1] * 200))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 24, "b": 24}
    # a mixed run: no step gives any request more than the cap, outputs stay exact
    for cap in (8, 40):
        arrivals, output_lens, prompt_lens = chapter_workload()
        config = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=512,
            long_prefill_token_threshold=cap,
        )
        scheduler = Scheduler(config, KVCacheManager(40, 16))

        def capped(step, out, running_before, cap=cap):
            assert max(out.num_scheduled_tokens.values(), default=0) <= cap

        outputs, _ = drive(scheduler, arrivals, output_lens, capped)
        assert_exact(scheduler, outputs, prompt_lens, output_lens)


def test_priority_queue_is_a_heap_in_urgency_order():
    """5.2: PriorityRequestQueue pops in (priority, arrival_time) order, whatever the
    order of appends and removals, as the sorted list did."""
    import minillm.scheduler as scheduler_module

    queue_cls = getattr(scheduler_module, "PriorityRequestQueue", None)
    if queue_cls is None:
        pytest.skip(
            "exercise 6.2: minillm.scheduler.PriorityRequestQueue does not exist"
        )
    rng, queue, model = random.Random(0), queue_cls(), []
    for i in range(400):
        if model and rng.random() < 0.3:
            gone = rng.choice(model)
            queue.remove(gone)
            model.remove(gone)
        else:
            r = Request(f"q{i}", [1], priority=rng.randint(0, 3), arrival_time=i)
            queue.append(r)
            model.append(r)
        model.sort(key=lambda r: (r.priority, r.arrival_time))
        assert len(queue) == len(model) and (not model or queue[0] is model[0])
    assert [queue.popleft() for _ in range(len(model))] == model


def test_priority():
    """5.2: admission by (priority, arrival_time); the least urgent is preempted (the
    chapter's sorted queue passes; the heap must too)."""
    needs_field(Request, "priority", "6.2")
    needs_field(SchedulerConfig, "policy", "6.2")
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, policy="priority"
    )
    # six low-priority requests queue up; an urgent one arrives at step 3
    low = [Request(f"low{i}", [1] * 6, priority=1, arrival_time=i) for i in range(6)]
    urgent = Request("urgent", [1] * 6, priority=0, arrival_time=10)
    arrivals = [low, [], [], [urgent]]
    output_lens = {r.request_id: 8 for r in [*low, urgent]}
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    started_before = set()

    def note(step, out, running_before):
        if step == 3:
            started_before.update(running_before | set(out.num_scheduled_tokens))

    outputs, first_token = drive(scheduler, arrivals, output_lens, note)
    assert_exact(scheduler, outputs, {rid: 6 for rid in output_lens}, output_lens)
    queued = [r.request_id for r in low if r.request_id not in started_before]
    assert queued, "the test needs requests still queued when the urgent one arrives"
    # (a request admitted in the same step as the urgent one gets its token with it)
    assert all(first_token["urgent"] <= first_token[rid] for rid in queued), first_token

    # memory pressure: the victims are always the least urgent running requests
    rng = random.Random(2)
    arrivals, output_lens, prompt_lens = [[] for _ in range(30)], {}, {}
    for i in range(14):
        rid = f"r{i}"
        prompt_lens[rid], output_lens[rid] = rng.randint(5, 60), rng.randint(5, 40)
        step = rng.randrange(30)
        arrivals[step].append(
            Request(
                rid, [1] * prompt_lens[rid], priority=rng.randint(0, 2), arrival_time=i
            )
        )
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=48, max_model_len=128, policy="priority"
    )
    scheduler = Scheduler(config, KVCacheManager(12, 16))
    num_preempted = 0

    def victims_least_urgent(step, out, running_before):
        nonlocal num_preempted
        key = {
            r.request_id: (r.priority, r.arrival_time)
            for r in scheduler.requests.values()
        }
        for victim in out.preempted_req_ids:
            num_preempted += 1
            for r in scheduler.running:
                assert key[r.request_id] < key[victim], (
                    f"step {step}: {victim} was preempted while {r.request_id}, less "
                    "urgent, kept running"
                )

    outputs, _ = drive(scheduler, arrivals, output_lens, victims_least_urgent)
    assert num_preempted > 0, "the test needs preemptions"
    assert_exact(scheduler, outputs, prompt_lens, output_lens)


def test_watermark():
    """5.3: admissions leave watermark * num_blocks blocks free; fewer preemptions."""
    needs_field(SchedulerConfig, "watermark", "6.3")
    preemptions = {}
    for watermark in (0.0, 0.1):
        arrivals, output_lens, prompt_lens = chapter_workload()
        config = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=512,
            watermark=watermark,
        )
        scheduler = Scheduler(config, KVCacheManager(40, 16))
        count = 0

        def check(step, out, running_before, watermark=watermark):
            nonlocal count
            count += len(out.preempted_req_ids)
            admitted = set(out.num_scheduled_tokens) - running_before
            others = running_before - set(out.preempted_req_ids)
            if admitted and (others or len(admitted) > 1):
                free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
                assert free >= watermark * 40, (
                    f"step {step}: {sorted(admitted)} admitted, {free} blocks left"
                )

        outputs, _ = drive(scheduler, arrivals, output_lens, check)
        assert_exact(scheduler, outputs, prompt_lens, output_lens)
        preemptions[watermark] = count
    assert preemptions[0.1] < preemptions[0.0], preemptions
