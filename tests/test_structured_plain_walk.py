"""Chapter 24's walk by plain bytes: inside a string, plain tokens allowed by their
length along the chain of states, the other tokens walked apart, against the whole
trie walked from each state."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_structured_output import schemas

from minillm.structured.matcher import (
    PLAIN,
    CompiledGrammar,
    class_chain,
    class_tokens,
    plain_index,
)
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams
from minillm.structured.token_index import walk_many

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "code": {"type": "string", "pattern": "^[a-z]+$"},
            "short": {"type": "string", "maxLength": 5},
            "long": {"type": "string", "minLength": 3, "maxLength": 120},
        },
        "required": ["name"],
    },
    {"type": "array", "items": {"type": "string", "maxLength": 700}},
    {"type": "string", "format": "date-time"},
    {  # patterns with a class and a count (JSONSchemaBench's ids and names)
        "type": "object",
        "properties": {
            "key": {"type": "string", "pattern": "^[0-9a-zA-Z_-]{1,30}$"},
            "id": {"type": "string", "pattern": "^[A-Fa-f\\d]{24}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
        },
    },
]


def plain_chain(table: np.ndarray, events, g: int, depth: int) -> np.ndarray | None:
    """The chain when every plain byte moves alike (the chapter's first version,
    before classes): (depth + 1,) the states that 0, 1, ..., depth plain bytes
    lead to from g, or None."""
    sink = table.shape[0] - 1
    chain, s = np.full(depth + 1, sink, np.int64), g
    for n in range(depth + 1):
        chain[n] = s
        if s == sink or n == depth:
            break
        row = table[s, PLAIN]
        if (row != row[0]).any() or (events is not None and events[s, PLAIN].any()):
            return None
        if row[0] == s:  # a loop: the same state for every length from here
            chain[n:] = s
            break
        s = int(row[0])
    return chain


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def same_walk(a, b) -> bool:
    """Two (ids, end states, uncertain ids): the same tokens, each ending in the
    same state, and the same uncertain tokens."""
    pairs = set(zip(a[0].tolist(), a[1].tolist()))
    ref = set(zip(b[0].tolist(), b[1].tolist()))
    return pairs == ref and len(a[0]) == len(b[0]) and set(a[2]) == set(b[2])


def test_plain_index_splits_the_vocabulary(compiler):
    index = compiler.index
    ids, lengths, others = plain_index(index)
    plain = set(PLAIN.tolist())
    for t, n in zip(ids.tolist(), lengths.tolist()):
        assert set(index.token_bytes[t]) <= plain and len(index.token_bytes[t]) == n
    rest = {int(t) for t in others.sorted_ids}
    spelled = {t for t, b in enumerate(index.token_bytes) if b}
    assert rest | set(ids.tolist()) == spelled and not rest & set(ids.tolist())


@pytest.mark.parametrize("whitespace", [True, False])
def test_walk_by_plain_bytes_equals_the_whole_walk_on_every_state(compiler, whitespace):
    index, chained, classed = compiler.index, 0, 0
    for schema in SCHEMAS:
        params = StructuredOutputsParams(
            json=schema, disable_any_whitespace=not whitespace
        )
        compiled = CompiledGrammar(compiler.compile(params).grammar, index)
        g_ = compiled.grammar
        for g in range(g_.num_states):
            assert same_walk(compiled.walk_state(g), compiled.full_walk(g)), g
            dense = (g_.table[g] != g_.SINK).sum() >= 128
            args = (g_.table, compiled.events, g, len(index.levels))
            chained += bool(dense and plain_chain(*args) is not None)
            found = class_chain(*args)
            classed += bool(found is not None and not found[1].all())
            fast = compiled.chain(g, len(index.levels))  # from the table of moves
            assert (fast is None) == (found is None), g
            if found is not None:
                assert np.array_equal(fast[0], found[0]), g
                assert np.array_equal(fast[1], found[1]), g
    assert chained >= 10  # plain strings and bounded ones took the chain
    assert classed >= 10  # and the patterns' classes took theirs


def test_class_tokens_are_the_plain_tokens_inside_the_class(compiler):
    index = compiler.index
    ids = plain_index(index)[0]
    for chars in (b"0123456789abcdefABCDEF", b"_-" + bytes(range(97, 123)), b"x"):
        cls = [b in chars for b in PLAIN.tolist()]
        got = class_tokens(index, np.array(cls))
        want = [set(index.token_bytes[t]) <= set(chars) for t in ids.tolist()]
        assert got.tolist() == want and any(want)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=schemas, whitespace=st.booleans(), seed=st.integers(0, 2**16))
def test_states_walked_together_equal_each_walked_alone(
    compiler, schema, whitespace, seed
):
    """walk_many (narrow_walks) and scan_many (loop_scans), against the reference
    walks one state at a time; and walk_many on any subset of the states."""
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=not whitespace)
    index = compiler.index
    compiled = CompiledGrammar(compiler.compile(params).grammar, index)
    for g, walk in compiled.narrow_walks.items():
        assert same_walk(walk, compiled.full_walk(g)), g
    others = plain_index(index)[2]
    for g, walk in compiled.loop_scans.items():
        assert same_walk(walk, compiled.full_walk(g, others)), g
    rng = random.Random(seed)
    g_ = compiled.grammar
    starts = np.array(sorted(rng.sample(range(g_.num_states), min(5, g_.num_states))))
    for g, walk in zip(
        starts.tolist(), walk_many(index, g_.table, starts, compiled.events)
    ):
        assert same_walk(walk, compiled.full_walk(g)), g
