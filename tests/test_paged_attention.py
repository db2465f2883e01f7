"""PagedAttention of chapter 5: equal to dense attention, and paged generation equal to
the dense cache of chapter 1 and to transformers.
"""

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from hf_models import SHAPE as HF_SHAPE
from hf_models import hf_greedy

from minillm.attention import (
    gather_blocks,
    generate_paged,
    paged_attention_per_seq,
    paged_attention_ref,
    query_layout,
    visibility_mask,
)
from minillm.hf import load_model
from minillm.kv_cache import PagedKVCache, compute_slot_mapping
from minillm.model import DenseKVCache, ModelConfig, build_attention_metadata, generate

transformers.logging.set_verbosity_error()


def paged_and_dense(
    backend,
    block_size,
    n_heads,
    n_kv_heads,
    context_lens,
    query_lens,
    seed=0,
    head_dim=16,
    dtype=torch.float32,
):
    """Run one step of random q/k/v through a PagedKVCache (shuffled blocks, every slot
    NaN first) and through chapter 1's DenseKVCache holding the same context. Returns
    (paged output, dense output).
    """
    gen = torch.Generator().manual_seed(seed)
    config = ModelConfig(
        num_hidden_layers=1,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
    )
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    paged = PagedKVCache(
        config, num_blocks, block_size, attn_backend=backend, dtype=dtype
    )
    paged.key_cache.fill_(float("nan"))
    paged.value_cache.fill_(float("nan"))
    dense = DenseKVCache(config, len(seq_lens), max(seq_lens), dtype=dtype)
    for i, (c, table) in enumerate(zip(context_lens, tables)):
        k, v = torch.randn(2, c, n_kv_heads, head_dim, generator=gen).to(dtype)
        slots = compute_slot_mapping(
            torch.tensor([table]),
            torch.zeros(c, dtype=torch.long),
            torch.arange(c),
            block_size,
        )
        paged.write(0, k, v, slots)
        dense.k[0, i, :c], dense.v[0, i, :c] = k, v
    n = sum(query_lens)
    q = torch.randn(n, n_heads, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, n, n_kv_heads, head_dim, generator=gen).to(dtype)
    _, md = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    _, md_dense = build_attention_metadata(
        query_lens, seq_lens, [[i] for i in range(len(seq_lens))], max(seq_lens)
    )
    return paged.attend(0, q, k, v, md), dense.attend(0, q, k, v, md_dense)


# --- attention
# ---------------------------------------------------------------------------------

KINDS = {
    "decode": ([5, 17, 1, 33, 12], [1, 1, 1, 1, 1]),
    "prefill": ([0, 0, 0, 0], [7, 1, 19, 4]),
    "prefill after context": ([9, 3, 20], [4, 11, 1]),
    "mixed": ([0, 14, 6, 0, 25], [6, 1, 5, 13, 1]),
}


@pytest.mark.parametrize("block_size", [1, 5, 12, 16])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_paged_attention_equals_dense_attention(block_size, n_heads, n_kv_heads, kind):
    context_lens, query_lens = KINDS[kind]
    out, expected = paged_and_dense(
        paged_attention_ref, block_size, n_heads, n_kv_heads, context_lens, query_lens
    )
    assert out.shape == expected.shape == (sum(query_lens), n_heads, 16)
    assert (out - expected).abs().max() <= 1e-5


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 5, 12, 16]),
    heads=st.sampled_from([(4, 4), (4, 2), (8, 2), (2, 1)]),
    seqs=st.lists(
        st.tuples(st.integers(0, 50), st.integers(1, 16)), min_size=1, max_size=7
    ),
    seed=st.integers(0, 10_000),
)
def test_paged_attention_equals_dense_attention_on_random_batches(
    block_size, heads, seqs, seed
):
    context_lens, query_lens = [c for c, _ in seqs], [q for _, q in seqs]
    for backend in (paged_attention_ref, paged_attention_per_seq):
        out, expected = paged_and_dense(
            backend, block_size, *heads, context_lens, query_lens, seed=seed
        )
        assert torch.isfinite(out).all()  # no NaN from slots no table owns
        assert (out - expected).abs().max() <= 1e-5


def test_reference_keeps_the_query_dtype():
    out, expected = paged_and_dense(
        paged_attention_ref, 4, 4, 2, [3, 0], [1, 5], dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max() < 3e-2


def test_query_layout_maps_tokens_to_sequences_and_rows():
    _, md = build_attention_metadata([3, 1, 2], [3, 8, 6], [[0], [1, 2], [3, 4]], 4)
    seq_idx, row = query_layout(md)
    assert seq_idx.tolist() == [0, 0, 0, 1, 2, 2] and row.tolist() == [0, 1, 2, 0, 0, 1]


def test_visibility_mask_is_causal_after_the_context_and_stops_at_seq_len():
    # 3 cached + 2 new; 2 cached + 1 new
    _, md = build_attention_metadata([2, 1], [5, 3], [[0, 1], [2]], 4)
    mask = visibility_mask(md)
    assert mask.shape == (2, 2, 5)
    assert mask[0].tolist() == [[True, True, True, True, False], [True] * 5]
    assert mask[1, 0].tolist() == [True, True, True, False, False]
    # a padded row still sees its sequence
    assert mask[1, 1].tolist() == [True, True, True, False, False]


def test_gather_blocks_follows_the_block_table():
    # slot s holds the value s
    cache = torch.arange(6 * 2, dtype=torch.float32).view(6, 2, 1, 1)
    got = gather_blocks(cache, torch.tensor([[4, 1, 0], [2, 0, 0]]), max_seq_len=5)
    assert got.shape == (2, 5, 1, 1)
    assert got[0].flatten().tolist() == [8, 9, 2, 3, 0]
    assert got[1, :2].flatten().tolist() == [4, 5]


# --- paged generation
# --------------------------------------------------------------------------

TEXTS = [
    'The "for" statement',
    "A class definition defines a class object.",
    "Exceptions are",
    'The "import" statement is used to',
    "Names refer to objects.",
    "In",
    'The "while" statement is used for repeated execution as long as',
    "When a description",
]


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    _, tokenizer = tiny
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) >= 6  # different lengths
    return prompts


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_generation_equals_dense_generation_on_the_tiny_model(
    tiny, tiny_prompts, block_size
):
    model, _ = tiny
    expected = generate(model, tiny_prompts, max_new_tokens=24)
    assert (
        generate_paged(model, tiny_prompts, max_new_tokens=24, block_size=block_size)
        == expected
    )
    assert (
        generate_paged(
            model,
            tiny_prompts,
            max_new_tokens=24,
            block_size=block_size,
            attn_backend=paged_attention_per_seq,
            shuffle_seed=None,
        )
        == expected
    )


def hf_greedy_each(reference, prompts, max_new_tokens):
    reference.generation_config.eos_token_id = None
    return [hf_greedy(reference, p, max_new_tokens) for p in prompts]


def test_paged_generation_equals_transformers_on_the_tiny_model(tiny, tiny_prompts):
    from transformers import AutoModelForCausalLM

    from minillm.tiny import tiny_model_path

    model, _ = tiny
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32
    ).eval()
    assert generate_paged(
        model, tiny_prompts, max_new_tokens=20, block_size=5
    ) == hf_greedy_each(reference, tiny_prompts, 20)


SHAPE = dict(HF_SHAPE, vocab_size=320)


@pytest.mark.parametrize(
    "cls, config",
    [
        (
            LlamaForCausalLM,
            LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False),
        ),
        (
            Qwen3ForCausalLM,
            Qwen3Config(**SHAPE, num_key_value_heads=1, tie_word_embeddings=True),
        ),
    ],
    ids=["llama-gqa2", "qwen3-gqa4"],
)
def test_paged_generation_equals_dense_and_transformers_on_random_hf_models(
    tmp_path, cls, config
):
    torch.manual_seed(0)
    reference = cls(config).eval()
    # random init leaves norm gains at one: perturb them so they matter
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    reference.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompts = [
        torch.randint(1, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (2, 5, 9, 14, 17, 23, 28, 40)
    ]
    paged = generate_paged(ours, prompts, max_new_tokens=20, block_size=12)
    assert paged == generate(ours, prompts, max_new_tokens=20)
    assert paged == hf_greedy_each(reference, prompts, 20)


def test_seeded_sampling_through_the_paged_cache_equals_the_dense_cache(
    tiny, tiny_prompts
):
    model, _ = tiny
    kwargs = dict(max_new_tokens=16, temperature=0.9, top_k=40, seed=11)
    assert generate_paged(model, tiny_prompts, block_size=4, **kwargs) == generate(
        model, tiny_prompts, **kwargs
    )


def test_a_poisoned_cache_with_few_blocks_still_generates_the_dense_tokens(
    tiny, tiny_prompts
):
    """Every slot starts as NaN and blocks are scarce, so freed blocks (holding a
    finished sequence's keys) are handed to sequences still running: nothing a
    sequence does not own may reach its attention.
    """
    model, _ = tiny
    dense = generate(model, tiny_prompts, max_new_tokens=24)
    stop = [dense[0][3], dense[2][3]]
    expected = generate(model, tiny_prompts, max_new_tokens=24, stop_token_ids=stop)
    block_size = 4
    peak = max(
        sum(
            -(-(len(p) + t) // block_size)
            for p, o in zip(tiny_prompts, expected)
            if len(o) > t
        )
        for t in range(24)
    )
    lifetime = sum(
        -(-(len(p) + len(o) - 1) // block_size) for p, o in zip(tiny_prompts, expected)
    )
    assert lifetime > peak  # the run must reuse blocks for the test to mean anything
    cache = PagedKVCache(
        model.config, peak, block_size, attn_backend=paged_attention_ref
    )
    cache.key_cache.fill_(float("nan"))
    cache.value_cache.fill_(float("nan"))
    assert (
        generate_paged(
            model, tiny_prompts, max_new_tokens=24, stop_token_ids=stop, kv_cache=cache
        )
        == expected
    )


def test_running_out_of_blocks_is_a_clear_error(tiny, tiny_prompts):
    model, _ = tiny
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        generate_paged(
            model, tiny_prompts, max_new_tokens=24, block_size=4, num_blocks=10
        )


def test_empty_prompts_are_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="at least one token"):
        generate_paged(model, [[1, 2], []], max_new_tokens=4)
