"""The one way a chapter reads a stored benchmark run: `stored(name)`.

Every benchmark writes benchmarks/results/{name}-{machine}-{day}.json with an
`environment` block (GPU, date, commit). A file name sorts H100 before H200 whatever
the day, so the newest run is picked by the date inside the file, never by the name;
`gpu="H100"` (any part of the GPU's name, or "cpu") asks for one machine's runs only.
Each read prints which machine and day it took, so a reader knows what a figure is.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine(run: dict) -> str:
    """The machine a run was measured on: its GPU's name, or "cpu"."""
    env = run.get("environment", {})
    return env.get("gpu") or "cpu"


def run_date(run: dict) -> str:
    """The run's date as stored (ISO 8601, so strings compare in time order)."""
    env = run.get("environment", {})
    return str(env.get("date") or run.get("date") or "")


def runs_of(name: str, gpu: str | None = None, results: Path = RESULTS) -> list[dict]:
    """Every stored run of benchmark `name`, oldest first by the date inside the file
    (on `gpu` only, when given: a part of the GPU's name, e.g. "H200", or "cpu")."""
    runs = []
    for path in results.glob(f"{name}-*.json"):
        run = json.loads(path.read_text())  # the glob's "-" keeps out name_other-...
        if gpu is not None and gpu.lower() not in machine(run).lower():
            continue
        run["_file"] = path.name
        runs.append(run)
    return sorted(runs, key=lambda r: (run_date(r), r["_file"]))


def stored(
    name: str, gpu: str | None = None, quiet: bool = False, results: Path = RESULTS
) -> dict | None:
    """The newest stored run of benchmark `name` (on `gpu` only, when given), or None
    when there is none; prints which machine and day it read unless quiet."""
    runs = runs_of(name, gpu, results)
    if not runs:
        if not quiet:
            where = f" on {gpu}" if gpu else ""
            print(f"stored: no run of {name!r}{where} in benchmarks/results/")
        return None
    run = runs[-1]
    if not quiet:
        print(f"stored: {name} read from {machine(run)}, {run_date(run)[:10]}")
    return run
