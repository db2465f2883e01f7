"""Chapter order is import order: a module of minillm imports only modules of its own
or earlier chapters, lazy imports included, and the imports have no cycle. And the
seam works one way: every module that registers an engine part is in minillm.PLUGINS.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import minillm

PACKAGE = Path(minillm.__file__).parent


def chapter_modules() -> dict[str, str]:
    """{module (dotted, without "minillm."): its chapter file} for every generated
    module (the package indexes, __init__.py, belong to no chapter)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        first = path.read_text().splitlines()[0]
        if "from chapters/" in first:
            name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            found[name] = first.split("from chapters/")[1].split()[0].rstrip(",")
    return found


def imports_of(name: str) -> set[str]:
    """Every minillm module `name` imports anywhere: top level, inside functions,
    under TYPE_CHECKING, or through importlib.import_module with a literal name."""
    tree = ast.parse((PACKAGE / Path(*name.split("."))).with_suffix(".py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "__import__")
        ):
            found.add(node.args[0].value)
    modules = chapter_modules()
    return {
        m.removeprefix("minillm.")
        for m in found
        if m.startswith("minillm.") and m.removeprefix("minillm.") in modules
    }


def test_the_walk_sees_lazy_imports():
    # decode_linear imports chapter 13's kernel inside a method
    assert "kernels.skinny_gemm" in imports_of("decode_linear")
    # and the engine's only way to the later chapters is the package index
    assert imports_of("registry") == set()


def test_no_module_imports_a_later_chapters_module():
    modules = chapter_modules()
    backwards = [
        f"minillm.{a} ({modules[a]}) imports minillm.{b} ({modules[b]})"
        for a in modules
        for b in sorted(imports_of(a))
        if modules[b] > modules[a]
    ]
    assert not backwards, "\n".join(backwards)


def test_imports_between_modules_have_no_cycle():
    graph = {name: imports_of(name) for name in chapter_modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycle = path[path.index(other) :] + [name, other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_every_module_that_registers_parts_is_a_plugin():
    from minillm import registry

    # import everything that does not need a server's libraries
    for info in pkgutil.walk_packages(minillm.__path__, "minillm."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            assert not (e.name or "").startswith("minillm"), e
    registering = {
        module for reg in registry.REGISTRIES for module in reg.registered_by.values()
    } | {owner for owner in registry.OWNERS.values() if owner != registry.__name__}
    hooks = [*registry.RUNNER_EXTENSIONS, *registry.EXECUTOR_HOOKS]
    hooks += [*registry.REQUEST_CHECKS, *registry.ENGINE_HOOKS]
    try:  # chapter 27's seam, where the server's libraries are installed
        from minillm.server import SERVER_EXTENSIONS

        hooks += SERVER_EXTENSIONS
    except ModuleNotFoundError:
        pass
    registering |= {hook.__module__ for hook in [*hooks, *registry.REQUEST_HOOKS]}
    assert registering == set(minillm.PLUGINS), (
        "a module registers parts or declares options but has no `#| plugin` cell, "
        "or a plugin registers nothing"
    )
    assert list(minillm.PLUGINS) == sorted(
        minillm.PLUGINS, key=lambda m: chapter_modules()[m.removeprefix("minillm.")]
    ), "PLUGINS are in chapter order"
