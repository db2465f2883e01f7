"""Convert chapter pages (MyST markdown) to .ipynb in one process, for nbval.

    python tools/to_notebooks.py OUT_DIR chapters/*.md chapters/lab_notes/*.md

The same as `jupytext --to ipynb -o OUT_DIR/NAME.ipynb PAGE` for each page, without
starting a Python process per page (a second each on a small CI machine).
"""

import sys
from pathlib import Path

import jupytext


def main(out: str, pages: list[str]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    names = [Path(p).stem for p in pages]
    if len(set(names)) != len(names):
        raise SystemExit("to_notebooks: two pages would share a notebook name")
    for page, name in zip(pages, names):
        jupytext.write(jupytext.read(page), Path(out) / f"{name}.ipynb", fmt="ipynb")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
