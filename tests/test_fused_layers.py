"""Chapter 15's fused layers: the same numbers as chapter 1's layers, bit for bit in
eager mode, with and without Qwen3's q/k norms, without and with a paged KV cache."""

import copy
import dataclasses

import pytest
import torch

from minillm.attention import generate_paged
from minillm.fused_layers import (
    FusedAttention,
    FusedDecoderModel,
    FusedMLP,
    fuse_layers,
    stacked_qk_norm,
)
from minillm.merged_projections import merge_projections
from minillm.model import CausalLM, DecoderModel


def model_with_norms(config, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(dataclasses.replace(config, qk_norm=True)).eval()
    for module in model.modules():
        if module.__class__.__name__ == "RMSNorm":
            module.weight.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_layers_compute_the_same_logits_and_tokens(tiny, qk_norm):
    model = model_with_norms(tiny[0].config) if qk_norm else copy.deepcopy(tiny[0])
    merge_projections(model)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused)
    assert type(fused.model) is FusedDecoderModel
    assert all(type(layer.self_attn) is FusedAttention for layer in fused.model.layers)
    assert all(type(layer.mlp) is FusedMLP for layer in fused.model.layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=g)
    positions = torch.arange(17).expand(3, 17)
    with torch.no_grad():
        assert torch.equal(fused(ids, positions), model(ids, positions))
    prompts = [[1, 5, 6, 7], [2, 9], [3, 11, 12, 13, 14, 15, 16, 17, 18]]
    assert generate_paged(fused, prompts, 6) == generate_paged(model, prompts, 6)


def test_fuse_layers_leaves_other_models_alone(tiny):
    plain = copy.deepcopy(tiny[0])  # projections not merged
    assert not fuse_layers(plain)
    assert type(plain.model) is DecoderModel


def test_stacked_norm_refuses_different_eps(tiny):
    model = model_with_norms(tiny[0].config)
    merge_projections(model)
    attn = model.model.layers[0].self_attn
    norm = stacked_qk_norm(attn)
    assert norm.weight.shape == (attn.n_heads + attn.n_kv_heads, attn.head_dim)
    attn.k_norm.eps = attn.q_norm.eps * 2
    with pytest.raises(ValueError, match="different eps"):
        stacked_qk_norm(attn)


def test_norms_are_made_by_the_products_on_a_decode_batch(tiny, monkeypatch):
    """A decode batch on a GPU: each layer's two norms and residual sums are made by
    the skinny kernel (rms_norm_linear); elsewhere chapter 1's norm, bit for bit."""
    from minillm import fused_layers

    calls = []
    real = fused_layers.rms_norm_linear
    monkeypatch.setattr(
        fused_layers,
        "rms_norm_linear",
        lambda *args: calls.append(args[0].shape) or real(*args),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model_with_norms(tiny[0].config).to(device, dtype)
    merge_projections(model)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused)
    ids = torch.tensor([[3], [7], [11]], device=device)  # three rows: a decode batch
    positions = torch.tensor([[4], [9], [2]], device=device)
    with torch.no_grad():
        got, expected = fused(ids, positions), model(ids, positions)
    assert len(calls) == 2 * len(model.model.layers)
    if device == "cpu":
        assert torch.equal(got, expected)
    else:  # cuBLAS and the skinny kernel: the same numbers within bf16 rounding
        err = (got.float() - expected.float()).abs().max() / expected.abs().max()
        assert err.item() < 3e-2
