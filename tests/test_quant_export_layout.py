"""Chapter 19's GPTQ and AWQ exports read as their formats' loaders read them.

Every quantized weight of an exported folder is dequantized here from the file alone,
by the documented layout, written independently of minillm's exporter (no
pack_int4 / unpack_columns), and compared bit for bit with minillm's own weights.
The layouts, as vLLM 0.32 reads them:

* GPTQ (vllm/model_executor/layers/quantization/auto_gptq.py, AutoGPTQConfig):
  qweight int32 [K / 8, N], input row 8r + j of column n in bits 4j of word [r, n];
  scales fp16 [K / g, N]; g_idx int32 [K], the group of each input row. With
  "sym": true the 4-bit type is uint4b8 (a code stands for code - 8) and qzeros is
  never read (the kernel is built with zero_points=False); 4-bit with "sym": false
  is refused ("Unsupported quantization config: bits=4, sym=False"). An asymmetric
  folder follows AutoGPTQ's v1 convention ("checkpoint_format": "gptq"): qzeros
  int32 [K / g, N / 8], output column 8c + j in bits 4j of word [g, c], holding the
  zero point minus one (GPTQModel's "gptq_v2" would store it as it is; vLLM 0.32
  does not read that format). We follow v1.
* AWQ (vllm/model_executor/layers/quantization/auto_awq.py, AutoAWQConfig,
  "version": "gemm", "zero_point": true): qweight int32 [K, N / 8], eight output
  columns a word in AWQ's interleaved order, which _convert_awq_to_standard_format
  undoes with _REVERSE_AWQ_PACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (column j sits in
  bits 4 * REVERSE[j]); qzeros int32 [K / g, N / 8] packed the same way, the zero
  point as it is (uint4 with zero points: code - zero); scales fp16 [K / g, N].
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from minillm.quantization import apply
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.checkpoint import (
    export_quantized,
    load_quantized_checkpoint,
    to_layout,
)
from minillm.quantization.rtn import dequantize_groups, quantize_rtn_groups

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble j in bits 4j
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # vLLM's _REVERSE_AWQ_PACK_ORDER


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., 8]: nibble j of each int32 word (bits 4j .. 4j + 3)."""
    return (words.to(torch.int64)[..., None] >> SHIFTS) & 0xF


def gptq_weight(t: dict, sym: bool) -> torch.Tensor:
    """W [N, K] float32 from one projection's GPTQ tensors, as vLLM (sym) or
    AutoGPTQ's v1 kernels (not sym) read them."""
    qweight = t["qweight"]  # (K / 8, N)
    codes = nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # (K, N)
    g_idx = t["g_idx"].long()  # (K,)
    if sym:
        zeros = torch.full_like(codes, 8)  # uint4b8: qzeros is not read
    else:
        qzeros = t["qzeros"]  # (G, N / 8), zero - 1
        zeros = (nibbles(qzeros).reshape(qzeros.shape[0], -1) + 1)[g_idx]  # (K, N)
    scales = t["scales"].float()[g_idx]  # (K, N)
    return ((codes - zeros).float() * scales).T


def awq_weight(t: dict, group_size: int) -> torch.Tensor:
    """W [N, K] float32 from one projection's AWQ tensors, as vLLM reads them."""
    qweight, qzeros = t["qweight"], t["qzeros"]  # (K, N / 8), (G, N / 8)
    codes = nibbles(qweight)[..., AWQ_REVERSE].reshape(qweight.shape[0], -1)  # (K, N)
    zeros = nibbles(qzeros)[..., AWQ_REVERSE].reshape(qzeros.shape[0], -1)  # (G, N)
    zeros = zeros.repeat_interleave(group_size, dim=0)  # (K, N)
    scales = t["scales"].float().repeat_interleave(group_size, dim=0)  # (K, N)
    return ((codes - zeros).float() * scales).T


@pytest.fixture(scope="module")
def tiny_stats(tiny):
    model, tokenizer = tiny
    return model, capture(model, token_windows(tokenizer, "train", 8, 64))


def export(model, stats, folder, fmt, method, sym):
    src = copy.deepcopy(model)
    codes = apply.int4_codes(src, method, stats, 128, sym=sym, awq_grid=3)
    export_quantized(src, codes, folder, fmt)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return codes, load_file(str(folder / "model.safetensors")), config


def minillms_weight(c, scales, zeros) -> torch.Tensor:
    """minillm's dequantized weight, with the scales as the file stores them."""
    return dequantize_groups(c, scales.half().float(), zeros)


@pytest.mark.parametrize(
    "fmt, method, sym",
    [("gptq", "gptq", True), ("gptq", "gptq", False), ("awq", "awq", False)],
)
def test_every_exported_weight_dequantizes_as_the_format_says(
    tiny_stats, tmp_path, fmt, method, sym
):
    model, stats = tiny_stats
    codes, tensors, config = export(model, stats, tmp_path, fmt, method, sym)
    assert config["group_size"] == 128
    loaded = load_quantized_checkpoint(tmp_path)
    for name, (c, scales, zeros) in codes.items():
        t = {k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales")}
        if fmt == "gptq":
            t["g_idx"] = tensors[f"{name}.g_idx"]
            read = gptq_weight(t, config["sym"])
        else:
            read = awq_weight(t, config["group_size"])
        ours = minillms_weight(c, scales, zeros)
        assert torch.equal(read, ours), name
        assert torch.equal(loaded.get_submodule(name).weight_int4.dequantize(), ours)


def test_gptq_says_sym_only_when_every_zero_point_is_8(tiny_stats, tmp_path):
    model, stats = tiny_stats
    codes, _, config = export(model, stats, tmp_path / "sym", "gptq", "rtn", True)
    assert config["sym"] is True
    assert all(bool((z == 8).all()) for _, _, z in codes.values())
    codes, _, config = export(model, stats, tmp_path / "asym", "gptq", "rtn", False)
    assert any(bool((z != 8).any()) for _, _, z in codes.values())
    assert config["sym"] is False
    # one asymmetric projection among symmetric ones is enough to lose the label
    src = copy.deepcopy(model)
    mixed = apply.int4_codes(src, "rtn", None, 128, sym=True)
    name = next(iter(mixed))
    w = src.get_submodule(name).weight.detach()
    mixed[name] = quantize_rtn_groups(w, 4, 128, sym=False)
    export_quantized(src, mixed, tmp_path / "mixed", "gptq")
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert config["quantization_config"]["sym"] is False


def test_a_sym_gptq_folder_is_read_with_zero_points_of_8(tiny_stats, tmp_path):
    """Like vLLM, minillm's loader takes "sym": true at its word and ignores qzeros:
    a folder whose label and qzeros disagree is read by the label."""
    model, stats = tiny_stats
    codes, tensors, config = export(model, stats, tmp_path, "gptq", "rtn", True)
    name = next(iter(codes))
    tensors[f"{name}.qzeros"] = torch.zeros_like(tensors[f"{name}.qzeros"])  # "1"
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = load_quantized_checkpoint(tmp_path).get_submodule(name).weight_int4
    assert torch.equal(back.to_codes()[2], torch.full_like(codes[name][2], 8))


def test_gptq_refuses_a_zero_point_it_cannot_store():
    w = torch.randn(16, 64).abs()  # all positive: every zero point is 0
    codes, scales, zeros = quantize_rtn_groups(w, 4, 32)
    assert (zeros == 0).all()
    with pytest.raises(ValueError, match="zero point of 0"):
        to_layout(codes, scales, zeros, "gptq")
    with pytest.raises(ValueError, match="integers in 0..15"):
        to_layout(codes, scales, zeros + 0.5, "awq")
