"""Chapter 24, "The engine thread's share, cut": the per-step caches change no mask.
advance_token and advance_single give advance's stacks; the processor's masks (the
finish budget's cut masks remembered, the EOS-only mask made once) equal the
reference path's over random walks; the one-copy bitmask equals per-row masks."""

import random

import numpy as np
import pytest
import torch

from minillm.structured.matcher import GrammarMatcher, allowed_tokens
from minillm.structured.processor import (
    GrammarCompiler,
    StructuredOutputLogitsProcessor,
    StructuredOutputsParams,
    reference_next_token_mask,
    reference_step,
)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
     "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
     "type": "string"}, "maxItems": 3}, "ok": {"type": "boolean"}}},
    {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
     "type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, "required": ["v"]},
    {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1},
               {"type": "string", "format": "date"}, {"type": "null"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def params_list():
    for schema in SCHEMAS:
        for compact in (False, True):
            yield StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    yield StructuredOutputsParams(regex=r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,3}")


def walk(proc, rng, steps):
    """A random walk through proc's masks, with an occasional forbidden token."""
    ids, vocab = [], proc.compiled.index.vocab_size
    for _ in range(steps):
        allowed = allowed_tokens(proc.next_token_mask(ids), vocab)
        ids.append(rng.randrange(vocab) if rng.random() < 0.03 else rng.choice(allowed))
    return [int(t) for t in ids]


def test_advance_token_equals_advance(compiler):
    """The stacks after a token, fast and cached, are advance's, for the sampled
    tokens and for random (mostly forbidden) ones."""
    rng, checked = random.Random(0), 0
    for params in params_list():
        proc = params.logits_processor(compiler, max_tokens=40)
        c, tb = proc.compiled, compiler.index.token_bytes
        ids = walk(proc, rng, 40)
        for s in range(len(ids)):
            m = proc.matcher(ids[:s])
            if m.terminated:
                break
            for t in [ids[s]] + [rng.randrange(len(tb)) for _ in range(8)]:
                if not tb[t]:
                    continue
                expected = c.advance(m.stacks, tb[t])
                assert c.advance_single(m.stacks, tb[t]) == expected
                assert c.advance_token(m.stacks, t) == expected
                assert c.advance_token(m.stacks, t) == expected  # cached
                checked += 1
    assert checked > 500


def test_advance_single_on_tokens_that_leave_a_rule(compiler):
    """Tokens that end a string, a number or a value and go on in the caller (`",`,
    `"}`, `1]`: added to the tiny vocabulary), tried from every state of a walk."""
    from minillm.structured.grammar import Grammar
    from minillm.structured.matcher import CompiledGrammar
    from minillm.structured.token_index import TokenIndex

    punct = [bytes([b]) for b in b'",:{}[]019']
    extra = [a + b for a in punct for b in punct] + [a + b + c for a in punct[:7]
             for b in punct[:7] for c in punct[:7]]  # fmt: skip
    base = compiler.index
    vocab = list(base.token_bytes) + extra
    index = TokenIndex(vocab, base.eos_token_ids, len(vocab))
    tree = StructuredOutputsParams(json=SCHEMAS[2], disable_any_whitespace=True)
    c = CompiledGrammar(Grammar(tree.rules()), index)
    stacks, checked = c.initial, 0
    for byte in b'{"v":1,"kids":[{"v":2,"kids":[{"v":3}]},{"v":4}]}':
        for data in extra:
            expected = c.advance(stacks, data)
            assert c.advance_single(stacks, data) == expected, data
            checked += expected is not None
        stacks = c.advance(stacks, bytes([byte]))
    assert checked > 100


@pytest.mark.parametrize("slack", [0, 30])
def test_masks_equal_the_reference_path(compiler, slack):
    """Every prefix's mask (with the finish budget biting, and after forbidden tokens
    or EOS) equals the reference computed from scratch; twice, so the remembered cut
    masks are checked too. max_tokens is the budget's need (the least it accepts:
    it bites from the first token) plus slack."""
    rng = random.Random(slack)
    for params in params_list():
        budget = params.logits_processor(compiler, max_tokens=1000).budget
        max_tokens = budget.min_tokens(budget.compiled.initial) + slack
        proc = params.logits_processor(compiler, max_tokens=max_tokens)
        for _ in range(2):
            ids = walk(proc, rng, max_tokens)
            state = (proc.compiled.initial, False)
            for s in range(len(ids) + 1):
                if s:
                    state = reference_step(proc.compiled, state, ids[s - 1])
                m = proc.matcher(ids[:s])
                assert m.terminated == state[1]
                if not m.terminated:
                    assert m.stacks == state[0]
                expected = reference_next_token_mask(proc, state, max_tokens - s)
                for _ in range(2):
                    assert np.array_equal(proc.next_token_mask(ids[:s]), expected)
                grammar = reference_next_token_mask(proc, state, None)
                assert np.array_equal(m.next_token_mask(), grammar)


def test_one_copy_bitmask_equals_per_row(compiler):
    """apply_batch with one grammar per row (the np.concatenate path) masks what
    each row's processor masks alone."""
    rng = random.Random(1)
    procs, outs = [], []
    for i, params in enumerate(params_list()):
        proc = params.logits_processor(compiler, max_tokens=24)
        procs.append(proc)
        outs.append(walk(proc, rng, 24)[: rng.randrange(25)])
    logits = torch.randn(len(procs), compiler.index.vocab_size)
    expected = torch.stack(
        [p(o, row.clone()) for p, o, row in zip(procs, outs, logits)]
    )
    rows = list(range(len(procs)))
    rng.shuffle(rows)  # the rows in another order than the logits'
    got = StructuredOutputLogitsProcessor.apply_batch(
        logits.clone()[rows], list(range(len(rows))), [procs[r] for r in rows],
        [outs[r] for r in rows],
    )  # fmt: skip
    assert torch.equal(got, expected[rows])


def test_last_output_path_equals_a_replay(compiler):
    """The processor's shortcut for the output it saw last (extended in place, by
    several tokens, from a new list, interleaved with a second output, shorter
    again, and another output ending in the same token) gives the matcher that a
    fresh replay of the whole output gives."""
    rng = random.Random(3)
    for params in params_list():
        proc = params.logits_processor(compiler, max_tokens=40)
        a, b = walk(proc, rng, 30), walk(proc, rng, 30)
        calls = [a[:s] for s in range(0, 31, 3)] + [b[:5], a[:12], b[:6], b[:9]]
        calls += [[*a[:20], a[20]], a[:4], a[:4], b[:2]]
        calls += [a[:8], [*b[:7], a[7]], [*b[:7], a[7], a[8]]]  # same last token
        for ids in calls:
            m = proc.matcher(list(ids))
            fresh = GrammarMatcher(proc.compiled)
            for t in ids:
                if not fresh.accept_token(t) and not fresh.terminated:
                    fresh.terminated = True
            assert m.terminated == fresh.terminated
            if not m.terminated:
                assert m.stacks == fresh.stacks


def test_final_mask_at_any_room_in_any_order(compiler):
    """The budget's remembered masks (per stacks where it cannot bite, per stacks and
    room where it does) equal the reference's for every room from 1 to past the
    point where the budget stops biting, asked in falling, rising and random order:
    a state first met with room to spare is not served its plain mask once the room
    runs short, nor the other way round."""
    rng, checked = random.Random(5), 0
    for params in params_list():
        proc = params.logits_processor(compiler, max_tokens=40)
        budget = proc.budget
        ids = walk(proc, rng, 40)
        for s in range(0, len(ids), 3):
            m = proc.matcher(ids[:s])
            if m.terminated:
                break
            bound = budget.bound(m.stacks)
            top = min(bound, 60) + 3
            rooms = list(range(1, top))
            for order in (rooms[::-1], rooms, rng.sample(rooms, len(rooms))):
                for remaining in order:
                    expected = reference_next_token_mask(
                        proc, (m.stacks, False), remaining
                    )
                    got = budget.final_mask(m.stacks, remaining)
                    assert np.array_equal(got, expected), (s, remaining, bound)
                    checked += 1
            budget.plain.clear()  # the next state starts from rising rooms
            budget.cuts.clear()
    assert checked > 500


def test_set_bits_equals_setting_each_bit():
    """set_bits (one packbits over a boolean vector) ORs the same bits as setting
    each token's bit by hand, into words that already hold some."""
    from minillm.structured.matcher import set_bits

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 500, 3000):
        words = rng.integers(0, 2**32, 100, dtype=np.uint64).astype(np.uint32)
        tokens = rng.integers(0, 3200, n).astype(np.int64)  # repeats included
        expected = words.copy()
        for t in tokens.tolist():
            expected[t >> 5] |= np.uint32(1 << (t & 31))
        set_bits(words, tokens)
        assert np.array_equal(words, expected)


def test_bound_counts_the_tokens_that_leave_a_rule(compiler):
    """Where a token leaves a rule and enters another that needs many tokens (`","`
    inside a long string of an array: a new string of 150 or more characters), the
    budget's bound counts that token on the real stacks, and its masks equal the
    reference's for every room up to past the bound."""
    schema = {"type": "array", "items": {"type": "string", "minLength": 150,
              "maxLength": 600}}  # fmt: skip
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    proc = params.logits_processor(compiler, max_tokens=200)
    budget, c = proc.budget, proc.compiled
    stacks = c.advance(c.initial, b'["' + b"a" * 160)
    closed = c.closure(stacks)
    assert len(c.unsure_tokens(closed))  # `"` closes a string of a rule of its own
    worst = max(
        int(budget.dist[list(s[:-1])].sum()) + budget.worst_after(s[-1]) for s in closed
    )
    bound = budget.bound(stacks)
    assert bound > worst  # raised by a token that starts the next string
    for remaining in range(1, bound + 4):
        expected = reference_next_token_mask(proc, (stacks, False), remaining)
        assert np.array_equal(budget.final_mask(stacks, remaining), expected)
