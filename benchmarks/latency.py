"""Batch-1 decode latency per output token: minillm eager and with CUDA graphs, against
HF and the roofline.

The workload: one request at a time, a prompt of 128 random token ids (uniform in [0,
10000), seed 0), 256 output tokens, greedy (temperature 0, ignore_eos), on two model
shapes in bf16 with random weights: Qwen3-0.6B and Llama-3.2-1B (or a real checkpoint:
--model /path or $MINILLM_MODEL). Each measurement runs after an untimed warm-up request
and is repeated 3 times; the median and every value are recorded.

Time per output token is decode time only, as vLLM's TPOT: (last token time - first
token time) / (n - 1), from the request's metrics (the prefill that makes the first
token is left out). Measured in the same run:

- minillm eager: chapter 13's Triton attention, no CUDA graphs;
- minillm with CUDA graphs (the same engine, `cuda_graphs=True`);
- with --quantization NAME (chapter 17's int4, chapters 18, 20's): the same engine
  with CUDA graphs on weights quantized at load (written to latency_NAME-*.json);
- with --early-launch 0 (or 1, 2): the same engine with CUDA graphs, its kernels
  launched in that mode (chapter 13's EARLY_LAUNCH) rather than the default;
- Hugging Face transformers `generate` at batch 1, eager PyTorch (its default
  attention): (time of 256 new tokens - time of 1 new token) / 255;
- the memory-bandwidth roofline: the bytes one decode step must read (every linear
  layer and the LM head once, the norms, one row of the embedding table unless it is
  tied to the LM head, and the KV cache of the context, averaged over the 255 decode
  steps) over the copy bandwidth measured in this run. Each time is reported as a
  multiple of that minimum, with the achieved bandwidth (bytes per step / time per
  token).

    # on a GPU; writes benchmarks/results/latency-*.json
    python benchmarks/latency.py
    python benchmarks/latency.py --shapes qwen3-0.6b   # one shape
    python benchmarks/latency.py --quantization int4   # and on 4-bit weights
    # a smoke test: tiny random shapes, float32, no graphs
    python benchmarks/latency.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    copy_bandwidth,
    engine_settings,
    environment,
    require_committed,
    save,
)
from benchmarks.throughput import QWEN3_0_6B  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.registry import OPTIONS, load_plugins  # noqa: E402
from minillm.hf import config_from_hf  # noqa: E402
from minillm.kernels import paged_decode  # noqa: E402
from minillm.kv_cache import kv_cache_bytes_per_token  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)

# name -> (transformers config class, model class, config kwargs)
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B),
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_3_2_1B),
}
# --quick: the same architectures, shrunk to run in seconds on a CPU
TINY = dict(
    vocab_size=10240,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=16384,
)
load_plugins()  # the options later chapters declare
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} | set(OPTIONS)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cpu_copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 10) -> float:
    """Measured host memcpy bandwidth in bytes/s (read + write counted),
    common.copy_bandwidth's CPU twin.
    """
    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * num_bytes / seconds


def prompt_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(10000, vocab_size)) for _ in range(length)]


def random_checkpoint(
    folder: Path, shape: str, quick: bool, device: str, dtype: torch.dtype
) -> None:
    """A checkpoint of the shape with HF's random initialisation (seed 0), as
    throughput.py makes one.
    """
    import transformers

    config_cls, model_cls, kwargs = SHAPES[shape]
    kwargs = {**kwargs, **TINY} if quick else kwargs
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(
            getattr(transformers, config_cls)(**kwargs)
        ).to(dtype)
    model.save_pretrained(folder)
    del model
    free(device)


def bytes_per_decode_step(
    folder: Path, dtype: torch.dtype, prompt_len: int, output_len: int
) -> dict:
    """What one decode step must read: weights (by tensor, from the checkpoint) + the
    context's KV cache.
    """
    from safetensors import safe_open

    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    shapes = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shapes[name] = list(st.get_slice(name).get_shape())
    size = dtype.itemsize
    parts = {
        "linear_bytes": 0,
        "norm_bytes": 0,
        "lm_head_bytes": 0,
        "embedding_row_bytes": 0,
    }
    tied = config.tie_word_embeddings and not any(
        n.endswith("lm_head.weight") for n in shapes
    )
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        if name.endswith("embed_tokens.weight"):
            parts["embedding_row_bytes"] += shape[-1] * size  # the step's one token
            if tied:  # the LM head is the same table, read whole
                parts["lm_head_bytes"] += numel * size
        elif name.endswith("lm_head.weight"):
            parts["lm_head_bytes"] += numel * size
        elif len(shape) == 1:  # RMSNorm weights (and any bias): negligible, counted
            parts["norm_bytes"] += numel * size
        else:
            parts["linear_bytes"] += numel * size
    weight_bytes = sum(parts.values())
    kv_per_token = kv_cache_bytes_per_token(config, dtype)
    # the decode step that makes output token j + 1 (j = 1 .. n-1) attends over
    # prompt_len + j tokens
    mean_context = prompt_len + output_len / 2
    kv_bytes = kv_per_token * mean_context
    return {
        **parts,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "mean_decode_context_tokens": mean_context,
        "kv_bytes": kv_bytes,
        "bytes": weight_bytes + kv_bytes,
        "lm_head_tied_to_embedding": tied,
    }


def engine_options(**wanted) -> dict:
    """The options this EngineConfig has; warns about the others (the script runs
    before and after they exist).
    """
    missing = sorted(set(wanted) - ENGINE_FIELDS)
    if missing:
        print(
            f"warning: EngineConfig has no {', '.join(missing)}: not passed",
            file=sys.stderr,
        )
    return {k: v for k, v in wanted.items() if k in ENGINE_FIELDS}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "values": values}


def run_minillm(
    folder: Path, prompt: list[int], cuda_graphs: bool, args, quantization=None
) -> dict:
    # chapter 13's kernels need a GPU
    backend = "triton" if args.device == "cuda" else "torch"
    options = engine_options(attention_backend=backend, cuda_graphs=cuda_graphs)
    if quantization:  # chapter 17's option
        options.update(engine_options(quantization=quantization))
        if args.quick and quantization == "int4":  # --quick's hidden size is 64
            options.update(engine_options(int4_group_size=32))
    start = time.perf_counter()
    llm = LLM(
        folder,
        device=args.device,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=len(prompt) + args.output_len + 16,
        **options,
    )
    init_s = time.perf_counter() - start
    llm.generate(
        [prompt[:16]],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    tpots, ttfts, tokens = [], [], None
    for _ in range(args.repeats):
        sync(args.device)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        completion = out.outputs[0]
        assert len(completion.token_ids) == args.output_len, (
            "the request must produce exactly output_len tokens"
        )
        tpots.append(completion.time_per_output_token)
        ttfts.append(out.metrics.time_to_first_token)
        tokens = tokens or completion.token_ids
    runner = llm.engine.model_runner
    graph_runner = getattr(runner, "graph_runner", None)
    resolved = engine_settings(llm.engine)
    resolved["early_launch"] = getattr(paged_decode, "EARLY_LAUNCH", None)
    # all steps, warm-up included
    resolved.update(
        {
            "num_graph_steps": getattr(runner, "num_graph_steps", None),
            "num_eager_steps": getattr(runner, "num_eager_steps", None),
            "graph_capture_s": getattr(graph_runner, "capture_seconds", None),
        }
    )
    result = {
        "time_per_output_token_s": summary(tpots),
        "time_to_first_token_s": summary(ttfts),
        "init_s": init_s,
        "steps": llm.engine.num_steps,
        "token_ids": tokens,
        # what the engine resolved its options to (None: no such attribute)
        "engine": resolved,
        "config": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "block_size": llm.engine.config.block_size,
            **options,
        },
    }
    del llm, out, completion, runner, graph_runner
    free(args.device)
    return result


def run_hf(folder: Path, prompt: list[int], args) -> dict:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype)
        .to(args.device)
        .eval()
    )
    model.generation_config.eos_token_id = None  # ignore_eos, as in throughput.py
    ids = torch.tensor([prompt], device=args.device)
    mask = torch.ones_like(ids)

    def timed(model, new_tokens: int) -> tuple[float, list[int]]:
        sync(args.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        sync(args.device)
        return time.perf_counter() - start, out[0, ids.shape[1] :].tolist()

    timed(model, 16)  # warm-up
    tpots, tokens = [], None
    for _ in range(args.repeats):
        one, _ = timed(model, 1)
        full, generated = timed(model, args.output_len)
        assert len(generated) == args.output_len
        tpots.append((full - one) / (args.output_len - 1))
        tokens = tokens or generated
    result = {
        "time_per_output_token_s": summary(tpots),
        "token_ids": tokens,
        "attn_implementation": model.config._attn_implementation,
    }
    del model
    free(args.device)
    return result


def ms(run: dict) -> str:
    """The run's median time per token, for the progress lines."""
    return f" ({run['time_per_output_token_s']['median'] * 1e3:.3f} ms/token)"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure_shape(
    folder: Path, name: str, label: str, prompt: list[int], bandwidth: float, args
) -> dict:
    roofline = bytes_per_decode_step(folder, args.dtype, len(prompt), args.output_len)
    roofline["min_time_per_output_token_s"] = roofline["bytes"] / bandwidth
    runs = {}
    runs["minillm_eager"] = run_minillm(folder, prompt, False, args)
    print(f"  {name}: minillm eager done{ms(runs['minillm_eager'])}", flush=True)
    if args.device != "cuda":
        runs["minillm_cuda_graphs"] = {"skipped": "CUDA graphs need a GPU"}
    elif "cuda_graphs" not in ENGINE_FIELDS:
        runs["minillm_cuda_graphs"] = {
            "skipped": "EngineConfig has no cuda_graphs option"
        }
    else:
        runs["minillm_cuda_graphs"] = run_minillm(folder, prompt, True, args)
        graphs = runs["minillm_cuda_graphs"]
        print(f"  {name}: minillm CUDA graphs done{ms(graphs)}", flush=True)
        for mode in args.early_launch:  # the same engine, kernels launched otherwise
            default, paged_decode.EARLY_LAUNCH = paged_decode.EARLY_LAUNCH, mode
            try:
                key = f"minillm_cuda_graphs_early_launch_{mode}"
                runs[key] = run_minillm(folder, prompt, True, args)
            finally:
                paged_decode.EARLY_LAUNCH = default
            print(f"  {name}: graphs, early launch {mode}{ms(runs[key])}", flush=True)
    if args.quantization:  # the same engine on quantized weights
        graphs = args.device == "cuda" and "cuda_graphs" in ENGINE_FIELDS
        key = f"minillm_{args.quantization}" + ("_cuda_graphs" if graphs else "")
        runs[key] = run_minillm(folder, prompt, graphs, args, args.quantization)
        print(f"  {name}: minillm {args.quantization} done", flush=True)
    if not args.skip_hf:
        runs["hf_transformers"] = run_hf(folder, prompt, args)
        print(f"  {name}: HF generate done", flush=True)
    eager_tokens = runs["minillm_eager"]["token_ids"]
    graph_tokens = runs["minillm_cuda_graphs"].get("token_ids")
    for key, run in runs.items():
        if "skipped" in run:
            continue
        t = run["time_per_output_token_s"]["median"]
        run["x_roofline"] = t / roofline["min_time_per_output_token_s"]
        run["achieved_bandwidth_bytes_per_s"] = roofline["bytes"] / t
        # greedy agreement
        run["tokens_matching_minillm_eager"] = common_prefix(
            run["token_ids"], eager_tokens
        )
        if key.startswith("minillm_cuda_graphs_early_launch"):  # same bits expected
            run["tokens_matching_minillm_cuda_graphs"] = common_prefix(
                run["token_ids"], graph_tokens
            )
        run["token_ids"] = run["token_ids"][:16]
    return {"model": label, "name": name, "roofline": roofline, **runs}


def print_table(shapes: list[dict], bandwidth: float) -> None:
    print(
        f"\ncopy bandwidth {bandwidth / 1e9:,.0f} GB/s; time per output token (decode "
        "only), median of repeats"
    )
    print(
        f"{'model':<16} {'run':<20} {'ms/token':>9} {'x roofline':>10} {'GB/s':>7}  "
        "all (ms)"
    )
    for s in shapes:
        r = s["roofline"]
        print(
            f"{s['name']:<16} {'roofline':<20} "
            f"{r['min_time_per_output_token_s'] * 1e3:9.3f} {1:10.2f} "
            f"{bandwidth / 1e9:7.0f}  ({r['bytes'] / 1e9:.3f} GB per step)"
        )
        for name in [k for k in s if k.startswith(("minillm_", "hf_"))]:
            run = s.get(name)
            if run is None:
                continue
            if "skipped" in run:
                print(f"{'':<16} {name:<20} {'skipped':>9}  ({run['skipped']})")
                continue
            t = run["time_per_output_token_s"]
            values = ", ".join(f"{v * 1e3:.3f}" for v in t["values"])
            print(
                f"{'':<16} {name:<20} {t['median'] * 1e3:9.3f} "
                f"{run['x_roofline']:10.2f} "
                f"{run['achieved_bandwidth_bytes_per_s'] / 1e9:7.0f}  {values}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MINILLM_MODEL"),
        help="a local HF folder (default: random Qwen3-0.6B and Llama-3.2-1B shapes)",
    )
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="random-weight shapes to run (without --model)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--skip-hf", action="store_true", help="leave out the HF generate baseline"
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="also run the engine with this quantization method (chapter 17: int4); "
        "the results go to latency_NAME-*.json",
    )
    parser.add_argument(
        "--early-launch",
        default="",
        help="comma-separated launch modes (chapter 13's EARLY_LAUNCH: 0 ordinary, 1 "
        "or 2 early) to also run the CUDA-graph engine with, as same-run baselines",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: tiny random shapes (2 layers, hidden 64), prompt 32, 16 "
        "output tokens",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    args.early_launch = [int(m) for m in args.early_launch.split(",") if m]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/latency.py measures GPU decode latency: no CUDA device found "
            "(--device cpu --quick for a smoke test)"
        )
    if args.quick:
        args.prompt_len, args.output_len = (
            min(args.prompt_len, 32),
            min(args.output_len, 16),
        )
    if args.output_len < 2 or args.repeats < 1:
        sys.exit(
            "--output-len must be at least 2 (time per output token needs two "
            "tokens), --repeats at least 1"
        )
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu":
        torch.manual_seed(0)

    begin = time.perf_counter()
    bandwidth = copy_bandwidth() if args.device == "cuda" else cpu_copy_bandwidth()
    record = {
        "benchmark": "latency",
        "environment": environment(),
        "workload": {
            "batch_size": 1,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "token_ids": "uniform in [0, 10000)",
            "seed": 0,
            "temperature": 0,
            "ignore_eos": True,
            "repeats": args.repeats,
            "dtype": str(args.dtype).removeprefix("torch."),
            "device": args.device,
            "quick": args.quick,
            "early_launch": paged_decode.EARLY_LAUNCH,  # the engine's default
            "early_launch_baselines": args.early_launch,
            "metric": "decode time per output token: "
            "(last - first token time) / (n - 1)",
        },
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_kind": "device-to-device copy"
        if args.device == "cuda"
        else "host memcpy",
        "shapes": [],
    }
    if args.model:
        jobs = [(str(args.model), None)]
    else:
        jobs = [
            (
                f"{s} shape, random weights"
                + (" (tiny: --quick)" if args.quick else ""),
                s,
            )
            for s in args.shapes.split(",")
        ]
        unknown = [s for _, s in jobs if s not in SHAPES]
        if unknown:
            sys.exit(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    record["workload"]["models"] = [label for label, _ in jobs]
    for label, shape in jobs:
        print(f"{label}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.model) if shape is None else Path(tmp)
            if shape is not None:
                random_checkpoint(folder, shape, args.quick, args.device, args.dtype)
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            prompt = prompt_ids(args.prompt_len, vocab)
            record["shapes"].append(
                measure_shape(
                    folder, shape or folder.name, label, prompt, bandwidth, args
                )
            )
    record["seconds"] = time.perf_counter() - begin
    print_table(record["shapes"], bandwidth)
    record["workload"]["quantization"] = args.quantization
    name = f"latency_{args.quantization}" if args.quantization else "latency"
    path = save(name, record, args.out or Path(__file__).resolve().parent / "results")
    print(f"\n{record['seconds']:.0f} s in all; wrote", path)


if __name__ == "__main__":
    main()
