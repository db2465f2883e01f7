"""Checks for chapter 24's exercises (chapters/24_token_masks.md, "Exercises")."""

import pytest
from _check import answer

from minillm.structured import budget, matcher
from minillm.structured.matcher import GrammarMatcher
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def test_forced_fraction(compiler):
    """18.1: the share of an output's bytes that the grammar forced."""
    forced_fraction = answer(matcher, "forced_fraction", "24.1")
    schema = {
        "type": "object",
        "properties": {"alpha": {"type": "boolean"}},
        "required": ["alpha"],
        "additionalProperties": False,
    }
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = compiler.compile(params)
    text = '{"alpha":true}'
    ids = [t for t, b in enumerate(compiler.index.token_bytes) if b and len(b) == 1]
    by_byte = {compiler.index.token_bytes[t]: t for t in ids}
    tokens = [by_byte[bytes([c])] for c in text.encode()]
    # every byte is forced but the choice of "t" (true) over "f" (false)
    assert forced_fraction(compiled, tokens) == pytest.approx(
        (len(text) - 1) / len(text)
    )
    assert GrammarMatcher(compiled).find_jump_forward_string() == b'{"alpha":'


def test_budget(compiler):
    """18.2: the exact fewest tokens to finish never exceeds the single-byte bound."""
    exact = answer(budget.FinishBudget, "exact_min_tokens", "24.2")
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = compiler.compile(params)
    fb = budget.FinishBudget(compiled)
    m = GrammarMatcher(compiled)
    for token in (t for t, b in enumerate(compiler.index.token_bytes) if b == b"{"):
        assert m.accept_token(token)
        break
    got = exact(fb, m.stacks)
    assert 1 <= got <= fb.min_tokens(m.stacks)
    assert exact(fb, compiled.initial) >= 1


def test_mask_single(compiler):
    """18.3: mask_single(stacks) equals mask(stacks) along a walk of a recursive
    schema (calls and returns, several configurations)."""
    import random

    import numpy as np

    from minillm.structured.matcher import CompiledGrammar, allowed_tokens

    mask_single = answer(CompiledGrammar, "mask_single", "24.3")
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["v"]}  # fmt: skip
    for compact in (True, False):
        params = StructuredOutputsParams(json=tree, disable_any_whitespace=compact)
        compiled, rng = compiler.compile(params), random.Random(0)
        m = GrammarMatcher(compiled)
        for _ in range(40):
            expected = compiled.mask(m.stacks)
            assert np.array_equal(mask_single(compiled, m.stacks), expected)
            allowed = allowed_tokens(expected, compiler.index.vocab_size).tolist()
            allowed = [t for t in allowed if t not in compiler.index.eos_token_ids]
            if not allowed:
                break
            assert m.accept_token(rng.choice(allowed))
