"""The FP8 KV cache (chapter 20, "An FP8 KV cache"): chapter 3's scaled write, chapter
5's reference and chapter 13's kernels reading the same FP8 cache, the engine's
kv_cache_dtype option, and swap.

On a CPU the Triton kernels run under TRITON_INTERPRET=1 (conftest.py), at tiny sizes.
"""

import pytest
import torch

from minillm.attention import generate_paged, paged_attention_ref
from minillm.config import EngineConfig
from minillm.kv_cache import (
    PagedKVCache,
    kv_cache_block_bytes,
    num_blocks_for_memory,
    quantize_kv,
    reshape_and_cache,
)
from minillm.llm import LLM
from minillm.model import ModelConfig, build_attention_metadata
from minillm.sampling_params import SamplingParams
from minillm.swap import Swapper

triton = pytest.importorskip("triton")

from minillm.kernels.paged_attention import triton_paged_attention  # noqa: E402
from minillm.kernels.reshape_and_cache import triton_reshape_and_cache  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantize_kv_rounds_within_e4m3_precision_and_clamps():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = torch.tensor(0.05)
    back = quantize_kv(x, FP8, scale).float() * scale
    normal = x.abs() / scale >= 2**-6  # E4M3's smallest normal number
    # 3 mantissa bits: round to nearest is off by at most half a step, 2**-4 relative
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-7)[normal].all()
    # below the normals, steps of 2**-9 (times the scale)
    assert ((back - x).abs() <= 2**-10 * scale + 1e-9)[~normal].all()
    big = torch.tensor([1e6, -1e6, 500.0])
    assert quantize_kv(big, FP8, 1.0).float().tolist() == [448.0, -448.0, 448.0]
    assert quantize_kv(x, torch.bfloat16, None).equal(x.to(torch.bfloat16))


def fp8_batch(query_lens, seq_lens, block_size, n_heads, n_kv, head_dim, seed=0):
    """q and an FP8 cache written from float32 K/V with scales; also the float32
    K/V cache the FP8 one approximates."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    shape = (num_blocks, block_size, n_kv, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g) / 2
    k_scale = (k.abs().amax() / 448).reshape(()).to(DEVICE)
    v_scale = (v.abs().amax() / 448).reshape(()).to(DEVICE)
    k, v = k.to(DEVICE), v.to(DEVICE)
    kc, vc = (
        torch.zeros(shape, dtype=FP8, device=DEVICE),
        torch.zeros_like(k, dtype=FP8),
    )
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    reshape_and_cache(k.flatten(0, 1), v.flatten(0, 1), kc, vc, slots, k_scale, v_scale)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=g).to(DEVICE)
    return q, (k, v), (kc, vc, k_scale, v_scale), md


def test_triton_write_matches_torch_write_byte_for_byte():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 3 * 2 * 24, generator=g).to(DEVICE) * 30
    k_scale = torch.tensor(0.0625, device=DEVICE)  # some keys clamp at 448
    v_scale = torch.tensor(0.5, device=DEVICE)
    if DEVICE == "cpu":
        # Triton's interpreter rounds float32 -> E4M3 wrongly where rounding carries
        # into the exponent (124 -> 64) and below the normals; the GPU's conversion
        # is exact. On the CPU: values E4M3 holds exactly once scaled (powers of two
        # as scales), and some past the range, so that the clamp and the slots are
        # checked, and the rounding only on a GPU.
        qkv[:, 48:96] = quantize_kv(qkv[:, 48:96], FP8, 1.0).float() * k_scale
        qkv[:, 96:] = quantize_kv(qkv[:, 96:], FP8, 1.0).float() * v_scale
        qkv[0, 48:52] = torch.tensor([1e4, -1e4, 40.0, -29.0])
    key, value = qkv[:, 48:96].view(7, 2, 24), qkv[:, 96:].view(7, 2, 24)
    slots = torch.randperm(20, generator=g)[:7].to(DEVICE)
    caches = [torch.zeros(5, 4, 2, 24, dtype=FP8, device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    triton_reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    as_bytes = [c.view(torch.uint8) for c in caches]
    assert as_bytes[0].equal(as_bytes[2]) and as_bytes[1].equal(as_bytes[3])
    assert (caches[0].float().abs() == 448).any()  # the clamp was exercised
    assert int((as_bytes[0] != 0).any(-1).any(-1).sum()) == 7


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [([1] * 5, [1, 17, 40, 3, 64]), ([5, 1, 12, 3], [5, 20, 30, 3])],
    ids=["decode", "prefill"],
)
@pytest.mark.parametrize("n_heads, n_kv", [(4, 4), (8, 2)])
def test_kernels_match_reference_on_the_same_fp8_cache(
    query_lens, seq_lens, n_heads, n_kv
):
    q, (k, v), (kc, vc, ks, vs), md = fp8_batch(
        query_lens, seq_lens, 5, n_heads, n_kv, 32
    )
    expected = paged_attention_ref(q, kc, vc, md, ks, vs)
    out = triton_paged_attention(q, kc, vc, md, k_scale=ks, v_scale=vs)
    assert (out - expected).abs().max() <= 1e-5
    # and the FP8 cache approximates the float32 one it was written from
    exact = paged_attention_ref(q, k, v, md)
    assert (expected - exact).abs().max() <= 0.1 * exact.abs().max()
    # without its scales the result is wrong: the scales are read
    unscaled = paged_attention_ref(q, kc, vc, md)
    assert (unscaled - exact).abs().max() > 0.1 * exact.abs().max()


def test_paged_cache_passes_its_scales_and_generation_stays_close(tiny):
    model = tiny[0]
    prompts = [[3, 17, 42, 8, 9, 100], [5, 6, 7], list(range(20, 45))]
    cache = PagedKVCache(model.config, 32, 4, paged_attention_ref, FP8)
    assert cache.scaled and cache.k_scale.shape == (model.config.num_hidden_layers,)
    assert not PagedKVCache(model.config, 2, 4).scaled
    seen = []

    def spy(q, kc, vc, md, **scales):
        seen.append(sorted(scales))
        return paged_attention_ref(q, kc, vc, md, **scales)

    cache.attn_backend = spy
    fp8 = generate_paged(model, prompts, 8, block_size=4, kv_cache=cache)
    assert seen and all(s == ["k_scale", "v_scale"] for s in seen)
    assert len(fp8) == 3 and all(len(o) == 8 for o in fp8)


def test_engine_sizes_blocks_by_the_cache_dtype_and_checks_the_option():
    config = ModelConfig(
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    bf16 = kv_cache_block_bytes(config, 16, torch.bfloat16)
    assert kv_cache_block_bytes(config, 16, FP8) * 2 == bf16
    gib = 1 << 30
    assert num_blocks_for_memory(config, 16, FP8, gib) == 2 * (gib // bf16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=16)


def test_engine_with_an_fp8_cache(tiny):
    bf16_block = kv_cache_block_bytes(tiny[0].config, 4, torch.bfloat16)
    budget = dict(cpu_kv_cache_bytes=100 * bf16_block)
    auto = LLM(**SMALL, **budget, dtype="bfloat16")
    fp8 = LLM(**SMALL, **budget, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.engine.kv_cache.key_cache.dtype == FP8
    blocks = fp8.engine.kv_cache.num_blocks
    assert blocks == 2 * auto.engine.kv_cache.num_blocks
    prompts = [[3, 17, 42, 8, 9, 100, 7], [5, 6, 7, 8], list(range(20, 45))]
    outs = fp8.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_swap_and_copy_on_write_move_fp8_blocks_as_bytes(tiny):
    cache = PagedKVCache(tiny[0].config, num_blocks=6, block_size=4, dtype=FP8)
    cache.key_cache.view(torch.uint8).random_(0, 120)  # finite E4M3 bytes
    cache.value_cache.view(torch.uint8).random_(0, 120)
    k = cache.key_cache[:, [4, 1]].view(torch.uint8).clone()
    v = cache.value_cache[:, [4, 1]].view(torch.uint8).clone()
    swapper = Swapper(cache, num_cpu_blocks=2)
    assert swapper.key_cache.dtype == FP8
    swapper.swap_out([(4, 1), (1, 0)])
    (
        cache.key_cache.view(torch.uint8).zero_(),
        cache.value_cache.view(torch.uint8).zero_(),
    )
    swapper.swap_in([(1, 0), (0, 5)])
    assert cache.key_cache[:, [0, 5]].view(torch.uint8).equal(k)
    assert cache.value_cache[:, [0, 5]].view(torch.uint8).equal(v)
    cache.copy_blocks([(0, 2)])  # copy-on-write (chapter 4), as bytes too
    assert cache.key_cache[:, 2].view(torch.uint8).equal(k[:, 0])
    assert cache.value_cache[:, 2].view(torch.uint8).equal(v[:, 0])


def test_fused_norm_rope_write_stores_the_scaled_fp8_cache():
    """Chapter 15's one-kernel norm, rotation and cache write into an FP8 cache: the
    bytes of chapter 13's scaled write of the unfused steps' keys and values (and, on a
    GPU, of chapter 3's)."""
    from minillm.kernels.qk_norm_rope import qk_norm_rope_write
    from minillm.model import apply_rope

    n_heads, n_kv, D, T = 4, 2, 32, 5
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(T, (n_heads + 2 * n_kv) * D, generator=g) * 3).to(DEVICE)
    angles = torch.rand(T, D, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([9, 0, 17, 4, 30]).to(DEVICE)
    scales = dict(
        k_scale=torch.tensor(0.03, device=DEVICE),
        v_scale=torch.tensor(0.02, device=DEVICE),
    )
    qk = apply_rope(qkv[:, : (n_heads + n_kv) * D].view(T, n_heads + n_kv, D), cos, sin)
    v = qkv[:, (n_heads + n_kv) * D :].view(T, n_kv, D)
    caches = [torch.zeros(8, 4, n_kv, D, dtype=FP8, device=DEVICE) for _ in "kvKV"]
    triton_reshape_and_cache(qk[:, n_heads:], v, *caches[:2], slots, **scales)
    q = qk_norm_rope_write(qkv, None, 0.0, cos, sin, *caches[2:], slots, n_heads,
                           **scales)  # fmt: skip
    assert (q - qk[:, :n_heads]).abs().max() <= 1e-5
    as_bytes = [c.view(torch.uint8) for c in caches]
    assert as_bytes[0].equal(as_bytes[2]) and as_bytes[1].equal(as_bytes[3])
    assert (as_bytes[2] != 0).any() and (as_bytes[3] != 0).any()
    if DEVICE == "cuda":
        torch_caches = [torch.zeros_like(c) for c in caches[:2]]
        reshape_and_cache(qk[:, n_heads:], v, *torch_caches, slots, **scales)
        assert torch_caches[0].view(torch.uint8).equal(as_bytes[2])


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's GPU path: graphs, fusions")
def test_gpu_engine_with_an_fp8_cache(tiny):
    """On a GPU: CUDA graphs, the fused norm-rotation-write kernel and the Triton
    attention, all on the FP8 cache; every request runs to its length."""
    from minillm import fused_layers

    llm = LLM(device="cuda", kv_cache_dtype="fp8", gpu_memory_utilization=0.3)
    cache = llm.engine.kv_cache
    assert cache.key_cache.dtype == FP8 and llm.engine.parts["attention_backend"] == (
        "triton"
    )
    qkv = torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda")
    assert fused_layers.can_attend_rotated(cache, qkv, 64)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 1)]
    outs = llm.generate(prompts, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 4


def test_greedy_agreement_counts_positions_prefixes_and_whole_outputs():
    from minillm.quantization.kv_fp8 import greedy_agreement

    got = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got == {"tokens": 7 / 8, "prefix": 6 / 8, "outputs": 1 / 2}


def test_swap_preemption_gives_recompute_tokens_with_an_fp8_cache(tiny):
    """Chapter 12's swap through an FP8 cache: the blocks go to the CPU and back as
    bytes, so a swapped request continues exactly as a recomputed one does (the
    recomputed K/V are quantized again to the same bytes)."""
    from test_swap import GREEDY as LONG
    from test_swap import TIGHT, mixed_prompts

    prompts = mixed_prompts(10, tiny[1].vocab_size, seed=1)
    runs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(**TIGHT, kv_cache_dtype="fp8", preemption_mode=mode)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, LONG)]
        assert llm.engine.kv_cache.key_cache.dtype == FP8
        assert llm.engine.num_preemptions > 0
    assert llm.engine.scheduler.num_swapped_in > 0
    assert runs["swap"] == runs["recompute"]
