"""Fail when a chapter's prose refers to a glue key that none of its cells glued.

`make book` builds with -W, so a `{glue:text}`key`` whose key no cell glued stops
the whole build; `make test` runs the chapters but not the book. This check closes
that gap: `make test-notebooks` records the keys each notebook glued
(tools/nbval_glue.py), and this script compares them with the keys the chapter's
prose uses, printing chapter and line for each one missing.

    python tools/check_glue.py GLUE_DIR [CHAPTER.md ...]
        (default: chapters/*.md and the lab notes, chapters/lab_notes/*.md)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# {glue}`key`, {glue:text}`key:.1f`, {glue:any}`key`, {glue:md}`key`, and the
# directives ```{glue:figure} key / ```{glue:math} key / ```{glue} key
ROLE = re.compile(r"\{glue(?::\w+)?\}`([^`:]+)(?::[^`]*)?`")
DIRECTIVE = re.compile(r"^\s*[`:]{3,}\{glue(?::\w+)?\}\s+(\S+)", re.M)


def references(text: str) -> list[tuple[int, str]]:
    """(line, key) for every glue key the text refers to, outside code cells."""
    found, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```{code-cell}"):
            in_code = True
        elif in_code and line.startswith("```"):
            in_code = False
            continue
        if in_code:
            continue
        found += [(number, key.strip()) for key in ROLE.findall(line)]
        found += [(number, key) for key in DIRECTIVE.findall(line)]
    return found


def missing(chapter: Path, glued: set[str]) -> list[tuple[int, str]]:
    return [(n, k) for n, k in references(chapter.read_text()) if k not in glued]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    folder = Path(argv[0])
    chapters = [Path(p).resolve() for p in argv[1:]]
    chapters = chapters or [
        *sorted((ROOT / "chapters").glob("*.md")),
        *sorted((ROOT / "chapters" / "lab_notes").glob("*.md")),
    ]
    problems = 0
    for chapter in chapters:
        keys_file = folder / f"{chapter.stem}.keys"
        glued = set(keys_file.read_text().split()) if keys_file.is_file() else set()
        name = chapter.relative_to(ROOT) if chapter.is_relative_to(ROOT) else chapter
        for number, key in missing(chapter, glued):
            problems += 1
            print(f"{name}:{number}: glue key {key!r} is used in the prose but no "
                  "cell glued it")  # fmt: skip
    if problems:
        print(f"check_glue: {problems} glue key(s) used but never glued")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
