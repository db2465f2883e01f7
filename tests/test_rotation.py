"""Chapter 18's rotation of the residual stream (chapters/18_quantization.md,
"Rotating the residual stream"): the Hadamard constructions, the model's function
kept, the LM head untied, and the engine's cached rotated GPTQ model."""

import copy
import dataclasses

import pytest
import torch

from minillm.config import EngineConfig
from minillm.int4 import Int4Linear
from minillm.llm import LLM
from minillm.merged_projections import merge_projections
from minillm.model import CausalLM
from minillm.quantization import apply, methods
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.checkpoint import export_quantized, load_quantized_checkpoint
from minillm.quantization.rotation import (
    hadamard,
    random_hadamard,
    random_orthogonal,
    rotate_residual,
)
from minillm.sampling_params import SamplingParams


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 20, 24, 48, 576, 960, 1024])
def test_hadamard_matrices_are_hadamard(n):
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_orders_without_a_construction_are_a_clear_error():
    assert hadamard(6) is None  # no Hadamard matrix of order 6 exists
    with pytest.raises(ValueError, match="order 6"):
        random_hadamard(6)


@pytest.mark.parametrize("make", [random_hadamard, random_orthogonal])
def test_rotations_are_orthogonal_and_seeded(make):
    q = make(48, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, make(48, seed=3)) and not torch.equal(q, make(48, seed=4))


def logits(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos))


def odd_model(config):
    """Norm weights far from one, biases on q/k/v, per-head q/k norms, untied."""
    torch.manual_seed(0)
    config = dataclasses.replace(
        config, qk_norm=True, attention_bias=True, tie_word_embeddings=False
    )
    model = CausalLM(config).eval()
    for module in model.modules():
        if type(module).__name__ == "RMSNorm":
            module.weight.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("shape", ["tiny", "merged", "odd"])
def test_rotation_keeps_the_logits(tiny, kind, shape):
    model = odd_model(tiny[0].config) if shape == "odd" else copy.deepcopy(tiny[0])
    if shape == "merged":
        merge_projections(model)
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    before = logits(model, ids)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    rotate_residual(model, kind, seed=1)
    assert torch.allclose(logits(model, ids), before, atol=1e-3, rtol=1e-4)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    assert tied == (shape != "odd")
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    stream = [m for m in norms if m.weight.numel() == model.config.hidden_size]
    assert stream and all(torch.all(m.weight == 1) for m in stream)


def test_unknown_rotation_changes_nothing(tiny):
    model = copy.deepcopy(tiny[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown rotation"):
        rotate_residual(model, "householder")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="quant_rotation"):
        EngineConfig(quantization="gptq", quant_rotation="householder")


def test_rotated_gptq_checkpoint_exports_and_loads_back(tiny, tmp_path):
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    rotate_residual(model, "hadamard", seed=0)
    stats = capture(model, token_windows(tokenizer, "train", 4, 64))
    codes = apply.int4_codes(model, "gptq", stats, 128, sym=True)
    export_quantized(model, codes, tmp_path, "gptq")
    loaded = load_quantized_checkpoint(tmp_path)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    apply.fake_quantize_layers(model, codes)
    ids = token_windows(tokenizer, "held_out", 1, 16)
    assert (logits(loaded, ids) - logits(model, ids)).abs().max() < 0.05  # fp16 file


def test_engine_builds_a_rotated_gptq_model_once_and_loads_it_after(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(methods, "default_cache_dir", lambda: tmp_path)
    opts = dict(device="cpu", num_kv_blocks=32, calibration_tokenizer="tiny",
                calibration_samples=4, calibration_seq_len=64,
                quant_rotation="hadamard")  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = LLM(quantization="gptq", **opts)
    monkeypatch.setattr(methods, "capture", None)  # a second build must not calibrate
    monkeypatch.setattr(apply, "gptq_sequential", None)
    monkeypatch.setattr(methods, "rotate_residual", None)  # nor rotate again
    second = LLM(quantization="gptq", **opts)
    outs = [
        llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0] for llm in (first, second)
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for llm in (first, second):
        m = llm.engine.model
        assert isinstance(m.model.layers[0].self_attn.qkv_proj, Int4Linear)
        assert m.lm_head.weight is not m.model.embed_tokens.weight
        assert torch.all(m.model.norm.weight == 1)
    a, b = first.engine.model, second.engine.model
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)


def test_auto_rotation_is_hadamard_for_gptq_where_one_is_built():
    from minillm.quantization.methods import rotation_of
    from minillm.quantization.rotation import hadamard

    auto = EngineConfig()
    assert auto.quant_rotation == "auto"  # the default
    assert rotation_of("gptq", auto, 576) == "hadamard"  # SmolLM2's width
    assert rotation_of("awq", auto, 576) is None
    assert rotation_of("w8a8", auto, 576) is None
    assert hadamard(22) is None  # no construction here: no rotation, no error
    assert rotation_of("gptq", auto, 22) is None
    off = EngineConfig(quant_rotation=None)
    assert rotation_of("gptq", off, 576) is None
    dense = EngineConfig(quant_rotation="orthogonal")
    assert rotation_of("awq", dense, 22) == "orthogonal"
