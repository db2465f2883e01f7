"""Worked solutions to chapter 19's exercises (chapters/19_quantized_serving.md).

Installed into minillm.quantization's modules the way a reader's exported cells would
put them there; the checks are exercises/test_19_quantized_serving.py.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn

from minillm.config import EngineConfig
from minillm.merged_projections import merge_projections
from minillm.quantization import apply, checkpoint, methods
from minillm.registry import QUANTIZATION_METHODS


# 18.1
def quantize_rtn_mse(model: nn.Module, config: EngineConfig) -> None:
    """RTN 4-bit weights with each group's range searched (mse_group_params), in
    groups of int4_group_size: no calibration, so nothing worth caching."""
    merge_projections(model)
    codes = apply.int4_codes(model, "rtn", None, config.int4_group_size, mse=True)
    apply.int4_layers(model, codes)


# 18.2
def checkpoint_bits(folder: str | Path) -> float:
    """Bits stored per quantized weight in a GPTQ or AWQ folder: every projection's
    qweight, qzeros, scales and g_idx, over the K x N weights its qweight holds."""
    stored = weights = 0
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            name, part = key.rsplit(".", 1)
            if f"{name}.qweight" not in f.keys():
                continue  # an ordinary fp16 tensor, not a quantized projection's
            t = f.get_tensor(key)
            stored += 8 * t.numel() * t.element_size()
            if part == "qweight":
                weights += 8 * t.numel()  # eight 4-bit codes a 32-bit word
    return stored / weights


methods.quantize_rtn_mse = QUANTIZATION_METHODS.register("rtn-mse")(quantize_rtn_mse)
checkpoint.checkpoint_bits = checkpoint_bits

SOLUTIONS = {"rtn_mse": quantize_rtn_mse, "checkpoint_bits": checkpoint_bits}
