"""Every exercise a chapter names has a worked solution (exercises/solutions/), and
the chapter shows it.

A chapter's "## Exercises" section names each exercise's check as
`pytest exercises/test_NN_slug.py -k NAME`; exercises/solutions/NN_slug.py lists its
answers in a dict `SOLUTIONS = {NAME: answer, ...}`. Read with ast, not imported:
importing a solution installs it into minillm, which the other tests must not see.
`pytest exercises --solutions` (make test) runs the checks against them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))
SOLUTIONS = ROOT / "exercises" / "solutions"
# pytest exercises/test_09_engine.py -k counting (the chapter may wrap after -k)
# what :pyobject: can show
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
CHECK = re.compile(r"pytest\s+exercises/test_(\d\d_\w+)\.py\s+-k\s+`?\s*([\w]+)")


def exercises_section(chapter: Path) -> str:
    text = chapter.read_text()
    start = text.find("\n## Exercises")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def named_checks(chapter: Path) -> list[tuple[str, str]]:
    """(NN_slug, -k name) of every check the chapter's Exercises section names."""
    section = re.sub(r"\s+", " ", exercises_section(chapter))
    return CHECK.findall(section)


def solution_entries(path: Path) -> dict[str, list[str]]:
    """SOLUTIONS' keys -> the names of the functions and classes that answer them
    (a name or a tuple of names), from the file's syntax tree."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SOLUTIONS" for t in node.targets
        ):
            assert isinstance(node.value, ast.Dict), f"{path.name}: SOLUTIONS a dict"
            entries = {}
            for k, v in zip(node.value.keys, node.value.values):
                names = v.elts if isinstance(v, ast.Tuple) else [v]
                assert all(isinstance(n, ast.Name) for n in names), ast.unparse(v)
                entries[ast.literal_eval(k)] = [n.id for n in names]
            return entries
    return {}


def dropdown(slug: str, names: list[str], indent: str = "   ") -> str:
    """The MyST a chapter shows under an exercise: its solution, folded away."""
    lines = ["````{dropdown} A worked solution"]
    for name in names:
        lines += [
            f"```{{literalinclude}} /exercises/solutions/{slug}.py",
            f":pyobject: {name}",
            "```",
        ]
    lines.append("````")
    return "\n".join(indent + line for line in lines)


def test_the_chapters_name_their_checks():
    assert sum(len(named_checks(c)) for c in CHAPTERS) >= 50


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.stem)
def test_every_exercise_has_a_solution(chapter):
    for slug, name in named_checks(chapter):
        path = SOLUTIONS / f"{slug}.py"
        assert path.exists(), f"{chapter.name}: no {path.relative_to(ROOT)} ({name})"
        entries = solution_entries(path)
        assert name in entries, (
            f"{chapter.name}: -k {name} has no entry in {path.name}'s SOLUTIONS"
        )


def test_every_solution_is_a_function_or_class_of_its_file():
    for path in sorted(SOLUTIONS.glob("[0-9][0-9]_*.py")):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, DEFINITIONS)}
        for name, names in solution_entries(path).items():
            # what :pyobject: can show
            assert set(names) <= defined, f"{path.name}: {name} -> {names}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.stem)
def test_every_exercise_shows_its_solution(chapter):
    section = exercises_section(chapter)
    for slug, name in named_checks(chapter):
        path = SOLUTIONS / f"{slug}.py"
        for obj in solution_entries(path).get(name, []) if path.exists() else []:
            shown = rf"/exercises/solutions/{slug}\.py\s*\n\s*:pyobject: {obj}\s*\n"
            assert re.search(shown, section), (
                f"{chapter.name}, exercise -k {name}: no dropdown shows {obj}; "
                f"paste under it:\n{dropdown(slug, solution_entries(path)[name])}"
            )


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("[0-9][0-9]_*.py")),
                         ids=lambda p: p.stem)  # fmt: skip
def test_every_solution_answers_a_named_exercise(path):
    chapter = ROOT / "chapters" / f"{path.stem}.md"
    named = {name for _, name in named_checks(chapter)} if chapter.exists() else set()
    extra = set(solution_entries(path)) - named
    assert not extra, (
        f"{path.name}: SOLUTIONS names no exercise of the chapter: {extra}"
    )
