"""Fixtures for the exercise checks (see _check.py), and the worked solutions.

`pytest exercises --solutions` (or MINILLM_EXERCISE_SOLUTIONS=1) first loads every
exercises/solutions/NN_slug.py, each of which installs its answers into the package
as a reader's answer would appear, and then counts a skipped check as a failure:
under --solutions every check must really run and pass.
"""

import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

SOLUTIONS = pathlib.Path(__file__).parent / "solutions"


def pytest_addoption(parser):
    parser.addoption(
        "--solutions",
        action="store_true",
        help="load exercises/solutions/* first; a skipped exercise check fails",
    )


def solutions_on(config) -> bool:
    return bool(
        config.getoption("--solutions", default=False)
        or os.environ.get("MINILLM_EXERCISE_SOLUTIONS") == "1"
    )


def pytest_configure(config):
    # before collection: the check modules import the names the solutions replace
    if solutions_on(config):
        sys.path.insert(0, str(SOLUTIONS))
        from _install import install_in_subprocesses, load_solutions

        load_solutions()
        install_in_subprocesses()  # for checks that start a fresh Python


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and solutions_on(item.config):
        report.outcome = "failed"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else ""
        report.longrepr = f"skipped under --solutions (no answer installed): {reason}"


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the course's tiny model, float32 on CPU."""
    from minillm.tiny import tiny_model

    return tiny_model(progress=False)
