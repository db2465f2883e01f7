"""Chapter 24 through vLLM's offline API: `SamplingParams(structured_outputs=...)` in
`LLM.generate`, applied by chapter 24's REQUEST_HOOKS entry. Every finished output
validates; the hook's path gives the tokens of an explicit processor (the reference);
a bad constraint is a ValueError naming structured_outputs that changes nothing."""

import json
import re

import jsonschema
import pytest

from minillm import LLM, SamplingParams
from minillm.registry import REQUEST_HOOKS
from minillm.sampling_params import StructuredOutputsParams
from minillm.structured import processor as chapter16

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["The while statement", "A list is", "def f(x):"]


@pytest.fixture(scope="module")
def llm(device):
    with LLM(device=device, dtype="float32", max_num_seqs=8, num_kv_blocks=256) as llm:
        yield llm


def structured(so, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 48)
    return SamplingParams(structured_outputs=so, **kwargs)


def test_the_hook_is_registered_once():
    hooks = [h for h in REQUEST_HOOKS if h.__name__ == "structured_outputs_hook"]
    assert hooks == [chapter16.structured_outputs_hook]


@pytest.mark.parametrize("compact", [False, True])
def test_every_finished_output_validates(llm, compact):
    """Sampled (n=3 per prompt, so three grammar states share one request's
    processor) and several prompts under one SamplingParams."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact)
    params = structured(so, n=3, temperature=1.0, seed=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [3] * len(PROMPTS)
    texts = [c.text for o in outputs for c in o.outputs]
    for o in outputs:
        for c in o.outputs:
            # finished by EOS, or at max_tokens: the budget (chapter 24) leaves
            # room to close the document within max_tokens, so both validate
            assert c.finish_reason in ("stop", "length")
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(set(texts)) > 1  # sampled: the choices are not one text repeated
    assert params.logits_processors == []  # the caller's params are not changed


def test_a_json_string_schema_and_json_object(llm):
    for so, check in [
        (StructuredOutputsParams(json=json.dumps(SCHEMA)), SCHEMA),
        (StructuredOutputsParams(json_object=True), {"type": "object"}),
    ]:
        out = llm.generate(PROMPTS[:1], structured(so, temperature=0), use_tqdm=False)
        c = out[0].outputs[0]
        jsonschema.validate(json.loads(c.text), check)


def test_the_hook_gives_the_tokens_of_an_explicit_processor(llm):
    """The reference: chapter 24's processor put in logits_processors by hand (the
    same batch, so that the same rows meet the same matrix products)."""
    so = StructuredOutputsParams(json=SCHEMA)
    via_field = llm.generate(PROMPTS, structured(so, temperature=0), use_tqdm=False)
    by_hand = llm.generate(
        PROMPTS,
        [
            SamplingParams(
                temperature=0,
                max_tokens=48,
                logits_processors=[chapter16.logits_processor(so, llm.tokenizer, 48)],
            )
            for _ in PROMPTS
        ],
        use_tqdm=False,
    )
    for a, b in zip(via_field, by_hand):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_regex_and_choice(llm):
    pattern = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,3}"
    so = StructuredOutputsParams(regex=pattern)
    for o in llm.generate(PROMPTS, structured(so, temperature=1.0, seed=3),
                          use_tqdm=False):  # fmt: skip
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    choice = ["yes", "no", "maybe so"]
    so = StructuredOutputsParams(choice=choice)
    params = structured(so, n=4, temperature=1.0, seed=0)
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        assert all(c.text in choice and c.finish_reason == "stop" for c in o.outputs)


def test_chapter_15s_subclass_is_the_same_constraint(llm):
    so = chapter16.StructuredOutputsParams(choice=["left", "right"])
    assert isinstance(so, StructuredOutputsParams) and so.kind == "choice"
    assert so.key() == chapter16.constraint_key(StructuredOutputsParams(**vars(so)))
    out = llm.generate(PROMPTS[:1], structured(so, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].text in ("left", "right")


@pytest.mark.parametrize(
    "so, words",
    [
        (
            StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}),
            "multipleOf",
        ),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(grammar="root ::= 'a'"), "grammar is not supported"),
        (StructuredOutputsParams(choice=[]), "choice"),
        (StructuredOutputsParams(regex="(unclosed"), ""),
    ],
)
def test_a_bad_constraint_is_a_value_error_and_changes_nothing(llm, so, words):
    op = llm.engine.output_processor
    before = (set(op.request_states), set(op.parents))
    params = structured(so)
    with pytest.raises(ValueError, match=r"^structured_outputs: .*" + re.escape(words)):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert (set(op.request_states), set(op.parents)) == before == (set(), set())
    assert params.logits_processors == []
    ok = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0),
                      use_tqdm=False)  # fmt: skip
    assert len(ok[0].outputs[0].token_ids) >= 1  # the engine still serves


def test_max_tokens_too_small_to_finish_is_refused(llm):
    so = StructuredOutputsParams(json={"type": "string", "minLength": 20})
    with pytest.raises(ValueError, match="structured_outputs: .*max_tokens=2"):
        llm.generate(PROMPTS[:1], structured(so, max_tokens=2), use_tqdm=False)


def test_a_request_is_not_constrained_twice(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    once = chapter16.structured_outputs_hook(llm.engine, structured(so))
    assert len(once.logits_processors) == 1 and once.structured_outputs is so
    assert chapter16.structured_outputs_hook(llm.engine, once) is once
    # an equal constraint (another object) counts as the same one
    again = structured(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA))))
    processors = once.logits_processors
    from dataclasses import replace

    assert chapter16.constrained_by(replace(again, logits_processors=processors),
                                    again.structured_outputs)  # fmt: skip
    # a different constraint beside it is added
    other = replace(once, structured_outputs=StructuredOutputsParams(json_object=True))
    assert (
        len(chapter16.structured_outputs_hook(llm.engine, other).logits_processors) == 2
    )
    # and the engine runs the pre-constrained params with one mask: same tokens
    a = llm.generate(PROMPTS[:1], replace(once, temperature=0), use_tqdm=False)
    b = llm.generate(PROMPTS[:1], structured(so, temperature=0), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_constrained_params_pickle_and_compile_again(llm):
    """The engine in a process of its own (chapter 28) receives pickled params: the
    processor comes back compiled from its source, and the hook sees it there."""
    import pickle

    chapter16.register_tokenizer(llm.tokenizer)
    once = chapter16.structured_outputs_hook(
        llm.engine, structured(StructuredOutputsParams(json=SCHEMA))
    )
    back = pickle.loads(pickle.dumps(once))
    assert chapter16.structured_outputs_hook(llm.engine, back) is back
    a = llm.generate(PROMPTS[:1], structured(back.structured_outputs, temperature=0),
                     use_tqdm=False)  # fmt: skip
    b = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=48, logits_processors=back.logits_processors),
        use_tqdm=False)  # fmt: skip
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_chapter_11s_runner_and_run_ahead_apply_the_hook_too(device):
    """The persistent batch with async scheduling (chapter 16) masks the rows of
    the hook's processors as it masks an explicit processor's: the same tokens."""
    so = StructuredOutputsParams(json=SCHEMA)
    with LLM(
        device=device,
        dtype="float32",
        max_num_seqs=8,
        num_kv_blocks=256,
        persistent_batch=True,
        async_scheduling=True,
    ) as ahead:
        via_field = ahead.generate(
            PROMPTS, structured(so, temperature=0), use_tqdm=False
        )
        processor = chapter16.logits_processor(so, ahead.tokenizer, 48)
        by_hand = ahead.generate(
            PROMPTS,
            SamplingParams(temperature=0, max_tokens=48, logits_processors=[processor]),
            use_tqdm=False,
        )
    for a, b in zip(via_field, by_hand):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        jsonschema.validate(json.loads(a.outputs[0].text), SCHEMA)
