"""Searched group ranges (chapters/18_quantization.md, "Round to nearest" and
"Choosing GPTQ's default"): mse_group_params against a per-group loop over the same
shrink factors; GPTQ with searched ranges against its closed-form reference; the
flag carried through RTN, sequential GPTQ and the engine's cache key."""

import pytest
import torch

from minillm.config import EngineConfig
from minillm.quantization import apply, methods
from minillm.quantization.calibration import token_windows
from minillm.quantization.gptq import gptq_quantize, gptq_reference
from minillm.quantization.rtn import (
    group_params,
    mse_group_params,
    quantize_rtn_groups,
    quantize_with,
)


def naive_search(row: torch.Tensor, bits: int, sym: bool, grid=100, shrink=0.8):
    """One group at a time, in Python: the first shrink factor of least error."""
    best, best_err = None, float("inf")
    for i in range(int(shrink * grid)):
        s, z = group_params(row[None, :] * (1 - i / grid), bits, sym)
        q = quantize_with(row[None, :], s, z, bits)
        err = float(((q - z[:, None]) * s[:, None] - row).abs().pow(2.4).sum())
        if err < best_err:
            best, best_err = (float(s), float(z)), err
    return best


@pytest.mark.parametrize("sym", [False, True])
def test_the_search_is_a_per_group_argmin_over_the_shrink_factors(sym):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=gen)
    w[::3, 5] *= 8  # outliers: the groups where clipping pays
    scales, zeros = mse_group_params(w, 4, sym)
    for r in range(len(w)):
        s, z = naive_search(w[r], 4, sym)
        assert float(scales[r]) == pytest.approx(s, rel=1e-12) and float(zeros[r]) == z
    plain = group_params(w, 4, sym)
    assert (scales <= plain[0]).all()  # shrunk or not, never widened
    assert (scales < plain[0]).any()  # and some group was clipped


def test_gptq_with_searched_ranges_equals_its_closed_form_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=gen, dtype=torch.float64)
    x = x @ torch.randn(64, 64, generator=gen, dtype=torch.float64)
    w, h = torch.randn(8, 64, generator=gen, dtype=torch.float64), x.T @ x
    fast = gptq_quantize(w, h, 4, 16, block_size=32, mse=True)
    slow = gptq_reference(w, h, 4, 16, mse=True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[2], slow[2])
    assert torch.allclose(fast[1], slow[1])
    plain = gptq_quantize(w, h, 4, 16, block_size=32)
    assert not torch.equal(fast[1], plain[1])  # the flag reached the groups


def test_rtn_with_searched_ranges_uses_the_search():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    codes, scales, zeros = quantize_rtn_groups(w, 4, 64, mse=True)
    s, z = mse_group_params(w.reshape(-1, 64), 4)
    assert torch.equal(scales, s.reshape(16, 2))
    assert torch.equal(zeros, z.reshape(16, 2))


def test_sequential_gptq_passes_the_flag_on(tiny):
    model, tokenizer = tiny
    windows = token_windows(tokenizer, "train", 2, 32)
    one = "model.layers.0.mlp.down_proj"
    args = dict(group_size=64, act_order=True, windows=windows)
    plain = apply.int4_codes(model, "gptq-seq", None, **args)[one]
    searched = apply.int4_codes(model, "gptq-seq", None, mse=True, **args)[one]
    assert not torch.equal(plain[1], searched[1])


def test_the_engine_option_is_in_the_cache_key():
    on = methods._settings("gptq", EngineConfig(gptq_mse=True))
    off = methods._settings("gptq", EngineConfig(gptq_mse=False))
    assert on != off


def test_gptq_has_a_group_size_of_its_own():
    c = EngineConfig(gptq_group_size=32, int4_group_size=128)
    assert methods._settings("gptq", c)["g"] == 32
    assert methods._settings("awq", c)["g"] == 128  # AWQ keeps chapter 17's
    c = EngineConfig(gptq_group_size=None, int4_group_size=64)
    assert methods._settings("gptq", c)["g"] == 64
    for bad in (20, 0, True, 32.0):
        with pytest.raises(ValueError, match="gptq_group_size"):
            EngineConfig(quantization="gptq", gptq_group_size=bad)


def test_the_grid_benchmark_marks_the_engine_default_and_pairs_its_ratios(
    tmp_path, monkeypatch
):
    """benchmarks/gptq_quality.py on the tiny model: the row the engine's defaults
    build is marked (a grid row where one is the same), and every stored ratio is
    the paired bootstrap of its window losses against bf16's."""
    import json
    import sys
    from pathlib import Path

    from minillm.quantization.quality import ppl_ratio

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import gptq_quality

    monkeypatch.setenv("MINILLM_FORCE_STORE", "1")  # the tree may be uncommitted
    gptq_quality.main(["--model", "tiny", "--calib", "2", "32", "--held-out", "64",
                       "64", "--rows", "rtn-g64", "default", "--threads", "1",
                       "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("gptq_quality-*.json")
    run = json.loads(path.read_text())
    assert [r["key"] for r in run["rows"]][:2] == ["bf16", "rtn-g64"]
    (default,) = [r for r in run["rows"] if r["engine_default"]]
    c = EngineConfig()
    assert default["settings"]["group_size"] == methods.gptq_group_size(c)
    assert default["settings"]["mse"] == c.gptq_mse
    for row in run["rows"]:
        again = ppl_ratio(run, row["label"], "bf16 (unquantized)")
        assert list(again) == pytest.approx([row["ratio"], *row["ratio_interval"]])
