"""The parts of benchmarks/compare_vllm.py and minillm.loadgen that decide what
chapter 29 reports: the workloads, the first divergence, which server replies count
as the same, and the client-side latencies. No vLLM needed: the comparisons are
checked on made-up replies, the load generator against chapter 27's server."""

from __future__ import annotations

import pytest

from benchmarks.compare_vllm import (
    compare_requests,
    equality_prompts,
    first_divergence,
    parse_profile_table,
    throughput_workload,
)
from minillm.loadgen import RequestTiming, percentiles


def test_equality_prompts_are_windows_of_mixed_lengths():
    stream = list(range(5000))
    prompts = equality_prompts(stream, n=64, seed=0)
    lens = [len(p) for p in prompts]
    assert len(prompts) == 64
    assert all(1 <= n <= 16 for n in lens[:16])
    assert all(17 <= n <= 128 for n in lens[16:48])
    assert all(129 <= n <= 512 for n in lens[48:])
    for p in prompts:  # a window: consecutive tokens of the stream
        assert p == stream[p[0] : p[0] + len(p)]
    assert equality_prompts(stream, n=64, seed=0) == prompts


def test_throughput_workload_is_seeded_and_in_range():
    prompts, outputs = throughput_workload(vocab=300, n=32, low=12, high=128)
    assert len(prompts) == len(outputs) == 32
    assert all(12 <= len(p) <= 128 for p in prompts)
    assert all(12 <= m <= 128 for m in outputs)
    assert all(0 <= t < 300 for p in prompts for t in p)
    assert throughput_workload(vocab=300, n=32, low=12, high=128) == (prompts, outputs)


def test_first_divergence_names_the_first_differing_token():
    a = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    assert first_divergence(a, [list(x) for x in a]) is None
    b = [[1, 2, 3], [4, 5, 0, 7, 8], [0]]
    got = first_divergence(a, b)
    assert (got["prompt"], got["token"]) == (1, 2)
    assert got["minillm"] == [6, 7, 8] and got["vllm"] == [0, 7, 8]
    # one output a prefix of the other: they part where the shorter one ends
    assert first_divergence([[1, 2]], [[1, 2, 3]])["token"] == 2


def test_replies_are_the_same_up_to_the_message_and_logprob_noise():
    ok = {"status": 200, "text": ["Paris"], "usage": [5, 1], "logprobs": [-0.5]}
    err = {"status": 400, "type": "BadRequestError", "message": "ours"}
    ours = [
        {"name": "a", "result": ok},
        {"name": "b", "result": err},
        {"name": "c", "result": ok},
    ]
    theirs = [
        {"name": "a", "result": dict(ok, logprobs=[-0.5001])},
        {"name": "b", "result": dict(err, message="theirs, worded otherwise")},
        {"name": "c", "result": dict(ok, usage=[5, 2])},
    ]
    rows = compare_requests(ours, theirs)
    assert [r["same"] for r in rows] == [True, True, False]
    assert rows[0]["max_logprob_diff"] == pytest.approx(1e-4)
    assert rows[1]["minillm"]["message"] == "ours"  # kept, shown, not compared
    other_type = [{"name": "b", "result": dict(err, type="Bad Request")}]
    assert not compare_requests(ours[1:2], other_type)[0]["same"]


def test_parse_profile_table_reads_torch_profilers_columns():
    table = (
        "-------------  ------------  ------------  ------------\n"
        "         Name    Self CPU %      Self CPU    # of Calls\n"
        "-------------  ------------  ------------  ------------\n"
        "     aten::mm        56.20%       1.590s          3376\n"
        "  aten::index         6.35%     179.000ms         1952\n"
        "-------------  ------------  ------------  ------------\n"
        "Self CPU time total: 2.823s\n"
    )
    rows = parse_profile_table(table)
    assert rows == [
        {"name": "aten::mm", "self_cpu_pct": 56.2, "calls": 3376},
        {"name": "aten::index", "self_cpu_pct": 6.35, "calls": 1952},
    ]


def test_timings_and_percentiles_follow_their_definitions():
    t = RequestTiming(start=1.0, chunk_times=[1.2, 1.25, 1.35], end=1.4)
    t.completion_tokens = 5
    assert t.ttft == pytest.approx(0.2)
    assert t.itls == pytest.approx([0.05, 0.1])
    assert t.tpot == pytest.approx(0.2 / 4)  # after the first token: 4 more
    p = percentiles([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles([0.002]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}
