"""Checks for chapter 17's exercises (chapters/17_int4_gemm.md, "Exercises")."""

import pytest
import torch
from _check import answer

from minillm import int4


def test_symmetric():
    """12.1: zeros of 8, scales of max |w| / 7, every weight within half a step."""
    quantize_symmetric = answer(int4, "quantize_symmetric", "17.1")
    w = torch.randn(16, 256) * torch.linspace(0.1, 2, 256)
    qw = quantize_symmetric(w, 64)
    assert isinstance(qw, int4.Int4Weight) and qw.group_size == 64
    codes, scales, zeros = qw.to_codes()
    assert torch.equal(zeros, torch.full_like(zeros, 8))
    expected = w.reshape(16, 4, 64).abs().amax(-1) / 7
    assert torch.allclose(scales.float(), expected, rtol=1e-2)
    step = scales.float().repeat_interleave(64, dim=1)
    assert ((qw.dequantize() - w).abs() <= step / 2 * 1.01 + 1e-6).all()


def test_bits():
    """12.2: 4.25 bits per weight for groups of 128 with bf16 scales."""
    bits_per_weight = answer(int4, "bits_per_weight", "17.2")
    w = torch.randn(64, 512, dtype=torch.bfloat16)
    for group, bits in [(128, 4.25), (32, 5.0)]:
        layer = int4.Int4Linear.from_weight(int4.quantize_rtn(w, group))
        assert bits_per_weight(layer) == pytest.approx(bits)


def test_faster():
    """12.3: the knobs in FASTER_KNOBS keep int4_matmul equal to the reference."""
    pytest.importorskip("triton")
    from minillm.kernels import int4_gemm

    knobs = answer(int4_gemm, "FASTER_KNOBS", "17.3")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for M, N, K in [(1, 64, 256), (3, 45, 512), (16, 96, 256)]:
        x = torch.randn(M, K, device=device)
        w = int4.quantize_rtn(torch.randn(N, K, device=device) / K**0.5, 128)
        ref = x.double() @ w.dequantize(torch.float64).T
        y = int4_gemm.int4_matmul(x, w, **knobs)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-4
