"""Chapter 20's fused W8A8 kernels against their references
(chapters/20_eight_bit.md, "Fusing the eight-bit layers on the GPU").

On a CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) at small
sizes whose row and column counts are not multiples of the tiles; on a GPU also at
Llama-3.1-8B shapes, the FP8 quantizer (the interpreter's E4M3 cast is wrong), and
the quantized layers through the fused path against their CPU reference.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from minillm.kernels.w8a8 import (  # noqa: E402
    int8_mm_config,
    int8_scaled_mm,
    quantize_rows,
)
from minillm.quantization.fp8 import FP8, Fp8Linear, quantize_fp8  # noqa: E402
from minillm.quantization.w8a8 import Int8Linear, int8_mm_ref, quantize_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")


def rows(m, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, k // 3] *= 50  # an outlier channel
    if m > 2:
        x[1] = 0  # the scale's floor
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 1000), (3, 2048 + 7)])
def test_quantize_rows_int8_is_quantize_int8_bit_for_bit(m, k, dtype):
    x = rows(m, k, seed=m, dtype=dtype)
    codes, scales = quantize_rows(x, torch.int8)
    ref_codes, ref_scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (m, 1)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)


def test_round_half_to_even_as_torch_round():
    # a row whose maximum is 127: the scale is 1, the codes are torch.round(x)
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5]])
    codes, scales = quantize_rows(x.to(DEVICE), torch.int8)
    assert scales.item() == 1.0
    assert codes.cpu().tolist() == torch.round(x).to(torch.int8).tolist()


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 4096), (33, 3000), (4096, 4096)])
def test_quantize_rows_fp8_is_quantize_fp8_bit_for_bit(m, k, dtype):
    x = rows(m, k, seed=m, dtype=dtype)
    codes, scales = quantize_rows(x, FP8)
    ref_codes, ref_scales = quantize_fp8(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


def test_quantize_rows_refuses_other_types():
    with pytest.raises(ValueError, match="int8 or float8"):
        quantize_rows(torch.zeros(2, 8, device=DEVICE), torch.int16)


def int8_pair(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a, _ = quantize_int8(torch.randn(m, k, generator=g))
    b, _ = quantize_int8(torch.randn(n, k, generator=g))
    return a.to(DEVICE), b.to(DEVICE)


# row counts on both sides of each config's bound, columns off the tiles
@pytest.mark.parametrize("m", [1, 16, 17, 128, 129])
def test_int8_scaled_mm_is_exact_with_unit_scales(m):
    a, b = int8_pair(m, 200, 512, seed=m)
    one = torch.ones(200, device=DEVICE)
    out = int8_scaled_mm(a, one[:1].expand(m, 1), b, one, torch.float32)
    assert torch.equal(out, int8_mm_ref(a, b).float())  # sums < 2**24: exact


@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_scaled_mm_applies_the_scales_and_the_bias(m, bias):
    a, b = int8_pair(m, 72, 256, seed=10 + m)
    g = torch.Generator().manual_seed(m)
    sa, sb = torch.rand(m, 1, generator=g), torch.rand(72, 1, generator=g)
    bias_ = torch.randn(72, generator=g) if bias else None
    out = int8_scaled_mm(
        a, sa.to(DEVICE), b, sb.to(DEVICE), torch.float32,
        None if bias_ is None else bias_.to(DEVICE),
    )  # fmt: skip
    ref = int8_mm_ref(a, b).double() * sa.double().to(DEVICE) * sb.double().T.to(DEVICE)
    if bias_ is not None:
        ref = ref + bias_.double().to(DEVICE)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_int8_scaled_mm_refuses_mismatched_operands():
    a, b = int8_pair(2, 8, 64, seed=0)
    one = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="int8"):
        int8_scaled_mm(a[:, :32], one[:2, None], b, one, torch.float32)
    with pytest.raises(ValueError, match="int8"):
        int8_scaled_mm(a.float(), one[:2, None], b, one, torch.float32)


def test_configs_grow_with_the_rows():
    tiles = [int8_mm_config(m)[0] for m in (1, 16, 17, 128, 129, 4096)]
    assert tiles == sorted(tiles) and tiles[0] <= 16 and tiles[-1] >= 64


@on_gpu
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_llama_8b_shapes_in_bf16(m, n, k):
    a, b = int8_pair(m, n, k, seed=m)
    g = torch.Generator().manual_seed(m)
    sa, sb = torch.rand(m, 1, generator=g) / 100, torch.rand(n, generator=g) / 100
    out = int8_scaled_mm(a, sa.cuda(), b, sb.cuda(), torch.bfloat16)
    ref = torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 32)), b.T)[:m]
    ref = ref.double() * sa.double().cuda() * sb.double().cuda()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 4e-3  # bf16's rounding of the output


@on_gpu
@pytest.mark.parametrize("cls", [Int8Linear, Fp8Linear])
def test_fused_layers_equal_their_cpu_reference(cls):
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(768, 304)  # cuBLAS's FP8 product wants N % 16 == 0
    linear.weight.data = torch.randn(304, 768, generator=g) / 30
    linear.bias.data = torch.randn(304, generator=g)
    layer = cls.from_linear(linear)
    x = torch.randn(2, 7, 768, generator=g)
    ref = layer(x)  # the CPU path: quantize_int8 / quantize_fp8, then the product
    out = layer.cuda()(x.cuda()).cpu()
    assert out.shape == ref.shape == (2, 7, 304)
    # the same codes and scales; int8 sums exactly, _scaled_mm writes bf16
    tol = 1e-5 if cls is Int8Linear else 1e-2
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
