"""Priority scheduling (chapter 6, "Priority scheduling"): vLLM's
scheduling_policy="priority" orders waiting requests by (priority, arrival) and
preempts the least urgent running request; "fcfs" keeps priorities but ignores them
(vLLM 0.32 accepts them there without error).
"""

import random

import pytest

from minillm.config import EngineConfig
from minillm.kv_cache_manager import KVCacheManager
from minillm.llm import LLM
from minillm.model import generate
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def served_order(prompts, outputs):
    """The prompts in the order their first token came."""
    pairs = sorted(zip(outputs, prompts), key=lambda p: p[0].metrics.first_token_time)
    return [prompt for _, prompt in pairs]


def record_victims(engine) -> list[str]:
    """Every id the engine's scheduler preempts from now on, in order."""
    victims, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        victims.extend(out.preempted_req_ids)
        return out

    engine.scheduler.schedule = recording
    return victims


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_seat_serves_by_priority_then_arrival(policy):
    llm = LLM(device="cpu", max_num_seqs=1, scheduling_policy=policy)
    prompts = ["a", "b", "c", "d"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1, 0])
    # fcfs ignores the priorities, as vLLM's FCFS queue does
    expected = ["b", "d", "c", "a"] if policy == "priority" else prompts
    assert served_order(prompts, outputs) == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_out_of_blocks_preempts_the_least_urgent(policy, tiny):
    model, tokenizer = tiny
    # 8 blocks of 4 tokens; each request grows to 6 + 14 tokens: both cannot fit
    llm = LLM(
        device="cpu",
        num_kv_blocks=8,
        block_size=4,
        max_model_len=32,
        scheduling_policy=policy,
    )
    victims = record_victims(llm.engine)
    prompts = [tokenizer.encode("The first one"), tokenizer.encode("A second one")]
    prompts = [p[:6] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    # the less urgent request (priority 1) arrives, and is admitted, first
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[1, 0])
    low, high = (o.request_id for o in outputs)
    assert victims, "the cache was meant to run out"
    assert victims[0] == (low if policy == "priority" else high)
    if policy == "priority":
        assert high not in victims
    reference = generate(llm.engine.model, prompts, max_new_tokens=14)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_engine_add_request_takes_priority_and_checks_it(tiny):
    llm = LLM(device="cpu", max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    for rid, rank in [("late", 5), ("urgent", -3), ("middle", 0)]:
        engine.add_request(rid, [5, 6, 7], GREEDY, priority=rank)
    assert [r.request_id for r in engine.scheduler.waiting] == [
        "urgent",
        "middle",
        "late",
    ]
    for bad in ["1", 1.5, True, None]:
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("bad", [5], GREEDY, priority=bad)
    assert (
        "bad" not in engine.output_processor.parents
        and len(engine.scheduler.waiting) == 3
    )
    engine.abort_request(["late", "urgent", "middle"])


def test_bad_policy_and_priority_lengths_are_value_errors():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    llm = LLM(device="cpu", scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1])
    assert not llm.engine.has_unfinished_requests()
    # one value for every prompt, as vLLM allows
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=3)) == 2


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_preempted_request_waits_in_its_place(policy):
    """FCFS puts the victim at the front of the queue; priority puts it where its
    (priority, arrival) belongs, behind a more urgent waiting request."""
    config = SchedulerConfig(max_num_seqs=4, max_model_len=64, policy=policy)
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    low = Request("low", [1] * 4, priority=1, arrival_time=0.0)
    scheduler.add_request(low)
    scheduler.schedule()
    urgent = Request("urgent", [1] * 4, priority=0, arrival_time=1.0)
    later = Request("later", [1] * 4, priority=2, arrival_time=2.0)
    scheduler.add_request(urgent)
    scheduler.add_request(later)
    scheduler._preempt(low)
    waiting = [r.request_id for r in scheduler.waiting]
    expected = ["urgent", "low", "later"] if policy == "priority" else None
    assert waiting == (expected or ["low", "urgent", "later"])
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_priority_never_preempts_the_more_urgent_on_a_random_workload():
    """Many requests of random priorities on a small cache: every victim is at least
    as late in (priority, arrival) order as every request left running."""
    rng = random.Random(0)
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96, policy="priority"
    )
    scheduler = Scheduler(config, KVCacheManager(12, 8))
    lens = {}
    for i in range(20):
        rid = f"r{i}"
        lens[rid] = rng.randint(4, 40)
        prompt = [1] * rng.randint(2, 40)
        rank = rng.randint(0, 2)
        scheduler.add_request(Request(rid, prompt, priority=rank, arrival_time=i))
    num_preempted = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        running = {(r.priority, r.arrival_time) for r in scheduler.running}
        for rid in out.preempted_req_ids:
            victim = scheduler.requests[rid]
            assert all(key <= (victim.priority, victim.arrival_time) for key in running)
            num_preempted += 1
        sampled = {r.request_id: [7] for r in out.scheduled_requests if out.samples(r)}
        for r in scheduler.update_from_output(out, sampled):
            if r.num_output_tokens >= lens[r.request_id]:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
                scheduler.finish_requests(r.request_id, status)
    assert num_preempted > 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
