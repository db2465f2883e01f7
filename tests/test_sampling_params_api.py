"""SamplingParams as vLLM 0.32's (vllm/sampling_params.py): its fields, what each
means in the engine, and a ValueError naming the field for anything minillm does not
take (issue 43). The sampler's new rules (logit_bias, bad words) are checked against
the one-request reference of chapter 7."""

import random

import pytest
import torch

from minillm.llm import LLM
from minillm.sampler import Sampler
from minillm.sampler_reference import reference_probs
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampling_params import (
    VLLM_ONLY_FIELDS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
    UnknownParameterError,
)

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def tokens_of(llm, prompt, **kwargs):
    out = llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)[0]
    return out.outputs[0]


# ---------------------------------------------------------------------------------
# The fields and their checks


def test_vllm_field_names_and_defaults():
    p = SamplingParams()
    expected = dict(
        n=1,
        prompt_logprobs=None,
        bad_words=[],
        detokenize=True,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=False,
        logit_bias=None,
        allowed_token_ids=None,
        structured_outputs=None,
        output_kind="cumulative",
    )
    assert {k: getattr(p, k) for k in expected} == expected


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(best_of=2), "best_of"),  # vLLM 0.32 has no best_of: unknown there too
        (dict(truncate_prompt_tokens=8), "truncate_prompt_tokens"),
        (dict(guided_decoding={"regex": "a"}), "guided_decoding"),
        (dict(max_token=3), "max_token"),
        (dict(watermarking=True), "watermarking"),
        (dict(logprob_token_ids=[1, 2]), "logprob_token_ids"),
        (dict(extra_args={"x": 1}), "extra_args"),
        (dict(flat_logprobs=True), "flat_logprobs"),
        (dict(thinking_token_budget=10), "thinking_token_budget"),
        (dict(stream_interval=4), "stream_interval"),
    ],
)
def test_unknown_or_unimplemented_keywords_are_named(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, UnknownParameterError)
    assert isinstance(info.value, TypeError)  # what Python says for a bad keyword
    assert info.value.field == field and field in str(info.value)


def test_unimplemented_fields_at_values_that_ask_nothing_are_accepted():
    for name, harmless in VLLM_ONLY_FIELDS.items():
        for value in harmless:
            assert SamplingParams(**{name: value}) == SamplingParams(), name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=2.5), "temperature"),  # vLLM: [0, 2]
        (dict(logprobs=-2), "logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs"),
        (dict(logit_bias={3: 100.5}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(detokenize="no"), "detokenize"),
        (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens"),
        (dict(stop=["x"], detokenize=False), "stop"),  # vLLM: stop needs text
        (dict(structured_outputs={"regex": "a"}), "structured_outputs"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    ],
)
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field)


def test_vllm_aliases():
    p = SamplingParams(
        seed=-1,
        logprobs=True,
        prompt_logprobs=True,
        output_kind=RequestOutputKind.DELTA,
    )
    assert (p.seed, p.logprobs, p.prompt_logprobs, p.output_kind) == (
        None,
        1,
        1,
        "delta",
    )
    assert SamplingParams(logit_bias={"5": -2}).logit_bias == {5: -2}
    original = SamplingParams(bad_words=["x"], logit_bias={1: 2.0})
    copied = original.clone()  # vLLM's method: a deep copy
    assert copied == original and copied.logit_bias is not original.logit_bias
    p = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    p.verify_token_ids(64)
    assert (p.logprobs, p.prompt_logprobs) == (64, 64)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={64: 1.0}).verify_token_ids(64)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=65).verify_token_ids(64)


def test_structured_outputs_params_take_exactly_one_kind():
    for kind, value in [
        ("json", {"type": "object"}),
        ("regex", "a+"),
        ("choice", ["a", "b"]),
        ("grammar", "root ::= 'a'"),
        ("json_object", True),
        ("structural_tag", "{}"),
    ]:
        so = StructuredOutputsParams(**{kind: value})
        assert so.kind == kind
        assert SamplingParams(structured_outputs=so).structured_outputs is so
    for bad in [{}, dict(regex="a", choice=["a"]), dict(disable_any_whitespace=True)]:
        with pytest.raises(ValueError) as info:
            StructuredOutputsParams(**bad)
        assert "structured_outputs" in str(info.value)


def test_beam_search_params():
    p = BeamSearchParams(beam_width=3, max_tokens=5)
    assert (p.ignore_eos, p.temperature, p.length_penalty) == (False, 0.0, 1.0)
    assert p.include_stop_str_in_output is False
    for kwargs, field in [
        (dict(beam_width=0, max_tokens=5), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=5, temperature=-1), "temperature"),
        (
            dict(beam_width=2, max_tokens=5, length_penalty=float("nan")),
            "length_penalty",
        ),
        (dict(beam_width=2, max_tokens=5, ignore_eos="no"), "ignore_eos"),
    ]:
        with pytest.raises(SamplingParamsError) as info:
            BeamSearchParams(**kwargs)
        assert info.value.field == field


# ---------------------------------------------------------------------------------
# logit_bias and bad words in the sampler, against the reference


def distribution(params, logits, outputs):
    n, vocab = logits.shape
    md = SamplingMetadata.from_requests(params, [[0]] * n, outputs, vocab)
    return Sampler().sampling_distribution(logits, md)


def test_bad_words_and_bias_match_the_reference():
    rng = random.Random(3)
    vocab, checked_bad = 24, 0
    for trial in range(30):
        n = rng.randint(1, 5)
        outputs = [
            [rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in range(n)
        ]
        params = []
        for out in outputs:
            # a word that the output's tail completes, half the time
            tail = out[-2:] if out and rng.random() < 0.5 else [rng.randrange(vocab)]
            params.append(
                SamplingParams(
                    temperature=rng.choice([0.0, 0.8, 1.0]),
                    top_p=rng.choice([1.0, 0.9]),
                    repetition_penalty=rng.choice([1.0, 1.2]),
                    logit_bias={rng.randrange(vocab): rng.uniform(-5, 5)}
                    if rng.random() < 0.6
                    else None,
                    bad_words_token_ids=[tail + [rng.randrange(vocab)]]
                    if rng.random() < 0.7
                    else None,
                )
            )
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial))
        probs = distribution(params, logits, outputs)
        for row in range(n):
            expected = reference_probs(
                logits[row].tolist(), params[row], [0], outputs[row]
            )
            assert torch.allclose(
                probs[row].double(),
                torch.tensor(expected, dtype=torch.float64),
                atol=1e-6,
            ), (trial, row)
            for word in params[row].bad_words_token_ids or []:
                if outputs[row][len(outputs[row]) - len(word) + 1 :] == word[:-1]:
                    assert probs[row, word[-1]] == 0
                    checked_bad += 1
    assert checked_bad > 5  # the words were completed often enough to matter


def test_logit_bias_decides_a_greedy_token(llm):
    plain = tokens_of(llm, "The value of", **GREEDY)
    forced = plain.token_ids[0] + 1
    biased = tokens_of(llm, "The value of", logit_bias={forced: 100.0}, **GREEDY)
    assert biased.token_ids == [forced] * len(biased.token_ids)
    # a bias against the greedy token: never chosen
    against = tokens_of(
        llm, "The value of", logit_bias={t: -100.0 for t in plain.token_ids}, **GREEDY
    )
    assert not set(against.token_ids) & set(plain.token_ids)


def test_bad_words_are_never_completed(llm):
    tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
    plain = tokens_of(llm, "The value of", **GREEDY)
    word = plain.text.split()[1]  # a word the model writes, after a space
    banned = SamplingParams(bad_words=[word])
    banned.update_from_tokenizer(tok)
    sequences = banned.bad_words_token_ids
    assert tok.encode(word, add_special_tokens=False) == sequences[0]
    spaced = tok.encode(" " + word, add_special_tokens=False)
    assert spaced in sequences or len(spaced) != len(sequences[0])

    def contains(tokens, seq):
        return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens)))

    assert any(contains(plain.token_ids, s) for s in sequences)  # it was written
    out = tokens_of(llm, "The value of", bad_words=[word], **GREEDY)
    assert not any(contains(out.token_ids, s) for s in sequences)
    assert out.token_ids != plain.token_ids


def test_bad_words_need_a_tokenizer():
    bare = LLM(device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words"):
        bare.generate([[5, 6]], SamplingParams(bad_words=["a"]), use_tqdm=False)


# ---------------------------------------------------------------------------------
# Text: detokenize, special tokens, stop strings


def test_detokenize_false_gives_tokens_without_text(llm):
    with_text = tokens_of(llm, "The value of", logprobs=1, **GREEDY)
    ids_only = tokens_of(llm, "The value of", logprobs=1, detokenize=False, **GREEDY)
    assert ids_only.token_ids == with_text.token_ids and with_text.text
    assert ids_only.text == ""
    assert all(
        lp.decoded_token is None for pos in ids_only.logprobs for lp in pos.values()
    )
    assert all(
        lp.decoded_token is not None
        for pos in with_text.logprobs
        for lp in pos.values()
    )


def test_special_tokens_in_text(llm):
    eos = llm.tokenizer.eos_token_id
    forced = dict(allowed_token_ids=[eos], temperature=0, max_tokens=3, ignore_eos=True)
    eos_text = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert tokens_of(llm, "A", **forced).text == ""
    for spaces in (True, False):
        shown = tokens_of(
            llm,
            "A",
            skip_special_tokens=False,
            spaces_between_special_tokens=spaces,
            **forced,
        )
        # byte-level BPE puts nothing between two special tokens, and vLLM's fast
        # detokenizer neither (it only ever removes spaces there)
        assert shown.text == eos_text * 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_and_include_stop_str_in_output(llm, include):
    plain = tokens_of(llm, "The value of", **GREEDY)
    stop = plain.text[5:8]
    assert stop and plain.text.find(stop) >= 1
    out = tokens_of(
        llm, "The value of", stop=[stop], include_stop_str_in_output=include, **GREEDY
    )
    end = plain.text.find(stop) + (len(stop) if include else 0)
    assert out.text == plain.text[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_n_and_seeds(llm):
    out = llm.generate(
        ["A"],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    again = llm.generate(
        ["A"],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]


# vLLM 0.32's SamplingParams.update_from_tokenizer on the tiny model's tokenizer,
# recorded by running vLLM's own method (.venv-vllm) over the same tokenizer.json
VLLM_BAD_WORDS = {
    "value": [[955], [402]],
    " value": [[955], [402]],
    "the": [[398], [269]],
    "statement": [[1425], [471]],
    "for loop": [[520, 1528], [344, 1528]],
    "x": [[89], [876]],
    "Exceptions are": [[1635, 84, 359], [1785, 84, 359]],
}


def test_bad_words_tokenize_as_vllm(tiny):
    if tiny[1].encode("for loop", add_special_tokens=False) != [520, 1528]:
        pytest.skip("recorded for the default tiny tokenizer (MINILLM_TINY_SEED=0)")
    for word, expected in VLLM_BAD_WORDS.items():
        params = SamplingParams(bad_words=[word])
        params.update_from_tokenizer(tiny[1])
        assert params.bad_words_token_ids == expected, word


def test_the_callers_params_are_left_as_given(llm):
    """Checking a request resolves fields (bad words to token ids, -1 logprobs to the
    vocabulary): on the engine's copy, never on the caller's object, which may serve
    other requests and engines."""
    params = SamplingParams(max_tokens=2, prompt_logprobs=-1, bad_words=["the"])
    before = repr(params), params.bad_words_token_ids
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(["A"], params, use_tqdm=False)
    assert (repr(params), params.bad_words_token_ids) == before
    ok = SamplingParams(max_tokens=2, bad_words=["the"])
    llm.generate(["A"], ok, use_tqdm=False)
    assert ok.bad_words_token_ids is None
