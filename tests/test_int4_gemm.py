"""Chapter 17's fused W4A16 kernel and its dequantize kernel against the reference
(chapters/17_int4_gemm.md, "The kernel").

On a CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) in float32, at
small sizes whose N is not a multiple of the tiles, so every mask is exercised; on a GPU
also in bfloat16 at the projection shapes of Llama-3.1-8B, and through the engine with
CUDA graphs and the persistent batch.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from minillm.int4 import int4_linear_ref, quantize_rtn  # noqa: E402
from minillm.kernels.int4_gemm import (  # noqa: E402
    FUSED_MAX_M,
    GEMV_MAX_M,
    default_config,
    dequantize_int4,
    gemv_config,
    int4_gemv,
    int4_linear,
    int4_matmul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative to max |reference|
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")


def make(M, N, K, group, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = quantize_rtn((torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype), group)
    return x, w


def check(y, x, w):
    ref = x.double() @ w.dequantize(torch.float64).T  # the weights exactly
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[x.dtype], f"relative error {err:.2e}"


# (M, N, K, group, knobs): split-K with more splits asked than K steps, a partial
# last N tile, both unpacking ways, a row count over one M tile, groups of 32
CONFIGS = [
    (1, 45, 256, 128, dict(split_k=1)),
    (3, 45, 256, 64, dict(split_k=8, block_k=64)),  # 4 K steps: 4 slices
    (5, 70, 256, 32, dict(gather=False, block_k=32, block_n=32, split_k=2)),
    (17, 33, 128, 128, dict(block_m=16, block_n=32, split_k=1)),  # two M tiles
    (20, 64, 256, 128, dict(block_m=32, gather=False, split_k=2)),
    (4, 45, 256, 128, dict(fold=False, split_k=2)),  # scale and zero per weight
    (4, 45, 256, 64, dict(fold=False, gather=True, block_k=64)),
]


@pytest.mark.parametrize("M,N,K,group,knobs", CONFIGS)
def test_kernel_matches_reference(M, N, K, group, knobs):
    x, w = make(M, N, K, group, seed=M)
    check(int4_matmul(x, w, **knobs), x, w)


# every group size the engine accepts, a multiple of 16, runs through every kernel at
# its default knobs: the tile along K is the largest power of two dividing the group
# (48, 80, 96, 112 in tiles of 16; 192 in tiles of 64)
@pytest.mark.parametrize("group", [*range(16, 257, 16), 384])
def test_every_accepted_group_size_runs_through_the_kernels(group):
    from minillm.config import EngineConfig

    EngineConfig(quantization="int4", int4_group_size=group)  # accepted
    x, w = make(3, 40, 2 * group, group, seed=group)
    check(int4_matmul(x, w), x, w)
    check(int4_matmul(x, w, fold=True, split_k=2), x, w)
    check(int4_gemv(x, w), x, w)
    assert torch.equal(dequantize_int4(w), w.dequantize().T)


@pytest.mark.parametrize("fold", [True, False])
def test_float16_and_its_magic_bits(fold):
    """fp16 codes as 1024 + c from their bits (the interpreter runs float16; bf16's
    128 + c is checked on the GPU)."""
    x, w = make(3, 40, 256, 128, dtype=torch.float16)
    check(int4_matmul(x, w, fold=fold), x, w)


# (M, N, K, group, knobs) for the GEMV: a partial last N tile, several rows (a program
# each), more splits asked than K steps, groups of 32, one step per slice
GEMV_CONFIGS = [
    (1, 45, 256, 128, dict(split_k=1)),
    (3, 45, 256, 64, dict(split_k=8, block_k=32)),  # 8 K steps: 8 slices
    (2, 70, 256, 32, dict(block_n=32, split_k=2)),
    (8, 33, 128, 128, dict(block_n=64, split_k=1)),
    (16, 64, 512, 128, dict(block_k=16, split_k=4)),
]


@pytest.mark.parametrize("M,N,K,group,knobs", GEMV_CONFIGS)
def test_gemv_matches_reference(M, N, K, group, knobs):
    x, w = make(M, N, K, group, seed=M)
    check(int4_gemv(x, w, **knobs), x, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_in_16_bit_floats(dtype):
    x, w = make(3, 40, 256, 128, dtype=dtype)
    check(int4_gemv(x, w, split_k=2), x, w)


def test_gemv_config_splits_k_to_fill_the_gpu():
    down = gemv_config(1, 4096, 14336, 128)  # Llama-3.1-8B's down_proj
    tiles = -(-4096 // down["block_n"])
    assert down["split_k"] > 1 and tiles * down["split_k"] >= 2 * 132
    assert gemv_config(3, 64, 256, 32)["block_k"] <= 32
    assert gemv_config(1, 28672, 4096, 128)["block_n"] > down["block_n"]  # wide


def test_gemv_codes_become_floats_from_their_bits():
    """The kernel's float32 2**23 + c, made by or-ing c into 2**23's bits, is exact."""
    from minillm.kernels.int4_gemm import FLOAT_2_23

    codes = torch.arange(16, dtype=torch.int32)
    floats = (codes | FLOAT_2_23.value).view(torch.float32) - 2.0**23
    assert torch.equal(floats, codes.float())


def test_int4_linear_takes_the_gemv_up_to_gemv_max_m():
    M = max(GEMV_MAX_M, 1)  # 0: the GEMV is off, and the tl.dot kernel runs
    x, w = make(M, 40, 256, 128)
    path = int4_gemv if M <= GEMV_MAX_M else int4_matmul
    assert torch.equal(int4_linear(x, w), path(x, w))


def test_split_k_counters_are_reset_between_launches():
    x, w = make(2, 40, 512, 128)
    first = int4_matmul(x, w, split_k=4)
    assert torch.equal(int4_matmul(x, w, split_k=4), first)
    first = int4_gemv(x, w, split_k=4)
    assert torch.equal(int4_gemv(x, w, split_k=4), first)


def test_dequantize_kernel_is_exact():
    _, w = make(1, 100, 256, 64)
    assert torch.equal(dequantize_int4(w), w.dequantize().T)


def test_bad_input_is_a_clear_error():
    x, w = make(2, 32, 256, 128)
    with pytest.raises(ValueError, match="does not fit"):
        int4_matmul(x[:, :128], w)
    with pytest.raises(ValueError, match="cast one"):
        int4_matmul(x.double(), w)
    with pytest.raises(ValueError, match="divide the group"):
        int4_matmul(
            x, quantize_rtn(torch.randn(32, 256, device=DEVICE), 32), block_k=64
        )


def test_default_config_splits_k_only_when_the_output_is_narrow():
    narrow = default_config(1, 4096, 14336, 128)  # Llama-3.1-8B's down_proj
    wide = default_config(256, 28672, 4096, 128)  # gate_up_proj at a big batch
    assert narrow["split_k"] > 1 and wide["split_k"] == 1
    assert default_config(1, 64, 256, 32)["block_k"] <= 32


def test_int4_linear_picks_a_path_and_keeps_shapes():
    x, w = make(6, 40, 256, 128)
    bias = torch.randn(40, device=DEVICE)
    y = int4_linear(x.reshape(2, 3, 256), w, bias)
    assert y.shape == (2, 3, 40)
    expected = int4_linear_ref(x, w, bias).reshape(2, 3, 40)
    assert torch.allclose(y, expected, atol=1e-4)


@on_gpu
@pytest.mark.parametrize(
    "M", sorted({1, 2, GEMV_MAX_M or 1, 8, 16, 64, FUSED_MAX_M + 1, 256})
)
@pytest.mark.parametrize(
    "N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
)
def test_llama_8b_shapes_in_bf16(M, N, K):
    x, w = make(M, N, K, 128, dtype=torch.bfloat16, seed=M)
    check(int4_linear(x, w), x, w)


@on_gpu
@pytest.mark.parametrize("M", [1, 3, 16, 64, FUSED_MAX_M + 1])
@pytest.mark.parametrize("group", [48, 80, 96, 112, 192])
def test_groups_that_are_not_powers_of_two_in_bf16(M, group):
    x, w = make(M, 4096, 32 * group, group, dtype=torch.bfloat16, seed=group)
    check(int4_linear(x, w), x, w)  # the path the engine takes for M rows
    check(int4_matmul(x, w), x, w)  # the tl.dot kernel, folded from 64 rows on
    check(int4_gemv(x, w), x, w)


@on_gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_at_llama_8b_shapes_in_bf16(M, N, K):
    x, w = make(M, N, K, 128, dtype=torch.bfloat16, seed=M)
    check(int4_gemv(x, w), x, w)


@on_gpu
def test_cuda_graphs_and_persistent_batch_through_the_quantized_model(tiny):
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    common = dict(device="cuda", dtype=torch.float32, num_kv_blocks=256, max_num_seqs=4)
    common.update(quantization="int4", attention_backend="triton")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def ids(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    fast = LLM(**common, cuda_graphs=True, persistent_batch=True)
    assert fast.engine.model_runner.num_graph_steps == 0
    got = ids(fast)
    assert fast.engine.model_runner.num_graph_steps > 0, "decode steps replayed"
    plain = LLM(**common, cuda_graphs=False, persistent_batch=False)
    assert got == ids(plain)


@on_gpu
def test_no_rows_gives_no_rows():
    x, w = make(0, 256, 512, 128, dtype=torch.bfloat16, seed=0)
    assert int4_linear(x, w).shape == (0, 256)
