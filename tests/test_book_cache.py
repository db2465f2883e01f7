"""tools/book_cache.py: make book reuses make test's outputs of the same code."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
book_cache = pytest.importorskip("book_cache")
pytest.importorskip("myst_nb")

PAGE = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A page

```{code-cell} ipython3
x = 6 * 7
print(x)
```

Some prose.

```{code-cell} ipython3
:tags: [skip-execution]

raise SystemExit
```
"""


def make_root(tmp_path: Path) -> Path:
    (tmp_path / "chapters").mkdir()
    (tmp_path / "minillm").mkdir()
    (tmp_path / "minillm" / "a.py").write_text("A = 1\n")
    (tmp_path / "chapters" / "01_page.md").write_text(PAGE)
    (tmp_path / "intro.md").write_text("# Intro\n")
    (tmp_path / "_toc.yml").write_text(
        "format: jb-book\nroot: intro\nchapters:\n  - file: chapters/01_page\n"
    )
    (tmp_path / "_config.yml").write_text(
        "execute:\n  cache: _build/.jupyter_cache\n"
        "parse:\n  myst_enable_extensions: [colon_fence]\n"
    )
    return tmp_path


def run_record(root: Path, first_source="x = 6 * 7\nprint(x)") -> dict:
    printed = {"output_type": "stream", "name": "stdout", "text": "42\n"}
    cells = [
        {"source": first_source, "outputs": [printed]},
        {"source": "raise SystemExit", "outputs": []},  # skip-execution: no output
    ]
    return {"fingerprint": book_cache.fingerprint(root), "seconds": 1.0, "cells": cells}


def test_the_pages_are_the_tocs_notebooks(tmp_path):
    root = make_root(tmp_path)
    assert book_cache.pages(root) == [root / "chapters" / "01_page.md"]


def test_the_fingerprint_follows_the_code(tmp_path, monkeypatch):
    root = make_root(tmp_path)
    monkeypatch.delenv("MINILLM_TINY_SEED", raising=False)
    before = book_cache.fingerprint(root)
    assert book_cache.fingerprint(root) == before
    (root / "minillm" / "a.py").write_text("A = 2\n")
    assert book_cache.fingerprint(root) != before
    after = book_cache.fingerprint(root)
    monkeypatch.setenv("MINILLM_TINY_SEED", "1")
    assert book_cache.fingerprint(root) != after


def test_a_run_of_other_cells_is_refused(tmp_path):
    root = make_root(tmp_path)
    nb = book_cache.read_page(root / "chapters" / "01_page.md", root)
    reason = book_cache.with_outputs(nb, run_record(root, first_source="x = 0"))
    assert reason == "code cell 1 differs from the one that ran"
    record = run_record(root)
    record["cells"].pop()
    assert "1 cells ran, the page has 2" in book_cache.with_outputs(nb, record)


def test_a_primed_page_is_found_as_myst_nb_looks_for_it(tmp_path, capsys):
    from jupyter_cache import get_cache

    root = make_root(tmp_path)
    runs = root / "runs"
    runs.mkdir()
    (runs / "01_page.json").write_text(json.dumps(run_record(root)))
    book_cache.prime(runs, root)
    assert "1 pages take make test's outputs" in capsys.readouterr().out
    cache = get_cache(str(root / "_build" / ".jupyter_cache"))
    page = book_cache.read_page(root / "chapters" / "01_page.md", root)
    _, merged = cache.merge_match_into_notebook(page)
    code = [c for c in merged.cells if c.cell_type == "code"]
    assert code[0].outputs[0]["text"] == "42\n"
    assert code[1].outputs == []


def test_a_run_of_other_code_is_not_primed(tmp_path, capsys):
    root = make_root(tmp_path)
    runs = root / "runs"
    runs.mkdir()
    (runs / "01_page.json").write_text(json.dumps(run_record(root)))
    (root / "minillm" / "a.py").write_text("A = 3\n")
    book_cache.prime(runs, root)
    out = capsys.readouterr().out
    assert "0 pages take" in out and "1 pages whose run was made from other code" in out
    assert not (root / "_build" / ".jupyter_cache").exists() or not list(
        (root / "_build" / ".jupyter_cache").rglob("*.ipynb")
    )
