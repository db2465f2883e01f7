"""Chapter 14's skinny matrix product against F.linear, and chapter 13's one-kernel
cache write against chapter 3's.

On a CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) in float32, at
small sizes whose N and K are not multiples of the tiles, so every mask is exercised; on
a GPU also in bfloat16 at the projection shapes of Qwen3-0.6B and Llama-3.2-1B.
"""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from helpers import assert_replays_equal  # noqa: E402

from minillm.kernels import skinny_gemm  # noqa: E402
from minillm.kernels.reshape_and_cache import triton_reshape_and_cache  # noqa: E402
from minillm.kernels.skinny_gemm import default_config, linear, skinny_linear  # noqa: E402
from minillm.kv_cache import reshape_and_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative to max |reference|


def make(M, N, K, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    return x, w


def check(y, x, w):
    ref = x.double() @ w.double().T
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[x.dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("M", [1, 2, 3, 5, 16])
def test_default_configuration(M):
    for N, K in ((70, 200), (33, 1100)):  # the second splits K (K > 1024, few bands)
        x, w = make(M, N, K, seed=M)
        check(skinny_linear(x, w), x, w)


# both multiply paths; split-K with a partial last step; more splits asked than K steps;
# block_n > N
CONFIGS = [
    (1, 45, 130, dict(use_dot=False, block_n=16, block_k=32, split_k=1)),
    # 5 K steps: slices of 2, 2, 1
    (1, 45, 130, dict(use_dot=False, block_n=16, block_k=32, split_k=4)),
    (4, 45, 130, dict(use_dot=False, block_n=32, block_k=64, split_k=2)),
    # M not a power of two
    (3, 33, 100, dict(use_dot=False, block_n=64, block_k=32, split_k=3)),
    (1, 45, 130, dict(use_dot=True, block_n=16, block_k=32, split_k=1)),
    (7, 45, 130, dict(use_dot=True, block_n=32, block_k=32, split_k=4)),
    # 5 K steps, 8 asked: 5 slices
    (16, 20, 70, dict(use_dot=True, block_n=16, block_k=16, split_k=8)),
    # one K step: no split
    (2, 50, 48, dict(use_dot=True, block_n=64, block_k=64, split_k=4)),
]


@pytest.mark.parametrize("M,N,K,knobs", CONFIGS)
def test_configurations(M, N, K, knobs):
    x, w = make(M, N, K)
    check(skinny_linear(x, w, **knobs), x, w)


def test_strided_inputs_and_counters_left_at_zero():
    base = torch.randn(12, 150).to(DEVICE)
    w = (torch.randn(40, 100) / 10).to(DEVICE)
    rows = base[::3, 7:107]  # 4 rows with a row stride of 450
    for _ in range(2):  # the second call must find the split-K counters at zero again
        check(skinny_linear(rows, w, block_k=32, split_k=3), rows, w)
    # stride 3 along K: copied to contiguous first
    cols = torch.randn(100, 3).to(DEVICE).T
    check(skinny_linear(cols, w, block_k=32), cols, w)
    assert all(int(c.abs().sum()) == 0 for c in skinny_gemm._COUNTERS.values())


def test_bad_shapes_are_refused():
    x, w = make(17, 8, 32)
    with pytest.raises(ValueError, match="1..16"):
        skinny_linear(x, w)
    with pytest.raises(ValueError):
        skinny_linear(x[:2], w[:, :16])


def test_default_configuration_follows_the_sweep():
    assert default_config(2, 1024, 2048) == dict(
        use_dot=False,
        block_n=16,
        block_k=256,
        num_stages=3,
        split_k=4,
        # Qwen3-0.6B o_proj: 64 bands, K split in 4
        num_warps=4,
    )
    # Llama gate_up: 1024 bands already
    assert default_config(2, 16384, 2048)["split_k"] == 1
    assert default_config(2, 4096, 1024)["split_k"] == 1  # short K is never split
    # one row: bands of 4, one step of at most 1024 columns per program
    assert default_config(1, 1024, 2048) == dict(
        use_dot=False, block_n=4, block_k=1024, num_stages=1, split_k=2, num_warps=4
    )
    assert default_config(1, 1024, 3072)["split_k"] == 3
    assert default_config(1, 4096, 1024)["split_k"] == 1
    assert default_config(1, 70, 200)["block_k"] == 256
    assert (
        default_config(3, 1024, 1024)["use_dot"]
        and not default_config(2, 1024, 1024)["use_dot"]
    )


def test_linear_and_the_operator_under_torch_compile():
    x, w = make(3, 40, 64)
    bias = torch.randn(40).to(DEVICE)
    x3 = torch.randn(2, 3, 64).to(DEVICE)
    torch.testing.assert_close(
        linear(x3, w, bias), F.linear(x3, w, bias), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        linear(torch.randn(40, 64).to(DEVICE), w).shape, torch.Size([40, 40])
    )
    compiled = torch.compile(
        lambda a, b: torch.ops.minillm.linear(a, b) * 2,
        backend="aot_eager",
        fullgraph=True,
    )
    torch.testing.assert_close(compiled(x, w), 2 * F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(
        torch.ops.minillm.linear.default,
        (x, w),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("M,N,K,knobs", CONFIGS[::2])
def test_gated_load_is_silu_mul_then_the_product(M, N, K, knobs):
    gate_up, w = make(M, N, 2 * K)[0], make(M, N, K, seed=1)[1]
    ref = F.linear(skinny_gemm.silu_mul(gate_up), w)
    got = skinny_linear(gate_up, w, gated=True, **knobs)
    check(got, skinny_gemm.silu_mul(gate_up), w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gated: 2K"):
        skinny_linear(gate_up[:, :K], w, gated=True)


def test_silu_and_linear_and_its_operator():
    gate_up, w = make(3, 40, 128)[0], make(3, 40, 64, seed=1)[1]
    expected = F.linear(skinny_gemm.silu_mul(gate_up), w)
    torch.testing.assert_close(
        skinny_gemm.silu_and_linear(gate_up, w), expected, rtol=1e-5, atol=1e-5
    )
    wide = torch.randn(2, 20, 128).to(DEVICE)  # 40 rows: PyTorch's arithmetic
    torch.testing.assert_close(
        skinny_gemm.silu_and_linear(wide, w),
        F.linear(skinny_gemm.silu_mul(wide), w),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.library.opcheck(
        torch.ops.minillm.silu_and_linear.default,
        (gate_up, w),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("M,N,K,knobs", CONFIGS[::2] + CONFIGS[1::4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_normed_load_is_chapter_1_norm_then_the_product(M, N, K, knobs, with_residual):
    """norm=: the product of RMSNorm(residual + x), and the sum stored exactly."""
    x, w = make(M, N, K)
    residual = make(M, N, K, seed=2)[0] if with_residual else None
    g = torch.rand(K, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5
    sums = torch.full_like(x, float("nan"))
    got = skinny_linear(x, w, norm=(g, 1e-6, residual, sums), **knobs)
    s = x if residual is None else residual + x
    assert torch.equal(sums, s)
    check(got, skinny_gemm.rms_norm(s, g, 1e-6), w)
    with pytest.raises(ValueError):
        skinny_linear(x, w, gated=True, norm=(g, 1e-6, residual, sums))


def test_rms_norm_linear_and_its_operator():
    x, w = make(3, 40, 64)
    residual = make(3, 40, 64, seed=1)[0]
    g = torch.rand(64).to(DEVICE) + 0.5
    for r in (None, residual):
        s = x if r is None else r + x
        y, got_s = skinny_gemm.rms_norm_linear(x, r, g, 1e-6, w)
        assert torch.equal(got_s, s)
        expected = F.linear(skinny_gemm.rms_norm(s, g, 1e-6), w)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    wide = torch.randn(2, 20, 64).to(DEVICE)  # 40 rows: PyTorch's arithmetic
    y, s = skinny_gemm.rms_norm_linear(wide, None, g, 1e-6, w)
    assert s is wide and torch.equal(
        y, F.linear(skinny_gemm.rms_norm(wide, g, 1e-6), w)
    )
    torch.library.opcheck(
        torch.ops.minillm.rms_norm_linear.default,
        (x, residual, g, 1e-6, w),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 at real sizes needs a GPU")
@pytest.mark.parametrize(
    "N,K",
    [
        (4096, 1024),
        (1024, 2048),
        (6144, 1024),
        (1024, 3072),
        (16384, 2048),
        (2048, 8192),
    ],
)
def test_bf16_projection_shapes_on_gpu(N, K):
    for M in (1, 2, 4, 8, 16):
        x, w = make(M, N, K, torch.bfloat16, seed=M)
        check(skinny_linear(x, w), x, w)
        check(linear(x, w), x, w)
        gate_up = make(M, N, 2 * K, torch.bfloat16, seed=M + 1)[0]
        act = skinny_gemm.silu_mul(gate_up)  # PyTorch's bf16 activation
        check(skinny_linear(gate_up, w, gated=True), act, w)
        residual = make(M, N, K, torch.bfloat16, seed=M + 2)[0]
        g = (torch.rand(K, device=DEVICE) + 0.5).to(torch.bfloat16)
        sums = torch.empty_like(x)
        y = skinny_linear(x, w, norm=(g, 1e-6, residual, sums))
        assert torch.equal(sums, residual + x)  # PyTorch's bf16 sum
        check(y, skinny_gemm.rms_norm(residual + x, g, 1e-6), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_matches_chapter_2(dtype):
    g = torch.Generator().manual_seed(0)
    # 9 tokens, 4 KV heads of 20; v is a strided slice
    qkv = torch.randn(9, 3 * 4 * 20, generator=g).to(DEVICE)
    key, value = qkv[:, 80:160].reshape(9, 4, 20).clone(), qkv[:, 160:].view(9, 4, 20)
    slots = torch.randperm(6 * 3, generator=g)[:9].to(DEVICE)
    caches = [
        torch.full((6, 3, 4, 20), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)
    ]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    triton_reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # nothing to write
    triton_reshape_and_cache(key[:0], value[:0], caches[2], caches[3], slots[:0])
    assert torch.equal(caches[0], caches[2])
    with pytest.raises(ValueError, match="do not fit"):
        triton_reshape_and_cache(key[:, :3], value[:, :3], caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2])  # refused before anything was written


@pytest.mark.skipif(
    DEVICE != "cuda", reason="programmatic dependent launch needs a GPU"
)
@pytest.mark.parametrize("pdl", [1, 2])
def test_dependent_launch_in_a_graph_gives_the_same_bits(pdl):
    """A chain of products that each read the previous one's output, captured in a
    CUDA graph: launched early (PDL), every product still waits for its input."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 1024, False), (1024, 2048, False), (6144, 1024, False),
              (1024, 3072, True)] * 3  # fmt: skip
    ws = [(torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
          for N, K, _ in shapes]  # fmt: skip
    x0 = torch.randn(1, 1024, generator=g).to(DEVICE, torch.bfloat16)

    def chain(knobs):
        h = x0 * 1.0
        for (_, _, gated), w in zip(shapes, ws):
            h = skinny_linear(h[:, : 2 * w.shape[1] if gated else w.shape[1]], w,
                              gated=gated, **knobs)  # fmt: skip
            h = h / h.float().norm().to(h.dtype)  # a kernel in between
        return h

    expected = chain({"pdl": 0})
    assert torch.equal(chain({"pdl": pdl}), expected)  # eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain({"pdl": pdl})
    assert_replays_equal(graph, out, expected)
    # back to back, no kernel in between
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = x0 * 1.0
        for (_, _, gated), w in zip(shapes, ws):
            h = skinny_linear(h[:, : 2 * w.shape[1] if gated else w.shape[1]], w,
                              gated=gated, pdl=pdl)  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    h0 = x0 * 1.0
    for (_, _, gated), w in zip(shapes, ws):
        h0 = skinny_linear(h0[:, : 2 * w.shape[1] if gated else w.shape[1]], w,
                           gated=gated)  # fmt: skip
    assert torch.equal(h, h0)
