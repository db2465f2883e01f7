"""Chapter 23, the keywords of real-world schemas (issue 47): each compiles to a
grammar whose every finished output validates (jsonschema, formats checked), the
masks stay exact on grammars of many rules, and what a grammar cannot hold is
refused by name or approximated with a warning that `guaranteed` reflects."""

import json
import random
import warnings

import jsonschema
import pytest

from minillm.structured.grammar import Grammar
from minillm.structured.ir import GrammarError
from minillm.structured.json_schema import JsonOptions, SchemaCompiler
from minillm.structured.processor import GrammarCompiler, StructuredOutputsParams
from minillm.structured.schema_ops import SchemaError, SchemaWarning, guaranteed
from tests.test_structured_output import check_masks_on_a_walk, random_walk, text_of

CHECK = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1])


def outputs(compiler, schema, n=4, seed=0, max_tokens=80):
    rng = random.Random(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaWarning)
        walks = [
            random_walk(compiler, {"json": schema}, rng, max_tokens) for _ in "x" * n
        ]
    return [json.loads(text_of(compiler, ids)) for ids in walks]


KEYWORDS = {
    "patternProperties": {"type": "object", "properties": {"id": {"type": "integer"}},
        "patternProperties": {"^x-": {"type": "boolean"}, "^n": {"type": "null"}},
        "required": ["id"], "minProperties": 2, "additionalProperties": False},
    "additionalProperties schema": {"type": "object", "minProperties": 2,
        "properties": {"a": {"type": "null"}},
        "additionalProperties": {"enum": [1, 2]}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,3}$"},
        "additionalProperties": {"type": "boolean"}, "minProperties": 1},
    "maxProperties": {"type": "object", "additionalProperties": {"type": "null"},
        "minProperties": 1, "maxProperties": 2},
    "dependentSchemas": {"type": "object", "required": ["a"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "dependentSchemas": {"a": {"properties": {"a": {"minimum": 5, "maximum": 6}}},
                             "b": {"required": ["c"]}}},
    "if/then/else": {"type": "object", "required": ["k", "v"],
        "properties": {"k": {"enum": ["n", "s"]}, "v": {}},
        "if": {"properties": {"k": {"const": "n"}}},
        "then": {"properties": {"v": {"type": "integer"}}},
        "else": {"properties": {"v": {"type": "string"}}}},
    "allOf of objects": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"a": {"minimum": 0}, "b": {"type": "null"}},
         "required": ["b"]}]},
    "formats": {"type": "array", "prefixItems": [{"format": "ipv6", "type": "string"},
        {"type": "string", "format": "hostname"}, {"type": "string",
        "format": "uri-reference"}, {"type": "string", "format": "idn-hostname"}],
        "items": False, "minItems": 4},
    "multipleOf": {"type": "array", "prefixItems": [
        {"type": "number", "multipleOf": 0.01, "minimum": -5, "maximum": 5},
        {"type": "integer", "multipleOf": 16, "minimum": 0, "exclusiveMaximum": 64}],
        "items": False, "minItems": 2},
    "nested arrays of objects": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "required": ["p"], "properties": {"p": {"type": "array",
        "maxItems": 2, "items": {"type": "object", "properties": {
            "q": {"type": "integer", "minimum": 0, "maximum": 9}}}}}}},
}  # fmt: skip


@pytest.mark.parametrize("name", list(KEYWORDS))
def test_keyword_outputs_validate(compiler, name):
    schema = KEYWORDS[name]
    for value in outputs(compiler, schema):
        jsonschema.validate(value, schema, format_checker=CHECK)


def test_keywords_constrain_what_is_written(compiler):
    """Not vacuous: the constrained keys and counts show up in the outputs."""
    values = outputs(compiler, KEYWORDS["patternProperties"], n=6, seed=3)
    assert any(k.startswith(("x-", "n")) for v in values for k in v)
    for v in outputs(compiler, KEYWORDS["maxProperties"], n=6, seed=4):
        assert 1 <= len(v) <= 2
    for v in outputs(compiler, KEYWORDS["if/then/else"], n=4, seed=5):
        assert v["k"] == "n" and isinstance(v["v"], int)  # if and then: narrower


def test_masks_exact_across_many_rules(compiler):
    """Every token the cached mask allows can be read on the real stacks, and no
    other can, on a grammar of nested object and array rules."""
    schema = KEYWORDS["nested arrays of objects"]
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    assert len(compiled.grammar.names) >= 3  # a rule per object / array schema
    check_masks_on_a_walk(compiler, compiled, random.Random(7), 20)


def test_rules_keep_repetition_from_multiplying_states():
    item = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}}
    sizes = {}
    for n in (2, 8):
        for per_rule in (False, True):
            rules = SchemaCompiler(
                {"type": "array", "items": item, "maxItems": n},
                JsonOptions(rule_per_schema=per_rule),
            ).rules()
            sizes[n, per_rule] = Grammar(rules).num_states  # fmt: skip
    inlined, rules = (sizes[8, r] - sizes[2, r] for r in (False, True))
    assert inlined / 6 > 10  # an item's states per item allowed
    assert rules / 6 <= 2  # a counter's step per item: one call, one comma


def test_approximations_warn_and_guaranteed_holds(compiler):
    schema = {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True,
              "minItems": 2, "maxItems": 4}  # fmt: skip
    with pytest.warns(SchemaWarning, match="uniqueItems"):
        SchemaCompiler(schema).rules()
    assert guaranteed(schema) == {k: v for k, v in schema.items() if k != "uniqueItems"}
    for value in outputs(compiler, schema, n=3):
        jsonschema.validate(value, guaranteed(schema))
    one = {"oneOf": [{"type": "integer"}, {"type": "number"}], "anyOf": [{}]}
    assert guaranteed(one) == {"anyOf": [{}], "allOf": [{"anyOf": one["oneOf"]}]}


def test_unknown_keywords_warn_and_constraining_ones_are_refused():
    with pytest.warns(SchemaWarning, match="x-internal"):
        SchemaCompiler({"type": "integer", "x-internal": {"not": 1}}).rules()
    with pytest.warns(SchemaWarning, match="format 'color'"):
        SchemaCompiler({"type": "string", "format": "color"}).rules()
    for schema, key in (({"not": {"pattern": "a"}}, "not"),
                        ({"type": "array", "contains": {}}, "contains")):  # fmt: skip
        with pytest.raises(SchemaError) as e:
            SchemaCompiler(schema).rules()
        assert e.value.keyword == key


def test_optional_trigger_is_never_written(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "null"},
              "b": {"type": "null"}}, "dependentRequired": {"a": ["b"]},
              "additionalProperties": {"type": "null"}}  # fmt: skip
    for value in outputs(compiler, schema, n=5, seed=9):
        assert "a" not in value
        jsonschema.validate(value, schema)


def test_integers_are_multiples_of_inverse_steps_under_float_division():
    """jsonschema divides floats (instance / step must be whole): every integer the
    grammar may write for multipleOf 0.01 / 0.1 / 0.25 passes that check."""
    import numpy as np

    n = np.arange(-(10**6), 10**6, dtype=np.float64)
    for step in (0.01, 0.1, 0.25, 0.5, 0.2, 0.05):
        q = n / step
        assert (np.trunc(q) == q).all(), step
    refused = {"type": "number", "multipleOf": 0.3}
    with pytest.raises(SchemaError, match="multipleOf"):
        SchemaCompiler(refused).rules()


def test_coverage_benchmark_tells_approximated_from_invalid():
    """benchmarks/schema_coverage.py: an output that fails only a stated
    approximation is counted apart; anything else that fails is invalid."""
    from benchmarks.schema_coverage import checker, judge, mask_percentiles
    from benchmarks.schema_coverage import relaxed_checker

    schema = {"type": "array", "uniqueItems": True}
    texts = ["[1, 1]", "[1, 2]", "{}"]
    outs = [{"end": "finished", "text": t} for t in texts] + [{"end": "over_budget"}]
    got = judge(checker(schema), outs, relaxed_checker(schema))
    assert got == ["approximated", "valid", "invalid", "over_budget"]
    assert relaxed_checker({"type": "array"}) is None  # nothing approximated
    p = mask_percentiles([1.0] * 99 + [50.0])
    assert (p["mask_us_p50"], p["mask_us_p99"], p["mask_steps"]) == (1.0, 50.0, 100)


NOTS = {
    "not {}": {"type": "object",
               "properties": {"a": {"not": {}}, "b": {"type": "null"}}},
    "not type": {"not": {"type": ["string", "object", "array", "number"]}},
    "not required": {"type": "object", "properties": {"a": {"type": "null"},
                     "b": {"type": "null"}}, "required": ["a"],
                     "not": {"anyOf": [{"required": ["b"]}, {"allOf": []}]},
                     "additionalProperties": {"type": "null"}},
    "not allOf required": {"type": "object", "required": ["a"],
                           "additionalProperties": {"type": "boolean"},
                           "not": {"allOf": [{"required": ["a"]},
                                             {"required": ["c"]}]}},
}  # fmt: skip


@pytest.mark.parametrize("name", ["not {}", "not type", "not allOf required"])
def test_not_forms_validate(compiler, name):
    schema = NOTS[name]
    values = outputs(compiler, schema, n=4, seed=11)
    for value in values:
        jsonschema.validate(value, schema)
    if name == "not {}":
        assert all("a" not in v for v in values)
    if name == "not allOf required":
        assert all("c" not in v for v in values)


def test_not_of_a_required_key_that_must_be_written_admits_nothing():
    schema = {"type": "object", "required": ["a"], "not": {"required": ["a"]}}
    with pytest.raises(GrammarError, match="admits no value"):
        Grammar(SchemaCompiler(schema).rules())


def test_conditionals_whose_if_the_rest_excludes_take_else(compiler):
    """allOf of if/thens keyed on one required property: the first `if` that
    can hold is taken with its `then`; the others' `if`s are then provably false,
    and their `else`s hold (each output validates, none is refused)."""
    schema = {"type": "object", "required": ["kind", "v"],
              "properties": {"kind": {"enum": ["a", "b"]}, "v": {}},
              "allOf": [
                  {"if": {"properties": {"kind": {"const": "a"}}},
                   "then": {"properties": {"v": {"type": "integer"}}}},
                  {"if": {"properties": {"kind": {"const": "b"}}},
                   "then": {"properties": {"v": {"type": "string"}}},
                   "else": {"properties": {"v": {"minimum": 3,
                                                 "maximum": 4}}}}]}  # fmt: skip
    for value in outputs(compiler, schema, n=4, seed=12):
        jsonschema.validate(value, schema)
        assert value["kind"] == "a" and value["v"] in (3, 4)
