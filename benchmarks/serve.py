"""Online serving: `minillm serve` driven over HTTP with streamed completions, as
`vllm bench serve` drives vLLM, against the offline engine on the same requests.

The client is asyncio and the standard library only (hand-written HTTP/1.1, chunked
transfer decoding and server-sent events), so one process keeps hundreds of streams
open. Arrivals follow vLLM's vllm/benchmarks/serve.py (`get_request`): a Poisson
process at each `--request-rate` (exponential gaps, rescaled so the n requests span
n / rate seconds; `inf` sends them all at once), or all at once under a client-side
`--max-concurrency` limit. Metrics as vLLM defines them (`calculate_metrics` in the
same file, the client `async_request_openai_completions` in
vllm/benchmarks/lib/endpoint_request_func.py): TTFT is the first chunk with a choice,
ITL every gap between chunks, TPOT (latency - TTFT) / (tokens - 1), output tok/s the
completion tokens the server reports over the run's wall time. Each run also
records the server's CPU per output token (its front end, and the whole process
tree) and, from its /metrics, the seconds its engine's process waited to hand
outputs to the front end (`engine_send_wait_s`: a front end that falls behind).

The baseline, measured in the same run before the server starts: the same requests
through the engine's offline loop (what `LLM.generate` runs), on an engine built from
the same flags as the server.

    # a GPU: the standard workload on a Qwen3-0.6B-shaped random checkpoint
    python benchmarks/serve.py
    # a CPU: the tiny model, a scaled-down workload
    python benchmarks/serve.py --cpu
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.servers import free_port, stop, wait_healthy  # noqa: E402


# -- the client: HTTP/1.1, chunked transfer encoding, server-sent events ------------


class ChunkedDecoder:
    """Bytes of a `Transfer-Encoding: chunked` body in, the payload out, however the
    network splits them."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # payload bytes of the current chunk still to come
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while not self.done:
            if self._left > 0:
                piece = self._buf[: self._left]
                out.append(piece)
                self._left -= len(piece)
                self._buf = self._buf[len(piece) :]
                if self._left:
                    break
                self._left = -2  # the CRLF after the payload
            if self._left < 0:
                if len(self._buf) < 2:
                    break
                self._buf, self._left = self._buf[2:], 0
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                break
            size = int(self._buf[:line_end].split(b";")[0], 16)
            self._buf = self._buf[line_end + 2 :]
            if size == 0:
                self.done = True
            self._left = size
        return b"".join(out)


class SSEParser:
    """Payload bytes in, the `data:` fields of complete events out (an event ends at a
    blank line; one may arrive split over any number of reads)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip().decode())
        return out


@dataclass
class RequestResult:
    """One streamed request as the client saw it (times from time.perf_counter)."""

    start: float
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    chunks: int = 0
    success: bool = False
    error: str = ""


async def stream_completion(host: str, port: int, payload: dict) -> RequestResult:
    """POST payload to /v1/completions with stream=True; time every chunk."""
    body = json.dumps(payload).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    result = RequestResult(start=time.perf_counter())
    last = result.start
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(head + body)
        headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(headers.split(" ", 2)[1])
        chunked = "transfer-encoding: chunked" in headers.lower()
        decoder, parser = ChunkedDecoder(), SSEParser()
        while data := await reader.read(1 << 16):
            now = time.perf_counter()
            payload_bytes = decoder.feed(data) if chunked else data
            if status != 200:
                result.error += payload_bytes.decode(errors="replace")
                continue
            for message in parser.feed(payload_bytes):
                if message == "[DONE]":
                    continue
                event = json.loads(message)
                # as vLLM counts them: every chunk with a choice, text or not
                if event.get("choices"):
                    if result.chunks == 0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last, result.chunks = now, result.chunks + 1
                elif usage := event.get("usage"):
                    result.output_tokens = usage["completion_tokens"]
                elif "error" in event:
                    result.error = event["error"].get("message", message)
            if chunked and decoder.done:
                break
        result.latency = last - result.start
        result.success = status == 200 and result.chunks > 0 and not result.error
        if status != 200 and not result.error:
            result.error = f"HTTP {status}"
    finally:
        writer.close()
    return result


# -- arrivals --------------------------------------------------------------------


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """When each of n requests is sent (seconds from the start): a Poisson process of
    the given rate, its gaps rescaled so the last one lands at n / rate, as vLLM's
    get_request does; all at 0 for rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    scale = (n / rate) / times[-1]
    return [x * scale for x in times]


async def run_load(
    host: str,
    port: int,
    payloads: list[dict],
    rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
) -> tuple[list[RequestResult], float, int]:
    """Send payloads at the arrival times of rate, at most max_concurrency in flight;
    returns the results, the run's wall time and the most requests seen in flight."""
    limit = asyncio.Semaphore(max_concurrency or len(payloads))
    in_flight = peak = 0
    when = arrival_times(len(payloads), rate, seed)

    async def one(payload: dict, at: float) -> RequestResult:
        nonlocal in_flight, peak
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await stream_completion(host, port, payload)
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                return RequestResult(start=time.perf_counter(), error=repr(e))
            finally:
                in_flight -= 1

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p, at) for p, at in zip(payloads, when)))
    return list(results), time.perf_counter() - start, peak


def run_sync(coroutine):
    """asyncio.run, also where a loop is running already (a notebook): in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# -- metrics ---------------------------------------------------------------------


def stats_ms(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (numpy's linear percentile)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    k = 0.99 * (len(ordered) - 1)
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    p99 = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return {
        "mean": 1e3 * statistics.fmean(values),
        "median": 1e3 * statistics.median(values),
        "p99": 1e3 * p99,
    }


def summarize(results: list[RequestResult], seconds: float) -> dict:
    done = [r for r in results if r.success]
    tokens = sum(r.output_tokens for r in done)
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1
    ]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": seconds,
        "request_throughput": len(done) / seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([x for r in done for x in r.itl]),
        "e2el_ms": stats_ms([r.latency for r in done]),
    }


# -- the workload, the offline baseline, the server ---------------------------------


def requests_of(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """throughput.py's standard workload (token ids folded into the vocabulary)."""
    from benchmarks.throughput import workload

    prompts, output_lens = workload(args.num_requests, args.min_len, args.max_len)
    return [[t % vocab_size for t in p] for p in prompts], output_lens


def payload(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def write_id_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer.json for a random checkpoint: token i is the word `t<i>`, so the
    server has text to detokenize and stream (the offline run decodes it too)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(
        str(folder / "tokenizer.json")
    )


def micro_checkpoint(folder: Path) -> None:
    """A one-layer random Llama (hidden 64) with the tiny model's tokenizer: a step
    that costs almost nothing on a CPU, so what remains is the server, as on a GPU."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.tiny import tiny_model_path

    tiny = tiny_model_path()
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder)


def server_argv(args, folder: Path | None) -> list[str]:
    argv = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(2 * args.max_len + 16),
        "--seed",
        "0",
        "--log-level",
        "warning",
    ]
    if folder is not None:
        argv += ["--model", str(folder), "--served-model-name", "bench"]
    if args.cpu:
        argv += ["--device", "cpu", "--num-kv-blocks", str(args.num_kv_blocks)]
    else:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv


def run_offline(argv: list[str], prompts, output_lens) -> dict:
    """The same requests through the offline loop of LLM.generate (final outputs
    only), on an engine built from the server's flags, after a short warm-up."""
    import torch

    from minillm.server import build_engine, parse_args
    from minillm.sampling_params import SamplingParams

    engine, _ = build_engine(parse_args(argv))

    def generate(batch, lens) -> tuple[int, float]:
        for i, (p, n) in enumerate(zip(batch, lens)):
            params = SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True, output_kind="final_only"
            )
            engine.add_request(f"offline-{len(batch)}-{i}", p, params)
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += sum(len(c.token_ids) for c in output.outputs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    generate(prompts[:4], [8] * 4)
    cpu = time.process_time()
    tokens, seconds = generate(prompts, output_lens)
    cpu = time.process_time() - cpu
    assert tokens == sum(output_lens), "ignore_eos: every request runs to max_tokens"
    result = {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "request_throughput": len(prompts) / seconds,
        "cpu_us_per_token": 1e6 * cpu / tokens,
    }
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def python_path(root: Path) -> str:
    """root first, then the caller's path (where fastapi or uvicorn may live)."""
    return os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])


def offline_in_child(argv: list[str], prompts, output_lens, tmp: Path) -> dict:
    """run_offline in a process of its own: it leaves nothing on the device (memory,
    CUDA graphs, threads) that the server's process would then compete with."""
    job, out = tmp / "offline_job.json", tmp / "offline.json"
    job.write_text(json.dumps({"argv": argv, "prompts": prompts, "lens": output_lens}))
    env = {**os.environ, "PYTHONPATH": python_path(ROOT)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-job", str(job)]
    subprocess.run(cmd + [str(out)], env=env, check=True)
    return json.loads(out.read_text())


def start_server(
    argv: list[str], log: Path, root: Path = ROOT
) -> tuple[subprocess.Popen, str, int]:
    """`minillm serve` from the tree at root, in its own process group."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": python_path(root)}
    cmd = [sys.executable, "-m", "minillm.server", "serve", *argv, "--port", str(port)]
    out = open(log, "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    out.close()
    return proc, "127.0.0.1", port


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, all its threads (Linux's /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (the server and its engine process), from /proc."""
    found, i = [pid], 0
    while i < len(found):
        for task in Path(f"/proc/{found[i]}/task").glob("*"):
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    return found


def tree_cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each of pids still running."""
    seconds = {p: cpu_seconds(p) for p in pids}
    return {p: s for p, s in seconds.items() if s is not None}


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two readings, over the processes alive at both (a
    compile worker of the engine may come and go)."""
    return sum(after[p] - before[p] for p in before.keys() & after.keys())


def send_wait_seconds(host: str, port: int) -> float | None:
    """The server's minillm:engine_core_send_wait_seconds_total: the time its
    engine process waited to hand outputs to the front end (None: not served)."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("minillm:engine_core_send_wait_seconds_total{"):
            return float(line.rpartition(" ")[2])
    return None


def run_modes(
    host, port, model, prompts, output_lens, args, pid, on_run=None
) -> list[dict]:
    """A warm-up, then every request rate and the max-concurrency mode, in turn;
    on_run(runs) after each."""
    payloads = [payload(model, p, n) for p, n in zip(prompts, output_lens)]
    run_sync(run_load(host, port, [payload(model, p, 8) for p in prompts[:4]]))
    modes = [(rate, None) for rate in args.request_rate]
    modes += [(float("inf"), c) for c in args.max_concurrency]
    runs, pids = [], process_tree(pid)  # the engine's process too, if it has one
    for rate, limit in modes:
        server_cpu, front_cpu = tree_cpu_seconds(pids), cpu_seconds(pid)
        client_cpu, waited = time.process_time(), send_wait_seconds(host, port)
        results, seconds, peak = run_sync(
            run_load(host, port, payloads, rate, limit, seed=args.seed)
        )
        summary = summarize(results, seconds)
        # what each side spent per output token (less noisy than throughput on a
        # shared CPU): the whole server, and its front end (HTTP) process alone
        after, front_after = tree_cpu_seconds(pids), cpu_seconds(pid)
        if front_cpu is not None and front_after is not None:
            tokens = summary["output_tokens"]
            spent = cpu_spent(server_cpu, after)
            summary["server_cpu_us_per_token"] = 1e6 * spent / tokens
            summary["front_end_cpu_us_per_token"] = (
                1e6 * (front_after - front_cpu) / tokens
            )
            summary["server_processes"] = len(pids)
        # a front end that falls behind makes the engine's process wait here
        if waited is not None:
            summary["engine_send_wait_s"] = send_wait_seconds(host, port) - waited
        summary["client_cpu_us_per_token"] = (
            1e6 * (time.process_time() - client_cpu) / summary["output_tokens"]
        )
        runs.append(
            {
                "request_rate": "inf" if rate == float("inf") else rate,
                "max_concurrency": limit,
                "peak_in_flight": peak,
                **summary,
            }
        )
        print(
            f"rate {rate}, max concurrency {limit}: "
            f"{summary['output_tokens_per_s']:,.0f} output tok/s, "
            f"TTFT p50 {summary['ttft_ms']['median']:.1f} ms, "
            f"ITL p99 {summary['itl_ms']['p99']:.1f} ms, "
            f"server CPU {summary.get('server_cpu_us_per_token', 0):.0f} us/token, "
            f"engine waiting in send {summary.get('engine_send_wait_s', 0):.2f} s, "
            f"{summary['failed']} failed",
            flush=True,
        )
        if on_run is not None:
            on_run(runs)
    return runs


def serve(
    argv, log: Path, root: Path, model_name, prompts, output_lens, args, on_run=None
):
    """Start the server of the tree at root, run every mode, stop it."""
    proc, host, port = start_server(argv, log, root)

    def killed(signum, frame):  # e.g. by `timeout`: no server outlives this script
        os.killpg(proc.pid, signal.SIGKILL)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, killed)
    try:
        startup = wait_healthy(f"http://{host}:{port}", proc)
        runs = run_modes(
            host, port, model_name, prompts, output_lens, args, proc.pid, on_run
        )
    finally:
        stop(proc)
        signal.signal(signal.SIGTERM, previous)
    return {
        "server_startup_seconds": startup,
        "runs": runs,
        "server_log_tail": log.read_text()[-2000:],
    }


def git_commit(root: Path) -> str | None:
    """The commit of the tree at root: git's, or a COMMIT file of an exported tree."""
    marker = Path(root) / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
    )
    return done.stdout.strip() or None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the tiny model on the CPU, with the CPU defaults below",
    )
    p.add_argument("--model", default=None, help="a local HF folder")
    p.add_argument(
        "--micro",
        action="store_true",
        help="with --cpu: a one-layer random model instead of the tiny one (the "
        "server's own cost, nearly alone)",
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-len", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        help="requests per second, Poisson (inf: all at once); one run each",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        nargs="*",
        default=None,
        help="also a run with all requests sent at once, at most this many in flight",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=4096, help="CPU only")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also measure the server of another checkout (e.g. the commit before a "
        "change), on the same requests in the same run",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also measure this tree's server with these extra flags, on the same "
        "requests, every request at once and under --max-concurrency (the request "
        "rates below inf measure arrivals, not the server); repeat for several "
        "servers, written with '=' (e.g. --compare=--engine-in-thread "
        "--compare='--http-stack asyncio')",
    )
    p.add_argument("--name", default="serve", help="the results file's prefix")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    # GPU: the standard workload; CPU: the tiny model on a scaled-down one
    gpu = dict(
        num_requests=256,
        min_len=100,
        max_len=1024,
        request_rate=[4, 16, 64, float("inf")],
        max_concurrency=[256],
        max_num_seqs=256,
        max_num_batched_tokens=16384,
    )
    cpu = dict(
        num_requests=64,
        min_len=16,
        max_len=64,
        request_rate=[8, 32, float("inf")],
        max_concurrency=[16],
        max_num_seqs=64,
        max_num_batched_tokens=1024,
    )
    for key, value in (cpu if args.cpu else gpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    import torch

    from benchmarks.common import environment, require_committed, save

    args = parse(argv)
    require_committed()  # before measuring: stored runs are of committed code
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu for the tiny model on the CPU")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else None
        if args.micro and folder is None:
            folder = Path(tmp) / "micro"
            micro_checkpoint(folder)
        if args.cpu and folder is None:
            from minillm.tiny import tiny_model_path

            config = json.loads((tiny_model_path() / "config.json").read_text())
            vocab, model_name = config["vocab_size"], "minillm-tiny"
        else:
            if folder is None:
                from benchmarks.throughput import QWEN3_0_6B, random_checkpoint

                folder = Path(tmp) / "model"
                random_checkpoint(folder)
                write_id_tokenizer(folder, QWEN3_0_6B["vocab_size"])
            config = json.loads((folder / "config.json").read_text())
            vocab, model_name = config["vocab_size"], "bench"
        prompts, output_lens = requests_of(args, vocab)
        argv = server_argv(args, folder)
        env = environment()
        record = {
            "benchmark": "serve",
            "environment": env,
            # MINILLM_CODE_COMMIT's, where the copy's .git is stale
            "code_commit": env.get("commit") or git_commit(ROOT),
            "workload": {
                "model": str(
                    args.model
                    or ("one-layer random Llama, hidden 64" if args.micro else None)
                    or ("the tiny model" if args.cpu else "Qwen3-0.6B shape, random")
                ),
                "num_requests": args.num_requests,
                "prompt_len": [args.min_len, args.max_len],
                "output_len": [args.min_len, args.max_len],
                "token_ids": f"throughput.py's workload, folded into [0, {vocab})",
                "ignore_eos": True,
                "temperature": 0,
                "prompt_tokens": sum(map(len, prompts)),
                "output_tokens": sum(output_lens),
                "server_flags": argv,
                "client": "asyncio, stdlib HTTP/1.1 + SSE, one connection a request",
            },
        }
        if not args.skip_offline:
            record["offline"] = offline_in_child(argv, prompts, output_lens, Path(tmp))
            print(
                f"offline: {record['offline']['output_tokens_per_s']:,.0f} "
                f"output tok/s, CPU {record['offline']['cpu_us_per_token']:.0f} "
                "us/token",
                flush=True,
            )
        load = (model_name, prompts, output_lens, args)

        def partial(runs: list[dict]) -> None:  # a run cut short keeps what it has
            save(args.name, {**record, "runs": runs, "partial": True}, args.out)

        record.update(serve(argv, Path(tmp) / "server.log", ROOT, *load, partial))
        if args.baseline_tree:
            print(f"the server of {args.baseline_tree}:", flush=True)
            record["baseline_tree"] = {
                "commit": git_commit(args.baseline_tree),
                **serve(argv, Path(tmp) / "base.log", args.baseline_tree, *load),
            }
        record["compare"] = []
        busy = argparse.Namespace(**{**vars(args), "request_rate": [float("inf")]})
        for i, flags in enumerate(args.compare):
            print(f"the server with {flags}:", flush=True)
            extra, log = [*argv, *flags.split()], Path(tmp) / f"compare{i}.log"
            result = serve(extra, log, ROOT, model_name, prompts, output_lens, busy)
            record["compare"].append({"flags": flags, **result})
    if "offline" in record:
        offline = record["offline"]["output_tokens_per_s"]
        others = [record.get("baseline_tree", {}), *record["compare"]]
        for run in record["runs"] + [r for o in others for r in o.get("runs", [])]:
            run["fraction_of_offline"] = run["output_tokens_per_s"] / offline
    path = save(args.name, record, args.out)
    print("wrote", path)
    return record


if __name__ == "__main__":
    if sys.argv[1:2] == ["--offline-job"]:  # the child of offline_in_child
        job = json.loads(Path(sys.argv[2]).read_text())
        result = run_offline(job["argv"], job["prompts"], job["lens"])
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        main()
