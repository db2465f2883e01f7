"""The vLLM paths the course cites: one list (tools/vllm_references.txt), checked.

The repo check runs everywhere; the check against vLLM's source runs only where
`import vllm` works (chapter 29's .venv-vllm), and is skipped elsewhere.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import check_vllm_refs as refs  # noqa: E402


def test_the_list_holds_exactly_the_paths_the_sources_cite():
    errors, _ = refs.check_repo(refs.ROOT, refs.LIST.read_text(encoding="utf-8"), False)
    assert errors == []
    assert refs.main(["--repo"]) == 0


def test_the_list_names_its_vllm_version_and_who_checks_it():
    head = refs.LIST.read_text(encoding="utf-8").splitlines()[0]
    assert head.startswith("# vLLM 0.32.0 ")
    assert "--vllm" in refs.LIST.read_text(encoding="utf-8")


def test_path_regex_takes_paths_and_nothing_around_them():
    line = (
        "see `vllm/v1/core/block_pool.py`, vllm/compilation/. and .venv-vllm/bin "
        "or github.com/vllm-project/vllm/tree/x (vllm:num_requests)"
    )
    found = [m.group().rstrip(".") for m in refs.PATH_RE.finditer(line)]
    assert found == ["vllm/v1/core/block_pool.py", "vllm/compilation/"]


def _repo(tmp_path, cites):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "chapters" / "01_x.md").write_text(cites, encoding="utf-8")
    return tmp_path


def test_repo_check_fails_on_unlisted_and_on_uncited_paths(tmp_path):
    root = _repo(tmp_path, "`vllm/a.py` and `vllm/b/` (old: vllm/old.py)\n")
    ok = "vllm/a.py A\nvllm/b/\nvllm/old.py -> vllm/new.py\nvllm/new.py N\n"
    errors, warnings = refs.check_repo(root, ok, strict=False)
    assert errors == [] and len(warnings) == 1 and "vllm/new.py" in warnings[0]
    errors, _ = refs.check_repo(root, ok, strict=True)  # a moved citation fails
    assert len(errors) == 1 and "chapters/01_x.md:1" in errors[0]

    errors, _ = refs.check_repo(root, "vllm/a.py\nvllm/c.py\n", strict=False)
    assert any("vllm/b/ is cited" in e for e in errors)
    assert any("vllm/c.py is listed but nothing cites it" in e for e in errors)
    assert any("vllm/old.py is cited" in e for e in errors)

    _, errors = refs.parse_list("vllm/a.py\nvllm/a.py\nvllm/x.py -> vllm/y.py\n")
    assert any("listed again" in e for e in errors)
    assert any("vllm/y.py needs a line of its own" in e for e in errors)


def _vllm(tmp_path):
    pkg = tmp_path / "site" / "vllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    (pkg / "a.py").write_text(
        "from x import imported\n"
        "B = 1\n"
        "class A:\n"
        "    field: int\n"
        "    def f(self):\n"
        "        self.attr = 2\n"
        "        local = 3\n"
    )
    (pkg / "sub" / "deep.py").write_text("def g():\n    pass\n")
    (pkg / "gone.py").write_text("")
    (pkg / "shim.py").write_text("from vllm.sub.deep import g\n")
    return pkg.parent


def test_vllm_check_finds_paths_and_symbols_and_reports_what_is_missing(tmp_path):
    site = _vllm(tmp_path)
    good = (
        "# vLLM 0.32.0\nvllm/a.py A A.f A.field A.attr B imported local\nvllm/sub/ g\n"
    )
    assert refs.check_vllm(site, good) == ([], [])
    assert refs.vllm_root(str(site / "vllm")) == site == refs.vllm_root(str(site))

    bad = (
        "# vLLM 0.31.0\n"
        "vllm/a.py A.g A.local C\n"  # A.local is a function's local, not a member
        "vllm/sub/ A\n"
        "vllm/missing.py\n"
        "vllm/a.py/ \n"  # a file is not a folder
        "vllm/gone.py -> removed\n"
        "vllm/shim.py -> vllm/sub/deep.py\n"
        "vllm/sub/deep.py h\n"
    )
    errors, warnings = refs.check_vllm(site, bad)
    text = "\n".join(errors)
    assert "vllm/a.py has no A.g, A.local, C" in text
    assert "vllm/sub/ has no A" in text
    assert "vllm/missing.py does not exist" in text
    assert "vllm/a.py/ does not exist" in text
    assert "vllm/gone.py exists; the list says removed" in text
    assert "vllm/sub/deep.py has no h" in text
    assert any("0.31.0" in w for w in warnings)
    assert any("vllm/shim.py still exists" in w for w in warnings)
    assert len(errors) == 6, errors


def _vllm_imports():
    if importlib.util.find_spec("vllm") is None:
        return False
    run = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return run.returncode == 0


@pytest.mark.skipif(not _vllm_imports(), reason="vLLM is not installed here")
def test_every_listed_path_and_symbol_exists_in_the_installed_vllm(capsys):
    assert refs.main(["--vllm"]) == 0, capsys.readouterr().out
