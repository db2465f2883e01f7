"""Where a batch-1 speculative step's time goes (chapter 21): the engine's CPU time
per phase, the GPU's kernels of a verification step against a plain decode step, and
the skinny product's time at the verification's row counts.

On the course's tiny model (float32) at batch 1, the "repetitive" workload of
benchmarks/speculative.py, 64 greedy tokens, on chapter 15's fast path:

1. `phases`: for each configuration (no speculation, n-gram k = 3, EAGLE k = 3 and
   k = 8), the wall time per step of the engine's parts, timed by wrapping them in
   place (inclusive: a part's time contains the parts it calls), the number of
   host waits (`.tolist()`, `.item()`, event synchronisations) and a cProfile
   listing of one pass (`*_cprofile.txt`).
2. `kernels`: torch.profiler's CUDA kernel table of replaying the one-token decode
   graph and the verification graph (1 + k decode rows), and of one engine pass.
3. `skinny`: the skinny product's device time (CUDA events, median of 50) on the
   tiny model's projections at M = 1, 2, 4, 6, 9, 16 rows, float32, on the CUDA
   cores (use_dot=False) and the tensor cores' emulated IEEE dot (use_dot=True).
4. `ab`: the verification graph and EAGLE's draft graph with the previous choices
   (float32 products on the emulated dot from 3 rows; the draft uncompiled).

    python benchmarks/speculative_profile.py --out /tmp   # on a GPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from benchmarks.speculative import replay_ms, step_parts  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.kernels import skinny_gemm  # noqa: E402
from minillm.registry import load_plugins  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.speculative import runner as spec_runner  # noqa: E402
from minillm.speculative.eagle_graphs import EagleGraphRunner  # noqa: E402
from minillm.speculative.workloads import held_out_prompts  # noqa: E402
from minillm.tiny import tiny_model  # noqa: E402

CONFIGS = {
    "none": None,
    "none, in step": "no async scheduling",
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram k=3 lookup 1..4": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
    },
    "eagle k=3": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle k=8": {"method": "eagle", "num_speculative_tokens": 8},
}


def build(model, tokenizer, spec) -> LLMEngine:
    options = {}
    if isinstance(spec, str):  # no speculation, each step run in step
        spec, options = None, {"async_scheduling": False}
    config = EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=1024, num_kv_blocks=84,
        persistent_batch=True,
        speculative_config=None if spec is None else
        {**spec, "disable_by_batch_size": None}, **options,
    )  # fmt: skip
    return LLMEngine(model, tokenizer, config)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_pass(engine, prompt, tag) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.add_request(tag, prompt, params)
    steps0 = engine.num_steps
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return time.perf_counter() - start, engine.num_steps - steps0


class Phases:
    """Wraps methods in place; inclusive wall time and calls per name."""

    def __init__(self):
        self.seconds, self.calls, self.undo = defaultdict(float), defaultdict(int), []

    def wrap(self, obj, attr: str, name: str) -> None:
        if obj is None or not hasattr(obj, attr):
            return
        fn = getattr(obj, attr)
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                calls[name] += 1

        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        setattr(obj, attr, timed)
        self.undo.append((obj, attr, fn if had else None))

    def restore(self) -> None:
        for obj, attr, fn in reversed(self.undo):
            if fn is None:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, fn)
        self.undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def wrap_engine(phases: Phases, engine) -> None:
    runner = engine.model_runner
    w = phases.wrap
    w(engine, "step", "engine.step (all)")
    w(engine, "_schedule", "schedule")
    w(engine.scheduler, "update_from_output", "scheduler.update_from_output")
    w(engine, "process_outputs", "process_outputs (detokenize, stop, outputs)")
    w(engine.stepper, "_take_tokens", "async: take_tokens (waits)")
    w(runner, "launch", "runner.launch")
    w(runner, "execute_model", "runner.execute_model")
    w(runner, "forward", "runner.forward (prepare + launch)")
    w(runner, "patch_for_pending", "spec: patch_for_pending")
    w(runner, "settle_proposals", "spec: settle_proposals (waits for drafts)")
    w(runner, "verify_and_propose", "spec: verify_and_propose")
    w(runner, "verify_greedy", "spec: verify_greedy (logits, argmax, wait)")
    w(runner, "propose", "spec: propose")
    w(runner, "cut_at_stop", "spec: cut_at_stop")
    verify = getattr(runner, "verify_graphs", None)
    for graphs, name in ((runner.graph_runner, "decode"), (verify, "verify")):
        w(graphs, "run", f"graphs: {name} run (host copies + replay)")
    proposer = getattr(runner, "proposer", None)
    w(proposer, "observe", "eagle: observe (features)")
    w(proposer, "propose_async", "eagle: propose_async")
    w(getattr(proposer, "graphs", None), "run", "eagle: draft graph run")
    w(spec_runner, "upload", "upload (host->device index copies)")
    for cls, attr, name in (
        (torch.Tensor, "tolist", "waits: Tensor.tolist"),
        (torch.Tensor, "item", "waits: Tensor.item"),
        (torch.cuda.Event, "synchronize", "waits: Event.synchronize"),
        (torch.cuda.CUDAGraph, "replay", "graph replay calls"),
    ):
        w(cls, attr, name)
    import minillm.gpu_model_runner as gmr

    w(gmr, "prepare_inputs", "prepare_inputs")


def step_kinds(engine) -> dict[str, list[float]]:
    """Wraps engine.step (outermost) to sort each call's wall time by what its
    step did: verified drafts, proposed without verifying, or neither."""
    runner, step = engine.model_runner, engine.step
    stats = getattr(runner, "spec_stats", None)
    kinds: dict[str, list[float]] = defaultdict(list)

    def timed():
        drafts = stats.num_drafts if stats else 0
        waiting = engine.scheduler.requests.values()
        fresh = any(r.num_output_tokens == 0 for r in waiting)
        start = time.perf_counter()
        out = step()
        took = time.perf_counter() - start
        kind = "plain"
        if fresh:  # a prompt's step (with async scheduling: the one after it)
            kind = "prompt"
        elif stats is not None and stats.num_drafts > drafts:
            kind = "verified"
        kinds[kind].append(took)
        return out

    engine.step = timed
    return kinds


def phases_of(model, tokenizer, prompt, out: Path, repeats: int, names) -> dict:
    result = {}
    for name in names:
        try:  # a failure leaves the other configurations their rows
            result[name] = phases_of_one(model, tokenizer, prompt, out, repeats, name)
        except Exception as e:
            traceback.print_exc()
            result[name] = {"error": repr(e)}
    return result


def phases_of_one(model, tokenizer, prompt, out: Path, repeats: int, name) -> dict:
    engine = build(model, tokenizer, CONFIGS[name])
    one_pass(engine, prompt, "warm")
    times = [one_pass(engine, prompt, f"t{i}") for i in range(repeats)]
    phases = Phases()
    wrap_engine(phases, engine)
    per_step = step_kinds(engine)
    steps = 0
    for i in range(repeats):
        steps += one_pass(engine, prompt, f"p{i}")[1]
    phases.restore()  # step_kinds' wrapper too
    prof = cProfile.Profile()
    prof.enable()
    one_pass(engine, prompt, "cprofile")
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    slug = "".join(c for c in name.replace(" ", "_") if c.isalnum() or c in "_")
    (out / f"phases_{slug}_cprofile.txt").write_text(text.getvalue())
    seconds = statistics.median(t for t, _ in times)
    row = {
        "pass_seconds": seconds,
        "steps": times[-1][1],
        "ms_per_step": 1e3 * seconds / times[-1][1],
        "tok_s": 64 / seconds,
        "per_step_us": {
            k: round(1e6 * v / steps, 1) for k, v in sorted(phases.seconds.items())
        },
        "calls_per_step": {
            k: round(v / steps, 2) for k, v in sorted(phases.calls.items())
        },
        "step_parts_ms": step_parts(engine.model_runner),
        # engine.step() wall time by what the step did: [median us, count]
        "step_us_by_kind": {
            k: [round(1e6 * statistics.median(v), 1), len(v)]
            for k, v in per_step.items()
        },
    }
    stats = getattr(engine.model_runner, "spec_stats", None)
    if stats is not None:
        row["tau"] = stats.mean_acceptance_length
    print(f"== {name}: {row['ms_per_step']:.3f} ms/step, {row['tok_s']:.0f} "
          f"tok/s, {row['steps']} steps, parts {row['step_parts_ms']}, "
          f"by kind {row['step_us_by_kind']}", flush=True)  # fmt: skip
    for k, v in row["per_step_us"].items():
        print(f"   {k:50} {v:9.1f} us/step  {row['calls_per_step'][k]:6.2f} calls")
    if name in ("none", "eagle k=8") and torch.cuda.is_available():
        row["kernels"] = kernel_tables(engine, prompt, out, slug)
    return row


def table(prof, n: int = 40) -> str:
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=n)


def kernel_tables(engine, prompt, out: Path, slug: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runner, info = engine.model_runner, {}
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    graphs = {"decode": runner.graph_runner.graphs.get(1)}
    verify = getattr(runner, "verify_graphs", None)
    if verify is not None and verify.graphs:
        graphs["verify"] = verify.graphs[verify.sizes[0]]
    draft = getattr(getattr(runner, "proposer", None), "graphs", None)
    if draft is not None and 1 in draft.graphs:
        graphs["draft"] = draft.graphs[1]
    for name, graph in graphs.items():
        if graph is None:
            continue
        with torch.inference_mode():
            with profile(activities=acts) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
        text = table(prof)
        (out / f"kernels_{slug}_{name}_graph.txt").write_text(text)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        info[f"{name}_graph_kernels_per_replay"] = len(kernels) / 5
        info[f"{name}_graph_kernel_us_per_replay"] = (
            sum(e.device_time for e in kernels) / 5
        )
        print(f"   {name} graph: {len(kernels) / 5:.0f} kernels per replay, "
              f"{info[f'{name}_graph_kernel_us_per_replay']:.1f} us of kernels",
              flush=True)  # fmt: skip
    with profile(activities=acts) as prof:
        one_pass(engine, prompt, "torch-profile")
    (out / f"kernels_{slug}_pass.txt").write_text(table(prof, 50))
    prof.export_chrome_trace(str(out / f"trace_{slug}.json"))
    return info


def skinny_sweep() -> list[dict]:
    # the tiny model's products: qkv merged, o, gate_up merged, down, lm_head
    shapes = {"qkv": (512, 256), "o": (256, 256), "gate_up": (1536, 256),
              "down": (256, 768), "lm_head": (2048, 256)}  # fmt: skip
    rows = []
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda") / 16
        for M in (1, 2, 4, 6, 9, 16):
            x = torch.randn(M, K, device="cuda")
            row = {"name": name, "M": M, "N": N, "K": K}
            for use_dot in (False, True):
                skinny_gemm.skinny_linear(x, w, use_dot=use_dot)
                row[f"use_dot={use_dot}"] = 1e3 * replay_ms(
                    lambda: skinny_gemm.skinny_linear(x, w, use_dot=use_dot)
                )
            row["cublas"] = 1e3 * replay_ms(lambda: torch.nn.functional.linear(x, w))
            rows.append(row)
            print(f"skinny {name:8} M={M:2}: cuda cores {row['use_dot=False']:6.1f} us,"
                  f" dot {row['use_dot=True']:6.1f} us, cuBLAS {row['cublas']:6.1f} us",
                  flush=True)  # fmt: skip
    return rows


def ab(model, tokenizer, prompt, labels, save_now) -> dict:
    """The verification and draft graphs with the previous choices."""
    result = {}
    old = skinny_gemm.default_config

    def previous(M, N, K, sms=132, float32=False):
        return old(M, N, K, sms, False)

    class Uncompiled(EagleGraphRunner):
        def __init__(self, proposer, sizes, compiled=False):
            super().__init__(proposer, sizes, compiled=False)

    for label, patch_gemm, patch_draft in (
        ("previous products, draft compiled", True, False),
        ("new products, draft uncompiled", False, True),
    ):
        if label.split(",")[0] not in labels and label.split(", ")[1] not in labels:
            continue
        if patch_gemm:
            skinny_gemm.default_config = previous
        if patch_draft:
            spec_runner.EagleGraphRunner = Uncompiled
        try:
            engine = build(model, tokenizer, CONFIGS["eagle k=8"])
            one_pass(engine, prompt, "warm")
            times = [one_pass(engine, prompt, f"t{i}") for i in range(5)]
            seconds = statistics.median(t for t, _ in times)
            result[label] = {
                "step_parts_ms": step_parts(engine.model_runner),
                "ms_per_step": 1e3 * seconds / times[-1][1],
                "tok_s": 64 / seconds,
            }
            print(f"ab {label}: {result[label]}", flush=True)
            save_now(result)
            del engine
        finally:
            skinny_gemm.default_config = old
            spec_runner.EagleGraphRunner = EagleGraphRunner
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default="speculative_profile")
    p.add_argument("--skip", nargs="*", default=[], help="phases skinny ab")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help="of CONFIGS")
    p.add_argument("--ab", nargs="+", default=["previous products", "draft uncompiled"])
    args = p.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    load_plugins()
    out = args.out or Path("/tmp")
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": args.name, "workload": "repetitive, batch 1, 64 tokens",
              "model": "course tiny model (float32)"}  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = tiny_model(device=device, dtype=torch.float32, progress=False)
    prompt = held_out_prompts(tokenizer, "repetitive", 1)[0]
    save_now = lambda: save(args.name, {**record, "environment": environment()}, out)  # noqa: E731
    if "phases" not in args.skip:
        record["phases"] = phases_of(
            model, tokenizer, prompt, out, args.repeats, args.configs
        )
        save_now()
    if "skinny" not in args.skip:
        record["skinny"] = skinny_sweep()
        save_now()
    if "ab" not in args.skip:

        def save_ab(result):
            record["ab"] = result
            save_now()

        ab(model, tokenizer, prompt, args.ab, save_ab)
    print(f"wrote {save_now()}")


if __name__ == "__main__":
    main()
