"""Checks for chapter 18's exercises (chapters/18_quantization.md, "Exercises")."""

import torch
from _check import answer

from minillm.quantization import apply, awq
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.rtn import fake_quantize, output_error


def _stats(tiny):
    model, tokenizer = tiny
    return capture(model, token_windows(tokenizer, "train", 8, 64))


def test_clip(tiny):
    """14.1: clipping before RTN never raises the output error, and lowers it
    somewhere."""
    awq_clip = answer(awq, "awq_clip", "18.1")
    stats = _stats(tiny)
    model = tiny[0]
    gains = []
    for name in ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]:
        w = model.get_submodule(name).weight.detach()
        h = stats[name].hessian
        clipped = awq_clip(w, h, bits=4, group_size=128, grid=10)
        assert clipped.shape == w.shape
        assert (clipped.abs() <= w.abs().amax() + 1e-6).all()
        rtn = output_error(w, fake_quantize(w, 4, 128), h)
        err = output_error(w, fake_quantize(clipped, 4, 128), h)
        assert err <= rtn * (1 + 1e-6)
        gains.append(err / rtn)
    assert min(gains) < 1


def test_three_bits(tiny):
    """14.2: GPTQ beats RTN at three bits and at four."""
    gptq_gain = answer(apply, "gptq_gain", "18.2")
    stats = _stats(tiny)
    three, four = gptq_gain(tiny[0], stats, 3), gptq_gain(tiny[0], stats, 4)
    assert 0 < three < 1 and 0 < four < 1
    print(f"GPTQ / RTN output error: 3 bits {three:.2f}, 4 bits {four:.2f}")


def test_true_sequential(tiny):
    """14.3: layer 0's q, k, v as gptq_sequential's; layer 0's down_proj statistics
    from the layer with its other six projections quantized."""
    import copy

    from minillm.quantization import sequential

    gptq_true_sequential = answer(sequential, "gptq_true_sequential", "18.3")
    model, tokenizer = tiny
    windows = token_windows(tokenizer, "train", 4, 64)
    codes, stats = gptq_true_sequential(model, windows, group_size=64)
    plain, _ = sequential.gptq_sequential(model, windows, group_size=64)
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}"
        assert all(torch.equal(a, b) for a, b in zip(codes[name], plain[name]))
    down = "model.layers.0.mlp.down_proj"
    done = {n: c for n, c in codes.items() if n.startswith("model.layers.0.")}
    del done[down]
    assert len(done) == 6
    prefix = copy.deepcopy(model)
    apply.fake_quantize_layers(prefix, done)
    seen = capture(prefix, windows)[down].hessian
    assert torch.allclose(stats[down].hessian, seen, rtol=1e-9)


def test_rotate_values(tiny):
    """14.4: the logits stay the same; v_proj's rows and o_proj's columns change."""
    import copy

    from minillm.quantization import rotation

    rotate_values = answer(rotation, "rotate_values", "18.4")
    model = tiny[0]
    rotated = copy.deepcopy(model)
    rotate_values(rotated, seed=0)
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    pos = torch.arange(24).expand_as(ids)
    with torch.inference_mode():
        before = model.compute_logits(model(ids, pos))
        after = rotated.compute_logits(rotated(ids, pos))
    assert torch.allclose(before, after, atol=1e-3, rtol=1e-4)
    o, o2 = model.model.layers[0].self_attn.o_proj, rotated.model.layers[0].self_attn
    assert not torch.allclose(o.weight, o2.o_proj.weight)
