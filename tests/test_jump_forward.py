"""Jump-forward decoding (chapter 24): the forced bytes, their canonical tokens, and
walks that append them without a model step."""

import json
import random

import jsonschema
import pytest

from minillm.structured.matcher import (
    GrammarMatcher,
    allowed_tokens,
    canonical_tokens,
    jump_forward_tokens,
)
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["circle", "square"]},
            "size": {"type": "integer"},
        },
        "required": ["name", "kind", "size"],
    },
    {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        },
        "required": ["v"],
    },
    {"type": "array", "items": {"const": {"a": [1, 2], "b": "constant text"}}},
]


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def reference_forced(compiled, stacks) -> bytes:
    """The forced bytes by brute force: while exactly one byte value can be read
    (tried on the real stacks) and the document may not end."""
    out = b""
    while stacks is not None and not compiled.is_complete(stacks):
        nexts = [b for b in range(256) if compiled.advance(stacks, bytes([b]))]
        if len(nexts) != 1:
            break
        out += bytes(nexts)
        stacks = compiled.advance(stacks, bytes(nexts))
    return out


def test_canonical_tokens_spell_the_bytes_with_longest_tokens(compiler):
    index = compiler.index
    for text in [b'","name":"', b"}]}", b'{"a":[1,2],"b":"constant text"}', b"x"]:
        ids = canonical_tokens(index, text)
        assert b"".join(index.token_bytes[t] for t in ids) == text
        rest = text
        for t in ids:  # no longer token spells the bytes at that point
            n = len(index.token_bytes[t])
            longer = [
                b for b in index.token_bytes if b and len(b) > n and rest.startswith(b)
            ]
            assert not longer, (text, index.token_bytes[t], longer)
            rest = rest[n:]


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_jump_forward_appends_only_forced_allowed_tokens(compiler, k):
    """A random walk with jump-forward: at each step the forced bytes equal the
    brute-force reference; each appended token is allowed by the mask and spells
    the forced bytes; the finished document validates against the schema."""
    index, schema = compiler.index, SCHEMAS[k]
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = compiler.compile(params)
    eos = set(index.eos_token_ids)
    appended = 0
    for seed in range(3):
        m, rng, out = GrammarMatcher(compiled), random.Random(seed), []
        while not m.is_terminated() and len(out) < 300:
            forced = m.find_jump_forward_string()
            assert forced == reference_forced(compiled, m.stacks)
            jump = jump_forward_tokens(m)
            assert jump == canonical_tokens(index, forced)[:-1] if forced else not jump
            for t in jump:
                assert t in allowed_tokens(m.next_token_mask(), index.vocab_size)
                assert forced.startswith(index.token_bytes[t])
                forced = forced[len(index.token_bytes[t]) :]
                assert m.accept_token(t)
                out.append(t)
            appended += len(jump)
            t = rng.choice(allowed_tokens(m.next_token_mask(), index.vocab_size))
            assert m.accept_token(t)
            if t not in eos:
                out.append(t)
        if m.is_terminated():
            text = b"".join(index.token_bytes[t] for t in out).decode()
            jsonschema.validate(json.loads(text), schema)
    assert appended > 0  # the schemas force keys: something was appended


def test_forced_bytes_are_what_every_constrained_walk_writes(compiler):
    """Constrained sampling without jump-forward writes, at every point, the bytes
    that jump-forward would have appended there (the texts agree; only the token
    split inside a forced stretch may differ)."""
    index = compiler.index
    params = StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True)
    compiled = compiler.compile(params)
    for seed in range(3):
        m, rng, out, promised = GrammarMatcher(compiled), random.Random(seed), b"", []
        while not m.is_terminated() and len(out) < 2000:
            promised.append((len(out), m.find_jump_forward_string()))
            t = rng.choice(allowed_tokens(m.next_token_mask(), index.vocab_size))
            assert m.accept_token(t)
            out += index.token_bytes[t] or b""
        for at, forced in promised:
            assert out[at : at + len(forced)] == forced
