"""Checks for the exercises of chapter 2 ("Checkpoints").

pytest exercises/test_02_checkpoints.py -k shards     # 2.1
pytest exercises/test_02_checkpoints.py -k q8_0       # 2.2
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _check import answer

import minillm.gguf_loader
import minillm.hf
from minillm.hf import load_model
from minillm.model import CausalLM, ModelConfig

# --- 2.1 save in shards ----------------------------------------------------------


def small_model() -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return CausalLM(config).eval()


def test_save_sharded_writes_shards_and_an_index_that_load_back(tmp_path):
    save_sharded = answer(minillm.hf, "save_sharded", "2.1")
    model = small_model()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    limit = 3 * max(sizes.values())  # several tensors a shard, several shards
    save_sharded(model, None, tmp_path, limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(sizes), "the index names every tensor once"
    assert index["metadata"]["total_size"] == sum(sizes.values())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and set(weight_map.values()) == set(files)
    assert not (tmp_path / "model.safetensors").exists()
    for name in files:
        in_file = [n for n, f in weight_map.items() if f == name]
        assert sum(sizes[n] for n in in_file) <= limit or len(in_file) == 1
    loaded = load_model(tmp_path)
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name


def test_save_sharded_gives_a_large_tensor_a_file_of_its_own(tmp_path):
    save_sharded = answer(minillm.hf, "save_sharded", "2.1")
    model = small_model()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    limit = 1024  # smaller than every matrix, larger than a norm's weight
    save_sharded(model, None, tmp_path, limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    total = len(files)
    assert files == [
        f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)
    ]
    for name, size in sizes.items():
        mates = [
            n for n, f in index["weight_map"].items() if f == index["weight_map"][name]
        ]
        assert (
            mates == [name] if size > limit else sum(sizes[n] for n in mates) <= limit
        )
    torch.testing.assert_close(
        load_model(tmp_path).model.embed_tokens.weight, model.model.embed_tokens.weight
    )


# --- 2.2 Q8_0 by hand ------------------------------------------------------------


def test_dequantize_q8_0_matches_gguf_on_random_blocks():
    dequantize_q8_0 = answer(minillm.gguf_loader, "dequantize_q8_0", "2.2")
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(0).normal(size=(5, 96)).astype(np.float32)
    data = quants.quantize(x, GGMLQuantizationType.Q8_0)  # (5, 3 * 34) bytes
    ours = dequantize_q8_0(data)
    assert ours.dtype == np.float32 and ours.shape == (5, 96)
    assert np.array_equal(ours, quants.dequantize(data, GGMLQuantizationType.Q8_0))


def test_dequantize_q8_0_matches_gguf_on_smollm2s_embedding_table():
    dequantize_q8_0 = answer(minillm.gguf_loader, "dequantize_q8_0", "2.2")
    pytest.importorskip("gguf")
    from minillm.convert import packaged_model_path

    try:
        path = packaged_model_path("smollm2")
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"SmolLM2's package is not installed: {e}")
    reader, _ = minillm.gguf_loader.read_gguf(path)
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert table.tensor_type.name == "Q8_0"
    from gguf import dequantize

    expected = dequantize(table.data, table.tensor_type)
    assert np.array_equal(dequantize_q8_0(np.asarray(table.data)), expected)
