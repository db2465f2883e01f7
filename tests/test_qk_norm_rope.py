"""Chapter 15's q/k norm, rotation and cache write in one kernel against the steps it
stands for: FusedAttention's stacked norm and apply_rope, then chapter 3's
reshape_and_cache.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) in float32; on a
GPU also in bfloat16, and inside the fused layers of a model generating through a paged
cache.
"""

import copy

import pytest
import torch

triton = pytest.importorskip("triton")

from minillm.attention import generate_paged  # noqa: E402
from minillm.kernels.qk_norm_rope import qk_norm_rope_write  # noqa: E402
from minillm.kv_cache import reshape_and_cache  # noqa: E402
from minillm.model import RMSNorm, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(qkv, norm, cos, sin, caches, slots, n_heads, n_kv, D):
    T = qkv.shape[0]
    qk = qkv[:, : (n_heads + n_kv) * D].view(T, n_heads + n_kv, D)
    v = qkv[:, (n_heads + n_kv) * D :].view(T, n_kv, D)
    if norm is not None:
        qk = norm(qk)
    qk = apply_rope(qk, cos, sin)
    q, k = qk.split([n_heads, n_kv], dim=-2)
    reshape_and_cache(k, v, *caches, slots)
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 4])  # 4: a tile of tokens, the last one partial
def test_one_kernel_matches_norm_rotation_and_cache_write(dtype, with_norm, tokens):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bfloat16 runs on the GPU")
    n_heads, n_kv, D, T = 4, 2, 32, 5
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (n_heads + 2 * n_kv) * D, generator=g).to(DEVICE, dtype)
    norm = None
    if with_norm:
        norm = RMSNorm(D, eps=1e-6)
        norm.weight.data = torch.rand(n_heads + n_kv, D, generator=g) + 0.5
        norm = norm.to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 3, 100, 2048]).to(DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = positions.float()[:, None] * inv_freq.to(DEVICE)
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([9, 0, 17, 4, 30]).to(DEVICE)
    ref_caches = [torch.zeros(8, 4, n_kv, D, dtype=dtype, device=DEVICE) for _ in "kv"]
    caches = [c.clone() for c in ref_caches]
    with torch.no_grad():
        expected = reference(qkv, norm, cos, sin, ref_caches, slots, n_heads, n_kv, D)
    weight = None if norm is None else norm.weight
    q = qk_norm_rope_write(
        qkv, weight, 1e-6, cos, sin, *caches, slots, n_heads, tokens=tokens
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 1/rms: its own order of sums
    assert (q.float() - expected.float()).abs().max() <= tol
    assert (caches[0].float() - ref_caches[0].float()).abs().max() <= tol
    assert torch.equal(caches[1], ref_caches[1])  # values are copied
    with pytest.raises(ValueError, match="does not fit"):
        qk_norm_rope_write(qkv[:, 1:], weight, 1e-6, cos, sin, *caches, slots, n_heads)


def test_fused_layers_generate_chapter_1_tokens_through_it(tiny, monkeypatch):
    """generate_paged through a paged cache: the fused layers take the one-kernel
    path (on a CPU only when told to) and produce the merged model's tokens."""
    from minillm import fused_layers
    from minillm.fused_layers import fuse_layers
    from minillm.kv_cache import PagedKVCache
    from minillm.merged_projections import merge_projections

    model = copy.deepcopy(tiny[0]).to(DEVICE)
    merge_projections(model)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused)
    if DEVICE == "cpu":  # the interpreter, where a GPU would take it by itself
        monkeypatch.setattr(
            fused_layers, "can_attend_rotated", lambda kv, *_: type(kv) is PagedKVCache
        )
    calls, real = [], fused_layers.qk_norm_rope_write
    monkeypatch.setattr(
        fused_layers, "qk_norm_rope_write", lambda *a: calls.append(1) or real(*a)
    )
    prompts = [[1, 5, 6, 7], [2, 9], [3, 11, 12, 13, 14, 15, 16, 17, 18]]
    got = generate_paged(fused, prompts, 6)
    assert calls  # the one-kernel path ran
    assert got == generate_paged(model, prompts, 6)
