"""Worked solutions to chapter 24's exercises (chapters/24_token_masks.md).

Installed into minillm.structured's modules the way a reader's exported cells would
put them there; the checks are exercises/test_24_token_masks.py.
"""

from __future__ import annotations

import numpy as np

from minillm.structured import budget, matcher
from minillm.structured.budget import FinishBudget
from minillm.structured.matcher import (
    CompiledGrammar,
    GrammarMatcher,
    allowed_tokens,
    set_bits,
)


# 23.1
def forced_fraction(compiled: CompiledGrammar, token_ids: list[int]) -> float:
    """Replaying an output, the share of its bytes the grammar forced when they were
    written: those a jump-forward engine would not have sampled."""
    m, token_bytes = GrammarMatcher(compiled), compiled.index.token_bytes
    forced = total = 0
    for token in token_ids:
        ahead, data = m.find_jump_forward_string(), token_bytes[token]
        common = 0  # the token's bytes that the forced string spells
        while common < min(len(ahead), len(data)) and ahead[common] == data[common]:
            common += 1
        forced, total = forced + common, total + len(data)
        if not m.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar here")
    return forced / total if total else 0.0


# 23.2
def exact_min_tokens(self: FinishBudget, stacks) -> int:
    """The fewest tokens that finish the document (a breadth-first search over
    stacks, one allowed token per edge); never more than min_tokens."""
    c = self.compiled
    bound = self.min_tokens(stacks)  # a finish exists within this many
    eos = set(c.index.eos_token_ids)
    frontier, seen = [stacks], {stacks}
    for depth in range(1, bound + 1):
        next_frontier = []
        for s in frontier:
            for t in allowed_tokens(c.mask(s), c.index.vocab_size).tolist():
                new = None if t in eos else c.advance_token(s, t)
                if new is None or new in seen:
                    continue
                if c.is_complete(new):
                    return depth
                seen.add(new)
                next_frontier.append(new)
        frontier = next_frontier
    return bound


# 23.3
def mask_single(self: CompiledGrammar, stacks) -> np.ndarray:
    """mask, with the uncertain tokens checked by advance_single (and not cached, so
    that it can be timed against mask on fresh stacks)."""
    closed = self.closure(stacks)
    words = self.state_mask(closed[0][-1])[0].copy()
    for stack in closed[1:]:
        words |= self.state_mask(stack[-1])[0]
    unsure = self.unsure_tokens(closed)
    if len(unsure):
        unsure = unsure[
            (words[unsure >> 5] >> (unsure & 31).astype(np.uint32)) & 1 == 0
        ]
        token_bytes = self.index.token_bytes
        ok = [t for t in unsure.tolist() if self.advance_single(closed, token_bytes[t])]
        set_bits(words, np.array(ok, dtype=np.int64))
    if self.is_complete(closed):
        set_bits(words, self.eos)
    return words


matcher.forced_fraction = forced_fraction
budget.FinishBudget.exact_min_tokens = exact_min_tokens
CompiledGrammar.mask_single = mask_single

SOLUTIONS = {
    "forced": forced_fraction,
    "budget": exact_min_tokens,
    "mask_single": mask_single,
}
