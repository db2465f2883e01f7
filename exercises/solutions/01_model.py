"""Worked solutions to chapter 1's exercises (chapters/01_model.md).

Installed into minillm.model and minillm.train the way a reader's exported cells
would put them there; the checks are exercises/test_01_model.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import minillm.hf
import minillm.model as model_module
import minillm.train
from minillm.model import CausalLM, RotaryEmbedding


# 1.1
@torch.no_grad()
def fuse_qkv(model: CausalLM) -> None:
    """Each layer's q_proj, k_proj and v_proj become one qkv_proj; project splits
    its output back. In place; the logits do not change."""
    for layer in model.model.layers:
        attn = layer.self_attn
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        sizes = [p.out_features for p in parts]
        fused = nn.Linear(
            parts[0].in_features,
            sum(sizes),
            bias=parts[0].bias is not None,
            device=parts[0].weight.device,
            dtype=parts[0].weight.dtype,
        )
        fused.weight.copy_(torch.cat([p.weight for p in parts]))  # output dim: 0
        if fused.bias is not None:  # Qwen 2's biases, side by side too
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
        del attn.q_proj, attn.k_proj, attn.v_proj  # nothing computes them any more
        attn.qkv_proj = fused

        def project(x: Tensor, attn=attn, sizes=sizes) -> tuple[Tensor, Tensor, Tensor]:
            return attn.qkv_proj(x).split(sizes, dim=-1)

        attn.project = project  # this instance only


# 1.2
_rope_inv_freq = model_module.rope_inv_freq  # chapter 1's, for the other kinds


def yarn_attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos and sin by 0.1 ln(factor) + 1 (1 for every other kind)."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Chapter 1's frequencies, and YaRN's: each frequency blended between theta_i
    and theta_i / factor, by a ramp over the dimension index between the dimensions
    that turn beta_fast and beta_slow times within the original context."""
    if (scaling or {}).get("rope_type") != "yarn":
        return _rope_inv_freq(head_dim, theta, scaling)
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dimension that turns `turns` times
        return (
            head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(dim_turning(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(dim_turning(scaling.get("beta_slow") or 1)), head_dim - 1)
    high = high + 0.001 if low == high else high
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2).float() - low) / (high - low)).clamp(0, 1)
    # ramp 0: fast dimensions keep their frequency; ramp 1: slow ones are interpolated
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


_rotary_init = RotaryEmbedding.__init__
_rotary_forward = RotaryEmbedding.forward


def rotary_init(self, config) -> None:
    _rotary_init(self, config)
    self.attention_factor = yarn_attention_factor(config.rope_scaling)


def rotary_forward(self, positions: Tensor, dtype: torch.dtype):
    cos, sin = _rotary_forward(self, positions, torch.float32)
    f = getattr(self, "attention_factor", 1.0)
    return (cos * f).to(dtype), (sin * f).to(dtype)


# 1.3
def unigram_loss(train_ids: Tensor, held_out_ids: Tensor, vocab_size: int) -> float:
    """Mean -ln p(x) over held_out_ids of the add-one smoothed training frequencies,
    p(v) = (c(v) + 1) / (N + V): a model that ignores context."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double()
    p = (counts + 1) / (len(train_ids) + vocab_size)
    return float(-p[held_out_ids].log().mean())


model_module.fuse_qkv = fuse_qkv
model_module.rope_inv_freq = minillm.hf.rope_inv_freq = rope_inv_freq
RotaryEmbedding.__init__ = rotary_init
RotaryEmbedding.forward = rotary_forward
minillm.train.unigram_loss = unigram_loss

SOLUTIONS = {
    "fuse_qkv": fuse_qkv,
    "yarn": (rope_inv_freq, yarn_attention_factor, rotary_forward),
    "unigram": unigram_loss,
}
