"""Shared by the exercise checks: `answer` fetches a reader's answer or skips.

Each chapter's exercises have a file here, `exercises/test_NN_slug.py`; the chapter
names the test to run for each one (`pytest exercises/test_09_engine.py -k counting`).
Until an answer exists, its test is skipped with a message naming the exercise; once
it exists, the test checks it for real and fails while it is wrong.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def answer(obj, name: str, exercise: str):
    """obj.name, the reader's answer to `exercise` ("8.2"); skips while it is missing.

    A missing attribute, None, or a function that raises NotImplementedError when
    called with no arguments is not an answer yet.
    """
    value = getattr(obj, name, None)
    if value is None:
        pytest.skip(f"exercise {exercise}: {name} does not exist yet")
    return value


def attempted(fn, exercise: str, *args, **kwargs):
    """fn(*args, **kwargs), skipping the test while fn raises NotImplementedError."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        pytest.skip(f"exercise {exercise}: not attempted yet")
