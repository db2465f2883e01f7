"""A pytest plugin for the nbval run of the chapters: records every key a cell glues.

MyST-NB's `glue(name, value)` displays the value with metadata {"scrapbook": {"name":
name}}; nbval keeps each cell's outputs on its test item. This plugin appends the
names a notebook's cells glued to $MINILLM_GLUE_DIR/<notebook>.keys, so that
tools/check_glue.py can fail `make test` when the prose of a chapter refers to a key
that no cell glued (which `make book`'s -W turns into an error).

    pytest -p nbval_glue --nbval-lax ...   (with tools/ on PYTHONPATH)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    folder = os.environ.get("MINILLM_GLUE_DIR")
    outputs = getattr(item, "test_outputs", None)
    if not folder or not outputs:
        return
    names = [
        out.get("metadata", {}).get("scrapbook", {}).get("name")
        for out in outputs
        if isinstance(out, dict)
    ]
    names = [n for n in names if n]
    if names:
        path = Path(folder) / f"{Path(str(item.fspath)).stem}.keys"
        with open(path, "a") as f:
            f.write("".join(f"{n}\n" for n in names))
