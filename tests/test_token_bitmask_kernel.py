"""Chapter 22, "Masks on the device": the Triton kernel masks exactly the logits that
the PyTorch reference (apply_token_bitmask_torch) masks, for float32, bfloat16 and
float16 logits, with and without indices, logits wider than the bitmask, rows that
are views of a wider tensor, and no rows at all. The engine's dispatcher uses the
kernel on a GPU only.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) at small
vocabularies.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from minillm.kernels.token_bitmask import BLOCK, apply_token_bitmask  # noqa: E402
from minillm.structured.bitmask import (  # noqa: E402
    apply_token_bitmask_inplace,
    apply_token_bitmask_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_bits(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32,
                         generator=gen)  # fmt: skip


def kernel(logits, bits, indices):
    rows = None if indices is None else torch.tensor(indices, dtype=torch.int32)
    got = apply_token_bitmask(
        logits.to(DEVICE), bits.to(DEVICE), None if rows is None else rows.to(DEVICE)
    )
    return got.cpu()


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 3),
    extra_rows=st.integers(0, 2),
    words=st.integers(1, 2 * BLOCK // 32 + 3),
    wider=st.integers(0, 70),
    dtype=st.sampled_from(DTYPES),
    indexed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_torch_reference(
    rows, extra_rows, words, wider, dtype, indexed, seed
):
    """Any bitmask, any logits width at or above the bitmask's (the bits past it
    read as cleared), rows in any order through indices."""
    bits = random_bits(rows, words, seed)
    batch = rows + extra_rows if indexed else rows
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(batch, 32 * words + wider, generator=gen).to(dtype)
    indices = torch.randperm(batch, generator=gen)[:rows].tolist() if indexed else None
    expected = apply_token_bitmask_torch(logits.clone(), bits, indices)
    assert torch.equal(kernel(logits.clone(), bits, indices), expected)


def test_rows_of_a_wider_tensor_and_no_rows():
    """Logits rows that are a view (row stride above the vocabulary) are masked in
    place, the columns outside the view untouched; an empty bitmask changes nothing."""
    bits = random_bits(2, 40, 0)
    wide = torch.randn(2, 1400).to(DEVICE)
    view = wide[:, :1300]  # (2, 1300), row stride 1400
    expected = apply_token_bitmask_torch(view.cpu().clone(), bits)
    apply_token_bitmask(view, bits.to(DEVICE))
    assert torch.equal(view.cpu(), expected)
    assert torch.isfinite(wide[:, 1300:]).all()
    logits = torch.randn(2, 1300).to(DEVICE)
    before = logits.clone()
    apply_token_bitmask(logits, bits[:0].to(DEVICE))
    assert torch.equal(logits, before)


def test_dispatch_uses_the_kernel_on_a_gpu_only(monkeypatch):
    """apply_token_bitmask_inplace calls the kernel for CUDA logits and the PyTorch
    path for CPU logits (the engine's CPU path never needs Triton)."""
    import minillm.kernels.token_bitmask as module

    calls = []
    monkeypatch.setattr(module, "apply_token_bitmask",
                        lambda *a: calls.append(a) or a[0])  # fmt: skip
    bits, logits = random_bits(2, 4, 1), torch.randn(2, 128)
    expected = apply_token_bitmask_torch(logits.clone(), bits)
    assert torch.equal(apply_token_bitmask_inplace(logits, bits), expected)
    assert calls == []
    if torch.cuda.is_available():
        apply_token_bitmask_inplace(logits.cuda(), bits, [1, 0])
        assert len(calls) == 1
