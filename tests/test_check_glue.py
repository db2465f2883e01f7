"""tools/check_glue.py: a glue key the prose uses and no cell glued is reported, with
its line (it would stop `make book`, whose -W turns the warning into an error)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import check_glue  # noqa: E402

CHAPTER = """# A chapter

```{code-cell} ipython3
glue("speed", 1.5, display=False)  # {glue:text}`not_prose` in code is not a use
```

It runs at {glue:text}`speed:.1f` tok/s on {glue:text}`machine`, {glue}`bare`.

```{glue:figure} plot
A figure.
```
"""


def test_references_are_found_with_their_lines_outside_code_cells():
    refs = check_glue.references(CHAPTER)
    assert refs == [(7, "speed"), (7, "machine"), (7, "bare"), (9, "plot")]


def test_a_key_no_cell_glued_is_reported_and_fails(tmp_path, capsys, monkeypatch):
    chapter = tmp_path / "99_x.md"
    chapter.write_text(CHAPTER)
    (tmp_path / "99_x.keys").write_text("speed\nbare\nplot\n")
    assert check_glue.missing(chapter, {"speed", "bare", "plot"}) == [(7, "machine")]
    monkeypatch.setattr(check_glue, "ROOT", tmp_path)
    assert check_glue.main([str(tmp_path), str(chapter)]) == 1
    assert "99_x.md:7: glue key 'machine'" in capsys.readouterr().out
    (tmp_path / "99_x.keys").write_text("speed\nbare\nplot\nmachine\n")
    assert check_glue.main([str(tmp_path), str(chapter)]) == 0
