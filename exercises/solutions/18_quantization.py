"""Worked solutions to chapter 18's exercises (chapters/18_quantization.md).

Installed into minillm.quantization's modules the way a reader's exported cells would
put them there; the checks are exercises/test_18_quantization.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.quantization import apply, awq, rotation, sequential
from minillm.quantization.calibration import LinearStats, decoder_linears, recording
from minillm.quantization.gptq import gptq_quantize
from minillm.quantization.rotation import random_hadamard
from minillm.quantization.rtn import (
    dequantize_groups,
    fake_quantize,
    output_error,
    quantize_rtn_groups,
)


# 17.1
def awq_clip(
    w: Tensor, hessian: Tensor, bits: int = 4, group_size: int = 128, grid: int = 10
) -> Tensor:
    """w with each group clamped to r * max |w_group|, r from 1.0 down to 0.5.

    The output error tr(E H E^T) is a sum over rows, so each row keeps the ratio that
    is best for it: exact, and never worse than RTN (r = 1 is on the grid)."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    peak = groups.abs().amax(dim=-1, keepdim=True)  # (N, G, 1)
    h = hessian.double()
    best_err = torch.full((n,), float("inf"), dtype=torch.float64)
    best = w.detach().float().clone()
    for r in torch.linspace(1.0, 0.5, grid):
        clipped = torch.maximum(torch.minimum(groups, r * peak), -r * peak)
        clipped = clipped.reshape(n, k)
        e = w.double() - fake_quantize(clipped, bits, group_size).double()
        row_err = ((e @ h) * e).sum(dim=1)  # (N,): each row's share of the error
        better = row_err < best_err
        best[better], best_err[better] = clipped[better], row_err[better]
    return best.to(w.dtype)


# 17.2
def gptq_gain(model: nn.Module, stats: dict[str, LinearStats], bits: int) -> float:
    """Mean over the projections of GPTQ's output error / RTN's, at `bits` bits
    (codes 0..2**bits - 1 in the same uint8 codes)."""
    ratios = []
    for name, linear in decoder_linears(model).items():
        w, h = linear.weight.detach().float().cpu(), stats[name].hessian
        gptq = dequantize_groups(*gptq_quantize(w, h, bits, 128))
        rtn = dequantize_groups(*quantize_rtn_groups(w, bits, 128))
        ratios.append(output_error(w, gptq, h) / output_error(w, rtn, h))
    return sum(ratios) / len(ratios)


# 17.3
STEPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
         ("down_proj",))  # fmt: skip


@torch.no_grad()
def gptq_true_sequential(
    model: nn.Module, windows: Tensor, group_size: int = 128, batch_size: int = 4
) -> tuple[dict, dict[str, LinearStats]]:
    """gptq_sequential, in four steps per layer: before each step the layer runs
    again, the projections of the earlier steps holding their quantized weights."""
    decoder, device = model.model, next(model.parameters()).device
    names = {m: n for n, m in decoder_linears(model).items()}
    inputs = []
    for batch in windows.to(device).split(batch_size):
        positions = torch.arange(batch.shape[1], device=device).expand_as(batch)
        x = decoder.embed_tokens(batch)
        inputs.append((x, *decoder.rotary_emb(positions, x.dtype)))
    codes, stats = {}, {}
    for layer in decoder.layers:
        mine = {names[m]: m for m in layer.modules() if m in names}
        saved = {n: m.weight.detach().clone() for n, m in mine.items()}
        try:
            for step in STEPS:
                now = {n: m for n, m in mine.items() if n.rsplit(".", 1)[-1] in step}
                with recording(now) as step_stats:  # this step's inputs only
                    for x, cos, sin in inputs:
                        layer(x, cos, sin, None, None)
                for name, linear in now.items():
                    w = linear.weight.detach().float().cpu()
                    c = gptq_quantize(w, step_stats[name].hessian, 4, group_size)
                    linear.weight.copy_(dequantize_groups(*c).to(linear.weight))
                    codes[name] = c
                stats |= step_stats
            inputs = [
                (layer(x, cos, sin, None, None), cos, sin) for x, cos, sin in inputs
            ]
        finally:  # the float weights back
            for name, w in saved.items():
                mine[name].weight.copy_(w)
    return codes, stats


# 17.4
@torch.no_grad()
def rotate_values(model: nn.Module, seed: int = 0) -> None:
    """Per KV head g an orthogonal R_g: v_proj's rows of head g become R_g^T W_v,g,
    and o_proj's columns of every query head h reading g become W_o,h R_g, so
    attention's output is unchanged (QuaRot's second rotation). In place."""
    config = model.config
    D, n_heads, n_kv = (
        config.head_dim,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        merged = hasattr(attn, "qkv_proj")
        v_proj = attn.qkv_proj if merged else attn.v_proj
        v_start = (n_heads + n_kv) * D if merged else 0  # v's rows in qkv_proj
        for g in range(n_kv):
            r = random_hadamard(D, seed=seed * 1000 + i * n_kv + g)  # float64
            rows = slice(v_start + g * D, v_start + (g + 1) * D)
            w = v_proj.weight[rows].double()
            v_proj.weight[rows] = (r.T @ w).to(v_proj.weight.dtype)
            if v_proj.bias is not None:
                b = v_proj.bias[rows].double()
                v_proj.bias[rows] = (r.T @ b).to(v_proj.bias.dtype)
            for h in range(g * n_heads // n_kv, (g + 1) * n_heads // n_kv):
                cols = slice(h * D, (h + 1) * D)
                w_o = attn.o_proj.weight[:, cols].double()
                attn.o_proj.weight[:, cols] = (w_o @ r).to(attn.o_proj.weight.dtype)


awq.awq_clip = awq_clip
apply.gptq_gain = gptq_gain
sequential.gptq_true_sequential = gptq_true_sequential
rotation.rotate_values = rotate_values

SOLUTIONS = {
    "clip": awq_clip,
    "three_bits": gptq_gain,
    "true_sequential": gptq_true_sequential,
    "rotate_values": rotate_values,
}
