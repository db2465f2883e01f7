#!/usr/bin/env python3
"""Format and lint the chapters' code cells with ruff, as the package and the tests are.

    python tools/ruff_chapters.py          format the chapters' code cells in place
    python tools/ruff_chapters.py --check  exit 1, naming the cells ruff would reformat
    python tools/ruff_chapters.py --lint   `ruff check` over each chapter's code

Each code cell is formatted on its own, as ruff formats the cells of a notebook, with
the settings of `[tool.ruff]` in pyproject.toml (line length 88: the book's code
column shows that many characters without scrolling). A cell's MyST options and
`#| export` directives are kept as they are.

For `--lint` each chapter becomes one Python file in which every line that is not
code is blank, so ruff reports `chapters/NN_slug.md:LINE` at the line of the chapter
itself, and a name defined in one cell is known to the cells after it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL_OPEN = re.compile(r"^```\{code-cell\}")
# A chapter is a notebook: imports come where the prose needs them (E402), each module
# it exports starts with its own `from __future__` import (F404), a later cell may
# redefine a name to show a better version (F811; the tangled modules are checked for
# it), and a kernel keeps the papers' names for its running max and sum, m and l (E741).
LINT_IGNORE = ["E402", "E741", "F404", "F811"]


def code_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line indices of each code cell's code: options and fences
    excluded.
    """
    spans, i = [], 0
    while i < len(lines):
        if not CELL_OPEN.match(lines[i]):
            i += 1
            continue
        i += 1
        if i < len(lines) and lines[i].strip() == "---":  # a YAML options block
            i = lines.index("---", i + 1) + 1
        else:
            while i < len(lines) and lines[i].startswith(":"):
                i += 1
            if i < len(lines) and not lines[i].strip() and lines[i - 1].startswith(":"):
                i += 1  # the blank line that ends the options
        first = i
        while lines[i].rstrip() != "```":
            i += 1
        spans.append((first, i))
        i += 1
    return spans


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the ruff installed beside this Python (the venv's), else the one on PATH."""
    exe = Path(sys.executable).parent / "ruff"
    cmd = [str(exe) if exe.exists() else "ruff", *args]
    return subprocess.run(cmd, cwd=ROOT, input=stdin, capture_output=True, text=True)


def format_chapters(paths: list[Path], check: bool) -> list[str]:
    """Format every cell (or, with check, only report); returns 'chapter:line' of
    changed cells.
    """
    with tempfile.TemporaryDirectory() as tmp:
        cells = {}  # temp file -> (chapter, span)
        texts = {p: p.read_text(encoding="utf-8").split("\n") for p in paths}
        for p, lines in texts.items():
            for first, end in code_spans(lines):
                if end > first:
                    f = Path(tmp, f"{p.stem}_{first:05d}.py")
                    f.write_text("\n".join(lines[first:end]) + "\n", encoding="utf-8")
                    cells[f] = (p, first, end)
        done = ruff("format", "--quiet", "--config", str(ROOT / "pyproject.toml"), tmp)
        if done.returncode:
            sys.exit(f"ruff format failed:\n{done.stderr}")
        changed, edits = [], {p: [] for p in paths}
        for f, (p, first, end) in cells.items():
            new = f.read_text(encoding="utf-8").rstrip("\n").split("\n")
            if new != texts[p][first:end]:
                changed.append(f"{p.relative_to(ROOT)}:{first + 1}")
                edits[p].append((first, end, new))
        if not check:
            for p, spans in edits.items():
                lines = texts[p]
                for first, end, new in sorted(spans, reverse=True):
                    lines[first:end] = new
                p.write_text("\n".join(lines), encoding="utf-8")
    return changed


def lint_chapters(paths: list[Path]) -> int:
    """`ruff check` each chapter as one file whose non-code lines are blank."""
    status = 0
    for p in paths:
        lines = p.read_text(encoding="utf-8").split("\n")
        code = [""] * len(lines)
        for first, end in code_spans(lines):
            code[first:end] = lines[first:end]
        rel = p.relative_to(ROOT).as_posix()
        done = ruff(
            "check",
            "--quiet",
            "--output-format",
            "concise",
            "--extend-ignore",
            ",".join(LINT_IGNORE),
            "--stdin-filename",
            rel + ".py",
            "-",
            stdin="\n".join(code) + "\n",
        )
        if done.returncode:
            status = 1
            print(done.stdout.replace(rel + ".py", rel), end="")
            print(done.stderr, end="", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", type=Path, help="default: chapters/*.md")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="report cells ruff would reformat"
    )
    mode.add_argument(
        "--lint", action="store_true", help="run `ruff check` over the chapters"
    )
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.chapters] or sorted(
        [*(ROOT / "chapters").glob("*.md"), *(ROOT / "chapters/lab_notes").glob("*.md")]
    )
    if args.lint:
        return lint_chapters(paths)
    changed = format_chapters(paths, check=args.check)
    for where in changed:
        print(f"{where}: {'would reformat' if args.check else 'reformatted'} this cell")
    if args.check and changed:
        print(
            "Run `python tools/ruff_chapters.py` (or `make format`) to format the "
            "chapters.",
            file=sys.stderr,
        )
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
