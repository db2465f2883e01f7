"""`from book.triton import glue`: the book's set-up (see book/__init__.py), and
Triton's interpreter (TRITON_INTERPRET=1) when there is no GPU, set before anything
imports triton."""

import os

import torch

from book import ROOT, glue, needs

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = ["ROOT", "glue", "needs"]
