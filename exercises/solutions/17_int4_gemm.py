"""Worked solutions to chapter 17's exercises (chapters/17_int4_gemm.md).

Installed into minillm.int4 and minillm.kernels.int4_gemm the way a reader's exported
cells would put them there; the checks are exercises/test_17_int4_gemm.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm import int4
from minillm.int4 import Int4Linear, Int4Weight


# 16.1
def quantize_symmetric(weight: Tensor, group_size: int = 128) -> Int4Weight:
    """Codes (w / scale) + 8 with scale max |w| / 7 per group: the range is symmetric
    around 0, the zero point always 8 (GPTQ's uint4b8)."""
    N, K = weight.shape
    if K % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={K}")
    w = weight.detach().float().reshape(N, K // group_size, group_size)
    scales = (w.abs().amax(dim=-1) / 7).to(weight.dtype).float()  # as stored
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero
    codes = (w / scales[..., None]).round().clamp(-8, 7) + 8  # 0..15
    return Int4Weight.from_codes(
        codes.reshape(N, K).to(torch.uint8),
        scales.to(weight.dtype),
        torch.full_like(scales, 8).to(weight.dtype),
        group_size,
    )


# 16.2
def bits_per_weight(layer: Int4Linear) -> float:
    """Bits the layer stores per weight: codes, scales and zeros (not the bias)."""
    stored = (layer.qweight, layer.scales, layer.zeros)
    bits = 8 * sum(t.numel() * t.element_size() for t in stored)
    return bits / (layer.in_features * layer.out_features)
    # groups of 128, bf16: 4 + 16 / 128 (scale) + 16 / 128 (zero) = 4.25


# 16.3
def faster_knobs() -> dict:
    """A candidate for the 2-16 row range, not a measured win: each int32 word is
    loaded once per code it holds (gather=True), so no shift by the row index is
    computed per code, and the repeated loads hit the L1 cache. The check shows it
    equal to the reference; benchmarks/int4_gemm.py on a GPU says whether it is
    faster."""
    return {"gather": True}


FASTER_KNOBS = faster_knobs()


int4.quantize_symmetric = quantize_symmetric
int4.bits_per_weight = bits_per_weight


def _install_knobs() -> None:
    try:  # Triton is an optional dependency (the kernels extra)
        from minillm.kernels import int4_gemm
    except ImportError:
        return
    int4_gemm.FASTER_KNOBS = FASTER_KNOBS


_install_knobs()

SOLUTIONS = {
    "symmetric": quantize_symmetric,
    "bits": bits_per_weight,
    "faster": faster_knobs,
}
