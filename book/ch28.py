"""Chapter 28's helpers that are not the lesson: the servers a stored
`benchmarks/serve.py --compare` run measured, and the tables of its runs.

The chapter (chapters/28_engine_process.md) and its lab notes
(chapters/lab_notes/28_engine_process_lab.md) import them, with chapter 27's
(book/ch27.py); the engine's process is in minillm/engine_core.py.
"""

from __future__ import annotations

from book.ch27 import busiest_run, mode_name

__all__ = ["busiest_run", "print_ab", "print_servers", "server_name", "servers_of"]


def server_name(flags: str) -> str:
    """A server of a `--compare` run, named by its flags."""
    where = "engine thread" if "--engine-in-thread" in flags else "engine process"
    return where + (", asyncio + h11" if "asyncio" in flags else ", uvloop + httptools")


def servers_of(record: dict) -> dict[str, list[dict]]:
    """{server name: its runs} of a record: this tree's server and those compared."""
    return {server_name(""): record["runs"]} | {
        server_name(c["flags"]): c["runs"] for c in record.get("compare", [])
    }


def print_servers(record: dict) -> None:
    """Each compared server's runs with every request at once (and its CPU split)."""
    for name, runs in servers_of(record).items():
        for r in (r for r in runs if r["request_rate"] == "inf"):
            front, cpu = r.get("front_end_cpu_us_per_token"), ""
            if front is not None:
                engine = r["server_cpu_us_per_token"] - front
                cpu = f", CPU/token: front end {front:3.0f}, engine {engine:3.0f} µs"
            print(
                f"{record['code_commit']} {name:>34}, {mode_name(r):>14}: "
                f"{r['output_tokens_per_s']:7,.0f} tok/s "
                f"({r['fraction_of_offline']:4.0%}){cpu}"
            )


def print_ab(ab: dict) -> None:
    """The delta-outputs A/B: every run of both trees, in the order they ran."""
    offline = ab["offline"]
    print(
        f"offline engine: {offline['output_tokens_per_s']:7,.0f} tok/s, CPU "
        f"{offline['cpu_us_per_token']:3.0f} µs/token"
    )
    trees = [
        ("delta outputs", ab["code_commit"], ab["runs"]),
        ("before", ab["baseline_tree"]["commit"], ab["baseline_tree"]["runs"]),
    ]
    for tree, commit, runs in trees:
        print(f"{tree} ({commit}), in the order they ran:")
        for r in runs:
            front = r["front_end_cpu_us_per_token"]
            print(
                f"  {mode_name(r):>14}: {r['output_tokens_per_s']:7,.0f} tok/s "
                f"({r['fraction_of_offline']:5.1%}), ITL p99 "
                f"{r['itl_ms']['p99']:3.0f} ms, CPU/token: front end {front:3.0f} "
                f"µs, engine process {r['server_cpu_us_per_token'] - front:3.0f} µs,"
                f" waiting in send {r['engine_send_wait_s']:.2f} s"
            )
