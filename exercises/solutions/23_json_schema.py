"""Worked solutions to chapter 23's exercises (chapters/23_json_schema.md).

Installed into minillm.structured's modules the way a reader's exported cells would
put them there; the checks are exercises/test_23_json_schema.py.
"""

from __future__ import annotations

from minillm.structured import numbers
from minillm.structured.ir import Bytes, Graph
from minillm.structured.json_schema import SchemaCompiler


# 22.1
def multiple_of_expr(k: int) -> Graph:
    """The non-negative multiples of k in decimal, no leading zero: node r < k holds
    the remainder r of the digits read (reading d goes to (10 r + d) % k); node k is
    the start, node k + 1 the number 0, which nothing may follow."""
    start, zero = k, k + 1

    def digit(d: int) -> Bytes:
        return Bytes(((ord("0") + d, ord("0") + d),))

    edges = [(start, digit(0), zero)]
    edges += [(start, digit(d), d % k) for d in range(1, 10)]
    edges += [(r, digit(d), (10 * r + d) % k) for r in range(k) for d in range(10)]
    return Graph(k + 2, tuple(edges), start, (0, zero))


_multiples = SchemaCompiler.multiples


def multiples(self, step, lo, hi, lo_strict, hi_strict, path: str):
    """The schema compiler's multipleOf, with the DFA for a whole step >= 2 and
    minimum 0 (no maximum): what a bounded range cannot spell out."""
    whole = float(step).is_integer() and step >= 2
    if whole and lo == 0 and not lo_strict and hi is None:
        return multiple_of_expr(int(step))
    return _multiples(self, step, lo, hi, lo_strict, hi_strict, path)


numbers.multiple_of_expr = multiple_of_expr
SchemaCompiler.multiples = multiples

SOLUTIONS = {"multiple": (multiple_of_expr, multiples)}
