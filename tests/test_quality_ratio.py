"""The paired bootstrap of a perplexity ratio (chapters/19_quantized_serving.md, "The
quality table"): quality.ppl_ratio against a naive computation written out in
Python, resample by resample, from the same draws."""

import math

import pytest
import torch

from minillm.quantization.quality import LEVEL, RESAMPLES, SEED, ppl_ratio


def naive_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Perplexity of a over perplexity of b on the windows, and the percentile
    interval of that ratio over resamples that draw the same windows for both."""
    n = len(a)
    g = torch.Generator().manual_seed(SEED)
    draws = torch.randint(n, (RESAMPLES, n), generator=g).tolist()  # the same draws
    ratios = []
    for idx in draws:
        ppl_a = math.exp(sum(a[i] for i in idx) / n)
        ppl_b = math.exp(sum(b[i] for i in idx) / n)
        ratios.append(ppl_a / ppl_b)
    logs = sorted(math.log(r) for r in ratios)

    def percentile(q: float) -> float:  # between the two nearest ranks, linear in
        pos = q * (len(logs) - 1)  # the log (the ranks are the ratio's)
        lo = math.floor(pos)
        hi = min(lo + 1, len(logs) - 1)
        return math.exp(logs[lo] + (pos - lo) * (logs[hi] - logs[lo]))

    point = math.exp(sum(a) / n) / math.exp(sum(b) / n)
    return point, percentile((1 - LEVEL) / 2), percentile((1 + LEVEL) / 2)


@pytest.mark.parametrize("n", [64, 97])
def test_ppl_ratio_is_the_naive_paired_bootstrap(n):
    gen = torch.Generator().manual_seed(n)
    b = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 + 2).tolist()
    a = [x + 0.05 + 0.1 * float(torch.randn(1, generator=gen)) for x in b]
    table = {"rows": [{"label": "a", "window_nll": a}, {"label": "b", "window_nll": b}]}
    got = ppl_ratio(table, "a", "b")
    want = naive_ratio(a, b)
    assert got == pytest.approx(want, rel=1e-9)
    assert got[1] < got[0] < got[2]


def test_an_unpaired_bootstrap_would_be_wider():
    """Pairing is the point: windows hard for both rows cancel in the ratio."""
    gen = torch.Generator().manual_seed(3)
    b = (torch.rand(64, generator=gen, dtype=torch.float64) * 3 + 1).tolist()
    a = [x * 1.02 for x in b]  # 2% more loss on every window, a wide spread
    table = {"rows": [{"label": "a", "window_nll": a}, {"label": "b", "window_nll": b}]}
    _, lo, hi = ppl_ratio(table, "a", "b")
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    ta, tb = torch.tensor(a).double(), torch.tensor(b).double()
    ia = torch.randint(64, (RESAMPLES, 64), generator=g1)
    ib = torch.randint(64, (RESAMPLES, 64), generator=g2)
    unpaired = (ta[ia].mean(1) - tb[ib].mean(1)).exp()
    q = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    ulo, uhi = torch.quantile(unpaired, q).tolist()
    assert hi - lo < (uhi - ulo) / 5
