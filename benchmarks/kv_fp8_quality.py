"""The quality cost of an FP8 KV cache on SmolLM2-135M-Instruct (chapter 20, "An FP8 KV
cache"), on the CPU.

The model in float32, its keys and values through chapter 3's paged cache in four
forms: float32, bfloat16 (the engine's cache on a GPU, the baseline), FP8 E4M3 with
vLLM's default scale of 1.0, and FP8 with per-layer scales measured on calibration
windows of the course corpus's train split (largest |K|, |V| over 448, as
llm-compressor computes them). For each: held-out perplexity over --windows windows
(each a prompt whose K/V are written to the cache and read back by chapter 5's
attention), with a bootstrap interval, and the paired bootstrap interval of its
perplexity over the bfloat16 cache's on the same windows; and greedy generation of
--new-tokens tokens from --prompts prompts (held-out text), compared with the bfloat16
cache's: the share of tokens equal at the same position and of whole outputs equal.
A CPU measurement of quality; the seconds are wall time on a shared machine.

    python benchmarks/kv_fp8_quality.py        # writes benchmarks/results/*.json
    # a quick look, not stored
    MINILLM_FORCE_STORE=1 python benchmarks/kv_fp8_quality.py --windows 4 \
        --prompts 4 --new-tokens 8 --out /tmp/kv
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from minillm.attention import generate_paged, paged_attention_ref  # noqa: E402
from minillm.convert import resolve_model  # noqa: E402
from minillm.hf import load_pretrained  # noqa: E402
from minillm.kv_cache import PagedKVCache  # noqa: E402
from minillm.quantization.calibration import token_windows  # noqa: E402
from minillm.quantization.kv_fp8 import (  # noqa: E402
    fp8_kv_scales,
    greedy_agreement,
    paged_window_nll,
    window_cache,
)
from minillm.quantization.quality import interval, ppl_interval  # noqa: E402
from minillm.quantization.quality import resampled_means  # noqa: E402

FP8 = torch.float8_e4m3fn
CACHES = {  # row -> (dtype, scales: None (1.0) or "measured")
    "float32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp8 scale 1": (FP8, None),
    "fp8 measured": (FP8, "measured"),
}


def with_scales(cache, scales):
    if scales is not None:
        cache.k_scale.copy_(scales[0])
        cache.v_scale.copy_(scales[1])
    return cache


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--calibration", type=int, default=16, help="train windows")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    require_committed()  # before measuring: stored runs are of committed code
    env = environment() | {"threads": args.threads}  # refuses uncommitted code
    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(resolve_model(args.model))
    windows = token_windows(tokenizer, "held_out", args.windows, args.window_len)
    calibration = token_windows(tokenizer, "train", args.calibration, args.window_len)
    # prompts: held-out text of the same split, away from the windows' starts
    prompts = token_windows(tokenizer, "held_out", args.prompts, args.prompt_len + 7)
    prompts = [row[7:].tolist() for row in prompts]
    t0 = time.perf_counter()
    k_scale, v_scale = fp8_kv_scales(model, calibration)
    measured = (k_scale, v_scale)
    record = {
        "benchmark": "kv_fp8_quality",
        "environment": env,
        "workload": {
            "model": args.model,
            "model_dtype": str(next(model.parameters()).dtype),
            "windows": [args.windows, args.window_len],
            "calibration_windows": [args.calibration, args.window_len],
            "prompts": [args.prompts, args.new_tokens],
            "prompt_len": args.prompt_len,
            "attention": "chapter 5's paged_attention_ref",
        },
        "scales": {
            "k": k_scale.tolist(),
            "v": v_scale.tolist(),
            "seconds": time.perf_counter() - t0,
        },  # fmt: skip
        "rows": [],
        "ratios": {},
        "greedy": {},
    }
    nll, outputs = {}, {}
    for name, (dtype, scales) in CACHES.items():
        t0 = time.perf_counter()
        scales = measured if scales == "measured" else None
        cache = with_scales(window_cache(model, windows, dtype), scales)
        nll[name] = paged_window_nll(model, windows, cache)
        blocks = sum(-(-(len(q) + args.new_tokens) // 16) for q in prompts)
        gen = PagedKVCache(model.config, blocks, 16, paged_attention_ref, dtype)
        with_scales(gen, scales)
        outputs[name] = generate_paged(model, prompts, args.new_tokens, kv_cache=gen)
        ppl = math.exp(float(nll[name].mean()))
        record["rows"].append({"cache": name, "ppl": ppl,
                               "ppl_interval": list(ppl_interval(nll[name])),
                               "window_nll": nll[name].tolist(),
                               "seconds": time.perf_counter() - t0})  # fmt: skip
        print(name, f"ppl {ppl:.4f}", flush=True)
    for name in CACHES:
        if name == "bf16":
            continue
        diff = nll[name] - nll["bf16"]  # the same windows: a paired resample
        lo, hi = interval(resampled_means(diff))
        mean = float(diff.mean())
        record["ratios"][f"{name} / bf16"] = [math.exp(x) for x in (mean, lo, hi)]
        record["greedy"][name] = greedy_agreement(outputs[name], outputs["bf16"])
        print(name, "/ bf16:", record["ratios"][f"{name} / bf16"],
              record["greedy"][name], flush=True)  # fmt: skip
    print("wrote", save("kv_fp8_quality", record, *([args.out] if args.out else [])))


if __name__ == "__main__":
    main()
