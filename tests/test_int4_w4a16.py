"""Chapter 17's one kernel for every M (w4a16_matmul) and the layout it reads
(shuffle_int4), against the reference (chapters/17_int4_gemm.md, "One kernel for
every M").

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) in float32 and
float16 at small sizes; on a GPU also in bfloat16 at the Llama-3.1-8B projections, for
every M the engine sends it, through int4_linear as Int4Linear calls it.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from test_int4_gemm import DEVICE, check, on_gpu  # noqa: E402
from test_int4_gemm import make as make_rtn  # noqa: E402

from minillm.int4 import (  # noqa: E402
    Int4Linear,
    Int4Weight,
    pack_int4,
    quantize_rtn,
    shuffle_int4,
    unpack_int4,
)
from minillm.kernels.int4_gemm import (  # noqa: E402
    int4_linear,
    w4a16_config,
    w4a16_matmul,
    w4a16_split,
)


def make(M, N, K, group, dtype=torch.float32, seed=0):
    """x, the weight in pack_int4's layout, the same in the kernel's layout."""
    x, w = make_rtn(M, N, K, group, dtype, seed)
    return x, w, Int4Weight(shuffle_int4(w.qweight), w.scales, w.zeros, group)


def test_shuffle_puts_channel_16j_plus_i_in_nibble_j_of_word_row_i():
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    kernel = unpack_int4(shuffle_int4(pack_int4(codes)))  # (N, K): 8i + j ordered
    for block in (0, 1):
        for i in range(16):
            for j in range(8):
                got = kernel[:, 128 * block + 8 * i + j]
                assert torch.equal(got, codes[:, 128 * block + 16 * j + i])
    assert torch.equal(shuffle_int4(shuffle_int4(pack_int4(codes)), inverse=True),
                       pack_int4(codes))  # fmt: skip


def test_shuffle_needs_k_a_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        shuffle_int4(pack_int4(torch.zeros(2, 64, dtype=torch.uint8)))


def test_int4_linear_keeps_the_kernel_layout_and_gives_the_weight_back(monkeypatch):
    monkeypatch.setattr(Int4Linear, "KERNEL_LAYOUT", True)
    _, w, ws = make(1, 24, 256, 64)
    layer = Int4Linear.from_weight(w)
    assert layer.shuffled and torch.equal(layer.qweight, ws.qweight)
    assert torch.equal(layer.weight_int4.qweight, w.qweight)
    w96 = quantize_rtn(torch.randn(24, 192), 64)  # K = 192: pack_int4's layout stays
    layer = Int4Linear.from_weight(w96)
    assert not layer.shuffled and torch.equal(layer.qweight, w96.qweight)


# (M, N, K, group, knobs): the CUDA cores for 1 and 2 rows, tl.dot from 3; a partial
# last N tile; more splits asked than steps; groups that end inside a step (48, 64)
# and groups of several steps (256); an M over one tile
CONFIGS = [
    (1, 45, 256, 128, dict(split_k=1)),
    (2, 40, 512, 256, dict(split_k=2)),
    (1, 33, 384, 48, dict(dot=False, block_m=1, block_n=32, split_k=8)),
    (3, 45, 256, 128, dict(split_k=2)),
    (5, 40, 256, 64, dict(block_n=32, split_k=1)),
    (17, 33, 256, 128, dict(block_m=16, block_n=32, split_k=2)),
    (4, 40, 384, 48, dict(fold=False, block_n=32, split_k=2)),  # scale per weight
    (20, 40, 256, 128, dict(fold=False, block_m=16, block_n=32)),
]


@pytest.mark.parametrize("M,N,K,group,knobs", CONFIGS)
def test_w4a16_matches_reference(M, N, K, group, knobs):
    x, w, ws = make(M, N, K, group, seed=M)
    check(w4a16_matmul(x, ws, **knobs), x, w)
    if group % 128 == 0:  # the same loop on pack_int4's layout
        check(w4a16_matmul(x, w, shuffled=False, **knobs), x, w)


@pytest.mark.parametrize("dot", [False, True])
def test_float16_magic_bits_in_both_ways_of_multiplying(dot):
    """fp16: 1024 + c for tl.dot, 128 + c in float32 for the CUDA cores."""
    x, w, ws = make(2, 40, 256, 128, dtype=torch.float16)
    check(w4a16_matmul(x, ws, dot=dot, block_m=16 if dot else 2), x, w)


def test_split_k_counters_are_reset_and_int4_linear_runs_the_kernel():
    x, w, ws = make(3, 40, 512, 128)
    first = w4a16_matmul(x, ws, split_k=4)
    assert torch.equal(w4a16_matmul(x, ws, split_k=4), first)
    y = int4_linear(x.reshape(1, 3, 512), ws, shuffled=True)
    assert torch.equal(y.reshape(3, 40), w4a16_matmul(x, ws))
    assert int4_linear(x[:0], ws, shuffled=True).shape == (0, 40)


@pytest.mark.parametrize("M", [17, 70])  # int4_matmul; dequantize-then-cuBLAS
def test_more_rows_than_w4a16_takes_read_the_kernel_layout_elsewhere(M):
    from minillm.kernels.int4_gemm import (
        FUSED_MAX_M,
        W4A16_MAX_M,
        dequantize_int4,
        int4_matmul,
    )

    assert W4A16_MAX_M < 17 <= FUSED_MAX_M < 70
    x, w, ws = make(M, 40, 256, 64)
    assert torch.equal(dequantize_int4(ws, shuffled=True), dequantize_int4(w))
    check(int4_matmul(x, ws, shuffled=True), x, w)
    check(int4_linear(x, ws, shuffled=True), x, w)


def test_bad_input_is_a_clear_error():
    x, w, ws = make(2, 32, 256, 128)
    with pytest.raises(ValueError, match="does not fit"):
        w4a16_matmul(x[:, :128], ws)
    with pytest.raises(ValueError, match="cast one"):
        w4a16_matmul(x.double(), ws)
    _, w48, _ = make(2, 32, 384, 48)
    with pytest.raises(ValueError, match="group size"):
        w4a16_matmul(torch.zeros(2, 384, device=DEVICE), w48, shuffled=False)


def test_config_picks_the_cuda_cores_for_few_rows_and_fills_the_gpu():
    assert not w4a16_config(1, 4096, 14336)["dot"]
    assert w4a16_config(8, 4096, 14336)["fold"]
    assert not w4a16_config(256, 4096, 4096)["fold"]
    assert w4a16_config(3, 4096, 14336)["dot"] and w4a16_config(256, 4096, 4096)["dot"]
    cfg = w4a16_config(1, 4096, 14336)  # Llama-3.1-8B's down_proj
    split = w4a16_split(1, 4096, 14336, cfg["block_m"], cfg["block_n"], 132)
    assert split > 1 and -(-4096 // cfg["block_n"]) * split >= 132


@on_gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 16, 32, 64, 65, 128, 256])
@pytest.mark.parametrize(
    "N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
)
def test_llama_8b_shapes_in_bf16(M, N, K):
    x, w, ws = make(M, N, K, 128, dtype=torch.bfloat16, seed=M)
    check(int4_linear(x, ws, shuffled=True), x, w)


@on_gpu
@pytest.mark.parametrize("M", [1, 3, 16, 200])
@pytest.mark.parametrize("group", [48, 64, 256])
def test_other_groups_in_bf16(M, group):
    x, w, ws = make(M, 4096, 3 * 128 * group // 16, group, dtype=torch.bfloat16)
    check(int4_linear(x, ws, shuffled=True), x, w)
