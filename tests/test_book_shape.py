"""The shape issue 44 gave the book, held: no chapter over 2,000 lines, no code cell
over 40, one Measured section of at most 15% of its chapter, a figure and exercises in
every chapter.

A cell's lines are those between its fences, less MyST's `:option:` lines (a `---`
block of options counts, as it shows in the source).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))
PAGES = CHAPTERS + sorted((ROOT / "chapters" / "lab_notes").glob("*.md"))
FIGURE = re.compile(r"plt\.show\(\)|\bplot_\w+\(|```\{figure\}|!\[")


def code_cells(text: str) -> list[tuple[int, int]]:
    """(first line, length) of every code cell."""
    lines, cells, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```{code-cell}"):
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            body = [line for line in lines[i + 1 : j] if not line.startswith(":")]
            cells.append((i + 1, len(body)))
            i = j
        i += 1
    return cells


def sections(text: str) -> list[tuple[str, int]]:
    """(heading, lines up to the next `## ` heading) of every `## ` section."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    ends = starts[1:] + [len(lines)]
    return [(lines[s], e - s) for s, e in zip(starts, ends)]


def test_there_are_chapters():
    assert len(CHAPTERS) >= 30


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_is_at_most_2000_lines(page):
    assert len(page.read_text().splitlines()) <= 2000


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_code_cell_is_over_40_lines(page):
    long = [(at, n) for at, n in code_cells(page.read_text()) if n > 40]
    assert not long, f"{page.name}: cells (line, lines) over 40: {long}"


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_one_measured_section_of_at_most_15_percent(page):
    text = page.read_text()
    measured = [n for heading, n in sections(text) if heading.startswith("## Measured")]
    assert len(measured) == 1, f"{page.name}: {len(measured)} Measured sections"
    assert measured[0] <= 0.15 * len(text.splitlines())


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_has_a_figure_and_ends_with_exercises(page):
    text = page.read_text()
    assert FIGURE.search(text), f"{page.name} draws no figure"
    assert sections(text)[-1][0] == "## Exercises"


def test_the_checks_can_fail():
    cell = "```{code-cell} ipython3\n" + "x = 1\n" * 41 + "```\n"
    assert code_cells("text\n" + cell) == [(2, 41)]
    text = "## Measured\n" + "a\n" * 9 + "## Exercises\nb\n"
    assert sections(text) == [("## Measured", 10), ("## Exercises", 2)]
