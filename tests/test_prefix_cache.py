"""Prefix caching (chapter 11): hash-chained blocks, the radix tree, and the engine
with either.
"""

import itertools
import random

import hypothesis.strategies as st
import pytest
import transformers
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hf_models import MODELS

from minillm.config import EngineConfig
from minillm.kv_cache_manager import KVCacheManager, NoFreeBlocksError
from minillm.llm import LLM
from minillm.prefix_cache import PrefixCachingKVCacheManager, hash_block_tokens
from minillm.radix_cache import RadixCache, RadixKVCacheManager
from minillm.request import Request
from minillm.sampling_params import SamplingParams

transformers.logging.set_verbosity_error()
IMPLS = [None, "hash", "radix"]
STATEFUL = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def assert_no_leaks(kv):
    """No request holds a block; blocks are free, or held once by the radix tree."""
    assert not kv.req_to_blocks
    pool = kv.block_pool
    if isinstance(kv, RadixKVCacheManager):
        in_tree = {id(b) for n in kv.tree.nodes() for b in n.value}
        assert all(b.ref_cnt == (id(b) in in_tree) for b in pool.blocks)
        assert kv.tree.protected_size == 0 and not kv.req_to_node
        assert pool.get_num_free_blocks() + len(in_tree) == pool.num_blocks
    else:
        assert pool.get_num_free_blocks() == pool.num_blocks and all(
            b.ref_cnt == 0 for b in pool.blocks
        )


def shared_prefix_prompts(vocab, n=14, prefix=40, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(prefix)]
    prompts = [
        system + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))]
        for _ in range(n - 4)
    ]
    prompts += [
        system[: prefix // 2] + [rng.randrange(1, vocab) for _ in range(5)]
        for _ in range(2)
    ]
    prompts += [
        [rng.randrange(1, vocab) for _ in range(rng.randint(3, 30))] for _ in range(2)
    ]
    return prompts


def run_prompt(kv, request):
    """Admit like the scheduler, compute the whole prompt in one step, register the
    full blocks.
    """
    blocks, num_cached = kv.get_computed_blocks(request)
    kv.allocate_slots(
        request, request.num_tokens - num_cached, new_computed_blocks=blocks
    )
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    return blocks, num_cached


# --- the engine: identical outputs, no leaks
# ---------------------------------------------------------------


def greedy_per_impl(prompts, max_tokens, *model, **sizes):
    """Greedy token ids of the engine on the CPU in blocks of 4 tokens, without a
    prefix cache and with each (IMPLS), by impl; and the LLMs, by impl, once each has
    checked that no request holds a block."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, llms = {}, {}
    for impl in IMPLS:
        llm = LLM(*model, device="cpu", block_size=4, prefix_cache_impl=impl, **sizes)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[impl] = [o.outputs[0].token_ids for o in outs]
        assert_no_leaks(llm.engine.kv_cache_manager)
        llms[impl] = llm
    return outputs, llms


def test_greedy_outputs_identical_off_hash_radix_tiny_model_under_preemption(tiny):
    prompts = shared_prefix_prompts(tiny[1].vocab_size, n=16, prefix=60)
    sizes = dict(num_kv_blocks=36, max_num_seqs=8, max_num_batched_tokens=32)
    outputs, llms = greedy_per_impl(prompts, 20, **sizes)
    for impl in ("hash", "radix"):
        assert llms[impl].engine.kv_cache_manager.prefix_cache_hits > 0
    assert outputs["hash"] == outputs[None] == outputs["radix"]
    preemptions = {impl: llm.engine.num_preemptions for impl, llm in llms.items()}
    assert all(preemptions.values()), preemptions


@pytest.mark.parametrize("cls, config", MODELS)
def test_greedy_outputs_identical_for_hf_models(hf_checkpoint, cls, config):
    _, path = hf_checkpoint(cls, config)
    prompts = shared_prefix_prompts(384, n=12, prefix=40, seed=1)
    sizes = dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=24)
    outputs, llms = greedy_per_impl(prompts, 16, path, **sizes)
    for llm in llms.values():
        assert llm.engine.num_preemptions > 0
    assert outputs["hash"] == outputs[None] == outputs["radix"]


@pytest.mark.parametrize("impl", ["hash", "radix"])
def test_shared_prefix_prefills_only_the_uncached_suffix(tiny, impl):
    rng = random.Random(3)
    # 4 full blocks of 16 (64 tokens) + 6
    system = [rng.randrange(1, 500) for _ in range(70)]
    prompts = [
        system + [rng.randrange(1, 500) for _ in range(rng.randint(3, 9))]
        for _ in range(8)
    ]
    llm = LLM(device="cpu", num_kv_blocks=128, max_num_seqs=8, prefix_cache_impl=impl)
    llm.generate([system], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    kv.prefix_cache_queries = kv.prefix_cache_hits = 0
    prefilled, schedule = [0], llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        for r in out.scheduled_requests:
            prefilled[0] += max(
                0,
                min(
                    out.num_scheduled_tokens[r.request_id],
                    r.num_prompt_tokens - r.num_computed_tokens,
                ),
            )
        return out

    llm.engine.scheduler.schedule = counting
    llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert prefilled[0] == sum(map(len, prompts)) - 8 * 64
    assert (kv.prefix_cache_hits, kv.prefix_cache_queries) == (
        8 * 64,
        sum(map(len, prompts)),
    )


def test_a_colliding_hash_never_returns_wrong_tokens_through_the_engine(tiny):
    prompts = shared_prefix_prompts(tiny[1].vocab_size, n=12, prefix=30, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(device="cpu", num_kv_blocks=64, block_size=4).generate(
            prompts, params, use_tqdm=False
        )
    ]
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=4, prefix_cache_impl="hash")
    kv = llm.engine.kv_cache_manager
    kv.hash_function = lambda key: 7  # every block of every request collides
    for _ in range(2):  # the second round finds everything cached, under one hash value
        assert [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)
        ] == expected
    assert kv.block_pool.num_collisions > 0 and kv.prefix_cache_hits > 0
    assert_no_leaks(kv)


def make_kv_cache_manager(num_blocks: int, block_size: int, impl: str | None):
    """The manager the engine builds for prefix_cache_impl=impl (chapter 8's seam)."""
    from minillm.registry import KV_CACHE_MANAGERS

    return KV_CACHE_MANAGERS[KV_CACHE_MANAGERS.resolve(impl, "cpu")](
        num_blocks, block_size
    )


def test_engine_config_rejects_an_unknown_prefix_cache():
    with pytest.raises(ValueError, match="prefix_cache_impl='lru'.*'hash', 'radix'"):
        EngineConfig(prefix_cache_impl="lru")
    assert type(make_kv_cache_manager(4, 4, None)) is KVCacheManager
    assert type(make_kv_cache_manager(4, 4, "hash")) is PrefixCachingKVCacheManager
    assert type(make_kv_cache_manager(4, 4, "radix")) is RadixKVCacheManager


# --- the hash cache, unit by unit
# --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["hash", "radix"])
def test_at_least_the_last_prompt_token_is_computed(impl):
    kv = make_kv_cache_manager(8, 4, impl)
    run_prompt(kv, Request("a", list(range(12))))
    assert kv.get_computed_blocks(Request("b", list(range(12))))[1] == 8
    assert kv.get_computed_blocks(Request("c", list(range(13))))[1] == 12
    assert kv.get_computed_blocks(Request("d", [0]))[1] == 0


def test_block_hash_chains_parent_tokens_and_extra_keys():
    h0 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h0, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9]), [3, 4]
    )
    assert hash_block_tokens(None, [1, 2], ("salt",)) != h0
    kv = PrefixCachingKVCacheManager(8, 2)
    run_prompt(kv, Request("a", [1, 2, 3, 4, 5], cache_salt="x"))
    assert kv.get_computed_blocks(Request("b", [1, 2, 3, 4, 5], cache_salt="x"))[1] == 4
    assert kv.get_computed_blocks(Request("c", [1, 2, 3, 4, 5], cache_salt="y"))[1] == 0
    assert kv.get_computed_blocks(Request("d", [1, 2, 3, 4, 5]))[1] == 0


def test_a_cached_block_is_forgotten_when_handed_out_for_new_content():
    kv = PrefixCachingKVCacheManager(3, 2)
    a = Request("a", [1, 2, 3, 4, 5])
    run_prompt(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(Request("a2", [1, 2, 3, 4, 5]))[1] == 4
    b = Request("b", [7, 7, 7, 7, 7, 7])  # needs all three blocks: evicts a's
    run_prompt(kv, b)
    assert (
        kv.block_pool.num_evictions == 2
        and kv.block_pool.cached_block_hash_to_block.keys()
        == {blk.block_hash.hash_value for blk in kv.req_to_blocks["b"]}
    )
    kv.free(b)
    assert kv.get_computed_blocks(Request("a3", [1, 2, 3, 4, 5]))[1] == 0


def test_radix_allocation_that_cannot_be_satisfied_changes_nothing():
    kv = RadixKVCacheManager(4, 2)
    a = Request("a", [1, 2, 3, 4, 5])
    run_prompt(kv, a)
    # hits 2 blocks, needs 2 more; only 1 free, a holds the rest
    b = Request("b", [1, 2, 3, 4, 9, 9, 9])
    blocks, num_cached = kv.get_computed_blocks(b)
    before = (
        [blk.ref_cnt for blk in kv.block_pool.blocks],
        kv.tree.evictable_size,
        kv.tree.protected_size,
    )
    with pytest.raises(NoFreeBlocksError):
        kv.allocate_slots(b, b.num_tokens - num_cached, new_computed_blocks=blocks)
    assert (
        [blk.ref_cnt for blk in kv.block_pool.blocks],
        kv.tree.evictable_size,
        kv.tree.protected_size,
    ) == before
    kv.free(a)  # now a's blocks are evictable: the same allocation succeeds by evicting
    kv.allocate_slots(b, b.num_tokens - num_cached, new_computed_blocks=blocks)
    assert kv.get_block_ids("b")[:2] == [blk.block_id for blk in blocks]


# --- the hash cache's LRU order, against a model
# -----------------------------------------------------------

BS = 2
token_seqs = st.lists(st.integers(0, 1), min_size=1, max_size=9)


class HashCacheMachine(RuleBasedStateMachine):
    """Sequences over {0, 1} through PrefixCachingKVCacheManager, checked against a
    model of the pool.

    The model knows the free queue (LRU: allocations from the head, a finished request's
    blocks to the tail in reverse, hits out of the middle) and what every block holds;
    every hit must be a block holding exactly the request's prefix, and a block handed
    out must lose its old content.
    """

    hash_function = hash

    def __init__(self):
        super().__init__()
        self.kv = PrefixCachingKVCacheManager(
            10, BS, hash_function=type(self).hash_function
        )
        self.model_free = list(range(10))
        # block id -> the token prefix its K/V hold (full blocks only)
        self.content: dict[int, tuple] = {}
        self.running: dict[str, Request] = {}
        self.ids = itertools.count()
        self.last_finished: tuple | None = None

    @rule(tokens=token_seqs, repeat_last=st.booleans())
    def start(self, tokens, repeat_last):
        if repeat_last and self.last_finished is not None:
            tokens = list(self.last_finished)
        request = Request(f"r{next(self.ids)}", tokens)
        blocks, num_cached = self.kv.get_computed_blocks(request)
        for i, blk in enumerate(blocks):  # every hit holds exactly this prefix
            assert self.content.get(blk.block_id) == tuple(tokens[: (i + 1) * BS])
        if repeat_last and self.last_finished is not None and not self.running:
            # the request that just finished left all its full blocks cached: all are
            # found again
            assert num_cached == (len(tokens) - 1) // BS * BS
        needed = -(-len(tokens) // BS) - len(blocks)
        free_after_touch = [
            b for b in self.model_free if b not in {blk.block_id for blk in blocks}
        ]
        if needed > len(free_after_touch):
            with pytest.raises(NoFreeBlocksError):
                self.kv.allocate_slots(
                    request, len(tokens) - num_cached, new_computed_blocks=blocks
                )
            self.kv.free(request)
            return
        new = self.kv.allocate_slots(
            request, len(tokens) - num_cached, new_computed_blocks=blocks
        )
        assert [b.block_id for b in new] == free_after_touch[:needed], (
            "allocation is not LRU"
        )
        self.model_free = free_after_touch[needed:]
        for b in new:  # handed out: its old content is gone from the cache
            self.content.pop(b.block_id, None)
            assert b.block_hash is None
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request, request.num_tokens)
        for i, blk in enumerate(
            self.kv.req_to_blocks[request.request_id][: len(tokens) // BS]
        ):
            self.content[blk.block_id] = tuple(tokens[: (i + 1) * BS])
        self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        rid = sorted(self.running)[i % len(self.running)]
        request = self.running.pop(rid)
        table = [b.block_id for b in self.kv.req_to_blocks[rid]]
        self.kv.free(request)
        held = {b.block_id for r in self.running for b in self.kv.req_to_blocks[r]}
        self.model_free += [b for b in reversed(table) if b not in held]
        self.last_finished = tuple(request.all_token_ids)

    @invariant()
    def pool_matches_model(self):
        pool = self.kv.block_pool
        assert [b.block_id for b in pool.free_block_queue] == self.model_free
        for v, candidates in pool.cached_block_hash_to_block.items():
            for block_id, blk in candidates.items():
                assert blk.block_hash.hash_value == v and blk.block_id == block_id
                assert blk.block_hash.token_ids == self.content[block_id][-BS:]

    def teardown(self):
        for rid in list(self.running):
            self.finish(0)
        assert_no_leaks(self.kv)


def test_hash_cache_lru_order_and_contents_against_a_model():
    run_state_machine_as_test(HashCacheMachine, settings=STATEFUL)


def test_hash_cache_with_a_three_valued_hash_still_returns_only_right_blocks():
    machine = type(
        "CollidingHashCacheMachine",
        (HashCacheMachine,),
        {"hash_function": lambda key: hash(key) % 3},
    )
    run_state_machine_as_test(machine, settings=STATEFUL)


# --- the radix tree, against a reference
# -------------------------------------------------------------------


class RadixMachine(RuleBasedStateMachine):
    """RadixCache against a dict of every cached prefix, with per-prefix access times
    and locks.
    """

    def __init__(self):
        super().__init__()
        self.tree = RadixCache(BS)
        self.ref: dict[tuple, int] = {}
        self.time: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list = []
        self.values = itertools.count()

    def prefixes(self, tokens):
        return [
            tuple(tokens[:k]) for k in range(BS, len(tokens) - len(tokens) % BS + 1, BS)
        ]

    def protected(self):
        return {p[:k] for p, _ in self.locks for k in range(BS, len(p) + 1, BS)}

    @rule(tokens=st.lists(st.integers(0, 2), max_size=12))
    def insert(self, tokens):
        prefixes = self.prefixes(tokens)
        values = [next(self.values) for _ in prefixes]
        num_existing, node = self.tree.insert(tokens, values)
        self.clock += 1
        assert num_existing == sum(
            1 for _ in itertools.takewhile(lambda p: p in self.ref, prefixes)
        )
        for p, v in zip(prefixes, values):
            self.ref.setdefault(p, v)
            self.time[p] = self.clock

    @rule(tokens=st.lists(st.integers(0, 2), max_size=12), lock=st.booleans())
    def match(self, tokens, lock):
        values, node = self.tree.match_prefix(tokens)
        self.clock += 1
        hit = list(itertools.takewhile(lambda p: p in self.ref, self.prefixes(tokens)))
        for p in hit:
            self.time[p] = self.clock
        assert values == [self.ref[p] for p in hit]
        if lock and hit:
            self.tree.inc_lock_ref(node)
            self.locks.append((hit[-1], node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 99))
    def unlock(self, i):
        self.tree.dec_lock_ref(self.locks.pop(i % len(self.locks))[1])

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        got, expected = self.tree.evict(n), []
        while len(expected) < n:
            protected = self.protected()
            leaves = [
                p
                for p in self.ref
                if p not in protected
                and not any(
                    len(q) == len(p) + BS and q[: len(p)] == p for q in self.ref
                )
            ]
            if not leaves:
                break
            victim = min(leaves, key=self.time.__getitem__)
            expected.append(self.ref.pop(victim))
            del self.time[victim]
        assert got == expected

    @invariant()
    def sizes_and_structure(self):
        assert self.tree.protected_size == len(self.protected())
        assert self.tree.evictable_size == len(self.ref) - self.tree.protected_size
        for node in self.tree.nodes():
            assert node.key and len(node.key) == len(node.value)
            assert node.parent.children[node.key[0]] is node
            assert node.lock_ref == sum(
                1 for _, locked in self.locks if self._below(locked, node)
            )

    def _below(self, locked, node):
        while locked is not None:
            if locked is node:
                return True
            locked = locked.parent
        return False


def test_radix_tree_matches_a_reference():
    run_state_machine_as_test(RadixMachine, settings=STATEFUL)
