"""The tangler: directives, targets, check mode, determinism (tools/tangle.py)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tangle", ROOT / "tools" / "tangle.py")
tangle = importlib.util.module_from_spec(spec)
sys.modules["tangle"] = tangle
spec.loader.exec_module(tangle)

FRONT = "---\njupytext:\n  text_representation:\n    format_name: myst\n---\n\n"


def cell(code: str, options: str = "") -> str:
    return f"```{{code-cell}} ipython3\n{options}{code}\n```\n\n"


def make_repo(tmp_path: Path, chapters: dict[str, str]) -> Path:
    (tmp_path / "chapters").mkdir(parents=True)
    for name, body in chapters.items():
        (tmp_path / "chapters" / name).write_text(FRONT + body)
    return tmp_path


def test_default_exp_and_export_write_the_module(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "01_a.md": "# Title\n\n"
            + cell("#| default_exp alpha")
            + cell("#| export\nX = 1")
            + cell("print('prose code, not exported')")
        },
    )
    tangle.write(root)
    text = (root / "minillm" / "alpha.py").read_text()
    assert (
        text.startswith(tangle.HEADER_MARK)
        and "chapters/01_a.md" in text.splitlines()[0]
    )
    assert "X = 1" in text and "prose code" not in text and "#|" not in text
    assert "# %% chapters/01_a.md:" in text
    assert (root / "minillm" / "__init__.py").exists()


def test_marker_points_at_the_cell_fence(tmp_path):
    root = make_repo(
        tmp_path, {"01_a.md": cell("#| default_exp alpha") + cell("#| export\nX = 1")}
    )
    tangle.write(root)
    text = (root / "minillm" / "alpha.py").read_text()
    line = int(text.split("# %% chapters/01_a.md:")[1].split()[0])
    chapter_lines = (root / "chapters" / "01_a.md").read_text().splitlines()
    assert chapter_lines[line - 1].startswith("```{code-cell}")
    assert chapter_lines[line] == "#| export"


def test_export_to_another_module_and_subpackage(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "02_b.md": cell("#| default_exp beta")
            + cell("#| export\nB = 2")
            + cell("#| export kernels.fast\nF = 3")
        },
    )
    tangle.write(root)
    assert "B = 2" in (root / "minillm" / "beta.py").read_text()
    fast = (root / "minillm" / "kernels" / "fast.py").read_text()
    assert "F = 3" in fast and "B = 2" not in fast
    assert (root / "minillm" / "kernels" / "__init__.py").exists()


def test_two_chapters_into_one_module_keep_chapter_order(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "02_b.md": cell("#| export shared\nSECOND = 2"),
            "01_a.md": cell("#| export shared\nFIRST = 1"),
        },
    )
    tangle.write(root)
    text = (root / "minillm" / "shared.py").read_text()
    assert text.index("FIRST") < text.index("SECOND")
    assert "chapters/01_a.md, chapters/02_b.md" in text.splitlines()[0]


def test_cell_options_are_not_exported(tmp_path):
    body = (
        cell("#| default_exp opts")
        + cell("#| export\nA = 1", options=":tags: [hide-input]\n\n")
        + cell("#| export\nB = 2", options="---\ntags: [remove-output]\n---\n")
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    tangle.write(root)
    text = (root / "minillm" / "opts.py").read_text()
    assert "A = 1" in text and "B = 2" in text and "tags" not in text


def test_chapter_that_exports_nothing_produces_no_module(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "01_a.md": cell("#| default_exp alpha") + cell("#| export\nX = 1"),
            "17_compare.md": "# Prose only\n\n" + cell("print(1)"),
        },
    )
    files = tangle.generate(root)
    assert set(files) == {Path("minillm/alpha.py"), Path("minillm/__init__.py")}


def test_check_passes_then_fails_after_an_edit_without_retangle(tmp_path):
    root = make_repo(
        tmp_path, {"01_a.md": cell("#| default_exp alpha") + cell("#| export\nX = 1")}
    )
    assert tangle.check(root)  # nothing written yet: missing files
    tangle.write(root)
    assert tangle.check(root) == []
    chapter = root / "chapters" / "01_a.md"
    chapter.write_text(chapter.read_text().replace("X = 1", "X = 2"))
    assert tangle.check(root) == ["minillm/alpha.py: differs from the chapters"]
    assert tangle.main(["--check", "--root", str(root)]) == 1


def test_check_fails_on_hand_edit_of_generated_module(tmp_path):
    root = make_repo(
        tmp_path, {"01_a.md": cell("#| default_exp alpha") + cell("#| export\nX = 1")}
    )
    tangle.write(root)
    (root / "minillm" / "alpha.py").write_text("X = 3\n")
    assert tangle.main(["--check", "--root", str(root)]) == 1


def test_stale_generated_module_is_reported_and_removed(tmp_path):
    root = make_repo(
        tmp_path, {"01_a.md": cell("#| default_exp alpha") + cell("#| export\nX = 1")}
    )
    tangle.write(root)
    chapter = root / "chapters" / "01_a.md"
    chapter.write_text(chapter.read_text().replace("alpha", "gamma"))
    assert "minillm/alpha.py: no chapter produces it" in tangle.check(root)
    tangle.write(root)
    assert not (root / "minillm" / "alpha.py").exists()
    assert tangle.check(root) == []


def test_output_is_deterministic(tmp_path):
    chapters = {
        "01_a.md": cell("#| default_exp alpha")
        + cell("#| export\nX = 1")
        + cell("#| export z.y\nY = 1"),
        "03_c.md": cell("#| export alpha\nZ = 1"),
    }
    first = tangle.generate(make_repo(tmp_path / "one", chapters))
    second = tangle.generate(make_repo(tmp_path / "two", chapters))
    assert first == second


@pytest.mark.parametrize(
    "body, message",
    [
        (cell("#| export\nX = 1"), "no module and no '#| default_exp'"),
        (cell("#| default_exp not-a-module"), "needs a module name"),
        (cell("#| exprot\nX = 1"), "unknown directive"),
        ("```{code-cell} ipython3\nX = 1\n", "never closed"),
    ],
)
def test_bad_directives_are_clear_errors(tmp_path, body, message):
    root = make_repo(tmp_path, {"01_a.md": body})
    with pytest.raises(tangle.TangleError, match=message):
        tangle.generate(root)


def test_class_continuation_cells_merge_into_one_class(tmp_path):
    body = (
        cell("#| default_exp grow")
        + cell("#| export\nclass A:\n    def f(self):\n        return 1")
        + cell(
            "#| export\nclass A(A):  # continued\n    def g(self):\n        return 2"
        )
        + cell("#| export\nB = A().g()")
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    tangle.write(root)
    text = (root / "minillm" / "grow.py").read_text()
    assert "class A(A)" not in text
    namespace = {}
    exec(compile(text, "grow.py", "exec"), namespace)
    assert (
        namespace["A"].__bases__ == (object,)
        and namespace["B"] == 2
        and namespace["A"]().f() == 1
    )
    script = {}
    # the notebook way runs too
    exec(compile(tangle.script(root / "chapters" / "01_a.md"), "s", "exec"), script)
    assert script["B"] == 2


def run_module(root: Path, name: str) -> dict:
    namespace = {}
    text = (root / "minillm" / f"{name}.py").read_text()
    exec(compile(text, f"{name}.py", "exec"), namespace)
    return namespace


def test_continuation_after_other_code_lands_in_its_class(tmp_path):
    # a class and a function between a class and its continuation once made the
    # continuation's methods nest inside the function, silently
    body = (
        cell("#| default_exp grow")
        + cell("#| export\nclass A:\n    def f(self):\n        return 1")
        + cell("#| export\nclass B:\n    pass")
        + cell("#| export\ndef helper():\n    return 3")
        + cell("#| export\nclass A(A):\n    def g(self):\n        return helper()")
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    tangle.write(root)
    ns = run_module(root, "grow")
    assert ns["A"]().g() == 3 and ns["A"]().f() == 1 and ns["A"].__bases__ == (object,)
    assert not hasattr(ns["B"], "g") and ns["helper"]() == 3
    assert "class A(A)" not in (root / "minillm" / "grow.py").read_text()


def test_continuation_that_is_not_on_a_cells_first_line_is_merged(tmp_path):
    # once recognised on a cell's first line only: the module kept `class A(A)`
    body = (
        cell("#| default_exp grow")
        + cell("#| export\nclass A:\n    pass")
        + cell(
            "#| export\nX = 5\n\n\nclass A(A):  # continued\n    def g(self):\n"
            "        return X\n\n\nY = A().g()"
        )
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    tangle.write(root)
    text = (root / "minillm" / "grow.py").read_text()
    ns = run_module(root, "grow")
    assert "class A(A)" not in text and ns["Y"] == 5 and ns["A"].__bases__ == (object,)
    # each piece's marker names its own line of the chapter
    lines = (root / "chapters" / "01_a.md").read_text().splitlines()
    pointed = {
        lines[int(m) - 1].strip()
        for m in re.findall(r"# %% chapters/01_a.md:(\d+)", text)
    }
    assert {"class A(A):  # continued", "Y = A().g()"} <= pointed


@pytest.mark.parametrize(
    "cells, message",
    [
        (
            ["#| export\nclass A(A):\n    pass"],
            r"01_a.md:\d+: 'class A\(A\):' continues class A, but no exported cell",
        ),
        (
            ["#| export other\nclass A:\n    pass", "#| export\nclass A(A):\n    pass"],
            r"class A is in minillm/other.py, so export this cell there",
        ),
        (
            ["#| export\nclass A:\n    pass", "#| export\n@x\nclass A(A):\n    pass"],
            "takes no decorators",
        ),
        (
            ["#| export\ndef f(:\n    pass"],
            r"01_a.md:\d+: exported code does not parse",
        ),
        (["X = 1\n#| export"], r"01_a.md:\d+: '#\| export' is not on the cell's first"),
        (["# a comment first\n#| export\nX = 1"], "is not on the cell's first lines"),
        (["#| plugin\nX = 1"], "'#| plugin' on a cell that is not exported"),
    ],
)
def test_tangler_misuse_is_a_clear_error(tmp_path, cells, message):
    body = cell("#| default_exp grow") + "".join(cell(c) for c in cells)
    with pytest.raises(tangle.TangleError, match=message):
        tangle.generate(make_repo(tmp_path, {"01_a.md": body}))


def test_stray_directive_error_names_its_chapter_line(tmp_path):
    body = cell("#| default_exp grow") + cell("X = 1\n#| export")
    root = make_repo(tmp_path, {"01_a.md": body})
    with pytest.raises(tangle.TangleError) as error:
        tangle.generate(root)
    line = int(re.search(r"01_a.md:(\d+):", str(error.value)).group(1))
    assert (root / "chapters" / "01_a.md").read_text().splitlines()[line - 1] == (
        "#| export"
    )


def test_plugin_modules_are_listed_in_chapter_order(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "02_b.md": cell("#| default_exp beta")
            + cell("#| export\n#| plugin\nB = 1"),
            "01_a.md": cell("#| default_exp alpha")
            + cell("#| export\n#| plugin\nA = 1")
            + cell("#| export\n#| plugin\nA2 = 1"),
            "03_c.md": cell("#| default_exp gamma") + cell("#| export\nC = 1"),
        },
    )
    tangle.write(root)
    ns = {}
    exec((root / "minillm" / "__init__.py").read_text(), ns)
    assert ns["PLUGINS"] == ("minillm.alpha", "minillm.beta")


def test_script_has_every_code_cell(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "01_a.md": cell("#| default_exp alpha")
            + cell("#| export\nX = 1")
            + cell("print(X)")
        },
    )
    text = tangle.script(root / "chapters" / "01_a.md")
    assert "X = 1" in text and "print(X)" in text


@pytest.mark.parametrize(
    "options",
    [":tags: [skip-execution, nbval-skip]\n\n", "---\ntags: [nbval-skip]\n---\n"],
)
def test_script_skips_the_cells_a_notebook_run_skips(tmp_path, options):
    # the server chapter's `main()` would serve forever in a script
    body = (
        cell("#| default_exp alpha") + cell("X = 1") + cell("serve_forever()", options)
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    text = tangle.script(root / "chapters" / "01_a.md")
    assert "X = 1" in text and "serve_forever" not in text
    assert tangle.read_code_cells(body, Path("x.md"))[2].source == "serve_forever()"


def test_repository_is_in_sync():
    assert tangle.check(ROOT) == [], "run `python tools/tangle.py` and commit minillm/"


def test_api_names_become_lazy_top_level_imports(tmp_path):
    root = make_repo(
        tmp_path,
        {
            "01_a.md": cell("#| default_exp alpha")
            + cell(
                "#| export\n#| api Engine make\nclass Engine:\n    pass\n\n\n"
                "def make():\n    return Engine()"
            )
        },
    )
    tangle.write(root)
    init = (root / "minillm" / "__init__.py").read_text()
    assert '"Engine": "minillm.alpha"' in init and '"make": "minillm.alpha"' in init
    assert "import minillm.alpha" not in init  # imported on first use only


@pytest.mark.parametrize(
    "body, message",
    [
        (cell("#| export\n#| api Missing\nX = 1"), "defines no 'Missing'"),
        (cell("#| api X\nX = 1"), "not exported"),
        (
            cell("#| export\n#| api X\nX = 1") + cell("#| export\n#| api X\nX = 2"),
            "already exported",
        ),
    ],
)
def test_api_directive_misuse_is_an_error(tmp_path, body, message):
    root = make_repo(tmp_path, {"01_a.md": cell("#| default_exp alpha") + body})
    with pytest.raises(tangle.TangleError, match=message):
        tangle.generate(root)


def test_the_package_exports_vllms_names_without_importing_torch():
    code = (
        "import sys, minillm\n"
        "assert 'torch' not in sys.modules, 'import minillm pulled torch in'\n"
        "from minillm import LLM, SamplingParams\n"
        "from minillm.llm import LLM as direct\n"
        "assert LLM is direct\n"
        "assert SamplingParams.__module__ == 'minillm.sampling_params'\n"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_generated_modules_are_formatted_as_ruff_formats_them(tmp_path):
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this Python")
    import subprocess

    done = subprocess.run(
        [str(ruff), "format", "--check", "minillm"], cwd=ROOT, capture_output=True
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_script_moves_future_imports_only_where_they_are_statements(tmp_path):
    # a substring replace once also cut the text out of strings
    body = (
        cell("#| default_exp alpha")
        + cell('NOTE = "from __future__ import annotations"')
        + cell("from __future__ import annotations\n\nX: int = 1")
    )
    root = make_repo(tmp_path, {"01_a.md": body})
    text = tangle.script(root / "chapters" / "01_a.md")
    assert text.startswith("from __future__ import annotations\n")
    assert text.count("from __future__ import") == 2  # the header and the string
    ns = {}
    exec(compile(text, "s", "exec"), ns)
    assert ns["NOTE"] == "from __future__ import annotations" and ns["X"] == 1


def test_check_reports_stale_and_changed_data_files(tmp_path):
    root = make_repo(
        tmp_path, {"01_a.md": cell("#| default_exp a") + cell("#| export\nA = 1")}
    )
    (root / "data").mkdir()
    (root / "data" / "corpus.txt").write_text("text\n")
    tangle.write(root)
    assert tangle.check(root) == []
    (root / "minillm" / "data" / "old.txt").write_text("a file no source makes\n")
    (root / "minillm" / "data" / "corpus.txt").write_text("edited\n")
    problems = tangle.check(root)
    assert any("old.txt: no chapter produces it" in p for p in problems)
    assert any("corpus.txt: differs" in p for p in problems)
    tangle.write(root)
    assert tangle.check(root) == []
    assert not (root / "minillm" / "data" / "old.txt").exists()
