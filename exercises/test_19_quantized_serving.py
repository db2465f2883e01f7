"""Checks for chapter 19's exercises (chapters/19_quantized_serving.md,
"Exercises")."""

import copy

import torch
from _check import answer

from minillm.quantization import apply, checkpoint, methods
from minillm.quantization.rtn import quantize_rtn_groups


def test_rtn_mse(tiny):
    """18.1: quantization="rtn-mse" serves Int4Linear layers holding RTN's codes
    with searched ranges, in groups of int4_group_size, and generates."""
    from minillm import LLM, SamplingParams
    from minillm.int4 import Int4Linear
    from minillm.merged_projections import merge_projections

    answer(methods, "quantize_rtn_mse", "19.1")
    llm = LLM(quantization="rtn-mse", device="cpu", dtype=torch.float32,
              num_kv_blocks=16, int4_group_size=64)  # fmt: skip
    reference = copy.deepcopy(tiny[0])
    merge_projections(reference)
    served = llm.engine.model
    for name in ("model.layers.0.mlp.gate_up_proj", "model.layers.1.self_attn.o_proj"):
        layer = served.get_submodule(name)
        assert isinstance(layer, Int4Linear)
        w = reference.get_submodule(name).weight.detach().float()
        want = quantize_rtn_groups(w, 4, 64, mse=True)
        got = layer.weight_int4.to_codes()
        assert torch.equal(got[0], want[0])
        assert torch.allclose(got[1].float(), want[1], rtol=1e-6)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4


def test_checkpoint_bits(tiny, tmp_path):
    """18.2: the bits a folder stores per quantized weight, from its tensors:
    4 + 20 / g in AWQ's layout, and g_idx's int32 a column on top in GPTQ's."""
    checkpoint_bits = answer(checkpoint, "checkpoint_bits", "19.2")
    model = tiny[0]
    for g in (32, 128):
        src = copy.deepcopy(model)
        codes = apply.int4_codes(src, "rtn", None, g, sym=True)
        weights = sum(c.numel() for c, _, _ in codes.values())
        g_idx = sum(32 * c.shape[1] for c, _, _ in codes.values())  # int32 per K
        for fmt in ("awq", "gptq"):
            checkpoint.export_quantized(src, codes, tmp_path / f"{fmt}{g}", fmt)
            bits = checkpoint_bits(tmp_path / f"{fmt}{g}")
            want = 4 + 20 / g + (g_idx / weights if fmt == "gptq" else 0)
            assert abs(bits - want) < 1e-9, (fmt, g, bits, want)
