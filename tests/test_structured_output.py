"""Chapters 22-24: grammars compiled to token masks. Every constrained output parses and
validates; the cached masks equal the slow per-token check; bad schemas are refused by
name; a constrained request's greedy output does not depend on its batch."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.structured import budget, dfa, grammar, json_text
from minillm.structured.bitmask import apply_token_bitmask_inplace
from minillm.structured.fsm import NFA
from minillm.structured.grammar import Grammar
from minillm.structured.ir import GrammarError
from minillm.structured.matcher import CompiledGrammar, GrammarMatcher, allowed_tokens
from minillm.structured.processor import (
    GrammarCompiler,
    StructuredOutputLogitsProcessor,
    StructuredOutputsParams,
)
from minillm.structured.schema_ops import SchemaError, SchemaWarning, guaranteed


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def random_walk(compiler, params, rng, max_tokens=60):
    """Sample uniformly among the allowed tokens (a random model) until EOS."""
    proc = StructuredOutputsParams(**params).logits_processor(
        compiler, max_tokens=max_tokens
    )
    eos = set(compiler.index.eos_token_ids)
    out: list[int] = []
    for _ in range(max_tokens + 1):
        logits = torch.zeros(compiler.index.vocab_size)
        proc(out, logits)
        allowed = torch.nonzero(logits > float("-inf")).flatten().tolist()
        assert allowed, f"the mask allows nothing after {out}"
        token = rng.choice(allowed)
        if token in eos:
            return out
        out.append(token)
    raise AssertionError("max_tokens passed without EOS being allowed")


def text_of(compiler, ids):
    return b"".join(compiler.index.token_bytes[t] for t in ids).decode()


# A strategy of JSON Schemas built from the keywords chapter 23 compiles.
leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
        st.integers(-1000, 1000),
        st.integers(0, 500),
    ),
    st.builds(
        lambda lo, hi: {"type": "number", "minimum": lo, "exclusiveMaximum": hi + 1},
        st.integers(-50, 50),
        st.integers(50, 99),
    ),
    st.builds(
        lambda a, b: {"type": "string", "minLength": a, "maxLength": a + b},
        st.integers(0, 4),
        st.integers(0, 6),
    ),
    st.sampled_from(
        [{"type": "string", "format": f} for f in ("date", "time", "uuid", "email")]
        + [{"type": "string", "pattern": "^[a-z]{2,5}[0-9]?$"}]
    ),
    st.builds(
        lambda vs: {"enum": vs},
        st.lists(st.text(max_size=4), min_size=1, max_size=3, unique=True),
    ),
    st.builds(lambda v: {"const": v}, st.integers(-5, 5) | st.text(max_size=3)),
)


def objects(children):
    names = st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=3, unique=True)

    def build(keys, values, required, extra):
        props = dict(zip(keys, values))
        req = [k for k, r in zip(keys, required) if r]
        return {"type": "object", "properties": props, "required": req,
                "additionalProperties": extra}  # fmt: skip

    return st.builds(
        build,
        names,
        st.lists(children, min_size=3, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
        st.booleans(),
    )


schemas = st.recursive(
    leaf,
    lambda children: st.one_of(
        objects(children),
        st.builds(
            lambda item, lo, n: {
                "type": "array",
                "items": item,
                "minItems": lo,
                "maxItems": lo + n,
            },  # fmt: skip
            children,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    ),
    max_leaves=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_every_constrained_output_validates(compiler, schema, seed):
    try:
        ids = random_walk(compiler, {"json": schema}, random.Random(seed), 80)
    except GrammarError as e:  # its shortest document needs more: refused by design
        assert "is too few for this schema" in str(e)
        return
    value = json.loads(text_of(compiler, ids))
    jsonschema.validate(
        value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def test_recursive_ref_validates(compiler):
    node = {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
        },
        "required": ["v", "kids"],
        "additionalProperties": False,
    }
    tree = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    rng = random.Random(0)
    for _ in range(5):
        ids = random_walk(compiler, {"json": tree}, rng, max_tokens=120)
        jsonschema.validate(json.loads(text_of(compiler, ids)), tree)


def test_regex_outputs_fullmatch(compiler):
    pattern = r"(\d{3}-){2}\d{4}|[A-Z][a-z]+ (is|was) [0-9]+"
    rng = random.Random(1)
    for _ in range(10):
        ids = random_walk(compiler, {"regex": pattern}, rng)
        assert re.fullmatch(pattern, text_of(compiler, ids))


def test_cached_masks_equal_checking_every_token(compiler):
    """The fast mask (per-state cache + context-dependent tokens on the stack) equals
    the reference: try every token's bytes on the matcher's real stacks."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "$ref": "#"}}, "b": {"type": "string", "maxLength": 3}}}  # fmt: skip
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    check_masks_on_a_walk(compiler, compiled, random.Random(2), 25)


def check_masks_on_a_walk(compiler, compiled, rng, steps):
    """Walk up to `steps` random allowed tokens; at each, the fast mask equals the
    tokens whose bytes advance the matcher's real stacks (and EOS once complete)."""
    index, m = compiler.index, GrammarMatcher(compiled)
    for _ in range(steps):
        fast = set(allowed_tokens(m.next_token_mask(), index.vocab_size).tolist())
        slow = {t for t, b in enumerate(index.token_bytes)
                if b and compiled.advance(m.stacks, b) is not None}  # fmt: skip
        if compiled.is_complete(m.stacks):
            slow |= set(index.eos_token_ids)
        assert fast == slow
        choices = sorted(fast - set(index.eos_token_ids))
        if not choices:
            break
        assert m.accept_token(rng.choice(choices))


def test_eos_only_when_complete(compiler):
    compiled = compiler.compile(StructuredOutputsParams(json={"type": "integer"}))
    m = GrammarMatcher(compiled)
    eos = compiler.index.eos_token_ids[0]
    assert not m.accept_token(eos)  # nothing written yet: the document is incomplete
    (one,) = [t for t, b in enumerate(compiler.index.token_bytes) if b == b"7"]
    assert m.accept_token(one) and m.accept_token(eos) and m.is_terminated()


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "contains": {"type": "string"}}, "contains"),
        ({"not": {"pattern": "a"}}, "not"),
        ({"type": "integer", "multipleOf": 7}, "multipleOf"),
        ({"type": "strnig"}, "type"),
        ({"$ref": "#/$defs/missing"}, "$ref"),
        (
            {"type": "string", "format": "email", "minLength": 250, "maxLength": 255},
            "maxLength",
        ),
    ],
)
def test_unsupported_keyword_is_named(compiler, schema, keyword):
    with pytest.raises(SchemaError) as e:
        compiler.compile(StructuredOutputsParams(json=schema))
    assert keyword in str(e.value)


def test_bitmask_equals_boolean_mask():
    vocab = 100
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, vocab, generator=g) < 0.3  # (3, vocab)
    bits = np.packbits(allowed.numpy(), axis=1, bitorder="little")  # (3, 13) uint8
    words = np.zeros((3, 4 * 4), np.uint8)
    words[:, : bits.shape[1]] = bits
    bitmask = torch.from_numpy(words.view(np.int32))  # (3, 4)
    logits = torch.randn(3, vocab, generator=g)
    expected = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(apply_token_bitmask_inplace(logits.clone(), bitmask), expected)


def test_greedy_constrained_output_is_batch_invariant():
    from minillm import LLM, SamplingParams

    llm = LLM(block_size=4, num_kv_blocks=256, max_num_seqs=8)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema)

    def constrained():
        proc = so.logits_processor(llm.tokenizer, max_tokens=40)
        return SamplingParams(temperature=0, max_tokens=40, logits_processors=[proc])

    alone = llm.generate(["Once upon a time"], constrained(), use_tqdm=False)[0]
    others = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
    mixed = llm.generate(
        ["Once upon a time", "The dog", "A cat sat", "In the"],
        [constrained(), *others],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    jsonschema.validate(json.loads(alone.outputs[0].text), schema)


def test_tokens_that_split_a_utf8_character(compiler):
    """Byte-level tokens may end inside a character: the grammar reads bytes, so a
    token holding half of "é" is allowed exactly when the rest can follow."""
    schema = {"type": "string", "pattern": "^[é漢]{2,4}$"}
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    m = GrammarMatcher(compiled)
    (quote,) = [t for t, b in enumerate(compiler.index.token_bytes) if b == b'"']
    assert m.accept_token(quote)
    allowed = allowed_tokens(m.next_token_mask(), compiler.index.vocab_size)
    first_bytes = {compiler.index.token_bytes[t][:1] for t in allowed.tolist()}
    assert first_bytes <= {"é".encode()[:1], "漢".encode()[:1]}
    halves = [t for t in allowed.tolist() if compiler.index.token_bytes[t] == b"\xc3"]
    assert halves, "the first byte of é alone is a token of a byte-level vocabulary"
    rng = random.Random(3)
    for _ in range(5):
        text = text_of(compiler, random_walk(compiler, {"json": schema}, rng, 40))
        assert re.fullmatch("[é漢]{2,4}", json.loads(text))


BATCH_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "string", "maxLength": 5},
]


def test_batch_bitmask_equals_per_row_processors(compiler):
    """One bitmask for the batch (apply_batch, through chapter 7's sampler door) masks
    exactly what each request's processor masks on its own row; rows without a
    grammar are untouched and a row with two grammars gets both masks."""
    from types import SimpleNamespace

    from minillm.logits_processors import apply_token_constraints

    rng = random.Random(0)
    procs, outputs = [], []
    for i in range(7):
        params = {"json": BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)]}
        walk = random_walk(compiler, params, rng, max_tokens=30)
        make = StructuredOutputsParams(**params).logits_processor
        procs.append(make(compiler, max_tokens=30))
        outputs.append(walk[: rng.randrange(len(walk) + 1)])
    # rows 0-6 constrained, row 7 free, row 2 with two grammars, in shuffled order
    row_procs = {6: [procs[6]], 2: [procs[2], procs[0]], 0: [procs[0]]}
    row_procs |= {r: [procs[r]] for r in (5, 1, 3, 4)}
    outs = outputs + [[]]
    logits = torch.randn(8, compiler.index.vocab_size, generator=torch.manual_seed(0))
    expected = logits.clone()
    for row, ps in row_procs.items():
        for p in ps:  # the reference: one call per row, as before
            expected[row] = p(outs[row], expected[row])
    md = SimpleNamespace(
        logits_processors=row_procs,
        output_token_ids=outs,
        allowed_token_ids_mask=None,
        banned_token_ids={},
        min_tokens={},
        bad_words_token_ids={},
        logit_bias=None,
    )
    got = apply_token_constraints(logits.clone(), md)
    assert torch.equal(got, expected)
    assert torch.equal(got[7], logits[7])
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_engine_tokens_equal_with_batch_and_per_row_masks():
    """The engine's outputs are the same whether the grammar masks are applied by one
    batch bitmask or one processor call per row (the processor hidden behind a plain
    function, which the sampler calls row by row)."""
    from minillm import LLM, SamplingParams

    llm = LLM(block_size=4, num_kv_blocks=256, max_num_seqs=8)
    prompts = ["Once upon a time", "The dog", "A cat sat", "In the"]

    def params(batched: bool) -> list:
        out = []
        for i in range(len(prompts)):
            so = StructuredOutputsParams(json=BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)])
            proc = so.logits_processor(llm.tokenizer, max_tokens=24)
            per_row = proc if batched else (lambda ids, logits, p=proc: p(ids, logits))
            out.append(SamplingParams(temperature=0, max_tokens=24,
                                      logits_processors=[per_row]))  # fmt: skip
        return out

    batch = llm.generate(prompts, params(True), use_tqdm=False)
    rows = llm.generate(prompts, params(False), use_tqdm=False)
    for b, r, i in zip(batch, rows, range(len(prompts))):
        assert b.outputs[0].token_ids == r.outputs[0].token_ids
        schema = BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)]
        jsonschema.validate(json.loads(b.outputs[0].text), schema)


def test_constrained_requests_run_ahead_like_chapter7():
    """Greedy constrained requests stay on chapter 16's run-ahead path (async
    scheduling, persistent batch): each step's mask waits for the token in flight,
    and the outputs equal chapter 9's engine, step for step."""
    from minillm import LLM, SamplingParams

    common = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8)
    prompts = ["Once upon a time", "The dog", "A cat sat", "In the", "Up"]

    def run(llm):
        params = []
        for i in range(len(prompts)):
            if i == 3:  # a free request in the same batch
                params.append(SamplingParams(temperature=0, max_tokens=20))
                continue
            so = StructuredOutputsParams(json=BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)])
            proc = so.logits_processor(llm.tokenizer, max_tokens=24)
            params.append(SamplingParams(temperature=0, max_tokens=24,
                                         logits_processors=[proc]))  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    expected = run(LLM(persistent_batch=False, **common))
    fast = LLM(persistent_batch=True, async_scheduling=True, **common)
    assert run(fast) == expected
    stepper = fast.engine.stepper
    assert stepper.num_ahead > 0 and stepper.num_in_step == 0


def test_next_masks_equal_next_token_mask(compiler):
    """prepare_batch's rows (next_masks, the common case inlined) get each
    processor's next_token_mask and leave its matcher where next_token_mask leaves
    it: outputs growing a token a step, then EOS; a token the mask forbade; an
    output that goes back (a preempted request, recomputed); one processor shared by
    two rows; with and without a finish budget."""
    from minillm.structured.processor import next_masks

    rng = random.Random(0)
    schemas = [
        *BATCH_SCHEMAS,
        {"type": "object", "properties": {"n": {"type": "integer"}}},
    ]
    eos = compiler.index.eos_token_ids[0]
    walks, made = [], []
    for i in range(5):
        params = {"json": schemas[i % len(schemas)]}
        walks.append(random_walk(compiler, params, rng, max_tokens=30) + [eos, eos])
        budget = 32 if i % 2 == 0 else None
        made.append((StructuredOutputsParams(**params), budget))

    def processors():
        procs = [so.logits_processor(compiler, max_tokens=b) for so, b in made]
        return [*procs, procs[1]]  # row 5 shares row 1's processor

    class Counted(StructuredOutputLogitsProcessor):  # counts the calls not inlined
        calls = 0

        def next_token_mask(self, output_token_ids):
            Counted.calls += 1
            return super().next_token_mask(output_token_ids)

    fast, ref = processors(), processors()
    for p in (fast[0], fast[3], fast[4]):  # rows with their own processor, no cut
        p.__class__ = Counted
    walks.append(walks[1][:3] + walks[0][3:])  # row 5: another output, same grammar
    forbidden = walks[2][:4]
    mask = ref[2].next_token_mask(forbidden)
    cut = next(t for t in range(compiler.index.vocab_size)
               if not (mask[t >> 5] >> (t & 31)) & 1)  # fmt: skip
    walks[2] = forbidden + [cut] + walks[2][4:]  # row 2 writes a forbidden token
    length = max(len(w) for w in walks)
    warm = processors()  # the grammars' caches filled, as a server's would be
    for step in range(length):
        [p.next_token_mask(w[: min(step, len(w))]) for p, w in zip(warm, walks)]
    rows = 0
    for step in [*range(length), *range(5, length)]:  # then all go back to step 5
        outs = [w[: min(step, len(w))] for w in walks]
        expected = [p.next_token_mask(o) for p, o in zip(ref, outs)]
        got = next_masks(fast, outs)
        rows += 3
        assert all(np.array_equal(g, e) for g, e in zip(got, expected)), step
        for f, r in zip(fast, ref):
            assert f.last[0] == r.last[0]
            assert (f.last[1].stacks, f.last[1].terminated) == (
                r.last[1].stacks,
                r.last[1].terminated,
            )
    assert Counted.calls < rows / 4  # most of their steps took the inlined path


OVERLAP_PROMPTS = ["Once upon a time", "The dog", "A cat sat on the mat " * 4,
                   "In the", "Up", "She said that the little bird " * 3]  # fmt: skip


def overlap_run(llm, mix: str) -> list:
    """Greedy outputs of OVERLAP_PROMPTS, every third request unconstrained unless
    mix is "constrained"; each constrained output is checked against its schema."""
    from minillm import SamplingParams

    params, schemas = [], []
    for i in range(len(OVERLAP_PROMPTS)):
        schema = BATCH_SCHEMAS[i % len(BATCH_SCHEMAS)]
        if mix != "constrained" and i % 3 == 2:  # a free request in the batch
            schema, processors = None, []
        else:
            so = StructuredOutputsParams(json=schema)
            processors = [so.logits_processor(llm.tokenizer, max_tokens=24)]
        schemas.append(schema)
        params.append(SamplingParams(temperature=0, max_tokens=24,
                                     logits_processors=processors))  # fmt: skip
    outputs = llm.generate(OVERLAP_PROMPTS, params, use_tqdm=False)
    for o, schema in zip(outputs, schemas):
        if schema is not None:
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mix", ["constrained", "mixed", "preempted"])
def test_overlapped_masks_equal_the_in_order_reference(device, mix):
    """Chapter 16's overlap (the grammar masks filled on the CPU while the step's
    forward pass runs) gives the greedy tokens of the in-order reference
    (overlap_masks=False: masks first, then the forward), alone, mixed with
    unconstrained requests, and under preemption and chunked prefill; on the CPU
    both equal chapter 9's engine. Every constrained output validates."""
    from minillm import LLM

    common = dict(device=device, block_size=4, max_num_seqs=8, num_kv_blocks=256)
    if device == "cuda":  # graphs, without compiling the layers of each engine
        common["torch_compile"] = False
    if mix == "preempted":  # too few blocks for all six; prompts in chunks of 16
        common.update(num_kv_blocks=24, max_num_batched_tokens=16)
    got = {}
    for overlap in (True, False):
        llm = LLM(persistent_batch=True, async_scheduling=True,
                  overlap_masks=overlap, **common)  # fmt: skip
        got[overlap] = overlap_run(llm, "mixed" if mix == "preempted" else mix)
        stepper = llm.engine.stepper
        assert stepper.num_ahead > 0 and stepper.num_in_step == 0
        assert (llm.engine.num_preemptions > 0) == (mix == "preempted")
    assert got[True] == got[False]
    if device == "cpu":  # float32 on both paths: chapter 9's tokens too
        chapter8 = LLM(persistent_batch=False, **common)
        assert got[True] == overlap_run(
            chapter8, "mixed" if mix == "preempted" else mix
        )


@pytest.mark.parametrize("overlap", [True, False])
def test_masks_are_filled_while_the_forward_runs(overlap, monkeypatch):
    """With overlap_masks, a launched step enqueues its forward pass before the CPU
    fills its grammar masks; the reference fills them first."""
    from minillm import LLM
    from minillm.gpu_model_runner import GPUModelRunner
    from minillm.structured.processor import StructuredOutputLogitsProcessor as Proc

    events = []

    def logged(name, f):
        def call(*args, **kwargs):
            events.append(name)
            return f(*args, **kwargs)

        return call

    monkeypatch.setattr(GPUModelRunner, "launch", logged("|", GPUModelRunner.launch))
    monkeypatch.setattr(
        GPUModelRunner, "forward", logged("forward", GPUModelRunner.forward)
    )
    monkeypatch.setattr(
        Proc, "prepare_batch", staticmethod(logged("masks", Proc.prepare_batch))
    )
    llm = LLM(block_size=4, num_kv_blocks=256, max_num_seqs=8, persistent_batch=True,
              async_scheduling=True, overlap_masks=overlap)  # fmt: skip
    overlap_run(llm, "mixed")
    steps = [s.split() for s in " ".join(events).split("|")[1:]]
    masked = [s for s in steps if "masks" in s]
    assert masked and all(len(s) == 2 for s in masked)
    expected = ["forward", "masks"] if overlap else ["masks", "forward"]
    assert all(s == expected for s in masked)


def test_processor_pickles_as_its_constraint(compiler, tiny):
    import pickle

    from minillm.structured import processor as proc_mod

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    proc = StructuredOutputsParams(json=schema).logits_processor(compiler, 16)
    proc.next_token_mask([])  # a matcher seen: it stays behind, replayed later
    sent = pickle.dumps(proc)
    whole = pickle.dumps(proc_mod.StructuredOutputLogitsProcessor(proc.compiled, 16))
    assert len(sent) < 2_000 < len(whole)
    back = pickle.loads(sent)
    # compiled by this process's first compiler of the vocabulary, then cached
    assert pickle.loads(sent).compiled is back.compiled and back.max_tokens == 16
    assert not back.prefixes
    assert (back.next_token_mask([]) == proc.next_token_mask([])).all()
    # another process: no compiler yet, only the registered tokenizer
    saved, tokenizers = dict(proc_mod.COMPILERS), list(proc_mod._TOKENIZERS)
    try:
        proc_mod.COMPILERS.clear()
        proc_mod._TOKENIZERS.clear()
        with pytest.raises(proc_mod.GrammarError, match="register_tokenizer"):
            pickle.loads(sent)
        proc_mod.compiler_for.cache_clear()
        proc_mod.register_tokenizer(tiny[1])
        elsewhere = pickle.loads(sent)
        assert elsewhere.compiled is not back.compiled  # compiled again, here
        assert (elsewhere.next_token_mask([]) == proc.next_token_mask([])).all()
    finally:
        proc_mod.COMPILERS.clear()
        proc_mod.COMPILERS.update(saved)
        proc_mod._TOKENIZERS[:] = tokenizers


LONG_KEYS = [f"a_rather_long_property_{i}" for i in range(6)]


def long_keys_processor(compiler, max_tokens):
    """Six required properties with long names that are tokens of their own (added to
    the tiny vocabulary): the shortest document is about 180 bytes but 40-odd tokens,
    as a real schema's keys are a few tokens each (JSONSchemaBench's o43230, say)."""
    from minillm.structured.grammar import Grammar
    from minillm.structured.matcher import CompiledGrammar
    from minillm.structured.processor import StructuredOutputLogitsProcessor
    from minillm.structured.token_index import TokenIndex

    base = compiler.index
    vocab = list(base.token_bytes) + [k.encode() for k in LONG_KEYS]
    index = TokenIndex(vocab, base.eos_token_ids, len(vocab))
    schema = {
        "type": "object",
        "properties": {k: {"type": "string"} for k in LONG_KEYS},
        "required": LONG_KEYS,
        "additionalProperties": False,
    }
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = CompiledGrammar(Grammar(params.rules()), index)
    return schema, StructuredOutputLogitsProcessor(compiled, max_tokens)


def test_budget_finishes_where_bytes_would_not_fit(compiler):
    """Regression: the budget counted bytes (single-byte tokens), so a schema whose
    shortest document has more bytes than max_tokens got no budget at all (the mask
    fell back to the grammar's) and random walks ran out inside a string. Counted in
    tokens it fits, and every walk finishes by max_tokens and validates."""
    from minillm.structured.budget import byte_steps

    max_tokens = 60
    schema, proc = long_keys_processor(compiler, max_tokens)
    c, eos = proc.compiled, set(proc.compiled.index.eos_token_ids)
    assert byte_steps(c)[0][c.initial[0][-1]] > 3 * max_tokens  # bytes: no room
    assert proc.budget.min_tokens(c.initial) < max_tokens
    for seed in range(4):
        rng, out = random.Random(seed), []
        for _ in range(max_tokens + 1):
            allowed = allowed_tokens(proc.next_token_mask(out), c.index.vocab_size)
            token = rng.choice(allowed.tolist())
            if token in eos:
                break
            out.append(token)
        assert len(out) <= max_tokens and c.is_complete(proc.matcher(out).stacks)
        text = b"".join(c.index.token_bytes[t] for t in out).decode()
        jsonschema.validate(json.loads(text), schema)


def test_max_tokens_below_the_budget_is_refused(compiler):
    """A max_tokens below what the budget needs to finish the document is a clear
    error when the request is made (not a silent cut-off); at the need it is not."""
    from minillm.structured.ir import GrammarError

    _, proc = long_keys_processor(compiler, 1000)
    need = proc.budget.min_tokens(proc.compiled.initial)
    with pytest.raises(GrammarError, match=f"max_tokens={need - 1} .*{need} tokens"):
        long_keys_processor(compiler, need - 1)
    assert long_keys_processor(compiler, need)[1].next_token_mask([]).any()
    # 22 bytes or more in one token: no way at all, and it says so
    short = StructuredOutputsParams(json={"type": "string", "minLength": 20})
    with pytest.raises(GrammarError, match="max_tokens=1 is too few"):
        short.logits_processor(compiler, max_tokens=1)


@settings(max_examples=30, deadline=None)
@given(
    lo=st.integers(0, 6),
    span=st.one_of(st.none(), st.integers(0, 6)),
    pattern=st.sampled_from([None, "^[a-c]+$", "x", "^(ab|c)*$"]),
    texts=st.lists(st.text(alphabet='abcx"\\\u00e9\u0001', max_size=14), max_size=12),
)
def test_counted_strings_equal_the_unrolled_expression(lo, span, pattern, texts):
    """json_string's directly built automaton (layers of one character's states)
    accepts exactly what the unrolled "char{lo,hi}" expression, with its pattern,
    accepts; for a bound it has the same (minimal) number of states."""
    from minillm.structured import charset as cs
    from minillm.structured.fsm import determinize
    from minillm.structured.ir import And, Rep, lit, seq
    from minillm.structured.json_text import json_char, json_string
    from minillm.structured.regex import regex_expr

    hi = None if span is None else lo + span
    body = Rep(json_char(cs.ANY), lo, hi)
    if pattern is not None:
        body = And(regex_expr(pattern, json_char, search=True), body)
    unrolled = determinize(seq(lit('"'), body, lit('"')))
    direct = json_string(lo, hi, pattern)
    if pattern is None and hi is not None:
        assert direct.num_states == unrolled.num_states
    for text in texts + ["a" * lo, "c" * (hi or lo + 3)]:
        data = json.dumps(text, ensure_ascii=False).encode()
        assert direct.matches(data) == unrolled.matches(data), (text, lo, hi)


def test_long_strings_compile_and_validate(compiler):
    """maxLength 255 (13 s to compile when unrolled) is a few seconds at most; two
    properties share one rule for it; every walk's output validates."""
    import time

    long = {"type": "string", "maxLength": 255}
    schema = {
        "type": "object",
        "properties": {"a": long, "b": long, "c": {**long, "pattern": "^[^,]+$"}},
        "required": ["a", "b", "c"],
        "additionalProperties": False,
    }
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    t0 = time.perf_counter()
    compiled = compiler.compile(params)
    assert time.perf_counter() - t0 < 8  # shared 2-core CI machines: a loose bound
    assert [n for n in compiled.grammar.names if n.startswith("string:")] == [
        "string:0",
        "string:1",
    ]  # a and b call one rule, c (with its pattern) another
    rng = random.Random(3)
    for _ in range(3):
        ids = random_walk(compiler, {"json": schema, "disable_any_whitespace": True},
                          rng, max_tokens=120)  # fmt: skip
        jsonschema.validate(json.loads(text_of(compiler, ids)), schema)


DEPENDENT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                   "c": {"type": "null"}, "d": {"enum": [1, 2]}},
    "required": ["a"],
}  # fmt: skip


@pytest.mark.parametrize(
    "deps, draft",
    [
        ({"dependencies": {"a": ["b"], "b": ["c"]}}, jsonschema.Draft7Validator),
        ({"dependentRequired": {"a": ["d"]}}, jsonschema.Draft202012Validator),
        ({"dependencies": {"c": ["a"], "zz": ["d"]}}, jsonschema.Draft7Validator),
    ],
)
def test_dependencies_folded_into_required_validate(compiler, deps, draft):
    """A required trigger's keys become required (to a fixpoint: a -> b -> c); a
    trigger whose keys are required, or that can never be written (zz: not a
    property, no additional ones), needs nothing. Every output validates under the
    draft that defines the keyword, and carries the keys it must."""
    schema = {**DEPENDENT, **deps}
    rng = random.Random(4)
    for _ in range(6):
        ids = random_walk(compiler, {"json": schema}, rng, max_tokens=60)
        value = json.loads(text_of(compiler, ids))
        draft(schema).validate(value)
        if "b" in deps.get("dependencies", {}):
            assert {"a", "b", "c"} <= value.keys()


@pytest.mark.parametrize(
    "deps",
    [
        {"dependencies": {"b": ["c"]}},  # optional trigger, optional key
        {"dependentRequired": {"zz": ["b"]}, "additionalProperties": True},
        {"dependencies": {"a": {"required": ["b"]}}},  # the schema form
    ],
)
def test_conditional_dependencies_never_write_their_trigger(compiler, deps):
    """An optional trigger of a condition is left out (exact, narrower): outputs
    validate (draft 7 defines `dependencies`) and never hold the trigger."""
    schema, rng = {**DEPENDENT, **deps}, random.Random(5)
    trigger = next(iter(next(iter(deps.values()))))
    for _ in range(4):
        ids = random_walk(compiler, {"json": schema}, rng, max_tokens=60)
        value = json.loads(text_of(compiler, ids))
        jsonschema.Draft7Validator(schema).validate(value)
        assert trigger not in value or trigger == "a"  # a: required, with its keys


def branch(key):
    return {
        "type": "object",
        "properties": {key: {"type": "string"}},
        "required": [key],
    }


def test_oneof_of_objects_told_apart_by_required_keys(compiler):
    """Strict grammar: each branch writes only its own key, which the other requires
    absent, so every output matches exactly one branch; outputs validate."""
    schema = {"oneOf": [branch("cityId"), branch("regionId"), {"type": "null"}]}
    rng, seen = random.Random(5), set()
    for _ in range(8):
        ids = random_walk(compiler, {"json": schema}, rng, max_tokens=40)
        value = json.loads(text_of(compiler, ids))
        jsonschema.validate(value, schema)
        seen.add(next(iter(value)) if isinstance(value, dict) else None)
    assert len(seen) >= 2  # more than one branch was taken


@pytest.mark.parametrize(
    "other",
    [
        {**branch("regionId"), "additionalProperties": True},  # may write cityId
        {
            "type": "object",
            "properties": {
                "cityId": {"type": "string"},
                "regionId": {"type": "string"},
            },
            "required": ["regionId"],
        },  # fmt: skip
    ],
)
def test_oneof_that_may_overlap_is_read_as_anyof_with_a_warning(compiler, other):
    """As xgrammar and vLLM do: a warning names the approximation, and outputs
    validate against the guaranteed schema (oneOf read as anyOf)."""
    schema = {"oneOf": [branch("cityId"), other]}
    with pytest.warns(SchemaWarning, match="oneOf read as anyOf"):
        StructuredOutputsParams(json=schema).rules()
    rng = random.Random(6)
    for _ in range(4):
        ids = random_walk(compiler, {"json": schema}, rng, max_tokens=40)
        jsonschema.validate(json.loads(text_of(compiler, ids)), guaranteed(schema))


# The compile path before its speed-ups, kept as the reference: each embedding of a
# DFA read its class runs anew, trimming built its predecessor lists and successor
# sets row by row, byte_steps' fixpoint read every (state, byte) pair, and
# token_distances looked tokens and their prefixes up in sets of all of them.
def reference_coreachable(automaton):
    preds = [[] for _ in range(automaton.num_states)]
    for src, row in enumerate(automaton.trans.tolist()):
        for dst in set(row):
            if dst >= 0:
                preds[dst].append(src)
    for src, calls in enumerate(automaton.calls):
        for _, dst in calls:
            preds[dst].append(src)
    alive = automaton.accepting.copy()
    stack = np.flatnonzero(alive).tolist()
    while stack:
        for p in preds[stack.pop()]:
            if not alive[p]:
                alive[p] = True
                stack.append(p)
    return alive


def reference_reachable(automaton):
    rows = automaton.trans.tolist()
    seen = [False] * automaton.num_states
    seen[0], stack = True, [0]
    while stack:
        s = stack.pop()
        for t in set(rows[s]).union(d for _, d in automaton.calls[s]):
            if t >= 0 and not seen[t]:
                seen[t] = True
                stack.append(t)
    return np.array(seen)


def reference_add_dfa(nfa, dfa):
    states = [nfa.state() for _ in range(dfa.num_states)]
    end = nfa.state()
    runs = dfa.class_runs()
    for i, row in enumerate(dfa.trans.tolist()):
        for c, dst in enumerate(row):
            if dst >= 0:
                nfa.edges[states[i]] += [(lo, hi, states[dst]) for lo, hi in runs[c]]
        if dfa.accepting[i]:
            nfa.eps[states[i]].append(end)
    return states[0], end


def reference_byte_steps(compiled):
    g, first = compiled.grammar, compiled.index.levels[0]
    byte_ids = first.byte[first.count > 0].astype(np.int64)
    moves = g.table[:, byte_ids]
    calls = [(s, c, r) for s, cs in enumerate(g.calls) for c, r in cs]
    calls = np.array(calls, np.int64).reshape(-1, 3)
    dist = np.where(g.accepting, 0, budget.INF).astype(np.int64)
    dist[g.SINK] = budget.INF
    while True:
        new = np.minimum(dist, 1 + dist[moves].min(axis=1, initial=budget.INF))
        np.minimum.at(new, calls[:, 0], dist[calls[:, 1]] + dist[calls[:, 2]])
        new[g.SINK] = budget.INF
        if (new == dist).all():
            break
        dist = new
    best, steps = dist[moves].argmin(axis=1), [None] * len(dist)
    for s in np.flatnonzero((dist > 0) & (dist < budget.INF)).tolist():
        if 1 + dist[moves[s, best[s]]] == dist[s]:
            steps[s] = (int(byte_ids[best[s]]), int(moves[s, best[s]]))
        else:
            steps[s] = next(
                (None, c, r) for c, r in g.calls[s] if dist[c] + dist[r] == dist[s]
            )
    return dist, steps


def reference_token_distances(compiled):
    dist, steps = reference_byte_steps(compiled)
    tokens = {b for b in compiled.index.token_bytes if b}
    prefixes = {t[:i] for t in tokens for i in range(1, len(t) + 1)}
    out = np.where(dist == 0, 0, budget.INF).astype(np.int64)
    order = [
        s for s in np.argsort(dist, kind="stable").tolist() if 0 < dist[s] < budget.INF
    ]
    while True:
        before = out.copy()
        for s in order:
            if steps[s][0] is None:
                out[s] = min(out[s], out[steps[s][1]] + out[steps[s][2]])
                continue
            text, path, t = b"", [s], s
            while steps[t] is not None and steps[t][0] is not None:
                longer = text + bytes([steps[t][0]])
                if longer not in prefixes:
                    break
                text, t = longer, steps[t][1]
                path.append(t)
            n = max(i for i in range(1, len(text) + 1) if text[:i] in tokens)
            out[s] = min(out[s], 1 + out[path[n]])
        if (out == before).all():
            break
    return out


COMPILE_SCHEMAS = [
    *BATCH_SCHEMAS,
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
     "event": {"type": "string", "maxLength": 12}}, "required": ["date", "event"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
     "n": {"type": "number", "minimum": 0, "maximum": 1}, "tags": {"type": "array",
     "items": {"enum": ["a", "bc", 3]}, "maxItems": 2}}, "required": ["id"]},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}},
     "b": {"type": "string", "pattern": "^[a-z]{2,5}[0-9]?$"}}},
    {"type": "object", "properties": {"x": {}, "y": {"type": "string"}}},
]  # fmt: skip


def compile_afresh(params, index):
    """Compiled without the automata that json_text caches across schemas."""
    for cached in (json_text.json_string, json_text.json_format, json_text.json_number):
        cached.cache_clear()
    return CompiledGrammar(Grammar(params.rules()), index)


@pytest.mark.parametrize("schema", COMPILE_SCHEMAS)
def test_compile_speedups_change_no_table_distance_or_mask(
    compiler, schema, monkeypatch
):
    """The compile path as it was (reference_* above) and as it is build the same
    grammar table, the same finish distances, and for every state the same token
    mask, uncertain tokens and budget masks."""
    params = StructuredOutputsParams(json=schema)
    fast = compile_afresh(params, compiler.index)
    with monkeypatch.context() as patch:
        patch.setattr(NFA, "add_dfa", reference_add_dfa)
        patch.setattr(dfa, "coreachable", reference_coreachable)
        patch.setattr(grammar, "coreachable", reference_coreachable)
        patch.setattr(dfa, "reachable", reference_reachable)
        ref = compile_afresh(params, compiler.index)
    a, b = fast.grammar, ref.grammar
    assert np.array_equal(a.table, b.table) and np.array_equal(a.accepting, b.accepting)
    assert a.calls == b.calls and np.array_equal(a.is_event, b.is_event)
    dist, steps = budget.byte_steps(fast)
    ref_dist, ref_steps = reference_byte_steps(ref)
    assert np.array_equal(dist, ref_dist) and steps == ref_steps
    fast_budget, ref_budget = budget.FinishBudget(fast), budget.FinishBudget(ref)
    ref_budget.dist = reference_token_distances(ref)
    assert np.array_equal(fast_budget.dist, ref_budget.dist)
    for g in range(a.num_states):
        (words, unsure), (ref_words, ref_unsure) = fast.state_mask(g), ref.state_mask(g)
        assert np.array_equal(words, ref_words) and np.array_equal(unsure, ref_unsure)
        stacks = ((g,),)
        for remaining in (1, 2, 3, 5, 8, 30):
            assert np.array_equal(
                fast_budget.mask(stacks, remaining), ref_budget.mask(stacks, remaining)
            )
