"""The INT4 format, its reference product, Int4Linear and the engine's "int4"
quantization (chapters/17_int4_gemm.md)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shapes import SMALL

from minillm.config import EngineConfig
from minillm.int4 import (
    PROJECTIONS,
    Int4Linear,
    Int4Weight,
    int4_linear_ref,
    pack_int4,
    quantize_rtn,
    replace_linears,
    unpack_int4,
)
from minillm.llm import LLM
from minillm.merged_projections import merge_projections
from minillm.model import CausalLM, ModelConfig
from minillm.sampling_params import SamplingParams


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 9),
    words=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(n, words, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, 8 * words), dtype=torch.uint8, generator=gen)
    packed = pack_int4(codes)
    assert packed.shape == (words, n) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), codes)


def test_pack_places_code_j_in_bits_4j():
    codes = torch.zeros(1, 8, dtype=torch.uint8)
    codes[0, 7] = 15  # the top nibble: the signed word is negative
    codes[0, 1] = 3
    assert pack_int4(codes).item() == (15 << 28 | 3 << 4) - 2**32


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((2, 8), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.uint8))


@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([16, 32, 64, 128]), seed=st.integers(0, 1000))
def test_codes_round_trip_and_dequantize_formula(group, seed):
    gen = torch.Generator().manual_seed(seed)
    N, K = 5, 256
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    scales = torch.rand(N, K // group, generator=gen) + 0.01
    zeros = torch.randint(0, 16, (N, K // group), generator=gen).float()
    w = Int4Weight.from_codes(codes, scales, zeros, group)
    c, s, z = w.to_codes()
    assert torch.equal(c, codes) and torch.equal(s, scales) and torch.equal(z, zeros)
    expected = (codes.float() - zeros.repeat_interleave(group, 1)) * (
        scales.repeat_interleave(group, 1)
    )
    assert torch.equal(w.dequantize(), expected)


def test_from_codes_rejects_bad_input():
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    ok = torch.ones(4, 2), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="group_size"):
        Int4Weight.from_codes(codes, *ok, 24)
    with pytest.raises(ValueError, match="scales and zeros"):
        Int4Weight.from_codes(codes, torch.ones(4, 4), torch.zeros(4, 4), 32)
    with pytest.raises(ValueError, match="integer"):
        Int4Weight.from_codes(codes, ok[0], ok[1] + 0.5, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_rtn_error_is_at_most_half_a_step(dtype, group):
    w = (torch.randn(48, 256) * torch.linspace(0.01, 3, 256)).to(dtype)
    qw = quantize_rtn(w, group)
    assert qw.scales.dtype == dtype
    step = qw.to_codes()[1].float().repeat_interleave(group, 1)
    error = (qw.dequantize() - w.float()).abs()
    assert (error <= step / 2 * (1 + 1e-3)).all()
    zero_weights = torch.zeros(2, group, dtype=dtype)  # an all-zero group stays 0
    assert torch.equal(
        quantize_rtn(zero_weights, group).dequantize(), zero_weights.float()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_on_cpu_is_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    qw = quantize_rtn(torch.randn(40, 128, generator=g), 64)
    bias = torch.randn(40, generator=g)
    layer = Int4Linear.from_weight(qw, bias)
    x = torch.randn(2, 3, 128, generator=g).to(dtype)
    y = layer.to(dtype)(x)
    assert y.shape == (2, 3, 40) and y.dtype == dtype
    dense = x.float() @ qw.dequantize().T + bias
    # bf16: scales, bias and the output each rounded to 8 significant bits, so the
    # error is a small fraction of the output's scale (an element near zero can be
    # off by more than 5e-2 in absolute terms); float32: exact to summation order
    err = (y.float() - dense).abs().max() / dense.abs().max()
    assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-5), err
    assert torch.equal(y, int4_linear_ref(x, layer.weight_int4, layer.bias))
    assert not list(layer.parameters()), "the packed weight is buffers, not parameters"


def small_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=64, **SMALL)
    return CausalLM(config).eval()


def test_replace_linears_swaps_every_projection_and_names_them():
    model = small_model()
    names = replace_linears(
        model,
        lambda name, linear: Int4Linear.from_weight(
            quantize_rtn(linear.weight, 64), linear.bias
        ),
    )
    expected = {
        f"model.layers.{i}.{part}.{p}"
        for i in range(2)
        for part, ps in [("self_attn", "qkvo"), ("mlp", ["gate", "up", "down"])]
        for p in [f"{x}_proj" for x in ps]
    }
    assert set(names) == expected
    assert isinstance(model.lm_head, torch.nn.Linear), "the LM head stays"
    merged = small_model()
    merge_projections(merged)
    names = replace_linears(merged, lambda name, linear: None)
    assert names == [], "make returned None: nothing replaced"
    kinds = {n.rpartition(".")[2] for n, m in merged.named_modules()} & set(PROJECTIONS)
    assert {"qkv_proj", "gate_up_proj"} <= kinds


def test_bad_group_size_is_an_error_that_changes_nothing():
    with pytest.raises(ValueError, match="multiple of 16"):
        EngineConfig(quantization="int4", int4_group_size=24)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from minillm.int4 import quantize_int4

    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(model, EngineConfig(quantization="int4", int4_group_size=48))
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("group", [0, 8, 24, 40, 100, -1, True, 128.0, "128"])
def test_group_sizes_the_kernels_cannot_run_are_refused_at_construction(group):
    allowed = r"must be a multiple of 16 \(16, 32, 48, 64, ...\)"
    with pytest.raises(ValueError, match=allowed):
        EngineConfig(quantization="int4", int4_group_size=group)


def test_the_engine_path_gives_the_same_clear_error(tiny):
    with pytest.raises(ValueError, match=r"multiple of 16 \(16, 32, 48"):
        LLM(device="cpu", quantization="int4", int4_group_size=40)
    with pytest.raises(ValueError, match="per-channel"):
        LLM(device="cpu", quantization="int4", int4_group_size=-1)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_engine_equals_dense_engine_on_dequantized_weights(tiny, group):
    common = dict(device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    quantized = LLM(quantization="int4", int4_group_size=group, **common)
    kinds = {type(m).__name__ for m in quantized.engine.model.modules()}
    assert "Int4Linear" in kinds and quantized.engine.parts["quantization"] == "int4"
    reference = LLM(**common)
    model = reference.engine.model
    merge_projections(model)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in PROJECTIONS:
            with torch.no_grad():
                module.weight.copy_(quantize_rtn(module.weight, group).dequantize())
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def ids(llm):
        return [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]

    assert ids(quantized) == ids(reference)


def test_serve_quantization_flag_reaches_the_engine(tiny):
    pytest.importorskip("fastapi")
    from minillm.server import build_engine, parse_args

    args = ["--quantization", "int4", "--num-kv-blocks", "64", "--device", "cpu"]
    engine, _ = build_engine(parse_args(args))
    assert engine.config.quantization == "int4"
    assert any(isinstance(m, Int4Linear) for m in engine.model.modules())
    plain, _ = build_engine(parse_args(["--num-kv-blocks", "64", "--device", "cpu"]))
    assert not any(isinstance(m, Int4Linear) for m in plain.model.modules())
