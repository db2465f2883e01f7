"""Offline throughput on the course's standard workload: minillm's engine against HF
`generate`.

The workload (COURSE.md, the mix nano-vllm and mini-sglang use): 256 requests, prompt
and output lengths each uniform in [100, 1024] tokens, random token ids in [0, 10000),
every request generating exactly its output length (ignore_eos), seed 0, on a
Qwen3-0.6B-shaped model in bf16 with random weights (or a real checkpoint: --model /path
or $MINILLM_MODEL).

Baselines measured in the same run: Hugging Face transformers `generate` (static
batches, left padding; each batch runs until its longest request is done, and only the
requested tokens are counted), and the memory-bandwidth limit of the workload (weights
read once per step of an ideal single batch, plus every decode token's KV read, over the
copy bandwidth measured in this run).

    # on a GPU; writes benchmarks/results/*.json
    python benchmarks/throughput.py
    python benchmarks/throughput.py --num-requests 32 --hf-requests 8   # a quick look
    # minillm only (an experiment, not stored)
    python benchmarks/throughput.py --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (
    StepTimeline,
    copy_bandwidth,
    engine_settings,
    environment,
    require_committed,
    KNOBS_BEFORE,
    kernel_knobs,
    knobs_set,
    save,
)  # noqa: E402
from minillm.kv_cache import kv_cache_bytes_per_token  # noqa: E402
from minillm.hf import config_from_hf  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


def workload(
    n: int, lo: int, hi: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 9999) for _ in range(rng.randint(lo, hi))] for _ in range(n)
    ]
    output_lens = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, output_lens


LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)  # fmt: skip
SHAPES = {"qwen3-0.6b": "Qwen3-0.6B", "llama-3.2-1b": "Llama-3.2-1B"}


def random_checkpoint(folder: Path, shape: str = "qwen3-0.6b") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        if shape == "llama-3.2-1b":
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_2_1B))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B))
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def bandwidth_limit(folder: Path, prompts, output_lens, bandwidth: float) -> dict:
    """Seconds a perfect engine would need: weights once per decode step of one batch
    + all KV reads.
    """
    import json

    from safetensors import safe_open

    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    weight_bytes = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                numel = 1
                for d in st.get_slice(name).get_shape():
                    numel *= d
                weight_bytes += 2 * numel  # bf16
    kv_per_token = kv_cache_bytes_per_token(config, torch.bfloat16)
    kv_reads = sum(
        sum(p_len + t for t in range(o))
        for p_len, o in zip(map(len, prompts), output_lens)
    )
    steps = max(output_lens)
    seconds = (steps * weight_bytes + kv_reads * kv_per_token) / bandwidth
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "decode_steps": steps,
        "kv_token_reads": kv_reads,
        "seconds": seconds,
        "output_tokens_per_s": sum(output_lens) / seconds,
    }


SAMPLING = {  # --sampling: the requests' parameters (all ignore_eos)
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "sampled": dict(temperature=0.8, top_p=0.95),
    "seeded": dict(temperature=0.8, top_p=0.95, seed=0),  # seed i for request i
    "top_k": dict(temperature=0.8, top_k=50),
    "min_p": dict(temperature=0.8, min_p=0.05),
    # OpenAI-style penalties on top of "sampled": chapter 16's counts on the device
    "penalties": dict(
        temperature=0.8,
        top_p=0.95,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
    ),
}


def sampling_params(mode: str, output_lens: list[int]) -> list[SamplingParams]:
    settings = SAMPLING[mode]
    return [
        SamplingParams(
            **{**settings, **({"seed": i} if "seed" in settings else {})},
            max_tokens=o,
            ignore_eos=True,
        )
        for i, o in enumerate(output_lens)
    ]


def build_llm(folder, args, fused: bool = True) -> LLM:
    return LLM(
        folder,
        dtype=torch.bfloat16,
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=2 * args.max_len + 16,
        fused_sampling=fused,
        kv_cache_dtype=getattr(args, "cache_dtype", "auto"),
        quantization=getattr(args, "quant", None),
    )


def run_minillm(
    folder,
    prompts,
    output_lens,
    args,
    mode: str = "greedy",
    fused: bool = True,
    llm: LLM | None = None,
) -> dict:
    """One run of the workload in `mode`, on llm if given (kept), else on an engine
    of its own (built here, freed after)."""
    own = llm is None
    llm = build_llm(folder, args, fused) if own else llm
    stepper = llm.engine.stepper
    ahead_before = getattr(stepper, "num_ahead", 0)
    in_step_before = getattr(stepper, "num_in_step", 0)
    graphs_before = getattr(llm.engine.model_runner, "num_graph_steps", 0)
    preempted_before = llm.engine.num_preemptions
    params = sampling_params(mode, output_lens)
    # warm-up with the mode's own parameters: the kernels it runs compile here
    llm.generate(
        prompts[:4],
        [replace(p, max_tokens=8) for p in params[:4]],
        use_tqdm=False,
    )
    steps_before = llm.engine.num_steps
    # where the time goes: prompt steps, decode steps by batch size (the timeline
    # wraps the engine's step and schedule; unwrapped after, for a next run)
    unwrapped = llm.engine.step, llm.engine.scheduler.schedule
    timeline = StepTimeline(llm.engine)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(output_lens), (
        "every request must produce exactly its output length"
    )
    result = {
        "sampling": {**SAMPLING[mode], "fused_sampling": fused},
        "seconds": seconds,
        "requests": len(prompts),
        "output_tokens": produced,
        "total_tokens": produced + sum(map(len, prompts)),
        "output_tokens_per_s": produced / seconds,
        "total_tokens_per_s": (produced + sum(map(len, prompts))) / seconds,
        "steps": llm.engine.num_steps - steps_before,
        # counted from this run's warm-up on (an engine of its own: from its start)
        "steps_launched_ahead": getattr(stepper, "num_ahead", 0) - ahead_before,
        # steps that needed chapter 7's sampler in step (warm-up included)
        "steps_in_step": getattr(stepper, "num_in_step", 0) - in_step_before,
        "graph_steps": getattr(llm.engine.model_runner, "num_graph_steps", 0)
        - graphs_before,
        "preemptions": llm.engine.num_preemptions - preempted_before,
        "engine": "its own" if own else "one for all modes (--one-engine)",
        "num_kv_blocks": llm.engine.kv_cache_manager.num_blocks,
        "timeline": timeline.summary(getattr(args, "step_floor", None)),
        "config": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "block_size": 16,
            "attention": llm.engine.parts["attention_backend"],
            "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
            **engine_settings(llm.engine),
            "kernel_knobs": kernel_knobs(),
        },
    }
    llm.engine.step, llm.engine.scheduler.schedule = unwrapped
    del outputs
    if own:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return result


def summary(knobs: str, run: dict) -> dict:
    """A run's throughput and seconds by kind of step (--knobs-rounds)."""
    kinds = run["timeline"]["by_kind"]
    return {
        "knobs": knobs,
        "output_tokens_per_s": run["output_tokens_per_s"],
        "seconds_by_kind": {kind: k["seconds"] for kind, k in kinds.items()},
    }


def run_hf(folder, prompts, output_lens, batch_size) -> dict:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    )
    model.generation_config.eos_token_id = None

    def batch_generate(batch, max_new):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda"
        )
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )

    batch_generate(prompts[:2], 8)  # warm-up
    torch.cuda.synchronize()
    start, generated = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i : i + batch_size], output_lens[i : i + batch_size]
        batch_generate(batch, max(lens))
        generated += len(batch) * max(lens)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    useful = sum(output_lens)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "requests": len(prompts),
        "batch_size": batch_size,
        "output_tokens": useful,
        "tokens_generated_including_padding_steps": generated,
        "output_tokens_per_s": useful / seconds,
        "total_tokens_per_s": (useful + sum(map(len, prompts))) / seconds,
    }


def sampled_runs(folder, prompts, output_lens, args, record, llm=None) -> dict:
    """{"sampling": {name: run}} for the sampled modes, each with its throughput as
    a fraction of the greedy run of the same process; the fused ones on llm if
    given (--one-engine: the greedy run's)."""
    greedy = record["minillm"]["output_tokens_per_s"]
    runs = {}
    for mode in [m for m in args.sampling if m != "greedy"]:
        for fused in [True, False] if args.unfused else [True]:
            name = mode if fused else f"{mode}_unfused"
            shared = llm if fused else None
            run = run_minillm(folder, prompts, output_lens, args, mode, fused, shared)
            run["fraction_of_greedy"] = run["output_tokens_per_s"] / greedy
            runs[name] = run
            print(
                f"minillm {name}: {run['output_tokens_per_s']:,.0f} output tok/s "
                f"({run['fraction_of_greedy']:.0%} of greedy)",
                flush=True,
            )
    return {"sampling": runs} if runs else {}


def kv_cache_runs(folder, prompts, output_lens, args, record, out) -> None:
    """The greedy run once more for each further --kv-cache-dtype, on an engine of
    its own: record["kv_cache_dtypes"][dtype], with its speed-up over the first."""
    first = record["minillm"]["output_tokens_per_s"]
    for dtype in args.kv_cache_dtype[1:]:
        save(args.name, record, out)  # a run out of time keeps what came before
        args.cache_dtype = dtype
        run = run_minillm(folder, prompts, output_lens, args)
        run["speedup_vs_first"] = run["output_tokens_per_s"] / first
        record.setdefault("kv_cache_dtypes", {})[dtype] = run
        print(f"minillm, kv_cache_dtype={dtype}: {run['output_tokens_per_s']:,.0f} "
              f"output tok/s ({run['speedup_vs_first']:.2f}x of "
              f"{args.kv_cache_dtype[0]})", flush=True)  # fmt: skip
    args.cache_dtype = args.kv_cache_dtype[0]


def quantization_runs(folder, prompts, output_lens, args, record, out) -> None:
    """The greedy run once more for each --quantization after the first, on an engine
    of its own: record["quantizations"][method], with its speed-up over the first."""
    first = record["minillm"]["output_tokens_per_s"]
    for method in args.quantization[1:]:
        save(args.name, record, out)  # a run out of time keeps what came before
        args.quant = None if method == "none" else method
        run = run_minillm(folder, prompts, output_lens, args)
        run["speedup_vs_first"] = run["output_tokens_per_s"] / first
        record.setdefault("quantizations", {})[method] = run
        print(f"minillm, quantization={method}: {run['output_tokens_per_s']:,.0f} "
              f"output tok/s ({run['speedup_vs_first']:.2f}x of "
              f"{args.quantization[0]})", flush=True)  # fmt: skip
    args.quant = None if args.quantization[0] == "none" else args.quantization[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MINILLM_MODEL"),
        help="a local HF folder (default: random Qwen3-0.6B shape)",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        help="the draw of prompts and lengths (0: the standard one; another seed "
        "gives a held-out draw of the same mix)",
    )
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=64,
        help="HF runs the first N requests (it is slow)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument(
        "--skip-hf",
        action="store_true",
        help="leave out the HF baseline (for quick experiments)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--sampling",
        nargs="+",
        default=["greedy"],
        choices=sorted(SAMPLING),
        help="sampling modes to run, each on the same requests (greedy first)",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="also run each sampled mode with fused_sampling=False (chapter 7's "
        "sampler in step, the path before chapter 16's kernel)",
    )
    parser.add_argument(
        "--knobs-before",
        nargs="?",
        const="order_and_prefill",
        default=None,
        choices=sorted(KNOBS_BEFORE),
        help="also run the engine greedy with earlier kernel choices (a set of "
        "benchmarks/common.py's KNOBS_BEFORE; alone: order_and_prefill), stored as "
        "minillm_knobs_before",
    )
    parser.add_argument(
        "--knobs-only",
        default=None,
        choices=sorted(KNOBS_BEFORE),
        help="build and run the greedy engine (the process's first) with these "
        "earlier choices instead of today's; for what differs only in a process's "
        "first engine, compare one process of each",
    )
    parser.add_argument(
        "--knobs-rounds",
        type=int,
        default=1,
        help="with --knobs-before: this many runs of each, alternating (now, "
        "before, now, ...); every run's summary in knobs_rounds",
    )
    parser.add_argument(
        "--one-engine",
        action="store_true",
        help="run greedy and the fused sampled modes one after another on one engine "
        "(built once: same CUDA graphs, same memory) instead of an engine each",
    )
    parser.add_argument(
        "--name",
        default="throughput",
        help="the stored result's name (e.g. throughput_sampling for a run with "
        "--skip-hf that should not replace the full one)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "fp8", "fp8_e4m3"],
        help="the KV cache's dtype (chapter 20's FP8 cache); more than one: the "
        "greedy run again with each of the others, on an engine of its own, stored "
        "under kv_cache_dtypes with its speed-up over the first",
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "int4", "gptq", "awq", "fp8", "w8a8"],
        help="the engine's weight quantization (chapters 17-18); more than one: the "
        "greedy run again with each of the others, on an engine of its own, stored "
        "under quantizations with its speed-up over the first",
    )
    parser.add_argument(
        "--shape",
        default="qwen3-0.6b",
        choices=sorted(SHAPES),
        help="the random checkpoint's shape when --model is not given",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.cache_dtype = args.kv_cache_dtype[0]
    args.quant = None if args.quantization[0] == "none" else args.quantization[0]
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/throughput.py measures GPU throughput: no CUDA device found"
        )

    prompts, output_lens = workload(
        args.num_requests, args.min_len, args.max_len, args.workload_seed
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            random_checkpoint(folder, args.shape)
        bandwidth = copy_bandwidth()
        record = {
            "benchmark": "throughput",
            "environment": environment(),
            "workload": {
                "model": str(args.model or f"{SHAPES[args.shape]} shape, random"),
                "quantization": args.quantization[0],
                "dtype": "bfloat16",
                "num_requests": args.num_requests,
                "prompt_len": [args.min_len, args.max_len],
                "output_len": [args.min_len, args.max_len],
                "distribution": "uniform",
                "token_ids": "uniform in [0, 10000)",
                "ignore_eos": True,
                "seed": args.workload_seed,
                "prompt_tokens": sum(map(len, prompts)),
                "output_tokens": sum(output_lens),
            },
            "copy_bandwidth_bytes_per_s": bandwidth,
        }
        record["bandwidth_limit"] = limit = bandwidth_limit(
            folder, prompts, output_lens, bandwidth
        )

        def step_floor(seqs: int, tokens: int, context: int) -> float:
            """A decode step's memory floor: the weights and its K/V read once."""
            if tokens > seqs:  # a step with prompt tokens: no floor of this kind
                return 0.0
            kv = limit["kv_bytes_per_token"] * context
            return (limit["weight_bytes"] + kv) / bandwidth

        args.step_floor = step_floor
        out = args.out or Path(__file__).resolve().parent / "results"
        only = KNOBS_BEFORE[args.knobs_only] if args.knobs_only else {}
        with knobs_set(only):
            llm = build_llm(folder, args) if args.one_engine else None
            record["minillm"] = run_minillm(folder, prompts, output_lens, args, llm=llm)
        record["knobs_only"] = only
        print(
            f"minillm: {record['minillm']['output_tokens_per_s']:,.0f} output tok/s",
            flush=True,
        )
        if args.knobs_before:  # second, so that a run out of time keeps the first
            record["knobs_before"] = KNOBS_BEFORE[args.knobs_before]
            record["knobs_rounds"] = [summary("now", record["minillm"])]
            for i in range(2 * args.knobs_rounds - 1):
                save(args.name, record, out)
                when = "before" if i % 2 == 0 else "now"
                with knobs_set(KNOBS_BEFORE[args.knobs_before] if i % 2 == 0 else {}):
                    run = run_minillm(folder, prompts, output_lens, args)
                if i == 0:
                    record["minillm_knobs_before"] = run
                record["knobs_rounds"].append(summary(when, run))
                print(f"minillm, knobs {when}: {run['output_tokens_per_s']:,.0f} "
                      "output tok/s", flush=True)  # fmt: skip
        record.update(sampled_runs(folder, prompts, output_lens, args, record, llm))
        kv_cache_runs(folder, prompts, output_lens, args, record, out)
        quantization_runs(folder, prompts, output_lens, args, record, out)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        for kind, k in record["minillm"]["timeline"]["by_kind"].items():
            print(
                f"  {kind:24}: {k['steps']:5d} steps, {k['seconds']:6.2f} s "
                f"({k['ms_per_step']:6.2f} ms per step)"
            )
        if not args.skip_hf:
            n = min(args.hf_requests, args.num_requests)
            record["hf_transformers"] = run_hf(
                folder, prompts[:n], output_lens[:n], args.hf_batch_size
            )
            print(
                f"HF generate ({n} requests): "
                f"{record['hf_transformers']['output_tokens_per_s']:,.0f} output tok/s"
            )
            record["speedup_vs_hf"] = (
                record["minillm"]["output_tokens_per_s"]
                / record["hf_transformers"]["output_tokens_per_s"]
            )
            print(f"minillm / HF: {record['speedup_vs_hf']:.2f}x")
    print(
        f"bandwidth limit: {record['bandwidth_limit']['output_tokens_per_s']:,.0f} "
        "output tok/s"
    )
    path = save(args.name, record, out)
    print("wrote", path)


if __name__ == "__main__":
    main()
