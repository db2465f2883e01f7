"""Checks for chapter 14's exercise (the skinny product). See _check.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _check import answer, attempted

triton = pytest.importorskip("triton")

from minillm.kernels import skinny_gemm  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


# 13.1 --------------------------------------------------------------------------------


def test_faster_backend():
    fn = answer(skinny_gemm, "faster_backend", "14.1")
    found = sorted(RESULTS.glob("decode_gemm-*.json"))
    if not found:
        pytest.skip("no stored decode_gemm result")
    record = json.loads(found[-1].read_text())
    expected = {
        (r["M"], r["N"], r["K"]): "cublas"
        if r["cublas_us"] < r["skinny_us"]
        else "skinny"
        for r in record["rows"]
    }
    assert "cublas" in expected.values() and "skinny" in expected.values()
    for (M, N, K), backend in expected.items():
        assert attempted(fn, "14.1", record, M, N, K) == backend, (M, N, K)
    # shapes the record did not measure: the rule linear() follows
    for M, N, K in ((3, 1024, 2048), (16, 77, 99), (1, 4096, 4096)):
        assert (M, N, K) not in expected and fn(record, M, N, K) == "skinny"
    for M in (17, 64, 4096):
        assert fn(record, M, 1024, 2048) == "cublas"
