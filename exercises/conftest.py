"""Fixtures for the exercise checks (see _check.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the course's tiny model, float32 on CPU."""
    from minillm.tiny import tiny_model

    return tiny_model(progress=False)
