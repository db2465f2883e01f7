"""Chapter 18's quantization algorithms (chapters/18_quantization.md): RTN, GPTQ
against its closed form and against RTN, AWQ and SmoothQuant folding, the int8 and
FP8 layers against their references, and the engine's cached methods."""

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import EngineConfig
from minillm.int4 import Int4Linear
from minillm.llm import LLM
from minillm.quantization import apply, eight_bit, methods
from minillm.quantization.awq import awq_search
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.checkpoint import (
    AWQ_ORDER,
    export_quantized,
    load_quantized_checkpoint,
    pack_columns,
    to_layout,
    unpack_columns,
)
from minillm.quantization.fp8 import Fp8Linear, fp8_mm, fp8_mm_ref, quantize_fp8
from minillm.quantization.gptq import gptq_quantize, gptq_reference
from minillm.quantization.rtn import (
    dequantize_groups,
    fake_quantize,
    group_params,
    output_error,
    quantize_rtn_groups,
    quantize_with,
)
from minillm.quantization.w8a8 import Int8Linear, int8_mm, int8_mm_ref, quantize_int8
from minillm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def calibrated(tiny):
    model, tokenizer = tiny
    stats = capture(model, token_windows(tokenizer, "train", 8, 64))
    return model, tokenizer, stats


def toy(seed, n=8, k=64, tokens=200):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    x = x @ torch.randn(k, k, generator=gen, dtype=torch.float64)  # correlated
    return torch.randn(n, k, generator=gen, dtype=torch.float64), x.T @ x


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([8, 16, 64, -1]))
def test_rtn_error_is_at_most_half_a_step_and_zero_stays_zero(seed, g):
    w, _ = toy(seed)
    w[:, 0] = 0
    codes, scales, zeros = quantize_rtn_groups(w, 4, g)
    assert codes.max() <= 15
    step = scales.repeat_interleave(w.shape[1] // scales.shape[1], dim=1)
    assert (
        (dequantize_groups(codes, scales, zeros) - w).abs() <= step / 2 + 1e-6
    ).all()
    assert (dequantize_groups(codes, scales, zeros)[:, 0] == 0).all()


def test_rtn_rejects_a_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn_groups(torch.randn(4, 48), 4, 32)


@pytest.mark.parametrize("g,block", [(16, 32), (16, 16), (64, 16), (-1, 32)])
def test_gptq_equals_the_closed_form_obs_solution(g, block):
    w, h = toy(0)
    fast = gptq_quantize(w, h, 4, g, block_size=block)
    slow = gptq_reference(w, h, 4, g)
    assert torch.equal(fast[0], slow[0])
    assert torch.allclose(fast[1], slow[1]) and torch.equal(fast[2], slow[2])


def test_gptq_first_column_update_is_the_obs_formula():
    """After column 0 is rounded, the rest moves by -e / Hinv_00 * Hinv_0,: ."""
    w, h = toy(1, n=1, k=6)
    hd = h + 0.01 * torch.diag(h).mean() * torch.eye(6, dtype=h.dtype)
    codes, scales, zeros = gptq_reference(w, h, 4, -1)
    q0 = (codes[:, 0].double() - zeros[:, 0].double()) * scales[:, 0].double()
    h_inv = torch.linalg.inv(hd)
    moved = w - (w[:, 0] - q0)[:, None] / h_inv[0, 0] * h_inv[0][None, :]
    # the reference's column 1 is rounded from exactly this updated weight
    expect = torch.round(moved[:, 1] / scales[:, 0].double()) + zeros[:, 0].double()
    assert torch.equal(codes[:, 1].double(), expect.clamp(0, 15))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_summed_output_error_below_rtns(calibrated, act_order):
    """Not a theorem for each matrix (GPTQ rounds greedily), but in expectation each
    column's error costs its conditional variance instead of its variance: summed
    over every projection of the model, GPTQ's output error is below RTN's."""
    model, _, stats = calibrated
    params = dict(model.named_parameters())
    gptq = rtn = 0.0
    for name, s in stats.items():
        if act_order and not name.startswith("model.layers.0."):
            continue  # act-order: one layer is enough (the loop is slow in Python)
        w = params[f"{name}.weight"].detach()
        q = gptq_quantize(w, s.hessian, 4, 128, act_order=act_order)
        gptq += output_error(w, dequantize_groups(*q), s.hessian)
        rtn += output_error(w, fake_quantize(w, 4, 128), s.hessian)
    assert gptq < rtn


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([16, 32, 64]))
def test_gptq_with_uncorrelated_inputs_is_rtn(seed, g):
    """H diagonal: no column predicts another, every update is zero, and GPTQ's
    codes, scales and zeros are RTN's."""
    w, h = toy(seed)
    q = gptq_quantize(w, torch.diag(torch.diag(h)), 4, g)
    groups = w.reshape(-1, g)  # RTN, in GPTQ's float64
    scales, zeros = group_params(groups, 4)
    codes = quantize_with(groups, scales, zeros, 4).reshape(w.shape)
    assert torch.equal(q[0], codes.to(torch.uint8))
    assert torch.equal(q[1], scales.reshape(len(w), -1).float())
    assert torch.equal(q[2], zeros.reshape(len(w), -1).float())


def test_gptq_rejects_blocks_and_groups_that_do_not_nest():
    w, h = toy(2)
    with pytest.raises(ValueError, match="nest"):
        gptq_quantize(w, h, 4, 16, block_size=24)


def test_folding_scales_keeps_the_model_function(calibrated):
    model, tokenizer, stats = calibrated
    ids = token_windows(tokenizer, "held_out", 2, 32)
    pos = torch.arange(32).expand_as(ids)
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for group in apply.scaling_groups(scaled):
            if group.fold is not None:
                k = scaled.get_submodule(group.names[0]).in_features
                apply.apply_scales(scaled, group, torch.rand(k) * 3 + 0.3)
        a = model.compute_logits(model(ids, pos))
        b = scaled.compute_logits(scaled(ids, pos))
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_awq_is_never_worse_than_rtn_on_the_calibration_set(calibrated):
    model, _, stats = calibrated
    for group in apply.scaling_groups(model):
        ws = [model.get_submodule(n).weight for n in group.names]
        _, alpha, errors = awq_search(ws, stats[group.names[0]], 4, 128, grid=3)
        assert errors[0] == pytest.approx(
            output_error(torch.cat(ws), fake_quantize(torch.cat(ws)), stats[
                group.names[0]].hessian), rel=1e-4)  # fmt: skip
        assert min(errors) <= errors[0] and errors[round(alpha * 3)] == min(errors)


def test_awqs_recorded_error_is_the_error_of_the_model_it_folds(calibrated):
    """The search's record for its alpha is the RTN error of the folded weights
    against the inputs the folded model really produces (its Hessians captured
    again): what makes "never worse than RTN" hold for the deployed model."""
    model, tokenizer, stats = calibrated
    folded, chosen = copy.deepcopy(model), []
    for group in apply.scaling_groups(folded):
        if group.fold is None:
            continue
        w = torch.cat([model.get_submodule(n).weight.detach() for n in group.names])
        s, alpha, errors = awq_search([w], stats[group.names[0]], 4, 128, grid=4)
        apply.apply_scales(folded, group, s)
        chosen.append((group.names[0], w * s, errors[round(alpha * 4)]))
    seen = capture(folded, token_windows(tokenizer, "train", 8, 64))
    for name, w_scaled, recorded in chosen:
        h = seen[name].hessian
        real = output_error(w_scaled, fake_quantize(w_scaled, 4, 128), h)
        assert real == pytest.approx(recorded, rel=1e-3), name


def test_int4_layers_compute_what_the_fake_quantized_weights_do(calibrated):
    model, tokenizer, stats = calibrated
    ids = token_windows(tokenizer, "held_out", 1, 16)
    pos = torch.arange(16).expand_as(ids)
    codes = apply.int4_codes(model, "rtn", stats, 128)
    fake, real = copy.deepcopy(model), copy.deepcopy(model)
    apply.fake_quantize_layers(fake, codes)
    assert len(apply.int4_layers(real, codes)) == len(codes)
    assert isinstance(real.model.layers[0].mlp.down_proj, Int4Linear)
    with torch.no_grad():
        a, b = fake.compute_logits(fake(ids, pos)), real.compute_logits(real(ids, pos))
    assert torch.allclose(a, b, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_int8_mm_is_exact(m, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=gen)
    assert torch.equal(int8_mm(a, b), int8_mm_ref(a, b))


def test_int8_and_fp8_layers_match_their_references():
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 5, 64, generator=gen)
    xq, xs = quantize_int8(x.reshape(-1, 64))
    lin8 = Int8Linear.from_linear(linear)
    ref = (xq.double() @ lin8.qweight.double().T) * xs.double() * lin8.weight_scale
    assert torch.allclose(
        lin8(x).reshape(-1, 32), (ref + linear.bias).float(), atol=1e-5
    )
    fp8 = Fp8Linear.from_linear(linear)
    aq, a_s = quantize_fp8(x.reshape(-1, 64))
    expect = fp8_mm_ref(aq, a_s, fp8.qweight, fp8.weight_scale, torch.float32)
    assert torch.equal(fp8(x).reshape(-1, 32), expect + linear.bias)
    assert torch.equal(
        fp8_mm(aq, a_s, fp8.qweight, fp8.weight_scale, torch.float32), expect
    )
    y = linear(x).detach()
    for layer in (lin8, fp8):
        assert float((layer(x) - y).norm() / y.norm()) < 0.1


def test_smoothing_moves_activation_range_into_weights(calibrated):
    model, _, stats = calibrated
    smoothed = copy.deepcopy(model)
    eight_bit.w8a8_layers(smoothed, stats, 0.5)
    assert all(
        isinstance(m, Int8Linear)
        for n, m in smoothed.named_modules()
        if n.endswith("proj")
    )
    norm = smoothed.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, model.model.layers[0].input_layernorm.weight)


def test_engine_builds_a_gptq_model_once_and_loads_it_after(tmp_path, monkeypatch):
    monkeypatch.setattr(methods, "default_cache_dir", lambda: tmp_path)
    opts = dict(device="cpu", num_kv_blocks=32, calibration_tokenizer="tiny",
                calibration_samples=4, calibration_seq_len=64)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = LLM(quantization="gptq", **opts)
    files = sorted(p.name for p in (tmp_path / "quantized").glob("*.safetensors"))
    assert len(files) == 1 and files[0].startswith("gptq-")
    monkeypatch.setattr(methods, "capture", None)  # a second build must not calibrate
    monkeypatch.setattr(apply, "gptq_sequential", None)  # in either way
    second = LLM(quantization="gptq", **opts)
    outs = [
        llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0] for llm in (first, second)
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    layer = second.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_engine_runs_w8a8_and_fp8(tmp_path, monkeypatch, method):
    monkeypatch.setattr(methods, "default_cache_dir", lambda: tmp_path)
    llm = LLM(quantization=method, device="cpu", num_kv_blocks=32,
              calibration_tokenizer="tiny", calibration_samples=4,
              calibration_seq_len=64)  # fmt: skip
    kind = {"w8a8": Int8Linear, "fp8": Fp8Linear}[method]
    assert isinstance(llm.engine.model.model.layers[1].mlp.down_proj, kind)
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_settings_and_missing_calibration_are_clear_errors():
    with pytest.raises(ValueError, match="smoothquant_alpha"):
        EngineConfig(quantization="w8a8", smoothquant_alpha=1.5)
    with pytest.raises(ValueError, match="calibration_tokenizer"):
        LLM(quantization="awq", device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_exported_checkpoint_loads_back_to_the_same_codes(calibrated, tmp_path, fmt):
    model, tokenizer, stats = calibrated
    src = copy.deepcopy(model)
    codes = apply.int4_codes(src, "rtn" if fmt == "gptq" else "awq", stats, 128,
                             sym=fmt == "gptq", awq_grid=3)  # fmt: skip
    export_quantized(src, codes, tmp_path, fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    loaded = load_quantized_checkpoint(tmp_path)
    for name, (c, scales, zeros) in codes.items():
        back = loaded.get_submodule(name).weight_int4.to_codes()
        assert torch.equal(back[0], c) and torch.equal(back[2].float(), zeros)
        assert torch.allclose(back[1].float(), scales, rtol=1e-3)
    ids = token_windows(tokenizer, "held_out", 1, 16)
    pos = torch.arange(16).expand_as(ids)
    apply.fake_quantize_layers(src, codes)
    with torch.no_grad():
        a = loaded.compute_logits(loaded(ids, pos))
        b = src.compute_logits(src(ids, pos))
    assert (a - b).abs().max() < 0.05  # fp16 scales and weights in the file


def test_awq_packing_is_what_vllm_unpacks():
    """Unpacked as vLLM's _convert_awq_to_standard_format does (bits 4s hold slot s,
    then its _REVERSE_AWQ_PACK_ORDER), our AWQ words give the columns in order."""
    values = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    words = pack_columns(values, AWQ_ORDER)  # (3, 2) int32
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    unpacked = (words.unsqueeze(-1) >> shifts) & 0xF  # (3, 2, 8): slot s at bits 4s
    unpacked = unpacked[:, :, [0, 4, 1, 5, 2, 6, 3, 7]]  # vLLM's reverse order
    assert torch.equal(unpacked.reshape(3, 16).to(torch.uint8), values)


def test_gptq_layout_stores_zero_minus_one_and_rejects_zero():
    codes, scales, zeros = quantize_rtn_groups(torch.randn(16, 64), 4, 32, sym=True)
    t = to_layout(codes, scales, zeros, "gptq")
    assert torch.equal(
        unpack_columns(t["qzeros"]), torch.full((2, 16), 7, dtype=torch.uint8)
    )
    assert t["qweight"].shape == (8, 16) and t["g_idx"].tolist() == [0] * 32 + [1] * 32
    with pytest.raises(ValueError, match="zero point of 0"):
        to_layout(codes, scales, torch.zeros_like(zeros), "gptq")
