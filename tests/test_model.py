"""The decoder of chapter 1: RoPE, attention, the dense KV cache, generation."""

import pytest
import shapes
import torch

from minillm.model import (
    AttentionMetadata,
    CausalLM,
    DenseKVCache,
    ModelConfig,
    RotaryEmbedding,
    apply_rope,
    build_attention_metadata,
    context_attention,
    generate,
    generate_without_cache,
    rope_inv_freq,
    sample_next,
)

SMALL = ModelConfig(vocab_size=97, **{**shapes.SMALL, "head_dim": 32})


def small_model(**overrides) -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(**{**SMALL.__dict__, **overrides})
    model = CausalLM(config).eval()
    # larger weights than the default init, so greedy ties are unlikely
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return model


def test_config_rejects_head_counts_that_do_not_group():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(ModelConfig(head_dim=32))
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(m, n):
        cm, sm = rope(torch.tensor([m]), torch.float32)
        cn, sn = rope(torch.tensor([n]), torch.float32)
        return (apply_rope(q, cm, sm) * apply_rope(k, cn, sn)).sum()

    assert torch.allclose(score(5, 2), score(105, 102), atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-4)


def test_rope_frequencies_stay_float32_when_model_is_cast():
    model = small_model().to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_llama3_scaling_keeps_high_frequencies_and_slows_low_ones():
    plain = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(
        64,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert torch.equal(scaled[0], plain[0])
    assert torch.allclose(scaled[-1], plain[-1] / 8)


def test_unknown_rope_scaling_is_an_error():
    with pytest.raises(NotImplementedError, match="yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_model_is_causal():
    model = small_model()
    ids = torch.randint(0, 97, (1, 12))
    pos = torch.arange(12)[None]
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 97
    with torch.no_grad():
        a, b = model(ids, pos), model(changed, pos)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_metadata_slots_follow_block_tables():
    positions, md = build_attention_metadata(
        [3, 1], [3, 6], [[5, 0], [2, 7]], block_size=4
    )
    assert positions.tolist() == [0, 1, 2, 5]
    assert md.slot_mapping.tolist() == [20, 21, 22, 7 * 4 + 1]
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert (
        md.seq_lens.tolist() == [3, 6] and md.max_query_len == 3 and md.max_seq_len == 6
    )
    assert md.num_seqs == 2 and md.num_tokens == 4


@pytest.mark.parametrize(
    "query_lens, seq_lens, tables, message",
    [
        ([2], [1], [[0]], "query_len <= seq_len"),
        ([0], [3], [[0]], "0 < query_len"),
        ([1], [9], [[0, 1]], "does not fit"),
        ([1, 1], [1], [[0]], "one entry per sequence"),
    ],
)
def test_metadata_rejects_impossible_batches(query_lens, seq_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, seq_lens, tables, block_size=4)


def test_context_attention_with_full_query_is_causal_attention():
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    from minillm.model import causal_attention

    expected = causal_attention(q[None], k[None], v[None])[0]
    assert torch.allclose(context_attention(q, k, v), expected, atol=1e-6)
    # the last query alone sees everything: equal to the last row
    assert torch.allclose(context_attention(q[-1:], k, v), expected[-1:], atol=1e-6)


def test_dense_cache_prefill_then_decode_equals_full_forward():
    model = small_model()
    ids = torch.randint(0, 97, (10,))
    with torch.no_grad():
        full = model(ids, torch.arange(10))
        cache = DenseKVCache(model.config, max_seqs=2, max_len=16)
        # row 1: rows are independent
        pos, md = build_attention_metadata([6], [6], [[1]], 16)
        first = model(ids[:6], pos, md, cache)
        outs = [first]
        for t in range(6, 10):
            pos, md = build_attention_metadata([1], [t + 1], [[1]], 16)
            outs.append(model(ids[t : t + 1], pos, md, cache))
    assert torch.allclose(torch.cat(outs), full, atol=1e-5)
    assert cache.k[:, 0].abs().sum() == 0  # the unused row was never written


def test_metadata_and_cache_go_together():
    model = small_model()
    with pytest.raises(ValueError, match="together"):
        model(
            torch.tensor([1, 2]),
            torch.tensor([0, 1]),
            kv_cache=DenseKVCache(model.config, 1, 4),
        )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1},
        {"qk_norm": True},
        {"attention_bias": True},
    ],
)
def test_batched_cached_generation_equals_recompute(overrides):
    model = small_model(**overrides)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    outs = generate(model, prompts, max_new_tokens=10)
    for prompt, out in zip(prompts, outs):
        assert out == generate_without_cache(model, prompt, 10)


def test_generation_stops_at_stop_token_and_keeps_it():
    model = small_model()
    free = generate(model, [[1, 2, 3]], max_new_tokens=10)[0]
    stop = free[4]
    out = generate(model, [[1, 2, 3]], max_new_tokens=10, stop_token_ids=[stop])[0]
    assert out == free[: free.index(stop) + 1]


def test_max_new_tokens_respected_and_empty_prompt_rejected():
    model = small_model()
    assert [len(o) for o in generate(model, [[1], [2, 3]], max_new_tokens=5)] == [5, 5]
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=3)


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = small_model()
    a = generate(model, [[1, 2]], 20, temperature=1.0, seed=3)
    assert a == generate(model, [[1, 2]], 20, temperature=1.0, seed=3)
    assert a != generate(model, [[1, 2]], 20, temperature=1.0, seed=4)


def test_temperature_zero_is_argmax_and_top_k_restricts():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample_next(logits).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = {
        sample_next(logits, temperature=5.0, top_k=2, generator=g).item()
        for _ in range(200)
    }
    assert draws == {1, 3}


def test_tied_embeddings_share_storage():
    model = small_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (
        small_model(tie_word_embeddings=False).lm_head.weight.data_ptr()
        != small_model(tie_word_embeddings=False).model.embed_tokens.weight.data_ptr()
    )


def test_metadata_dataclass_fields_match_vllm_names():
    names = set(AttentionMetadata.__dataclass_fields__)
    assert {
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "slot_mapping",
        "max_query_len",
        "max_seq_len",
    } == names
