"""Sequential GPTQ calibration (chapters/18_quantization.md, "Sequential
calibration"): against its reference, one-shot GPTQ run layer by layer on a model
whose earlier layers are already quantized; layer 0 equal to one-shot; the model left
unchanged, also when GPTQ fails halfway through a layer.

No test asserts that sequential GPTQ's held-out perplexity is at most one-shot's:
each layer's codes minimise that layer's error on the inputs it sees, greedily,
which bounds neither the end-to-end loss nor text the calibration never saw; on
the tiny model the 4-bit rows differ by less than the slice-to-slice noise of the
perplexity itself (the chapter's quality table shows both)."""

import copy

import pytest
import torch

from minillm.config import EngineConfig
from minillm.int4 import Int4Linear
from minillm.llm import LLM
from minillm.quantization import apply, methods, sequential
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.gptq import gptq_quantize
from minillm.quantization.rtn import dequantize_groups, fake_quantize, output_error
from minillm.quantization.sequential import gptq_sequential


def layer_of(name: str) -> int:
    return int(name.split(".")[2])  # model.layers.<i>.<...>


@pytest.fixture(scope="module")
def windows(tiny):
    return token_windows(tiny[1], "train", 4, 64)


@pytest.fixture(scope="module")
def seq(tiny, windows):
    return gptq_sequential(tiny[0], windows, group_size=64, act_order=True)


def test_layer_0_codes_are_one_shot_gptqs(tiny, windows, seq):
    model = tiny[0]
    codes, stats = seq
    float_stats = capture(model, windows)  # one-shot's statistics
    params = dict(model.named_parameters())
    first = [n for n in codes if layer_of(n) == 0]
    assert len(first) == 7  # q, k, v, o, gate, up, down
    for name in first:
        h = float_stats[name].hessian
        assert torch.equal(stats[name].hessian, h)
        one_shot = gptq_quantize(params[f"{name}.weight"].detach(), h, 4, 64,
                                 act_order=True)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(codes[name], one_shot))


def test_each_layer_is_quantized_against_the_quantized_prefixs_inputs(
    tiny, windows, seq
):
    model = tiny[0]
    codes, stats = seq
    params = dict(model.named_parameters())
    float_stats = capture(model, windows)
    gptq_err = rtn_err = 0.0
    for i in range(1, len(model.model.layers)):
        prefix = copy.deepcopy(model)  # layers < i quantized, the rest float
        apply.fake_quantize_layers(
            prefix, {n: c for n, c in codes.items() if layer_of(n) < i}
        )
        seen = capture(prefix, windows)
        for name in (n for n in codes if layer_of(n) == i):
            h = seen[name].hessian
            assert torch.allclose(stats[name].hessian, h, rtol=1e-9, atol=0)
            assert not torch.allclose(float_stats[name].hessian, h, rtol=1e-4)
            w = params[f"{name}.weight"].detach()
            ref = gptq_quantize(w, h, 4, 64, act_order=True)
            assert all(torch.equal(a, b) for a, b in zip(codes[name], ref))
            rtn_err += output_error(w, fake_quantize(w, 4, 64), h)
            gptq_err += output_error(w, dequantize_groups(*codes[name]), h)
    # below RTN summed over the projections, as chapter 18 argues (not a theorem for
    # each matrix: GPTQ rounds greedily)
    assert gptq_err < rtn_err


def test_the_model_is_unchanged_also_when_gptq_fails_midway(tiny, windows, monkeypatch):
    model = tiny[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def failing(*args, **kwargs):  # succeeds on layer 0, fails inside layer 1
        calls.append(1)
        if len(calls) == 9:
            raise ValueError("the Hessian is not positive definite: raise damp")
        return gptq_quantize(*args, **kwargs)

    monkeypatch.setattr(sequential, "gptq_quantize", failing)
    with pytest.raises(ValueError, match="positive definite"):
        gptq_sequential(model, windows[:4], group_size=64)
    assert len(calls) == 9
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sequential_gptq_needs_the_calibration_windows(tiny):
    with pytest.raises(ValueError, match="calibration windows"):
        apply.int4_codes(tiny[0], "gptq-seq", None)


@pytest.mark.parametrize("sequential", [True, False])
def test_the_engine_calibrates_as_gptq_sequential_says(
    tmp_path, monkeypatch, sequential
):
    assert EngineConfig().gptq_sequential  # the default
    monkeypatch.setattr(methods, "default_cache_dir", lambda: tmp_path)
    calls = []

    def spy(name, real):
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    monkeypatch.setattr(methods, "capture", spy("capture", methods.capture))
    monkeypatch.setattr(apply, "gptq_sequential", spy("seq", apply.gptq_sequential))
    llm = LLM(quantization="gptq", gptq_sequential=sequential, device="cpu",
              num_kv_blocks=16, calibration_tokenizer="tiny", calibration_samples=4,
              calibration_seq_len=64)  # fmt: skip
    assert calls == (["seq"] if sequential else ["capture"])
    assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj, Int4Linear)
