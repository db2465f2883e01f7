"""Checks for chapter 20's exercises (chapters/20_eight_bit.md, "Exercises")."""

import torch
from _check import answer

from minillm.quantization import kv_fp8, w8a8
from minillm.quantization.calibration import token_windows


def test_static(tiny):
    """17.1: one given scale for the whole tensor; error at most half a step."""
    quantize_int8_static = answer(w8a8, "quantize_int8_static", "20.1")
    x = torch.randn(16, 64) * torch.linspace(0.1, 3, 16)[:, None]
    scale = float(x.abs().max()) / 127
    codes = quantize_int8_static(x, scale)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert ((codes.float() * scale - x).abs() <= scale / 2 + 1e-6).all()
    per_token, s = w8a8.quantize_int8(x)
    assert (per_token.float() * s - x).norm() < (codes.float() * scale - x).norm()


def test_head_scales(tiny):
    """17.2: a scale per KV head; the largest over a layer's heads is the layer's."""
    fp8_kv_head_scales = answer(kv_fp8, "fp8_kv_head_scales", "20.2")
    model, tokenizer = tiny
    windows = token_windows(tokenizer, "held_out", 4, 32)
    k, v = fp8_kv_head_scales(model, windows)
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    assert k.shape == v.shape == shape and (k > 0).all() and (v > 0).all()
    k_layer, v_layer = kv_fp8.fp8_kv_scales(model, windows)
    assert torch.allclose(k.amax(dim=1), k_layer.cpu())
    assert torch.allclose(v.amax(dim=1), v_layer.cpu())
    assert (k < k_layer.cpu()[:, None]).any()  # some head's keys are smaller
