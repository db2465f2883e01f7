"""The tokenizer and corpus of chapter 1."""

import hypothesis.strategies as st
from hypothesis import given, settings

from minillm.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    Tokenizer,
    read_corpus,
    split_corpus,
    train_tokenizer,
)

DOCS = read_corpus()
TRAIN, HELD_OUT = split_corpus(DOCS)
TOK = train_tokenizer(TRAIN[:20], vocab_size=512)


def test_corpus_is_the_shipped_pydoc_topics():
    assert (
        len(DOCS) == 79
        and "for" in DOCS
        and DOCS["for"].startswith('The "for" statement')
    )


def test_split_is_deterministic_and_disjoint():
    assert split_corpus(DOCS) == (TRAIN, HELD_OUT)
    assert len(HELD_OUT) == 7 and not set(TRAIN) & set(HELD_OUT)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_inverts_encode_for_any_text(text):
    # A text that spells a special token ("<|end_of_text|>") encodes to that token, as
    # in every HF
    # tokenizer; kept in the decode, it round-trips too.
    assert (
        TOK.decode(
            TOK.encode(text, add_special_tokens=False), skip_special_tokens=False
        )
        == text
    )


def test_text_spelling_a_special_token_becomes_that_token():
    assert TOK.encode(EOS_TOKEN, add_special_tokens=False) == [TOK.eos_token_id]
    # skipped by default, as the engine's output text does
    assert TOK.decode([TOK.eos_token_id]) == ""


def test_bos_is_prepended_and_special_tokens_have_ids():
    assert TOK.encode("hi")[0] == TOK.bos_token_id
    assert TOK.encode("hi", add_special_tokens=False)[0] != TOK.bos_token_id
    assert (
        TOK.id_to_token(TOK.bos_token_id) == BOS_TOKEN
        and TOK.id_to_token(TOK.eos_token_id) == EOS_TOKEN
    )


def test_training_is_deterministic():
    again = train_tokenizer(TRAIN[:20], vocab_size=512)
    text = DOCS["with"]
    assert again.encode(text) == TOK.encode(text)


def test_save_and_load_round_trip(tmp_path):
    TOK.save(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.encode(DOCS["if"]) == TOK.encode(DOCS["if"])
    assert (loaded.bos_token_id, loaded.eos_token_id) == (
        TOK.bos_token_id,
        TOK.eos_token_id,
    )


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
