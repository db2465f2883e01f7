"""The book reuses `make test`'s notebook run instead of executing every chapter again.

    python tools/book_cache.py prime DIR    # DIR: where tools/nbval_executed.py wrote

For every page of the book (`_toc.yml`) with a run in DIR, this reads the page as
MyST-NB reads it, checks that the run's code cells are the page's code cells and
that the run was made from the same code (`fingerprint`), fills the page's cells
with the run's outputs and stores the notebook in the book's execution cache
(`_config.yml`'s execute.cache). Jupyter Book then finds it there and does not
execute the page; a page with no usable run is executed as before. Nothing else
in the cache changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a chapter's run depends on besides its own cells (which the cache's key covers).
SOURCES = ("minillm", "book", "benchmarks", "data", "exercises", "examples")
FILES = ("pyproject.toml", "constraints.txt")


def fingerprint(root: Path = ROOT) -> str:
    """A hash of the code and data a chapter imports or reads, the tiny-model seed
    and the model cache's path: a run made under another fingerprint is not reused."""
    digest = hashlib.sha256()
    paths = [root / f for f in FILES]
    for folder in SOURCES:
        paths += sorted((root / folder).rglob("*"))
    for path in paths:
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    for name in ("MINILLM_TINY_SEED", "MINILLM_CACHE"):
        digest.update(f"{name}={os.environ.get(name, '')}\0".encode())
    return digest.hexdigest()[:16]


def pages(root: Path = ROOT) -> list[Path]:
    """The toc's pages that are notebooks (MyST markdown with a kernelspec)."""
    import yaml

    toc = yaml.safe_load((root / "_toc.yml").read_text())
    found, stack = [toc.get("root")], [toc]
    while stack:
        node = stack.pop()
        for part in (
            node.get("parts", []) + node.get("chapters", []) + node.get("sections", [])
        ):
            found.append(part.get("file"))
            stack.append(part)
    paths = [root / f"{f}.md" for f in found if f]
    return [p for p in paths if p.is_file() and "kernelspec:" in p.read_text()[:800]]


def read_page(path: Path, root: Path = ROOT):
    """The page as a notebook, read the way MyST-NB reads it for the build."""
    import yaml
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    config = yaml.safe_load((root / "_config.yml").read_text())
    extensions = config.get("parse", {}).get("myst_enable_extensions", [])
    md_config = MdParserConfig(enable_extensions=set(extensions))
    return read_myst_markdown_notebook(
        path.read_text(), config=md_config, add_source_map=True, path=path
    )


def with_outputs(nb, run: dict):
    """`nb` with the run's outputs in its code cells, or a reason it cannot be."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    cells = run["cells"]
    if len(code) != len(cells):
        return f"{len(cells)} cells ran, the page has {len(code)}"
    for number, (cell, ran) in enumerate(zip(code, cells), 1):
        if cell.source.strip() != ran["source"].strip():
            return f"code cell {number} differs from the one that ran"
        cell.outputs = ran["outputs"]
        cell.execution_count = number if ran["outputs"] else None
    return nb


def prime(folder: Path, root: Path = ROOT) -> int:
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    config = __import__("yaml").safe_load((root / "_config.yml").read_text())
    cache = get_cache(str(root / config["execute"]["cache"]))
    stamp, primed, reasons = fingerprint(root), 0, []
    for page in pages(root):
        run_file = folder / f"{page.stem}.json"
        if not run_file.is_file():
            reasons.append(f"{page.stem}: no run")
            continue
        run = json.loads(run_file.read_text())
        if run["fingerprint"] != stamp:
            reasons.append(f"{page.stem}: run made from other code")
            continue
        nb = with_outputs(read_page(page, root), run)
        if isinstance(nb, str):
            reasons.append(f"{page.stem}: {nb}")
            continue
        nb.cells = [nbformat.from_dict(c) for c in nb.cells]
        bundle = CacheBundleIn(
            nb, str(page), data={"execution_seconds": run["seconds"]}
        )
        cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
        primed += 1
    other = [r for r in reasons if r.endswith(": run made from other code")]
    unrun = [r for r in reasons if r.endswith(": no run")]
    said = [r for r in reasons if r not in unrun and r not in other]
    said += [f"{len(other)} pages whose run was made from other code"] if other else []
    said += [f"{len(unrun)} pages with no run in {folder}"] if unrun else []
    print(
        f"book_cache: {primed} pages take make test's outputs; executed anew: "
        + ("; ".join(said) or "none")
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "prime":
        print(__doc__)
        sys.exit(2)
    sys.exit(prime(Path(sys.argv[2])))
