"""Compile time of a JSON string with a maxLength bound, on the CPU: chapter 23's
direct construction (json_string: one layer of a character's states per count)
against the unrolled expression it replaced ('"' char{0,n} '"' through Thompson's
NFA, the subset construction and minimisation), in the same run.

    python benchmarks/string_length.py [--lengths 16 32 64 128 255]

Writes benchmarks/results/string_length-cpu-DATE.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, require_committed, save  # noqa: E402
from minillm.structured import charset as cs  # noqa: E402
from minillm.structured.fsm import determinize  # noqa: E402
from minillm.structured.ir import Rep, lit, seq  # noqa: E402
from minillm.structured.json_text import json_char, json_string  # noqa: E402


def timed(build) -> tuple[float, int]:
    t0 = time.perf_counter()
    dfa = build()
    return time.perf_counter() - t0, dfa.num_states


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 255]
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    char = json_char(cs.ANY)
    determinize(char)  # warm the caches both paths share
    rows = []
    for n in args.lengths:
        json_string.cache_clear()
        direct_s, direct_states = timed(lambda: json_string(0, n))
        unrolled_s, unrolled_states = timed(
            lambda: determinize(seq(lit('"'), Rep(char, 0, n), lit('"')))
        )
        rows.append(
            {
                "max_length": n,
                "direct_s": round(direct_s, 4),
                "unrolled_s": round(unrolled_s, 3),
                "direct_states": direct_states,
                "unrolled_states": unrolled_states,
            }
        )
        print(rows[-1], flush=True)
    record = {
        "benchmark": "string_length",
        "environment": environment(),
        "workload": {"schema": '{"type": "string", "maxLength": n}', "charset": "any"},
        "rows": rows,
    }
    path = (
        save("string_length", record, args.out)
        if args.out
        else save("string_length", record)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
