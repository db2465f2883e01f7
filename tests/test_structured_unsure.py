"""Chapter 24's uncertain tokens checked as one trie walk (`unsure_after`): on every
step of random walks over real-world-shaped schemas, the same tokens and the same
stacks after each as `advance` token by token, and the masks (with and without the
finish budget) equal to trying every token's bytes on the real stacks."""

import random

import numpy as np
import pytest

from minillm.structured.matcher import GrammarMatcher, allowed_tokens, set_bits
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams

NAME = {"type": "string", "pattern": "^[0-9a-zA-Z_-]{1,40}$"}
SCHEMAS = [
    {  # bounded strings in objects, in arrays (JSONSchemaBench's slowest shape)
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 60},
            "tags": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"key": NAME, "value": {"type": "string"}},
                    "required": ["key", "value"],
                    "additionalProperties": False,
                },
            },
            "kind": {"enum": ["standalone", "master", "owned"]},
            "n": {"type": "integer", "minimum": 0},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "s": {"type": "string", "maxLength": 9},
                "x": {"anyOf": [{"type": "number"}, {"type": "array"}]},
            },
        },
    },
    {"type": "object", "additionalProperties": {"type": "string", "format": "uuid"}},
]


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def test_unsure_after_equals_advance_token_by_token(compiler):
    index, checked = compiler.index, 0
    for schema, seed in [(s, seed) for s in SCHEMAS for seed in range(3)]:
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        compiled = compiler.compile(params)
        m, rng = GrammarMatcher(compiled), random.Random(seed)
        for _ in range(40):
            closed = compiled.closure(m.stacks)
            fast = compiled.unsure_after(closed)
            slow = {}
            for t in compiled.unsure_tokens(closed).tolist():
                after = compiled.advance(closed, index.token_bytes[t])
                if after is not None:
                    slow[t] = after
            assert fast == slow
            checked += len(slow)
            allowed = allowed_tokens(m.next_token_mask(), index.vocab_size)
            each = {
                t
                for t, b in enumerate(index.token_bytes)
                if b and compiled.advance(m.stacks, b) is not None
            }
            if compiled.is_complete(m.stacks):
                each |= set(index.eos_token_ids)
            assert set(allowed.tolist()) == each
            choices = sorted(each - set(index.eos_token_ids))
            if not choices:
                break
            assert m.accept_token(rng.choice(choices))
    assert checked > 0  # some step had uncertain tokens that pass


def reference_budget(budget, stacks, remaining):
    """The finish budget's bound and cut mask with every uncertain token run
    through advance on its own (the code before unsure_after)."""
    c, words = budget.compiled, None
    closed, room = c.closure(stacks), remaining - 1
    after = [c.advance(closed, c.index.token_bytes[t]) for t in c.unsure_tokens(closed)]
    worst = max(
        int(budget.dist[list(s[:-1])].sum()) + budget.worst_after(s[-1]) for s in closed
    )
    bound = max([worst, *(budget.min_tokens(a) for a in after if a is not None)])
    if bound > room:
        words = np.zeros(c.num_words, np.uint32)
        for stack in closed:
            lower = int(budget.dist[list(stack[:-1])].sum())
            ids, states = budget.token_walk(stack[-1])
            set_bits(words, ids[lower + budget.dist[states] <= room])
        ok = [
            t
            for t, a in zip(c.unsure_tokens(closed).tolist(), after)
            if a is not None and budget.min_tokens(a) <= room
        ]
        set_bits(words, np.array(ok, dtype=np.int64))
        if c.is_complete(closed):
            set_bits(words, c.eos)
    return bound, words


@pytest.mark.parametrize("schema", [SCHEMAS[0], SCHEMAS[2]])
def test_budget_bound_and_cut_masks_equal_the_reference(compiler, schema):
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    max_tokens = 30
    proc = params.logits_processor(compiler, max_tokens=max_tokens)
    budget, index, cut = proc.budget, compiler.index, 0
    rng, out = random.Random(1), []
    for _ in range(max_tokens):
        m = proc.matcher(out)
        remaining = max_tokens - len(out)
        bound, words = reference_budget(budget, m.stacks, remaining)
        assert budget.bound(m.stacks) == bound
        if words is not None:
            assert np.array_equal(budget.mask(m.stacks, remaining), words)
            cut += 1
        allowed = allowed_tokens(proc.next_token_mask(out), index.vocab_size).tolist()
        choices = [t for t in allowed if t not in index.eos_token_ids]
        if not choices:
            break
        out.append(rng.choice(choices))
    assert cut > 0  # the budget did bite on this walk
