"""Worked solutions to chapter 22's exercises (chapters/22_structured_output.md).

Installed into minillm.structured's modules the way a reader's exported cells would
put them there; the checks are exercises/test_22_structured_output.py.
"""

from __future__ import annotations

import collections

from minillm.structured import dfa
from minillm.structured.dfa import DFA


# 21.1
def shortest_match(automaton: DFA) -> bytes | None:
    """The shortest string the DFA accepts, the smallest bytes first among those
    (None: the language is empty). Breadth-first from state 0, each state's bytes
    tried in increasing order: the first accepting state reached ends the string."""
    table = automaton.table()  # (states, 256)
    came_from: dict[int, tuple[int, int] | None] = {0: None}
    queue = collections.deque([0])
    while queue:
        state = queue.popleft()
        if automaton.accepting[state]:
            out = []
            while came_from[state] is not None:
                state, byte = came_from[state]
                out.append(byte)
            return bytes(reversed(out))
        for byte in range(256):
            nxt = int(table[state, byte])
            if nxt >= 0 and nxt not in came_from:
                came_from[nxt] = (state, byte)
                queue.append(nxt)
    return None


dfa.shortest_match = shortest_match

SOLUTIONS = {"shortest": shortest_match}
