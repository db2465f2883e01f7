"""Loads the worked solutions: every exercises/solutions/NN_slug.py, in chapter order.

Each solution module installs its answers into minillm when it is imported, as a
reader's answer would appear there. exercises/conftest.py calls load_solutions()
under `pytest exercises --solutions`; a check that starts a fresh Python process gets
them through a sitecustomize.py that calls it too (see install_in_subprocesses).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
# the solutions a check needs in a Python process it starts (8.1 asks a fresh process
# for sha256_hash); loading all of them there would import every chapter's modules
IN_SUBPROCESSES = ("11_prefix_cache",)


def load_solutions(only: tuple[str, ...] | None = None) -> list:
    modules = []
    for path in sorted(HERE.glob("[0-9][0-9]_*.py")):
        if only is not None and path.stem not in only:
            continue
        name = f"exercise_solutions_{path.stem}"
        if name in sys.modules:  # once per process
            modules.append(sys.modules[name])
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def install_in_subprocesses() -> None:
    """Python processes started from this one (with its sys.path as PYTHONPATH, as
    the checks do) load the solutions at start-up, through a sitecustomize.py."""
    folder = tempfile.mkdtemp(prefix="minillm-solutions-")
    atexit.register(shutil.rmtree, folder, True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(
            "import runpy\n"
            f"runpy.run_path({str(HERE / '_install.py')!r})['load_solutions']"
            f"({IN_SUBPROCESSES!r})\n"
        )
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [folder, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
