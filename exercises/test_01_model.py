"""Checks for the exercises of chapter 1 ("The model").

pytest exercises/test_01_model.py -k fuse_qkv     # 1.1
pytest exercises/test_01_model.py -k yarn         # 1.2
pytest exercises/test_01_model.py -k unigram      # 1.3
"""

from __future__ import annotations

import copy
import math
import tempfile

import torch
from _check import answer, attempted

import minillm.model
import minillm.train
from minillm.model import CausalLM, ModelConfig, generate, rope_inv_freq


def logits_of(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[-1]).expand_as(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions))


# --- 1.1 fuse the projections ----------------------------------------------------


def check_fused(model: CausalLM, ids: torch.Tensor) -> None:
    fuse_qkv = answer(minillm.model, "fuse_qkv", "1.1")
    before = logits_of(model, ids)
    n_params = sum(p.numel() for p in model.parameters())
    greedy = generate(model, [ids[0, :5].tolist()], max_new_tokens=8)
    fuse_qkv(model)
    config = model.config
    width = config.num_attention_heads + 2 * config.num_key_value_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            assert not hasattr(attn, name), f"the layer still has {name}"
        assert isinstance(attn.qkv_proj, torch.nn.Linear)
        assert attn.qkv_proj.out_features == width * config.head_dim
        assert (attn.qkv_proj.bias is not None) == config.attention_bias
    assert sum(p.numel() for p in model.parameters()) == n_params
    torch.testing.assert_close(logits_of(model, ids), before, atol=1e-5, rtol=1e-5)
    # through the KV cache too
    assert generate(model, [ids[0, :5].tolist()], max_new_tokens=8) == greedy


def test_fuse_qkv_keeps_the_tiny_models_logits(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode('The "for" statement is used to iterate')])
    check_fused(copy.deepcopy(model), ids)


def test_fuse_qkv_keeps_qwen2_biases():
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
    )
    model = CausalLM(config).eval()
    for p in model.parameters():  # large weights and biases, so a mix-up shows
        torch.nn.init.normal_(p, 0, 0.3)
    check_fused(model, torch.randint(0, 97, (2, 12)))


# --- 1.2 YaRN ---------------------------------------------------------------------

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def test_yarn_matches_transformers_past_the_original_context():
    attempted(rope_inv_freq, "1.2", 32, 10000.0, dict(YARN))
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minillm.hf import load_model

    hf_config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, **YARN},
    )
    theirs_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    ours_freq = rope_inv_freq(32, 10000.0, dict(YARN))
    torch.testing.assert_close(ours_freq, theirs_freq, atol=1e-7, rtol=1e-6)

    torch.manual_seed(0)
    reference = LlamaForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(tmp)
        ours = load_model(tmp)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    # 200 positions: three times the original context of 64
    torch.testing.assert_close(logits_of(ours, ids), expected, atol=1e-4, rtol=1e-4)


# --- 1.3 a unigram baseline -------------------------------------------------------


def reference_unigram_loss(train_ids, held_out_ids, vocab_size) -> float:
    counts = [0] * vocab_size
    for t in train_ids.tolist():
        counts[t] += 1
    total = len(train_ids) + vocab_size
    nll = [-math.log((counts[t] + 1) / total) for t in held_out_ids.tolist()]
    return sum(nll) / len(nll)


def test_unigram_loss_is_the_smoothed_frequency_cross_entropy():
    unigram_loss = answer(minillm.train, "unigram_loss", "1.3")
    g = torch.Generator().manual_seed(0)
    # skewed towards small ids, and never above 39
    train_ids = (torch.rand(2000, generator=g) ** 3 * 40).long()
    # tokens 40-49 never occur in training: add-one smoothing still gives them mass
    held_out = torch.randint(0, 50, (300,), generator=g)
    got = unigram_loss(train_ids, held_out, 50)
    assert isinstance(got, float)
    assert math.isclose(
        got, reference_unigram_loss(train_ids, held_out, 50), rel_tol=1e-6
    )
    # a vocabulary larger than the tokens seen spreads the smoothing thinner
    assert math.isclose(
        unigram_loss(train_ids, held_out, 64),
        reference_unigram_loss(train_ids, held_out, 64),
        rel_tol=1e-6,
    )


def test_unigram_loss_of_a_stream_on_itself_is_its_smoothed_entropy():
    unigram_loss = answer(minillm.train, "unigram_loss", "1.3")
    ids = torch.tensor([0, 0, 0, 1])  # counts 3 and 1, smoothed over V = 2: 4/6, 2/6
    expected = -(3 * math.log(4 / 6) + math.log(2 / 6)) / 4
    assert math.isclose(unigram_loss(ids, ids, 2), expected, rel_tol=1e-9)
