"""Chapter 24's counts past the longest token: positions of a long bounded string
that no token can tell apart share one mask (CompiledGrammar.canonical), checked
against the same grammar with canonical off and the whole trie walked per state,
at every position of random walks, for the mask and the finish budget's mask."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.structured import matcher
from minillm.structured.budget import FinishBudget
from minillm.structured.matcher import (
    CompiledGrammar,
    GrammarMatcher,
    depth_classes,
    short_tokens,
)
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def brute_classes(trans, labels, depth) -> list:
    """Each state's behaviour on every byte string of at most depth bytes."""

    def sig(g, d):
        here = tuple(labels[g])
        if d == 0:
            return here
        return here, tuple(None if t < 0 else sig(t, d - 1) for t in trans[g])

    return [sig(g, depth) for g in range(len(trans))]


def test_depth_classes_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, k = int(rng.integers(2, 12)), int(rng.integers(1, 4))
        trans = rng.integers(-1, n, size=(n, k)).astype(np.int32)
        labels = rng.integers(0, 2, size=(n, 1)).astype(np.int32)
        for depth in range(4):
            cls = depth_classes(trans, labels, depth)
            sigs = brute_classes(trans, labels.tolist(), depth)
            for a in range(n):
                for b in range(n):
                    assert (cls[a] == cls[b]) == (sigs[a] == sigs[b]), (a, b, depth)


def bounded_schemas(longest: int, rng: random.Random) -> list:
    """Long bounded strings (past the longest token), as JSONSchemaBench has."""
    out = [
        {
            "type": "object",
            "properties": {
                "a": {"type": "string", "maxLength": longest + 40},
                "b": {"type": "string", "minLength": longest + 5, "maxLength": 300},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        {
            "type": "array",
            "items": {"type": "string", "pattern": f"^[a-z0-9_-]{{1,{longest + 30}}}$"},
            "maxItems": 3,
        },
    ]
    for _ in range(2):
        hi = longest + rng.randrange(2, 80)
        lo = rng.choice([0, 1, rng.randrange(0, hi)])
        out.append({"type": "string", "minLength": lo, "maxLength": hi})
    return out


def walk_and_compare(compiler, schema, rng, steps=120):
    """Random walk; at each position c's masks against the reference's."""
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    c = compiler.compile(params)
    ref = CompiledGrammar(c.grammar, c.index)
    ref.canonical = lambda stacks: stacks  # every position on its own
    ref.near = lambda g: g  # every token walked from every state
    ref.walk_state = ref.full_walk  # the whole trie, per state
    budget, ref_budget = FinishBudget(c), FinishBudget(ref)
    m, merged, eos = GrammarMatcher(c), 0, set(c.index.eos_token_ids)
    for _ in range(steps):
        stacks = m.stacks
        words = c.mask(stacks)
        assert (words == ref.mask(stacks)).all(), "mask"
        for left in (2, 3, 5, 9, 1000):
            cut = budget.final_mask(stacks, left)
            ref_cut = ref_budget.mask(stacks, left)
            if not ref_cut.any():
                ref_cut = ref.mask(stacks)
            assert (cut == ref_cut).all(), f"budget mask, {left} tokens left"
        merged += c.canonical(stacks) != stacks
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
        if not allowed:
            break
        assert m.accept_token(rng.choice(allowed))
    return merged


def test_canonical_masks_equal_the_reference(compiler):
    rng = random.Random(0)
    longest = len(compiler.index.levels)
    merged = [walk_and_compare(compiler, s, rng) for s in bounded_schemas(longest, rng)]
    assert sum(merged) > 0, "no position stood for another: the check tested nothing"


def test_representatives_are_few_far_from_the_bound(compiler):
    """A string of maxLength longest + 60, one character a token: the positions
    more than a token from both ends share a representative."""
    longest = len(compiler.index.levels)
    schema = {"type": "string", "maxLength": longest + 60}
    c = compiler.compile(StructuredOutputsParams(json=schema))
    token_of = {b: t for t, b in enumerate(c.index.token_bytes) if b and len(b) == 1}
    m, reps = GrammarMatcher(c), []
    for b in b'"' + b"x" * (longest + 60):
        assert m.accept_token(token_of[bytes([b])])
        reps.append(c.canonical(m.stacks))
    assert len(set(reps)) <= longest + 2
    assert len(set(reps[1:60])) == 1  # 1..60 written: over longest left


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    extra=st.integers(2, 150),
    low=st.integers(0, 3),
    kind=st.sampled_from(["maxLength", "pattern", "pair"]),
    batch=st.sampled_from([1, 2, 5, 64]),
    seed=st.integers(0, 2**16),
)
def test_long_walks_batched_equal_the_reference(
    compiler, extra, low, kind, batch, seed
):
    """long_walk's batches (walk_many over the long tokens from a rule's states,
    LONG_BATCH of them at once), asked in a random order: every state's mask and
    uncertain tokens equal the reference's, each long walk the whole trie's."""
    longest = len(compiler.index.levels)
    string = {"type": "string", "minLength": low, "maxLength": longest + extra}
    if kind == "pattern":
        string = {
            "type": "string",
            "pattern": f"^[a-z0-9_-]{{{low},{longest + extra}}}$",
        }
    schema = string
    if kind == "pair":
        schema = {"type": "array", "items": string, "maxItems": 2}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    c = compiler.compile(params)
    c = CompiledGrammar(c.grammar, c.index)
    ref = CompiledGrammar(c.grammar, c.index)
    ref.near = lambda g: g
    ref.walk_state = ref.full_walk
    long = short_tokens(c.index)[3]
    order = list(range(c.grammar.num_states))
    random.Random(seed).shuffle(order)
    old, matcher.LONG_BATCH = matcher.LONG_BATCH, batch
    try:
        for g in order:
            words, unsure = c.state_mask(g)
            ref_words, ref_unsure = ref.state_mask(g)
            assert (words == ref_words).all(), g
            assert set(unsure.tolist()) == set(ref_unsure.tolist()), g
        assert c.long_batch, "no state asked for a long walk: nothing tested"
        for g, (ids, ends, uncertain) in c.long_batch.items():
            r_ids, r_ends, r_unc = c.full_walk(g, long)
            assert set(zip(ids.tolist(), ends.tolist())) == set(
                zip(r_ids.tolist(), r_ends.tolist())
            ) and len(ids) == len(r_ids), g
            assert set(uncertain.tolist()) == set(r_unc.tolist()), g
    finally:
        matcher.LONG_BATCH = old
