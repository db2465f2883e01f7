"""A pytest plugin for the nbval run of the chapters: keeps what every cell printed.

`make test` runs every chapter as a notebook; `make book` used to run every one of
them again to get the same outputs. With $MINILLM_EXECUTED_DIR set, this plugin
writes, for each notebook whose cells all passed (a cell tagged `nbval-skip` counts
as run with no output, as MyST-NB's `skip-execution` leaves it), a JSON file
`<notebook>.json` with each code cell's source and outputs and a fingerprint of the
code the run imported (tools/book_cache.py). `tools/book_cache.py prime` puts those
outputs into the book's execution cache, so `make book` re-runs only a chapter whose
run is missing, failed, or was made from other code.

    pytest -p nbval_executed --nbval-lax ...   (with tools/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
from book_cache import fingerprint

_CELLS: dict[str, dict[int, dict]] = defaultdict(dict)
_FAILED: set[str] = set()
_STARTED: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    cell = getattr(item, "cell", None)
    if cell is None or not os.environ.get("MINILLM_EXECUTED_DIR"):
        return
    report = outcome.get_result()
    notebook = str(item.fspath)
    _STARTED.setdefault(notebook, time.time())
    if report.failed:
        _FAILED.add(notebook)
    elif report.when == "call" or report.skipped:
        outputs = (
            [] if report.skipped else list(getattr(item, "test_outputs", []) or [])
        )
        _CELLS[notebook][item.cell_num] = {"source": cell.source, "outputs": outputs}


def pytest_sessionfinish(session):
    folder = os.environ.get("MINILLM_EXECUTED_DIR")
    if not folder or not _CELLS:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    stamp = fingerprint()
    for notebook, cells in _CELLS.items():
        target = Path(folder) / f"{Path(notebook).stem}.json"
        if notebook in _FAILED or sorted(cells) != list(range(len(cells))):
            target.unlink(missing_ok=True)
            continue
        record = {
            "fingerprint": stamp,
            "seconds": time.time() - _STARTED[notebook],
            "cells": [cells[i] for i in range(len(cells))],
        }
        target.write_text(json.dumps(record))
