"""The generated table of LLM(...) options (tools/options_table.py) and the error for a
misspelt option."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.config import EngineConfig
from minillm.registry import OPTIONS, load_plugins

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import options_table  # noqa: E402


def test_the_table_names_every_option_once_with_what_it_does():
    load_plugins()
    text = options_table.table()
    rows = [re.split(r"(?<!\\)\|", line) for line in text.splitlines()[2:]]
    names = [row[1].strip().strip("`") for row in rows]
    assert len(names) == len(set(names))
    assert set(OPTIONS) <= set(names)
    assert {"model", "dtype", "block_size", "max_num_seqs"} <= set(names)
    assert all(len(row) == 8 and row[6].strip() for row in rows)


def test_the_readme_and_the_book_page_are_up_to_date():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "options_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "typo, meant", [("max_num_seq", "max_num_seqs"), ("cuda_graph", "cuda_graphs")]
)
def test_a_misspelt_option_names_the_closest(typo, meant):
    with pytest.raises(TypeError, match=f"did you mean '{meant}'"):
        EngineConfig(**{typo: 1})
