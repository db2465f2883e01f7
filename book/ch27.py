"""Chapter 27's helpers that are not the lesson: a load client, /metrics scrapes, and
the plots and tables of the stored `benchmarks/serve.py` runs (those that compare
servers are chapter 28's, in book/ch28.py).

The chapter (chapters/27_serve.md) and its lab notes
(chapters/lab_notes/27_serve_lab.md) import them; the server itself is in minillm/.
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt

CDFS = [
    ("minillm:time_to_first_token_seconds", "TTFT"),
    ("minillm:inter_token_latency_seconds", "inter-token latency"),
    ("minillm:e2e_request_latency_seconds", "end-to-end latency"),
]


def _http():
    try:
        import httpx
    except ImportError:  # recent openai releases ship it as httpx2, with the same API
        import httpx2 as httpx
    return httpx


def _samples(url: str):
    from prometheus_client.parser import text_string_to_metric_families

    text = _http().get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        yield from family.samples


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name: value} (a finish reason in brackets), without buckets."""
    values = {}
    for s in _samples(url):
        if "le" not in s.labels:
            reason = s.labels.get("finished_reason")
            values[s.name + (f"[{reason}]" if reason else "")] = s.value
    return values


def histogram(url: str, name: str) -> tuple[list[float], list[float]]:
    """(bucket upper bounds, cumulative counts) of one histogram from /metrics."""
    buckets = [
        (float(s.labels["le"]), s.value)
        for s in _samples(url)
        if s.name == name + "_bucket"
    ]
    return [b for b, _ in buckets], [v for _, v in buckets]


def timed_request(client, prompt: str, max_tokens: int = 64) -> tuple[float, float]:
    """One streamed completion through the openai client: (TTFT, end to end) s."""
    start, first = time.perf_counter(), None
    stream = client.completions.create(
        model="minillm-tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    return first - start, time.perf_counter() - start


def plot_latency_cdfs(url: str, clients: list[tuple[float, float]]) -> None:
    """The server's TTFT, ITL and end-to-end histograms as CDFs, with the clients'
    own (TTFT, end to end) measurements as dots."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, (name, title) in zip(axes, CDFS):
        bounds, cumulative = histogram(url, name)
        finite = [b != float("inf") for b in bounds]
        fraction = [c / cumulative[-1] for c in cumulative]
        ax.step(
            [b for b, f in zip(bounds, finite) if f],
            [c for c, f in zip(fraction, finite) if f],
            where="post",
            label="server histogram",
        )
        ax.set(xscale="log", xlabel="seconds", title=title, ylim=(0, 1.05))
    share = [(i + 1) / len(clients) for i in range(len(clients))]
    label = f"{len(clients)} concurrent clients"
    axes[0].plot(sorted(t for t, _ in clients), share, ".", label=label)
    axes[2].plot(sorted(e for _, e in clients), share, ".", label=label)
    axes[0].set_ylabel("share of requests ≤ x")
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency CDFs, tiny model on CPU (measured)")
    plt.tight_layout()
    plt.show()


def mode_name(run: dict) -> str:
    """How a run sent its requests: a concurrency limit, all at once, or a rate."""
    if run["max_concurrency"]:
        return f"≤{run['max_concurrency']} in flight"
    if run["request_rate"] == "inf":
        return "all at once"
    return f"{run['request_rate']:g}/s"


def plot_serve(record: dict, title: str) -> None:
    """Throughput (against the offline engine) and ITL of each run of a record."""
    runs, offline = record["runs"], record["offline"]["output_tokens_per_s"]
    names, x = [mode_name(r) for r in runs], range(len(record["runs"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    left.plot(x, [r["output_tokens_per_s"] for r in runs], "o-", label="server")
    left.axhline(offline, color="gray", ls="--", label="offline engine, same run")
    top = max(offline, *(r["output_tokens_per_s"] for r in runs))
    left.set(ylabel="output tokens/s", ylim=(0, 1.15 * top))
    right.plot(x, [r["itl_ms"]["p99"] for r in runs], "o-", label="p99")
    right.plot(x, [r["itl_ms"]["median"] for r in runs], "s-", label="median")
    right.set(ylabel="inter-token latency (ms)", ylim=(0, None))
    for ax in (left, right):
        ax.set(xticks=list(x), xticklabels=names, xlabel="request rate")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    plt.tight_layout()
    plt.show()


def print_serve(record: dict) -> None:
    """One line per run: throughput, its share of the offline engine, latencies."""
    for r in record["runs"]:
        print(
            f"{mode_name(r):>16}: {r['output_tokens_per_s']:8,.0f} tok/s "
            f"({r['fraction_of_offline']:4.0%} of offline), TTFT p50 "
            f"{r['ttft_ms']['median']:7.1f} ms, TPOT p50 {r['tpot_ms']['median']:6.1f} "
            f"ms, ITL p50/p99 {r['itl_ms']['median']:6.1f}/{r['itl_ms']['p99']:6.1f} ms"
        )


def busiest_run(runs: list[dict]) -> dict:
    """The run with every request sent at once (the most streams in flight)."""
    return next(
        r for r in runs if r["request_rate"] == "inf" and not r["max_concurrency"]
    )
