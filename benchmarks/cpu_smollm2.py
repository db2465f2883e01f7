"""SmolLM2-135M-Instruct on a CPU: minillm's offline throughput and batch-1 time per
token against Hugging Face transformers `generate`, in the same run (chapter 2, "A
real pretrained model, from a GGUF file").

The model is the packaged GGUF file, converted once by minillm (`LLM("smollm2")`);
transformers loads the same converted folder. Workload: 16 requests whose prompts are
windows of the course corpus, lengths uniform in [64, 256] tokens (seed 0), each
generating exactly 64 tokens (ignore_eos), greedy. transformers runs them as one
static batch (left padding). Batch 1: a 64-token prompt, time per output token =
(time for 65 tokens - time for 1) / 64. Both in float32 and bfloat16, on --threads
CPU threads (default 2). The machine may be shared: the two systems' runs alternate,
and each number is the best of --repeats (default 3).

    python benchmarks/cpu_smollm2.py            # writes benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import engine_settings, environment, require_committed, save  # noqa: E402
from minillm.convert import resolve_model  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.tokenizer import Tokenizer, read_corpus  # noqa: E402


def workload(tokenizer: Tokenizer, n: int, low: int, high: int, seed: int = 0):
    rng = random.Random(seed)
    stream = tokenizer.encode("\n\n".join(read_corpus().values()))
    prompts = []
    for _ in range(n):
        length = rng.randint(low, high)
        start = rng.randrange(len(stream) - length)
        prompts.append(stream[start : start + length])
    return prompts


def minillm_runner(folder, dtype, max_num_seqs):
    llm = LLM(folder, device="cpu", dtype=dtype, max_num_seqs=max_num_seqs)

    def run(batch, tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outputs = llm.generate(batch, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)

    return llm, run


def hf_runner(folder, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None

    def run(batch, tokens):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + tokens

    return model, run


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def attention_share(run, prompts, output_len) -> float:
    """The share of a batched minillm run spent in chapter 5's reference attention
    (the engine's attention on a CPU), by cProfile."""
    profile = cProfile.Profile()
    profile.runcall(run, prompts, output_len)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, ..)}
    total = max(v[3] for v in stats.values())
    attention = sum(
        v[3]
        for (file, _, name), v in stats.items()
        if file.endswith("attention.py") and name == "paged_attention_ref"
    )
    return attention / total


def measure(folder, dtype, prompts, output_len, repeats) -> dict:
    """Both systems on one dtype, their runs interleaved, the best of `repeats` each
    (the machine is shared: the best run is the one least disturbed)."""
    llm, ours = minillm_runner(folder, dtype, len(prompts))
    hf_model, theirs = hf_runner(folder, dtype)
    one = prompts[0][:64]
    times = {name: {"batch": [], "first": [], "full": []} for name in ("ours", "hf")}
    for run in (ours, theirs):
        run(prompts[:2], 4)  # warm-up
    for _ in range(repeats):
        for name, run in (("ours", ours), ("hf", theirs)):
            times[name]["batch"].append(timed(run, prompts, output_len))
            times[name]["first"].append(timed(run, [one], 1))
            times[name]["full"].append(timed(run, [one], output_len + 1))
    result = {}
    for name, system in (("ours", "minillm"), ("hf", "transformers")):
        t = {k: min(v) for k, v in times[name].items()}
        result[system] = {
            "seconds": t["batch"],
            "output_tokens_per_s": len(prompts) * output_len / t["batch"],
            "batch1_ms_per_token": 1e3 * (t["full"] - t["first"]) / output_len,
            "all_seconds": times[name],
        }
    result["minillm"]["attention_share_batched"] = attention_share(
        ours, prompts, output_len
    )
    result["minillm"]["engine"] = engine_settings(llm.engine)
    del llm, hf_model
    gc.collect()
    return result


def cpu_model() -> str | None:
    """The CPU's model name, from /proc/cpuinfo (Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    prompts = workload(Tokenizer.from_pretrained(folder), args.num_requests, 64, 256)
    load_before = os.getloadavg()
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        measured = measure(folder, dtype, prompts, args.output_len, args.repeats)
        for system, result in measured.items():
            runs[f"{system} {name}"] = result
            shown = {
                k: v for k, v in result.items() if k not in ("all_seconds", "engine")
            }
            print(f"{system:12s} {name:8s} {shown}", flush=True)
    record = {
        "benchmark": "cpu_smollm2",
        "environment": {
            **environment(),
            "cpu_model": cpu_model(),
            "threads": args.threads,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "workload": {
            "model": f"{args.model} ({folder.name})",
            "num_requests": args.num_requests,
            "prompt_lens": [len(p) for p in prompts],
            "output_len": args.output_len,
            "batch1_prompt_len": 64,
            "transformers": "one static batch, left padding",
            "repeats": args.repeats,
            "timing": "runs of the two systems interleaved; the best of the repeats",
        },
        "runs": runs,
    }
    if not args.no_save:
        print("wrote", save("cpu_smollm2", record))


if __name__ == "__main__":
    main()
