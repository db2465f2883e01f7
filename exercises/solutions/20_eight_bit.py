"""Worked solutions to chapter 20's exercises (chapters/20_eight_bit.md).

Installed into minillm.quantization's modules the way a reader's exported cells would
put them there; the checks are exercises/test_20_eight_bit.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.quantization import kv_fp8, w8a8


# 19.1
def quantize_int8_static(x: Tensor, scale: float) -> Tensor:
    """int8 codes of x [M, K] for one calibrated scale (per tensor, not per token)."""
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)


# 19.2
def fp8_kv_head_scales(model: nn.Module, windows: Tensor) -> tuple[Tensor, Tensor]:
    """Per-layer, per-KV-head (k_scale, v_scale), each (num_layers, n_kv_heads): the
    largest |K| and |V| of each head the windows write, over E4M3's largest value."""

    class HeadMaxCache(kv_fp8.PagedKVCache):
        def write(self, layer_idx, key, value, slot_mapping):
            if not hasattr(self, "absmax"):
                self.absmax = torch.zeros(2, self.key_cache.shape[0], key.shape[1])
            for row, x in ((0, key), (1, value)):
                seen = x.detach().abs().amax(dim=(0, 2)).float().cpu()  # (n_kv,)
                most = self.absmax[row, layer_idx]
                self.absmax[row, layer_idx] = torch.maximum(most, seen)
            super().write(layer_idx, key, value, slot_mapping)

    dtype = next(model.parameters()).dtype
    cache = kv_fp8.window_cache(model, windows, dtype, cls=HeadMaxCache)
    kv_fp8.paged_window_nll(model, windows, cache)
    return cache.absmax[0] / kv_fp8.E4M3_MAX, cache.absmax[1] / kv_fp8.E4M3_MAX


w8a8.quantize_int8_static = quantize_int8_static
kv_fp8.fp8_kv_head_scales = fp8_kv_head_scales

SOLUTIONS = {
    "static": quantize_int8_static,
    "head_scales": fp8_kv_head_scales,
}
