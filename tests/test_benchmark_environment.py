"""benchmarks/common.py stores runs of committed code only: a tree whose minillm/ or
benchmarks/ differs from its commit is refused before the benchmark runs and again at
save time, unless MINILLM_FORCE_STORE=1, which marks the stored run forced; a copy of
the tree whose .git is stale or missing is checked against the commit it names.

Each test builds a small git repository in tmp_path with the layout the check reads.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import (
    UncommittedCode,
    code_hash,
    committed_code_hash,
    require_committed,
    save,
    uncommitted_code,
)

BENCHMARKS = Path(common.__file__).resolve().parent


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()


def commit_all(root: Path, message: str) -> str:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "--short", "HEAD")


@pytest.fixture
def repo(tmp_path) -> Path:
    """A committed tree: minillm/ (a sub-package, a data file, names whose path order
    and string order differ), benchmarks/ and a stored result."""
    root = tmp_path / "repo"
    files = {
        "minillm/__init__.py": "",
        "minillm/engine.py": "STEP = 1\n",
        "minillm/a-b.py": "X = 1\n",
        "minillm/a/b.py": "Y = 2\n",
        "minillm/data/topics.txt": "topics\n",
        "benchmarks/__init__.py": "",
        "benchmarks/bench.py": "print('bench')\n",
        "benchmarks/results/bench-cpu-2026-01-01.json": "{}\n",
        "chapters/01.md": "# one\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "init", "-q")
    git(root, "config", "user.email", "test@example.com")
    git(root, "config", "user.name", "test")
    commit_all(root, "first")
    return root


def test_a_clean_tree_is_accepted_and_names_its_commit(repo):
    info = require_committed({}, repo)
    assert info["committed"] and not info["forced"]
    assert info["commit"] == git(repo, "rev-parse", "--short", "HEAD")
    assert info["uncommitted_changes"] == []
    assert info["code_sha256"] == code_hash(repo)


@pytest.mark.parametrize(
    "change, path",
    [
        ("edit", "minillm/engine.py"),
        ("delete", "minillm/a/b.py"),
        ("edit", "minillm/data/topics.txt"),  # not code_hash's, still code
        ("new", "benchmarks/new.py"),
        ("new", "minillm/sub/new.py"),  # untracked, in an untracked folder
    ],
)
def test_a_dirty_tree_is_refused_naming_the_files(repo, change, path):
    if change == "delete":
        (repo / path).unlink()
    else:
        (repo / path).parent.mkdir(exist_ok=True)
        (repo / path).write_text("changed = True\n")
    assert uncommitted_code(repo) == [path]
    with pytest.raises(UncommittedCode, match=re.escape(path)) as refused:
        require_committed({}, repo)
    assert "MINILLM_FORCE_STORE=1" in str(refused.value)  # says what to do


def test_results_chapters_and_untracked_non_code_do_not_count(repo):
    (repo / "benchmarks/results/bench-cpu-2026-01-02.json").write_text("{}\n")
    (repo / "benchmarks/results/bench-cpu-2026-01-01.json").write_text("[]\n")
    (repo / "benchmarks/notes.txt").write_text("scratch\n")
    (repo / "chapters/01.md").write_text("# changed\n")
    assert uncommitted_code(repo) == []
    assert require_committed({}, repo)["committed"]


def test_a_forced_run_goes_ahead_marked_with_its_changes(repo):
    (repo / "minillm/engine.py").write_text("STEP = 2\n")
    info = require_committed({"MINILLM_FORCE_STORE": "1"}, repo)
    assert info["forced"] and not info["committed"]
    assert info["uncommitted_changes"] == ["minillm/engine.py"]
    with pytest.raises(UncommittedCode):
        require_committed({"MINILLM_FORCE_STORE": "0"}, repo)


def test_a_tree_git_cannot_read_is_refused_unless_forced(repo, tmp_path):
    copy = tmp_path / "copy"  # the tree without its .git
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    with pytest.raises(UncommittedCode, match="git cannot say"):
        require_committed({}, copy)
    info = require_committed({"MINILLM_FORCE_STORE": "1"}, copy)
    assert info["forced"] and info["uncommitted_changes"] is None


def test_the_committed_hash_is_the_trees_hash(repo):
    assert committed_code_hash("HEAD", repo) == code_hash(repo)
    (repo / "minillm/a/b.py").write_text("Y = 3\n")
    assert committed_code_hash("HEAD", repo) != code_hash(repo)


def test_a_copy_names_its_commit_and_is_checked_against_it(repo, tmp_path):
    """The device's copy: the tree of a newer commit beside a .git that is stale
    (an older commit checked out, the newer one absent) or current."""
    old = git(repo, "rev-parse", "--short", "HEAD")
    stale = tmp_path / "stale.git"
    shutil.copytree(repo / ".git", stale)  # before the newer commit
    (repo / "minillm/engine.py").write_text("STEP = 2\n")
    new = commit_all(repo, "second")
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    shutil.copytree(stale, copy / ".git")
    assert uncommitted_code(copy) == ["minillm/engine.py"]  # git status is fooled
    with pytest.raises(UncommittedCode, match=f"cannot read {new}"):
        require_committed({"MINILLM_CODE_COMMIT": new}, copy)
    # the hash printed by `python -m benchmarks.common` on the committed tree
    env = {"MINILLM_CODE_COMMIT": new, "MINILLM_CODE_SHA256": code_hash(repo)}
    info = require_committed(env, copy)
    assert info["committed"] and info["commit"] == new and not info["forced"]
    # the same claim for a tree that is not that commit's is refused
    (copy / "minillm/engine.py").write_text("STEP = 3\n")
    with pytest.raises(UncommittedCode, match="code_sha256"):
        require_committed(env, copy)
    # a copy whose .git holds the commit (HEAD older): checked by git itself
    shutil.rmtree(copy / ".git")
    shutil.copytree(repo / ".git", copy / ".git")
    git(copy, "reset", "-q", "--soft", old)
    with pytest.raises(UncommittedCode, match="code_sha256"):
        require_committed({"MINILLM_CODE_COMMIT": new}, copy)  # STEP = 3
    (copy / "minillm/engine.py").write_text("STEP = 2\n")
    info = require_committed({"MINILLM_CODE_COMMIT": new}, copy)
    assert info["committed"] and info["checked_by"] == f"git show {new}"


def test_environment_and_save_refuse_a_dirty_tree(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", repo)
    monkeypatch.delenv("MINILLM_CODE_COMMIT", raising=False)
    monkeypatch.delenv("MINILLM_FORCE_STORE", raising=False)
    out = tmp_path / "results"
    record = {"benchmark": "bench", "environment": common.environment(), "rows": [1]}
    assert record["environment"]["committed"]
    path = save("bench", record, out)
    assert json.loads(path.read_text())["environment"]["forced"] is False
    (repo / "minillm/engine.py").write_text("STEP = 2\n")  # edited during the run
    with pytest.raises(UncommittedCode):
        save("bench", record, out)
    with pytest.raises(UncommittedCode):
        common.environment()  # before any measurement
    monkeypatch.setenv("MINILLM_FORCE_STORE", "1")
    stored = json.loads(save("bench", record, out).read_text())["environment"]
    assert stored["forced"] and stored["code_sha256_at_save"] == code_hash(repo)
    forced = common.environment()
    assert forced["forced"] and forced["uncommitted_changes"] == ["minillm/engine.py"]


def test_save_refuses_code_that_changed_while_the_run_ran(repo, tmp_path, monkeypatch):
    """Committed at the start and at the end, but not the same code: the run ran the
    code of neither check alone."""
    monkeypatch.setattr(common, "ROOT", repo)
    monkeypatch.delenv("MINILLM_CODE_COMMIT", raising=False)
    monkeypatch.delenv("MINILLM_FORCE_STORE", raising=False)
    record = {"benchmark": "bench", "environment": common.environment()}
    (repo / "minillm/engine.py").write_text("STEP = 2\n")
    commit_all(repo, "second")
    with pytest.raises(UncommittedCode, match="changed while it ran"):
        save("bench", record, tmp_path)


def test_every_benchmark_that_stores_checks_before_it_measures():
    """A script that calls environment() also calls require_committed() as soon as it
    has read its arguments, so that a refused run costs no GPU time."""
    scripts = [
        path
        for path in sorted(BENCHMARKS.glob("*.py"))
        if path.name != "common.py" and "environment()" in path.read_text()
    ]
    assert len(scripts) > 20
    for path in scripts:
        assert "require_committed()" in path.read_text(), path.name
