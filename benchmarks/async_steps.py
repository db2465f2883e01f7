"""Async scheduling against stepping in order (chapter 16, issue 46 target 1): decode
steps per second of the same engine with `async_scheduling=False` and with its default,
at several batch sizes, on the course's tiny model and on a Qwen3-0.6B-shaped model.

Both engines of a (model, batch) pair are built once and timed in alternating rounds
(--rounds), each round --steps whole `engine.step()` calls of greedy decoding after the
prompts' prefill; the median round and the spread are stored. With --profile, one
extra round of each at batch 1 runs under cProfile and its busiest functions (own
time) are stored beside the timings, so that where the CPU's time goes can be read.
With --trace B ..., one more round of each at those batch sizes runs under
torch.profiler: the GPU's busy time per step beside the wall time, and the device work
and CUDA runtime calls of a step.

    python benchmarks/async_steps.py [--models tiny qwen3-0.6b] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import engine_settings, environment, require_committed, save  # noqa: E402
from benchmarks.profile_step import ms_per_step  # noqa: E402
from benchmarks.throughput import random_checkpoint  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.hf import load_model  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

MODES = {"in order": {"async_scheduling": False}, "async (default)": {}}


def load(name: str, tmp: Path):
    if name == "tiny":
        from minillm.tiny import tiny_model

        return tiny_model(device="cuda", dtype=torch.float32, progress=False)[0]
    random_checkpoint(tmp / name, shape=name)
    return load_model(tmp / name, dtype=torch.bfloat16, device="cuda")


def engine_for(model, batch: int, options: dict, tokens: int) -> LLMEngine:
    """An engine with `batch` requests decoding, prefilled and warmed up."""
    max_model_len = 64 + tokens + 16
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            max_num_seqs=max(batch, 2),
            max_model_len=max_model_len,
            num_kv_blocks=max(batch, 2) * (max_model_len // 16 + 2) + 2,
            **options,
        ),
    )
    rng, vocab = random.Random(0), model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(64)], params)
    for _ in range(8):
        engine.step()  # prefill, then warm-up decode steps
    return engine


def round_ms(engine: LLMEngine, steps: int) -> float:
    return ms_per_step(engine, 0, steps)


def profile_lines(engine: LLMEngine, steps: int, top: int = 30) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    round_ms(engine, steps)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def timeline(engine: LLMEngine, steps: int) -> dict:
    """A torch.profiler round (CPU and CUDA): the wall time of a step, the time the
    GPU was busy in it (the union of its kernels and copies), and per step the device
    work and the CUDA runtime calls by name, with their counts and time."""
    from torch.profiler import ProfilerActivity, profile

    round_ms(engine, 10)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = round_ms(engine, steps)
    events = prof.profiler.kineto_results.events()
    device, runtime = [], {}
    for e in events:
        start, length, name = e.start_ns(), e.duration_ns(), e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            device.append((start, start + length, name))
        elif name.startswith(("cuda", "cu")) and not name.startswith("cuda::"):
            n, t = runtime.get(name, (0, 0))
            runtime[name] = (n + 1, t + length)
    device.sort()
    busy, end, kinds = 0, 0, {}
    for start, stop, name in device:
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
        n, t = kinds.get(name[:60], (0, 0))
        kinds[name[:60]] = (n + 1, t + stop - start)

    def per_step(table):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:20]
        return {k: [n / steps, t / steps / 1e3] for k, (n, t) in rows}

    return {"wall_ms_per_step": wall, "gpu_busy_ms_per_step": busy / steps / 1e6,
            "device_ops_per_step": per_step(kinds),  # [count, us] a step
            "runtime_calls_per_step": per_step(runtime)}  # fmt: skip


def measure(model, batch: int, args) -> dict:
    tokens = 8 + args.steps * (args.rounds + 1) + 8
    engines = {m: engine_for(model, batch, o, tokens) for m, o in MODES.items()}
    times = {m: [] for m in MODES}
    for _ in range(args.rounds):  # alternating: drift hits both alike
        for mode, engine in engines.items():
            times[mode].append(round_ms(engine, args.steps))
    row = {"batch": batch, "ms_per_step": {}, "ms_per_step_rounds": times}
    for mode in MODES:
        row["ms_per_step"][mode] = statistics.median(times[mode])
    row["settings"] = {m: engine_settings(e) for m, e in engines.items()}
    if args.profile and batch == 1:
        row["profile"] = {m: profile_lines(e, args.steps) for m, e in engines.items()}
    if args.trace and batch in args.trace:
        row["trace"] = {m: timeline(e, args.steps) for m, e in engines.items()}
        for m, t in row["trace"].items():
            print(f"  {m}: wall {t['wall_ms_per_step']:.3f} ms, GPU busy "
                  f"{t['gpu_busy_ms_per_step']:.3f} ms a step")  # fmt: skip
    a, b = (row["ms_per_step"][m] for m in MODES)
    row["async_speedup"] = a / b
    print(f"batch {batch:3d}: in order {a:.3f} ms, async {b:.3f} ms ({a / b:.2f}x)")
    del engines
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--trace", nargs="*", type=int, default=[], help="batch sizes to trace too"
    )
    parser.add_argument("--name", default="async_steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/async_steps.py times GPU steps: no CUDA device found")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            print(name, flush=True)
            model = load(name, Path(tmp))
            runs[name] = [measure(model, b, args) for b in args.batches]
            del model
    record = {
        "benchmark": "async_steps",
        "environment": environment(),
        "workload": {
            "models": {
                "tiny": "the course's tiny model, float32",
                "qwen3-0.6b": "Qwen3-0.6B shape, random weights, bfloat16",
            },
            "prompt_tokens": 64,
            "sampling": "greedy, ignore_eos",
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "timed": "whole engine.step() calls of decoding, rounds alternating "
            "between the two engines; median round",
            "modes": {m: o for m, o in MODES.items()},
        },
        "runs": runs,
    }
    save(args.name, record, args.out or Path(__file__).parent / "results")


if __name__ == "__main__":
    main()
