"""The Triton paged-attention kernels of chapter 13 against chapter 5's reference.

On a CPU they run under TRITON_INTERPRET=1 (set in conftest.py before triton is
imported), at small sizes; on a GPU also in bfloat16 and at realistic sizes.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from helpers import assert_replays_equal  # noqa: E402

from minillm.attention import generate_paged, paged_attention_ref  # noqa: E402
from minillm.kernels.paged_attention import triton_paged_attention  # noqa: E402
from minillm.kernels.paged_decode import paged_decode  # noqa: E402
from minillm.kernels.paged_prefill import (  # noqa: E402
    paged_prefill,
    prefill_block_m,
    prefill_tile_map,
)
from minillm.model import build_attention_metadata, generate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU the prefill kernel's key tiles are 16 or more (tl.dot); the CPU's
# interpreter takes any size
ON_GPU_TILES_OF_16 = pytest.mark.skipif(DEVICE == "cuda", reason="a key tile under 16")
# The interpreter runs every program one after another in Python: on the CPU a grid's
# diagonal (each value of each knob once), on a GPU the whole grid.
GPU_ONLY = pytest.mark.skipif(
    DEVICE != "cuda", reason="the CPU's interpreter runs the grid's diagonal"
)
# the orders a prefill kernel's tiles may take: all four on a GPU, two on the CPU
TILE_ORDERS = [(True, True), (False, False)] + (
    [(True, False), (False, True)] if DEVICE == "cuda" else []
)


def diagonal(block_sizes, head_layouts):
    """Every (block size, heads) pair; those off the diagonal run on a GPU only."""
    return [
        pytest.param(b, *h, marks=() if i == j else GPU_ONLY)
        for i, b in enumerate(block_sizes)
        for j, h in enumerate(head_layouts)
    ]


def batch(
    query_lens,
    seq_lens,
    block_size,
    n_heads,
    n_kv,
    head_dim,
    dtype=torch.float32,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(
        DEVICE, dtype
    )
    v = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(
        DEVICE, dtype
    )
    # a block no table owns: must never be read
    k[-1], v[-1] = float("nan"), float("nan")
    free = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=g).to(DEVICE, dtype)
    return q, k, v, md


@pytest.mark.parametrize(
    "block_size, n_heads, n_kv", diagonal([1, 5, 16], [(4, 4), (4, 2), (8, 2)])
)
def test_decode_kernel_matches_reference(block_size, n_heads, n_kv):
    q, k, v, md = batch(
        [1] * 5, [1, 17, 40, 3, 64], block_size, n_heads, n_kv, 32, seed=block_size
    )
    expected = paged_attention_ref(q, k, v, md)
    for splits in (1, 8):
        out = paged_decode(
            q, k, v, md.block_tables, md.seq_lens, md.max_seq_len, num_splits=splits
        )
        assert (out - expected).abs().max() <= 1e-5
    # pieces of a fixed size, past the longest context too (as under CUDA graphs, with
    # max_model_len)
    for split_tokens in (32, 64):
        out = paged_decode(
            q,
            k,
            v,
            md.block_tables,
            md.seq_lens,
            300,
            block_n=32,
            split_tokens=split_tokens,
        )
        assert (out - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode(
            q, k, v, md.block_tables, md.seq_lens, 300, block_n=32, split_tokens=48
        )
    with pytest.raises(ValueError, match="not both"):
        paged_decode(
            q,
            k,
            v,
            md.block_tables,
            md.seq_lens,
            300,
            block_n=32,
            split_tokens=32,
            num_splits=2,
        )


@pytest.mark.parametrize("n_heads, n_kv", [pytest.param(4, 4, marks=GPU_ONLY), (8, 2)])
def test_decode_programs_in_another_order_give_the_same_bits(
    n_heads, n_kv, monkeypatch
):
    """order: the programs start longest sequence first (or in any order given); each
    still writes its own sequence's rows, so the output is the same, bit for bit."""
    from minillm.kernels import paged_attention as backend
    from minillm.kernels.paged_attention import decode_order

    q, k, v, md = batch([1] * 6, [1, 17, 40, 3, 64, 9], 16, n_heads, n_kv, 32, seed=5)
    order = decode_order(md)
    assert md.seq_lens[order.long()].tolist() == sorted(md.seq_lens.tolist())[::-1]
    assert decode_order(md) is order  # built once per metadata
    shuffled = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, md.block_tables, md.seq_lens, md.max_seq_len)
    for splits in (1, 4):
        plain = paged_decode(*args, splits)
        for o in (order, shuffled):
            assert torch.equal(paged_decode(*args, splits, order=o), plain)
    monkeypatch.setattr(backend, "ORDER_DECODES_FROM", 2)
    assert torch.equal(backend.triton_paged_attention(q, k, v, md), paged_decode(*args))
    assert (paged_decode(*args) - paged_attention_ref(q, k, v, md)).abs().max() <= 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="dependent launch needs a GPU")
@pytest.mark.parametrize("pdl", [1, 2])
def test_decode_launched_early_in_a_graph_matches_the_reference(pdl):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    q, k, v, md = batch([1] * 3, [300, 17, 1000], 16, 16, 8, 128, torch.bfloat16)
    expected = paged_decode(q, k, v, md.block_tables, md.seq_lens, 1024, pdl=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = q * 1.0  # a kernel before, that the first launch must wait for
        for _ in range(8):  # each reads the previous one's output
            h = paged_decode(h, k, v, md.block_tables, md.seq_lens, 1024, pdl=pdl)
    ref = q
    for _ in range(8):
        ref = paged_decode(ref, k, v, md.block_tables, md.seq_lens, 1024, pdl=0)
    assert_replays_equal(graph, h, ref)
    expected_first = paged_attention_ref(q, k, v, md).float()
    assert (expected.float() - expected_first).abs().max() <= 2e-2


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("n_heads, n_kv", [(4, 4), (4, 2), (8, 2)])
def test_prefill_kernel_matches_reference_on_a_mixed_batch(block_size, n_heads, n_kv):
    # a decode, a prompt with no context, chunks after cached context, a one-token
    # prompt
    q, k, v, md = batch(
        [1, 16, 5, 1, 9],
        [9, 16, 40, 1, 30],
        block_size,
        n_heads,
        n_kv,
        32,
        seed=block_size,
    )
    out = paged_prefill(q, k, v, md)
    assert (out - paged_attention_ref(q, k, v, md)).abs().max() <= 1e-5


@pytest.mark.parametrize("query_lens, seq_lens", [([7, 12], [7, 12]), ([40], [100])])
def test_prefill_kernel_prompts_and_long_chunks(query_lens, seq_lens):
    q, k, v, md = batch(query_lens, seq_lens, 16, 8, 2, 32, seed=len(query_lens))
    assert (
        paged_prefill(q, k, v, md) - paged_attention_ref(q, k, v, md)
    ).abs().max() <= 1e-5


@pytest.mark.parametrize("block_m", [2, 4, 8])
def test_prefill_tiles_smaller_than_the_chunks(block_m):
    # several tiles per sequence, partial last tiles, and grid slots past the last real
    # tile (the grid is
    # sized by num_tokens // block_m + num_seqs, and only the device knows how many
    # tiles there are)
    q, k, v, md = batch(
        [1, 16, 5, 1, 9, 13], [9, 16, 40, 1, 30, 13], 5, 8, 2, 32, seed=block_m
    )
    out = paged_prefill(q, k, v, md, block_m=block_m, block_n=16)
    assert (out - paged_attention_ref(q, k, v, md)).abs().max() <= 1e-5


@pytest.mark.parametrize("block_m, block_n", [(4, 16), (8, 16), (16, 16), (8, 32)])
def test_prefill_full_and_diagonal_key_tiles_meet_anywhere(block_m, block_n):
    # contexts just below, at and above a multiple of block_n, so the first key tile
    # that needs the mask starts before, at or after a tile's first query; chunks that
    # are not a multiple of block_m, so the last tile runs past the chunk's end
    contexts = [0, 15, 16, 17, 31, 32, 33, 3]
    query_lens = [23, 1, 16, 9, 17, 5, 40, 33]
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    q, k, v, md = batch(query_lens, seq_lens, 16, 8, 2, 32, seed=block_m + block_n)
    expected = paged_attention_ref(q, k, v, md)
    for longest_first in (True, False):
        out = paged_prefill(
            q, k, v, md, block_m=block_m, block_n=block_n, longest_first=longest_first
        )
        assert (out - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "block_m, block_n, diag_n",
    [
        (4, 16, 16),
        pytest.param(8, 16, 4, marks=ON_GPU_TILES_OF_16),
        (8, 32, 16),
        (8, 64, 32),
        (16, 64, 16),
    ],
)
def test_prefill_tiles_aligned_to_the_chunk_end_and_small_diagonal_tiles(
    block_m, block_n, diag_n
):
    # the padding rows at the start of a chunk's first tile (its start is negative),
    # contexts shorter than that padding, and a diagonal walked in smaller key tiles
    contexts = [0, 15, 16, 17, 31, 32, 33, 3, 0]
    query_lens = [23, 1, 16, 9, 17, 5, 40, 33, 3]
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    q, k, v, md = batch(query_lens, seq_lens, 16, 8, 2, 32, seed=block_m + diag_n)
    expected = paged_attention_ref(q, k, v, md)
    for longest_first, align_end in TILE_ORDERS:
        out = paged_prefill(
            q, k, v, md, block_m=block_m, block_n=block_n, diag_n=diag_n,
            longest_first=longest_first, align_end=align_end,
        )  # fmt: skip
        assert (out - expected).abs().max() <= 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="the CPU interpreter takes any tile")
def test_prefill_refuses_tiles_below_16_on_a_gpu():
    q, k, v, md = batch([23, 1], [23, 16], 16, 8, 2, 32)
    for knobs in (dict(diag_n=4), dict(block_n=8)):
        with pytest.raises(ValueError, match="16 keys or more"):
            paged_prefill(q, k, v, md, **knobs)


def test_prefill_tiles_aligned_to_the_end_pad_only_the_first_tile():
    _, _, _, md = batch([1, 16, 5, 40, 9, 13], [9, 16, 40, 40, 30, 13], 5, 8, 2, 32)
    block_m = 4
    seq, start = (t.tolist() for t in prefill_tile_map(md, block_m, False, True))
    q_lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).tolist()
    for s, n in enumerate(q_lens):
        starts = [f for t, f in zip(seq, start) if t == s and f < n]
        # the tiles cover the chunk exactly once, and the last one ends with it
        rows = sorted(r for f in starts for r in range(f, f + block_m) if r >= 0)
        assert rows == list(range(n)) and max(starts) + block_m == n


def test_prefill_tile_map_puts_the_longest_tiles_first():
    _, _, _, md = batch([1, 16, 5, 40, 9, 13], [9, 16, 40, 40, 30, 13], 5, 8, 2, 32)
    block_m = 4
    seq, start = (t.tolist() for t in prefill_tile_map(md, block_m, False))
    sorted_seq, sorted_start = (t.tolist() for t in prefill_tile_map(md, block_m, True))
    # the same tiles, spare ones included, in another order
    assert sorted(zip(seq, start)) == sorted(zip(sorted_seq, sorted_start))
    q_lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).tolist()
    seq_lens = md.seq_lens.tolist()

    def keys(s, first):  # the keys the tile's last row sees; a spare tile: none
        if first >= q_lens[s]:
            return -1
        return seq_lens[s] - q_lens[s] + min(first + block_m, q_lens[s])

    work = [keys(s, f) for s, f in zip(sorted_seq, sorted_start)]
    assert work == sorted(work, reverse=True) and work[-1] == -1


def test_prefill_tiles_shrink_to_the_longest_chunk_but_keep_16_rows():
    assert prefill_block_m(1000, 2, 128) == 64  # a prompt step: 64 tokens x 2 heads
    assert prefill_block_m(4, 2, 128) == 8  # a verify step: 16 rows, not 128
    assert prefill_block_m(1, 1, 128) == 16
    assert prefill_block_m(3, 8, 128) == 4  # 4 tokens x 8 heads: more than needed
    assert prefill_block_m(1, 32, 128) == 1  # a group wider than 16 rows
    # a verify-like batch at the default tile: same answer as the reference
    q, k, v, md = batch([4, 4, 3], [40, 9, 20], 16, 4, 2, 32)
    assert (
        paged_prefill(q, k, v, md) - paged_attention_ref(q, k, v, md)
    ).abs().max() <= 1e-5


def test_head_dim_that_is_not_a_power_of_two():
    q, k, v, md = batch([3, 1], [10, 6], 4, 4, 2, 80)
    assert (
        triton_paged_attention(q, k, v, md) - paged_attention_ref(q, k, v, md)
    ).abs().max() <= 1e-5
    qd, kd, vd, mdd = batch([1, 1], [10, 6], 4, 4, 2, 80)
    assert (
        triton_paged_attention(qd, kd, vd, mdd) - paged_attention_ref(qd, kd, vd, mdd)
    ).abs().max() <= 1e-5


def test_the_model_on_the_triton_backend_generates_the_dense_tokens(tiny):
    model, tokenizer = tiny
    model = model.to(DEVICE)
    prompts = [
        tokenizer.encode(t) for t in ["The", 'The "while" statement is used for', "A"]
    ]
    assert generate_paged(
        model, prompts, 5, attn_backend=triton_paged_attention
    ) == generate(model, prompts, 5)
    model.to("cpu")


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 and realistic sizes need a GPU")
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [([1] * 64, [4096] * 64), ([1] * 8 + [512], [2048] * 8 + [1024])],
)
def test_bf16_realistic_sizes_on_gpu(query_lens, seq_lens):
    q, k, v, md = batch(query_lens, seq_lens, 16, 16, 8, 128, dtype=torch.bfloat16)
    expected = paged_attention_ref(q, k, v, md).float()
    out = triton_paged_attention(q, k, v, md).float()
    assert (out - expected).abs().max() <= 2e-2  # bf16 output rounding, both sides


def test_the_engine_on_the_triton_backend_matches_the_reference_backend(tiny):
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    prompts = [[0, 5, 6, 7], [0, 9], [0, 11, 12, 13, 14, 15, 16, 17, 18]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            device=DEVICE,
            dtype=torch.float32,
            attention_backend=backend,
            num_kv_blocks=16,
            block_size=4,
            # chunked prefill: mixed batches of chunks and decodes
            max_num_seqs=4,
            max_num_batched_tokens=8,
        )
        outs[backend] = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs["triton"] == outs["torch"]
