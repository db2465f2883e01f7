"""Many LoRA adapters in one engine (chapter 31): throughput on the standard workload
with 1, 4, 16 and 64 distinct rank-16 adapters on every linear layer, against the same
engine without LoRA, and batch-1 latency with one adapter against none.

The model is Qwen3-0.6B-shaped (or, with --shape llama-3.2-1b, Llama-3.2-1B-shaped)
with random weights (bf16), the adapters random PEFT folders written here (rank 16, all
seven linear modules of every layer, lora_alpha 32). Requests take the adapters
round-robin; `max_loras` (16) slots on the GPU, so 64 adapters cycle through them.
Every engine runs with the engine's defaults (chapter 15's CUDA graphs and compiled
layers, chapter 16's async scheduling); `base` is the engine without adapters, and
each LoRA run reports its share of it (`share_of_base`). With --uncompiled N, one more
run takes N adapters without the compiled layers (`lora_N_uncompiled`), as the engine
ran them before they wrapped chapter 15's layers.

    python -m benchmarks.lora                    # on a GPU; writes benchmarks/results/
    python -m benchmarks.lora --shape llama-3.2-1b   # stored as lora_llama-3.2-1b-*
    python -m benchmarks.lora --quick            # a tiny shape on the CPU, not stored
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, environment, require_committed, save  # noqa: E402
from benchmarks.latency import SHAPES, TINY  # noqa: E402
from benchmarks.throughput import workload  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.lora.peft import MODULES, module_shapes  # noqa: E402
from minillm.lora.request import LoRARequest  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


def random_checkpoint(folder: Path, shape: str, quick: bool, device: str) -> None:
    """A random-weight checkpoint of SHAPES[shape] (benchmarks/latency.py), or its
    tiny version with quick."""
    import transformers

    config_cls, model_cls, kwargs = SHAPES[shape]
    config = getattr(transformers, config_cls)(
        **(dict(kwargs, **TINY) if quick else kwargs)
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(folder)


def random_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT folder: rank-`rank` A and B for every linear module of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (k, n) in module_shapes(config).items():
            block = "self_attn" if module in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, k, generator=gen) / k**0.5
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    peft = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(peft))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(folder: Path, args, loras: int, compiled: bool = True) -> LLM:
    lora = {}
    if loras:
        lora = dict(
            enable_lora=True,
            max_loras=min(loras, args.max_loras),
            max_lora_rank=args.rank,
            max_cpu_loras=max(loras, args.max_loras),
        )
    runner = {} if compiled else dict(torch_compile=False)  # else the defaults
    return LLM(
        str(folder),
        dtype=torch.bfloat16,
        skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2 * args.hi + 16,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **runner,
        **lora,
    )


def throughput(llm: LLM, prompts, output_lens, adapters: list) -> dict:
    params = [
        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        for o in output_lens
    ]
    loras = [
        adapters[i % len(adapters)] if adapters else None for i in range(len(prompts))
    ]
    warm = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 4
    llm.generate(prompts[:4], warm, use_tqdm=False, lora_request=loras[:4])
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    sync()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens_per_s": sum(output_lens) / seconds}


def latency(llm: LLM, prompt: list[int], tokens: int, adapter, repeats: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)
        sync()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "all_s": times}


def free(llm: LLM) -> None:
    llm.shutdown()
    torch._dynamo.reset()  # compiled code holds the model (and its graphs' memory)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shape, CPU, not stored")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=1024)
    p.add_argument("--adapters", default="1,4,16,64", help="distinct adapters per run")
    p.add_argument("--uncompiled", type=int, help="also N adapters, no compiled layers")
    p.add_argument("--max-loras", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--latency-prompt", type=int, default=512)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help="where to store the run")
    p.add_argument("--name", help="stored as NAME-*.json; default lora[_SHAPE]")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.lo, args.hi = 8, 8, 32
        args.latency_prompt, args.latency_tokens, args.repeats = 16, 8, 1
    else:
        require_committed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = [int(n) for n in args.adapters.split(",")]
    prompts, output_lens = workload(args.num_requests, args.lo, args.hi)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        random_checkpoint(folder, args.shape, args.quick, device)
        from minillm.hf import load_model

        config = load_model(str(folder), dtype=torch.bfloat16, device="cpu").config
        adapters = []
        for i in range(max(counts)):
            random_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        runs = {}
        plan = [("base", 0, True)] + [(f"lora_{n}", n, True) for n in counts]
        if args.uncompiled:
            plan.append((f"lora_{args.uncompiled}_uncompiled", args.uncompiled, False))
        for label, n, compiled in plan:
            llm = build(folder, args, n, compiled)
            runs[label] = throughput(llm, prompts, output_lens, adapters[:n])
            runs[label]["num_adapters"] = n
            if label == "base" or label == "lora_1":
                prompt = prompts[0][: args.latency_prompt]
                one = adapters[:1] if n else [None]
                runs[label]["batch1"] = latency(
                    llm, prompt, args.latency_tokens, one[0], args.repeats
                )
            print(label, {k: v for k, v in runs[label].items() if k != "batch1"})
            free(llm)
    base = runs["base"]
    for label, run in runs.items():
        run["share_of_base"] = run["output_tokens_per_s"] / base["output_tokens_per_s"]
    if 1 in counts:
        b1 = runs["lora_1"]["batch1"]["median_s"] / base["batch1"]["median_s"]
        runs["lora_1"]["batch1_overhead"] = b1 - 1
    record = {
        "environment": environment() if not args.quick else {"gpu": None},
        "workload": {
            "model": f"{args.shape} shape, random weights, bf16"
            if not args.quick
            else f"quick ({args.shape}, shrunk)",
            "shape": args.shape,
            "num_requests": args.num_requests,
            "prompt_and_output_len": [args.lo, args.hi],
            "rank": args.rank,
            "max_loras": args.max_loras,
            "targets": list(MODULES),
            "runner": "the engine's defaults: graphs, compiled layers, async "
            "scheduling (*_uncompiled: no compiled layers)",
            "latency": {"prompt": args.latency_prompt, "tokens": args.latency_tokens},
        },
        "runs": runs,
    }
    print(json.dumps({k: v["share_of_base"] for k, v in runs.items()}))
    if not args.quick:
        name = "lora" if args.shape == "qwen3-0.6b" else f"lora_{args.shape}"
        name = args.name or name
        print(save(name, record, args.out))


if __name__ == "__main__":
    main()
