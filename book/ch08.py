"""Chapter 8's helpers that are not the lesson: the package's import graph, read
from its source, and an inventory of what the later chapters plug into the seam
(issue 44). book/ch09.py draws the graph for chapter 9's lab notes.

    from book.ch08 import import_graph, seam_inventory
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

# the seam's lists of hooks (minillm/registry.py), beside its registries
HOOK_LISTS = (
    "RUNNER_EXTENSIONS",
    "EXECUTOR_HOOKS",
    "REQUEST_HOOKS",
    "REQUEST_CHECKS",
    "ENGINE_HOOKS",
    "FAST_PATH_BLOCKERS",
)


def module_imports(source: str) -> set[str]:
    """The minillm modules one module's source imports (inside functions too), without
    the "minillm." prefix; `from minillm.x import y` counts both x and x.y."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m.removeprefix("minillm.") for m in found if m.startswith("minillm.")}


def import_graph(package: Path) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module -> the chapter that wrote it, module -> the modules it imports), read
    from each generated module; its header line names the chapter. The package
    indexes (__init__.py, written by the tangler) have no chapter and are left out."""
    chapter_of, imports = {}, {}
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        head = source.splitlines()[0] if source else ""
        if "from chapters/" not in head:
            continue
        name = ".".join(path.relative_to(package).with_suffix("").parts)
        chapter_of[name] = head.split("from chapters/")[1].split("_")[0]
        imports[name] = module_imports(source)
    # keep the names that are modules: not a package, not a function imported by name
    imports = {a: {b for b in found if b in chapter_of} for a, found in imports.items()}
    return chapter_of, imports


def seam_inventory(registry, chapter_of: dict[str, str]) -> dict[str, dict]:
    """chapter -> {"parts": [...], "options": [...], "hooks": [...]}: every part
    registered, option declared (beyond the registries' own) and hook added, by the
    chapter whose module did it; read from the package's registry module after
    load_plugins, so a module that could not be imported adds nothing."""
    rows: dict[str, dict] = {}

    def row(module: str) -> dict:
        chapter = chapter_of.get(module.removeprefix("minillm."), "?")
        return rows.setdefault(chapter, {"parts": [], "options": [], "hooks": []})

    for reg in registry.REGISTRIES:
        for name, module in reg.registered_by.items():
            row(module)["parts"].append(f"{reg.option}={name!r}")
    for name, owner in registry.OWNERS.items():
        if owner != registry.__name__:  # a registry's option is the registry's
            row(owner)["options"].append(name)
    for seam in HOOK_LISTS:
        for hook in getattr(registry, seam):
            row(hook.__module__)["hooks"].append(seam)
    return dict(sorted(rows.items()))


def print_inventory(rows: dict[str, dict], width: int = 88) -> None:
    """A paragraph per chapter: what it plugs in, and where."""
    for chapter, found in rows.items():
        said = [f"{k}: {', '.join(v)}" for k, v in found.items() if v]
        head = f"ch. {chapter.lstrip('0'):>3}  "
        print(textwrap.fill("; ".join(said), width, initial_indent=head,
                            subsequent_indent=" " * len(head)))  # fmt: skip


def plot_inventory(rows: dict[str, dict]) -> None:
    """Parts, options and hooks each chapter plugs into the seam, stacked."""
    import matplotlib.pyplot as plt

    chapters = [c for c in rows if c != "?"]
    fig, ax = plt.subplots(figsize=(8, 2.6))
    bottom = [0] * len(chapters)
    for kind in ("parts", "options", "hooks"):
        n = [len(rows[c][kind]) for c in chapters]
        ax.bar([c.lstrip("0") for c in chapters], n, bottom=bottom, label=kind)
        bottom = [a + b for a, b in zip(bottom, n)]
    ax.set(xlabel="chapter", ylabel="plugged into the seam")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
