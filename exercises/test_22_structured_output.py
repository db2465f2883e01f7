"""Checks for chapter 22's exercises (chapters/22_structured_output.md, "Exercises")."""

from _check import answer

from minillm.structured import dfa
from minillm.structured.charset import utf8
from minillm.structured.fsm import determinize
from minillm.structured.ir import NOTHING
from minillm.structured.regex import regex_expr


def test_shortest_match():
    """16.1: shortest_match(dfa) is the shortest string the automaton accepts, the
    smallest bytes first among those, or None for an empty language."""
    shortest_match = answer(dfa, "shortest_match", "22.1")
    for pattern, expected in [
        ("[0-9]{3}", b"000"),
        ("(ab|b)c+", b"bc"),
        ("x?", b""),
        ("[a-c]{2,3}x|yy", b"yy"),
        ("[^\\x00-\\x7f]", "\x80".encode()),  # the smallest two-byte character
        ("(q|[d-f])z", b"dz"),
    ]:
        automaton = determinize(regex_expr(pattern, utf8, search=False))
        got = shortest_match(automaton)
        assert got == expected, (pattern, got)
        assert automaton.matches(got)
    assert shortest_match(determinize(NOTHING)) is None
