"""The Lab notes part (issue 44): every page of chapters/lab_notes/ belongs to a
chapter, is in the book's table of contents, is linked from its chapter and links
back, and is named NN_slug_lab.md so that its glue keys (tools/check_glue.py) and its
notebook in `make test-notebooks` never collide with the chapter's."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "chapters" / "lab_notes"


def lab_pages() -> list[Path]:
    return sorted(LAB.glob("*.md"))


def test_every_lab_page_has_its_chapter_and_both_links():
    toc = (ROOT / "_toc.yml").read_text()
    for page in lab_pages():
        assert page.stem.endswith("_lab"), f"{page.name}: name it NN_slug_lab.md"
        chapter = ROOT / "chapters" / f"{page.stem[: -len('_lab')]}.md"
        assert chapter.is_file(), f"{page.name}: no chapter {chapter.name}"
        assert f"- file: chapters/lab_notes/{page.stem}\n" in toc, f"{page.name}: toc"
        assert f"<lab_notes/{page.stem}>`" in chapter.read_text(), (
            f"{chapter.name} does not link to {page.name}"
        )
        assert f"<../{chapter.stem}>`" in page.read_text(), (
            f"{page.name} does not link back to {chapter.name}"
        )


def test_lab_pages_come_last_in_the_toc_in_chapter_order():
    toc = (ROOT / "_toc.yml").read_text()
    files = re.findall(r"- file: (\S+)", toc)
    labs = [f for f in files if f.startswith("chapters/lab_notes/")]
    assert labs == sorted(labs)
    assert files[len(files) - len(labs) :] == labs


def test_lab_pages_are_collected_by_the_checks():
    makefile = (ROOT / "Makefile").read_text()
    assert "chapters/lab_notes/*.md" in makefile  # make test-notebooks
    check_glue = (ROOT / "tools" / "check_glue.py").read_text()
    assert '"lab_notes"' in check_glue
