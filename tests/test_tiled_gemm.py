"""Chapter 10's tiled product for a batch of decode rows, with its three prologues,
against F.linear, chapter 1's norm and the MLP's activation; and the functions that
route TILED_ROWS rows to it.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) in float32, at
sizes that are not multiples of the tiles; on a GPU also in bfloat16 at Qwen3-0.6B's
projection shapes and batch sizes, and inside the fused layers.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from minillm.kernels import skinny_gemm, tiled_gemm  # noqa: E402
from minillm.kernels.tiled_gemm import (  # noqa: E402
    batched_linear,
    batched_rms_norm_linear,
    batched_silu_linear,
    tiled_config,
    tiled_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to max |reference|


def make(M, N, K, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(M, K, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    gn = (1 + 0.2 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    return x, r, w, gn


def close(y, ref):
    assert y.shape == ref.shape
    err = ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err <= TOL[y.dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize(
    "M, N, K, knobs",
    [
        (40, 48, 80, (32, 32, 32, 4, 2)),  # M, N and K past the tiles' multiples
        (17, 70, 64, (16, 64, 64, 4, 2)),
        (64, 32, 96, (64, 32, 32, 4, 3)),
    ],
)
def test_the_three_prologues_match_their_references(M, N, K, knobs):
    x, r, w, gn = make(M, N, K)
    close(tiled_linear(x, w, knobs=knobs), F.linear(x, w))
    sums = torch.empty_like(x)
    got = tiled_linear(x, w, 1, (gn, 1e-6, r, sums), knobs)
    assert torch.equal(sums, r + x)  # the residual sums, for the next layer
    close(got, F.linear(skinny_gemm.rms_norm(r + x, gn, 1e-6), w))
    gate_up = torch.cat([x, r], dim=1)
    close(
        tiled_linear(gate_up, w, 2, knobs=knobs),
        F.linear(skinny_gemm.silu_mul(gate_up), w),
    )


def test_the_operators_schemas_and_shapes():
    x, r, w, gn = make(20, 24, 64)
    for op, args in (
        (torch.ops.minillm.tiled_linear.default, (x, w, 0)),
        (torch.ops.minillm.tiled_rms_norm_linear.default, (x, r, gn, 1e-6, w)),
        (torch.ops.minillm.tiled_rms_norm_linear.default, (x, None, gn, 1e-6, w)),
    ):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_knobs_by_rows():
    assert tiled_config(17) == tiled_gemm.TILED_KNOBS[0][1]
    assert tiled_config(256) == tiled_gemm.TILED_KNOBS[-1][1]
    assert tiled_config(4096) == tiled_gemm.TILED_KNOBS[-1][1]


def test_routing_by_rows(monkeypatch):
    """TILED_ROWS rows on a GPU go to tiled_linear; everything else to chapter 10's
    linear, silu_and_linear and rms_norm_linear, with their results."""
    monkeypatch.setattr(tiled_gemm, "TILED_ROWS", (17, 256))
    calls = []
    real = tiled_gemm.tiled_linear
    monkeypatch.setattr(
        tiled_gemm,
        "tiled_linear",
        lambda *a, **k: calls.append(a[2:3]) or real(*a, **k),
    )
    for M in (3, 20, 300):
        x, r, w, gn = make(M, 24, 64, seed=M)
        calls.clear()
        close(batched_linear(x, w), F.linear(x, w))
        close(batched_silu_linear(torch.cat([x, r], 1), w),
              F.linear(skinny_gemm.silu_mul(torch.cat([x, r], 1)), w))  # fmt: skip
        for residual in (None, r):
            s = x if residual is None else residual + x
            y, got_s = batched_rms_norm_linear(x, residual, gn, 1e-6, w)
            assert torch.equal(got_s, s)
            close(y, F.linear(skinny_gemm.rms_norm(s, gn, 1e-6), w))
        tiled = DEVICE == "cuda" and M == 20
        assert calls == ([(0,), (2,), (1,), (1,)] if tiled else [])


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 at real sizes needs a GPU")
@pytest.mark.parametrize(
    "N, K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
)
@pytest.mark.parametrize("M", [17, 64, 129, 256])
def test_bf16_projection_shapes_on_gpu(N, K, M):
    x, r, w, gn = make(M, N, K, torch.bfloat16, seed=N + M)
    close(tiled_linear(x, w), F.linear(x, w))
    sums = torch.empty_like(x)
    got = tiled_linear(x, w, 1, (gn, 1e-6, r, sums))
    assert torch.equal(sums, r + x)
    close(got, F.linear(skinny_gemm.rms_norm(r + x, gn, 1e-6), w))
    gate_up = torch.cat([x, r], 1)
    close(tiled_linear(gate_up, w, 2), F.linear(skinny_gemm.silu_mul(gate_up), w))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tiled path runs on a GPU only")
def test_fused_layers_on_a_batch_take_the_tiled_product(tiny, monkeypatch):
    """A decode batch of 40 rows through the fused layers, tiled against cuBLAS."""
    from minillm.fused_layers import fuse_layers
    from minillm.merged_projections import merge_projections

    model = copy.deepcopy(tiny[0]).to(DEVICE, torch.bfloat16)
    merge_projections(model)
    fuse_layers(model)
    ids = torch.arange(40, device=DEVICE)[:, None] * 7 % model.config.vocab_size
    positions = torch.arange(40, device=DEVICE)[:, None] % 13
    with torch.no_grad():
        expected = model(ids, positions)
        monkeypatch.setattr(tiled_gemm, "TILED_ROWS", (17, 256))
        got = model(ids, positions)
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err.item() < 3e-2
