#!/usr/bin/env python3
"""Check the vLLM source paths the course cites, against one list and against vLLM.

The course cites vLLM by file path ("`Scheduler.schedule` in vllm/v1/core/...").
Every cited path, with the symbols the text names next to it, is listed once in
tools/vllm_references.txt, pinned to one vLLM version. Two checks keep it honest:

    python tools/check_vllm_refs.py [--repo] [--strict]
        The list matches the sources: every path the sources cite is listed,
        and every listed path is cited somewhere. Needs no vLLM (CI runs it).
        A citation of a path the list records as moved (OLD -> NEW) is
        reported; --strict makes that an error too.
    python tools/check_vllm_refs.py --vllm [DIR]
        Every listed path exists in the vLLM under DIR (a `vllm` package folder
        or a site-packages folder; default: where `vllm` is installed, found
        without importing it), every listed symbol is bound there (a def, a
        class, an assignment or an import of that name; `Class.member` must be
        defined in that class's body or assigned to `self.member` in one of its
        methods), and every path the list calls removed is gone (a moved one
        left behind, say as a deprecated shim that re-exports, is a warning).

The list, one entry a line (`#` starts a comment):

    vllm/v1/core/sched/scheduler.py Scheduler Scheduler.schedule
    vllm/model_executor/model_loader/          a folder ends with "/"
    OLD -> NEW [NEW ...]                       the sources cite OLD, which is NEW in
                                               this version (split: several NEWs,
                                               each listed on its own line)
    OLD -> removed                             cited as history (vLLM v0): gone now

A NEW path counts as cited while its OLD one is, so the list can name where the
sources must point before they do.

The sources scanned are SOURCES below (minillm/ is generated from chapters/, so
it is not scanned); a path is what `PATH_RE` matches, less a trailing ".".
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tools" / "vllm_references.txt"
SOURCES = (
    "chapters/*.md",
    "chapters/lab_notes/*.md",
    "book/*.md",
    "README.md",
    "benchmarks/*.py",
    "tests/*.py",
    "tools/*.py",
    "exercises/*.py",
    "exercises/*.md",
)
# This tool and its test talk about paths without citing vLLM.
NOT_SCANNED = ("tools/check_vllm_refs.py", "tests/test_vllm_refs.py")
# A path starts at a "vllm/" that no word, dot, dash or slash precedes (so neither
# ".venv-vllm/" nor a URL's "vllm-project/vllm/..." counts).
PATH_RE = re.compile(r"(?<![\w./-])vllm/[A-Za-z0-9_./]+")
SYMBOL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")
REMOVED = "removed"


@dataclass
class Entry:
    line: int
    path: str
    symbols: list[str] = field(default_factory=list)
    moved_to: list[str] | None = None  # OLD -> NEW...: the NEW paths ([] if removed)


def parse_list(text: str) -> tuple[list[Entry], list[str]]:
    """The entries of the list, and the errors in it."""
    entries, errors = [], []
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        e = Entry(n, words[0])
        if words[1:2] == ["->"]:
            e.moved_to = [] if words[2:] == [REMOVED] else words[2:]
            if not words[2:]:
                errors.append(f"line {n}: '->' needs the new path(s) or '{REMOVED}'")
        else:
            e.symbols = words[1:]
        for p in [e.path, *(e.moved_to or [])]:
            if not PATH_RE.fullmatch(p):
                errors.append(f"line {n}: {p!r} is not a vllm/... path")
        for s in e.symbols:
            if not SYMBOL_RE.match(s):
                errors.append(f"line {n}: {s!r} is not a symbol (name or Class.name)")
        entries.append(e)
    current = {e.path for e in entries if e.moved_to is None}
    seen: dict[str, int] = {}
    for e in entries:
        if e.path in seen:
            errors.append(
                f"line {e.line}: {e.path} is listed again (line {seen[e.path]})"
            )
        seen.setdefault(e.path, e.line)
        for new in e.moved_to or []:
            if new not in current:
                errors.append(f"line {e.line}: {new} needs a line of its own")
    return entries, errors


def cited_paths(root: Path = ROOT) -> dict[str, list[str]]:
    """Every vLLM path the sources cite -> where ("file:line")."""
    cited: dict[str, list[str]] = {}
    for pattern in SOURCES:
        for f in sorted(root.glob(pattern)):
            rel = f.relative_to(root).as_posix()
            if rel in NOT_SCANNED:
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                for m in PATH_RE.finditer(line):
                    cited.setdefault(m.group().rstrip("."), []).append(f"{rel}:{n}")
    return cited


def check_repo(root: Path, list_text: str, strict: bool) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the list against what the sources under root cite."""
    entries, errors = parse_list(list_text)
    cited = cited_paths(root)
    warnings = []
    listed = {e.path for e in entries}
    pending = {new for e in entries if e.path in cited for new in e.moved_to or []}
    for path, where in sorted(cited.items()):
        if path not in listed:
            errors.append(f"{path} is cited ({', '.join(where)}) but not listed")
    for e in entries:
        if e.moved_to is None and e.path not in cited and e.path not in pending:
            errors.append(f"line {e.line}: {e.path} is listed but nothing cites it")
        elif e.moved_to and e.path in cited:
            (errors if strict else warnings).append(
                f"{e.path} is cited ({', '.join(cited[e.path])}) but in this version "
                f"it is {' and '.join(e.moved_to)}"
            )
        elif e.moved_to is not None and e.path not in cited:
            warnings.append(f"line {e.line}: nothing cites {e.path} any more: drop it")
    return errors, warnings


# --- vLLM's side: which names a module binds ----------------------------------------


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _names(
    target: ast.AST, attrs_of: tuple[str, ...] = (), plain: bool = True
) -> list[str]:
    """Names a target binds: `x`, `a, b` (if plain); `self.x` ("self" in attrs_of)."""
    if isinstance(target, ast.Name):
        return [target.id] if plain else []
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names(t, attrs_of, plain)]
    if isinstance(target, ast.Starred):
        return _names(target.value, attrs_of, plain)
    if (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id in attrs_of
    ):
        return [target.attr]
    return []


@dataclass
class Bindings:
    names: set[str] = field(default_factory=set)  # bound anywhere in the module
    members: dict[str, set[str]] = field(default_factory=dict)  # class -> its names

    def has(self, symbol: str) -> bool:
        if "." not in symbol:
            return symbol in self.names
        cls, member = symbol.split(".")
        return member in self.members.get(cls, set())


def bindings(source: str, into: Bindings | None = None) -> Bindings:
    """The names a module binds, and the members of each class it defines."""
    b = into or Bindings()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            b.names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                b.names.add(alias.asname or alias.name.split(".")[0])
        for t in _targets(node):
            b.names.update(_names(t, ("self", "cls")))
        if isinstance(node, ast.ClassDef):
            members = b.members.setdefault(node.name, set())
            for item in node.body:
                if isinstance(
                    item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                ):
                    members.add(item.name)
                for t in _targets(item):
                    members.update(_names(t))
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for sub in ast.walk(item):
                        for t in _targets(sub):
                            members.update(_names(t, ("self", "cls"), False))
    return b


def vllm_root(where: str | None) -> Path | None:
    """The folder holding the `vllm` package: DIR, its parent, or the installed one."""
    if where is None:
        spec = importlib.util.find_spec("vllm")  # finds, does not import
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(list(spec.submodule_search_locations)[0]).parent
    d = Path(where)
    if (d / "vllm").is_dir():
        return d
    if d.name == "vllm" and d.is_dir():
        return d.parent
    return None


def installed_version(root: Path) -> str | None:
    m = re.search(
        r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
        (root / "vllm" / "_version.py").read_text(encoding="utf-8")
        if (root / "vllm" / "_version.py").is_file()
        else "",
    )
    return m.group(1) if m else None


def check_vllm(root: Path, list_text: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the list against the vLLM source tree under root."""
    entries, errors = parse_list(list_text)
    warnings = []
    pinned = re.search(r"^#\s*vLLM\s+(\S+)", list_text, re.M)
    have = installed_version(root)
    if pinned and have and pinned.group(1) != have:
        warnings.append(f"the list is for vLLM {pinned.group(1)}; {root} has {have}")
    cache: dict[str, Bindings] = {}
    for e in entries:
        if e.moved_to is not None:
            if (root / e.path.rstrip("/")).exists():
                if e.moved_to:  # a deprecated module may stay behind, re-exporting
                    warnings.append(f"line {e.line}: {e.path} still exists (a shim?)")
                else:
                    errors.append(
                        f"line {e.line}: {e.path} exists; the list says removed"
                    )
            continue
        target = root / e.path.rstrip("/")
        folder = e.path.endswith("/")
        if not (target.is_dir() if folder else target.is_file()):
            errors.append(f"line {e.line}: {e.path} does not exist under {root}")
            continue
        if e.path not in cache:
            b = Bindings()
            for f in sorted(target.rglob("*.py")) if folder else [target]:
                try:
                    bindings(f.read_text(encoding="utf-8"), b)
                except SyntaxError as exc:
                    errors.append(f"{f}: cannot parse ({exc}); symbols unchecked")
            cache[e.path] = b
        missing = [s for s in e.symbols if not cache[e.path].has(s)]
        if missing:
            errors.append(f"line {e.line}: {e.path} has no {', '.join(missing)}")
    return errors, warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--repo", action="store_true", help="check the list (default)")
    mode.add_argument(
        "--vllm",
        nargs="?",
        const="",
        metavar="DIR",
        help="check the list against vLLM's source (default: the installed vllm)",
    )
    ap.add_argument("--strict", action="store_true", help="moved citations fail")
    ap.add_argument("--list", type=Path, default=LIST, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    text = args.list.read_text(encoding="utf-8")
    if args.vllm is not None:
        root = vllm_root(args.vllm or None)
        if root is None:
            print(f"no vllm package at {args.vllm or '(not installed)'}")
            return 1
        errors, warnings = check_vllm(root, text)
        what = f"vLLM {installed_version(root) or '?'} at {root / 'vllm'}"
    else:
        errors, warnings = check_repo(args.root, text, args.strict)
        what = "the sources"
    for w in warnings:
        print(f"warning: {w}")
    for e in errors:
        print(f"error: {e}")
    n = len(parse_list(text)[0])
    rel = (
        args.list.relative_to(args.root)
        if args.list.is_relative_to(args.root)
        else args.list
    )
    verdict = f"{len(errors)} error(s)" if errors else "ok"
    print(f"{rel}: {n} paths checked against {what}: {verdict}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
