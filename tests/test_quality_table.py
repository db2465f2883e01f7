"""Chapter 19's quality table: the stored SmolLM2 table is the one the chapter asks
for (its key hashes the weights, the sizes and the code the rows run, so a change
to a quantizer makes the stored copy stale, and this file says so loudly instead of
letting the book recompute it or serve an old one), and its intervals are what the
bootstrap defines."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm.quantization import quality
from minillm.quantization.quality import (
    SMOLLM2_TABLE,
    TABLE_MODULES,
    command,
    ppl_interval,
    ppl_ratio,
    quality_key,
    resampled_means,
    sources_hash,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CHAPTER = ROOT / "chapters" / "19_quantized_serving.md"


@pytest.fixture(scope="module")
def smol_key() -> str:
    return quality_key("smollm2", **SMOLLM2_TABLE)[0]


def test_the_chapter_reads_the_stored_smollm2_table_and_never_computes_it():
    call = 'quality_table("smollm2", **SMOLLM2_TABLE, stored=RESULTS, compute=False)'
    assert call in CHAPTER.read_text()


def test_the_stored_smollm2_table_is_the_one_the_chapter_asks_for(smol_key):
    path = RESULTS / f"quality-{smol_key}.json"
    assert path.is_file(), (
        f"benchmarks/results/{path.name} is missing: the quantization code, the "
        "weights or the sizes changed since the stored table was computed. Run\n  "
        f"{command('smollm2', **SMOLLM2_TABLE)} --store benchmarks/results\n"
        "(about an hour on two cores) and delete the stale quality-*.json."
    )


def test_no_stale_quality_table_is_stored(smol_key):
    stored = sorted(p.name for p in RESULTS.glob("quality-*.json"))
    assert stored == [f"quality-{smol_key}.json"], stored


def test_every_stored_row_has_its_windows_and_its_bootstrap_interval(smol_key):
    path = RESULTS / f"quality-{smol_key}.json"
    if not path.is_file():
        pytest.skip("no stored table (the test above says why)")
    table = json.loads(path.read_text())
    assert table["held_out"][0] >= 64
    assert table["bootstrap"] == {"resamples": 2000, "level": 0.95, "seed": 0}
    for row in table["rows"]:
        nll = torch.tensor(row["window_nll"], dtype=torch.float64)
        assert len(nll) == table["held_out"][0]
        assert row["ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-12)
        assert row["ppl_interval"] == pytest.approx(ppl_interval(nll), rel=1e-12)


def test_the_key_hashes_every_quantization_module_the_table_imports():
    """TABLE_MODULES lists what the rows run: every minillm.quantization module
    that importing the table pulls in must be in it (a new one would otherwise
    change the rows without changing the key)."""
    code = (
        "import sys, minillm.quantization.quality; "
        "print(' '.join(m for m in sys.modules if m.startswith('minillm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    imported = {
        m.removeprefix("minillm.quantization.")
        for m in out.stdout.split()
        if m.startswith("minillm.quantization.")
    }
    assert imported and imported <= set(TABLE_MODULES), imported - set(TABLE_MODULES)


def test_the_sources_hash_sees_code_but_not_origin_lines_or_docstrings(tmp_path):
    package = ROOT / "minillm"
    copy = tmp_path / "minillm"
    for name in [*(f"quantization/{m}.py" for m in TABLE_MODULES), "kernels/w8a8.py"]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(package / name, copy / name)
    assert sources_hash(copy) == sources_hash(package)
    gptq = copy / "quantization" / "gptq.py"
    text = gptq.read_text()
    marker = next(x for x in text.splitlines() if x.startswith("# %% "))
    gptq.write_text(text.replace(marker, "# %% chapters/18_quantization.md:99999"))
    assert sources_hash(copy) == sources_hash(package)  # the prose moved, not code
    renumbered = text.replace("chapter 18", "chapter 99").replace("16_quant", "99_q")
    assert renumbered != text  # its header and docstrings name the chapter
    gptq.write_text(renumbered)
    assert sources_hash(copy) == sources_hash(package)  # words, not code
    gptq.write_text(text.replace("damp: float = 0.01", "damp: float = 0.02", 1))
    assert sources_hash(copy) != sources_hash(package)


def test_told_not_to_compute_a_missing_table_is_an_error_with_the_command(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(quality, "default_cache_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="--held-out 64 128"):
        quality.quality_table(
            "tiny", (8, 128), (64, 128), 128, stored=tmp_path, compute=False
        )


def test_the_bootstrap_is_seeded_and_pairs_rows_on_the_same_windows():
    gen = torch.Generator().manual_seed(0)
    nll = torch.rand(64, generator=gen, dtype=torch.float64) + 2
    assert torch.equal(resampled_means(nll), resampled_means(nll))
    lo, hi = ppl_interval(nll)
    assert lo < math.exp(float(nll.mean())) < hi
    table = {
        "rows": [
            {"label": "a", "window_nll": nll.tolist()},
            {"label": "b", "window_nll": (nll + 0.1).tolist()},  # worse everywhere
            {
                "label": "c",
                "window_nll": (nll + torch.randn(64, generator=gen)).tolist(),
            },
        ]
    }
    r, lo, hi = ppl_ratio(table, "b", "a")  # a constant shift: no spread at all
    assert r == pytest.approx(math.exp(0.1)) and lo == pytest.approx(r)
    assert hi == pytest.approx(r)
    r, lo, hi = ppl_ratio(table, "c", "a")  # noise as large as the spread: wide
    assert lo < r < hi and hi / lo > 1.2
