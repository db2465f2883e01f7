"""tools/book_check.py (`make book-check`): its link check finds a missing page and a
missing anchor; and the book's set-up module (book/__init__.py) stops a chapter with
the package to install."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import book_check  # noqa: E402

import book  # noqa: E402


def test_broken_internal_links_are_found_and_good_ones_pass(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "index.html").write_text('<a href="chapters/a.html#here">ok</a>')
    (tmp_path / "chapters" / "a.html").write_text(
        '<h1 id="here">A</h1><a href="b.html">gone</a><a href="#nowhere">x</a>'
        '<a href="https://example.com/">outside</a><a href="../index.html">up</a>'
    )
    (tmp_path / "old.html").write_text('<meta http-equiv="Refresh" content="0; url=x">')
    cache = {}
    assert book_check.broken_links(tmp_path / "index.html", tmp_path, cache) == []
    found = book_check.broken_links(tmp_path / "chapters" / "a.html", tmp_path, cache)
    assert found == ["b.html (no such file)", "#nowhere (no #nowhere there)"]
    rels = [p.relative_to(tmp_path).as_posix() for p in book_check.pages(tmp_path, [])]
    assert rels == ["chapters/a.html", "index.html"]


def test_without_a_built_book_it_fails_and_says_so(tmp_path, capsys):
    assert book_check.main([str(tmp_path)]) == 1
    assert "run `make book` first" in capsys.readouterr().out


def test_needs_names_what_to_install(monkeypatch):
    book.needs("json")  # installed: nothing happens
    monkeypatch.setitem(book.PIP, "no_such_pkg_xyz", "no-such-pkg==1.0")
    with pytest.raises(
        SystemExit, match=r"needs: pip install no-such-pkg==1.0 other_xyz$"
    ):
        book.needs("json", "no_such_pkg_xyz", "other_xyz")


def test_without_chromium_it_says_so_and_passes_unless_required(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "index.html").write_text("<p>a book</p>")
    monkeypatch.setattr(book_check, "browser_path", lambda: None)
    assert book_check.main([str(tmp_path), "--out", str(tmp_path / "shots")]) == 0
    assert "NOT RUN: Chromium" in capsys.readouterr().out
    assert book_check.main([str(tmp_path), "--require"]) == 1
