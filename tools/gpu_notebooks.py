"""Run every chapter and the appendix top to bottom as a notebook on this machine's GPU,
as `make test` runs them on a CPU (nbval on the jupytext notebooks), and store one
result: per chapter, pass or fail (with the failing cell and its first line), seconds.

    python3 tools/gpu_notebooks.py [--out DIR] [--timeout S] [--state DIR --budget S]
                                   [CHAPTER.md ...]

Run it on the GPU box from the repository's root, with the packages of
`tools/gpu_rounds/notebooks.txt` importable and a model cache ($MINILLM_CACHE) that
holds the tiny model and its drafts. It writes DIR/gpu_notebooks-{gpu}-{day}.json
through benchmarks.common.save, which stores runs of committed code only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")  # colours, raw or as the XML escaped them
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, environment, save  # noqa: E402


def failures(junit: Path) -> list[tuple[str, str]]:
    """(test name, message) of each failed or errored item of a junit XML report."""
    if not junit.is_file():
        return []
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for bad in (*case.iter("failure"), *case.iter("error")):
            text = ANSI.sub("", bad.text or bad.get("message") or "")
            found.append((case.get("name", "?"), text[-1500:]))
    return found


def cell_source(notebook: Path, name: str) -> str:
    """The first line of the cell nbval calls name ("Cell N": the Nth code cell)."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    code = [c for c in cells if c.cell_type == "code"]
    try:
        source = code[int(name.split()[-1])].source
    except (ValueError, IndexError):
        return ""
    return next((line for line in source.splitlines() if line.strip()), "")


def run_chapter(chapter: Path, work: Path, timeout: int) -> dict:
    notebook, junit = work / f"{chapter.stem}.ipynb", work / f"{chapter.stem}.xml"
    subprocess.run(
        [sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb",
         "-o", str(notebook), str(chapter)],
        check=True,
    )  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={timeout}",
           "-o", "testpaths=", "-o", "addopts=", f"--junitxml={junit}",
           str(notebook)]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-2000:]
    seconds = time.perf_counter() - start
    bad = failures(junit)
    row = {"chapter": chapter.name, "passed": rc == 0, "seconds": round(seconds, 1)}
    if rc != 0:
        first = bad[0] if bad else ("", "")
        row |= {"returncode": rc, "failed_cell": first[0],
                "failed_cell_first_line": cell_source(notebook, first[0]),
                "error": first[1] or tail}  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("chapters", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--timeout", type=int, default=600, help="seconds per chapter")
    p.add_argument(
        "--state",
        type=Path,
        help="a folder that keeps the rows between calls (each with its commit and "
        "GPU): chapters it holds are not run again, the stored result has them all",
    )
    p.add_argument(
        "--budget", type=float, default=1e9, help="start no chapter after these seconds"
    )
    args = p.parse_args(argv)
    chapters = args.chapters or sorted((ROOT / "chapters").glob("*.md"))
    env = environment()
    os.environ.setdefault("MPLBACKEND", "Agg")
    state = args.state or Path(tempfile.mkdtemp())
    state.mkdir(parents=True, exist_ok=True)
    rows_file = state / "rows.jsonl"  # a chapter run again replaces its row
    done = {}
    if rows_file.is_file():
        lines = rows_file.read_text().splitlines()
        done = {r["chapter"]: r for r in map(json.loads, filter(None, lines))}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for chapter in chapters:
            if chapter.name in done and not args.chapters:  # named: run again
                continue
            if time.perf_counter() - start > args.budget:
                print(f"{chapter.name}: not started (budget)", flush=True)
                continue
            row = run_chapter(chapter.resolve(), Path(work), args.timeout)
            row |= {"commit": env.get("commit"), "gpu": env.get("gpu") or "cpu"}
            done[chapter.name] = row
            with open(rows_file, "a") as f:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
            verdict = "pass" if row["passed"] else f"FAIL at {row['failed_cell']}"
            print(f"{chapter.name}: {verdict} ({row['seconds']:.0f} s)", flush=True)
    every = sorted({c.name for c in chapters} | set(done))
    rows = [done.get(name, {"chapter": name, "passed": None}) for name in every]
    record = {"environment": env, "chapters": rows,
              "passed": sum(r["passed"] is True for r in rows),
              "failed": sum(r["passed"] is False for r in rows),
              "not_run": sum(r["passed"] is None for r in rows)}  # fmt: skip
    print(f"saved {save('gpu_notebooks', record, args.out)}")


if __name__ == "__main__":
    main()
