"""Checks for chapter 23's exercises (chapters/23_json_schema.md, "Exercises")."""

from _check import answer

from minillm.structured import numbers
from minillm.structured.fsm import determinize


def test_multiple_of():
    """17.1: multiple_of_expr(k) spells exactly the non-negative multiples of k."""
    multiple_of_expr = answer(numbers, "multiple_of_expr", "23.1")
    for k in (1, 3, 7, 10):
        dfa = determinize(multiple_of_expr(k))
        for n in range(0, 400):
            assert dfa.matches(str(n).encode()) == (n % k == 0), (k, n)
        assert not dfa.matches(b"03") and not dfa.matches(b"")
