"""Worked solutions to chapter 2's exercises (chapters/02_checkpoints.md).

Installed into minillm.hf and minillm.gguf_loader the way a reader's exported cells
would put them there; the checks are exercises/test_02_checkpoints.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

import minillm.gguf_loader
import minillm.hf
from minillm.hf import _refuse_merged, save_pretrained
from minillm.model import CausalLM
from minillm.tokenizer import Tokenizer


# 2.1
def save_sharded(
    model: CausalLM, tokenizer: Tokenizer | None, folder, max_shard_bytes: int
) -> None:
    """save_pretrained, with the tensors in files of at most max_shard_bytes each
    (a larger tensor alone in its file) and model.safetensors.index.json."""
    _refuse_merged(model)
    folder = Path(folder)
    save_pretrained(model, tokenizer, folder)  # config, tokenizer, one file
    (folder / "model.safetensors").unlink()
    shards, size = [{}], 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = p.detach().contiguous().cpu()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# 2.2
def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """A Q8_0 tensor's raw bytes (rows, 34 * blocks) -> float32 (rows, 32 * blocks):
    per block a float16 scale d, then 32 int8 q; w = d * q."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)  # (rows, n, 1)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)  # (rows, n, 32)
    return (d * q).reshape(rows, -1)


minillm.hf.save_sharded = save_sharded
minillm.gguf_loader.dequantize_q8_0 = dequantize_q8_0

SOLUTIONS = {"shards": save_sharded, "q8_0": dequantize_q8_0}
