"""Chapter 16's sampling kernel against chapter 7's Sampler on the GPU.

For 1, 64 and 256 rows of bfloat16 logits over Qwen3's vocabulary (151,936), and four
settings (temperature alone; top-p 0.95; top-k 50 and top-p 0.95; min-p 0.05), every
row seeded: the time of chapter 7's `Sampler.sample` (float32 copy, sort for top-p, the
counter-based noise in PyTorch) and of `minillm.kernels.sample.sample` on the same
metadata, and whether they drew the same tokens. Times are means over repeated calls
after a warm-up, with the device synchronised around each batch of calls.

    # on a GPU; writes benchmarks/results/sampler-*.json
    python benchmarks/sampler.py

With --penalties, the penalty step alone instead (chapter 16, "Penalties in one
kernel"): for 1, 64 and 256 rows of bfloat16 logits, every row with repetition 1.1,
frequency 0.5 and presence 0.5 and the counts of a 512-token prompt and 512 output
tokens, the time of `PenaltiesState.apply_elementwise` (chapter 7's formula in
PyTorch, float32) and of `PenaltiesState.apply_kernel` (one Triton kernel), whether
they give the same float32 logits, and the time of one step's count update (one
token per row, `index_put_` with accumulate), and the sampling kernel's top-p draw
(T=0.8, top_p=0.95) on the penalised float32 logits against the same logits in
bfloat16 (what a batch without penalties hands it).

    python benchmarks/sampler.py --penalties   # benchmarks/results/sampler_penalties-*
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from minillm.kernels.sample import sample  # noqa: E402
from minillm.request import Request  # noqa: E402
from minillm.sampler import Sampler, stream_keys  # noqa: E402
from minillm.sampling_ahead import PenaltiesState  # noqa: E402
from minillm.sampling_metadata import SamplingMetadata  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 151_936  # Qwen3's
SETTINGS = {
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "min_p": dict(temperature=0.8, min_p=0.05),
}


def mean_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def measure(num_seqs: int, setting: str) -> dict:
    g = torch.Generator().manual_seed(num_seqs)
    logits = (2 * torch.randn(num_seqs, VOCAB, generator=g)).cuda().bfloat16()
    params = [SamplingParams(**SETTINGS[setting], seed=i) for i in range(num_seqs)]
    md = SamplingMetadata.from_requests(
        params, [[0]] * num_seqs, [[]] * num_seqs, VOCAB, device="cuda"
    )
    keys = stream_keys(md, None)
    sampler = Sampler()

    def kernel():
        return sample(
            logits, md.temperature, md.top_k, md.top_p, md.min_p, keys, md.positions
        )

    def chapter7():
        return sampler.sample(logits.float(), md)[0]

    same = bool(torch.equal(kernel(), chapter7()))
    return {
        "num_seqs": num_seqs,
        "setting": setting,
        "chapter7_ms": mean_ms(chapter7),
        "kernel_ms": mean_ms(kernel),
        "same_tokens": same,
    }


PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
PROMPT_LEN = OUTPUT_LEN = 512
MAX_MODEL_LEN = 2 * 1024 + 16


def penalty_step(num_seqs: int, device: str = "cuda", vocab: int = VOCAB):
    """The state, and (PyTorch's apply, the kernel's, one step's count update)."""
    rng = random.Random(num_seqs)
    params = SamplingParams(**PENALTIES)
    requests = []
    for i in range(num_seqs):
        r = Request(str(i), [rng.randrange(vocab) for _ in range(PROMPT_LEN)], params)
        r.append_output_token_ids([rng.randrange(vocab) for _ in range(OUTPUT_LEN)])
        requests.append(r)
    # the counts' dtype of benchmarks/throughput.py's engine (max_len 1024): int16
    state = PenaltiesState(num_seqs, torch.device(device), MAX_MODEL_LEN)
    rows = list(range(num_seqs))[::-1]  # batch row j is state row num_seqs - 1 - j
    state.update(rows, requests, vocab, None)
    md = SamplingMetadata.from_requests(
        [params] * num_seqs, [[]] * num_seqs, [[]] * num_seqs, vocab
    )
    g = torch.Generator().manual_seed(num_seqs)
    logits = (2 * torch.randn(num_seqs, vocab, generator=g)).to(device).bfloat16()
    sel = list(range(num_seqs))
    tokens = torch.randint(vocab, (num_seqs,), device=device)
    return state, (
        lambda: state.apply_elementwise(logits, sel, rows, md),
        lambda: state.apply_kernel(logits, sel, rows, md),
        lambda: state._count(rows, tokens),
    )


def measure_penalties(num_seqs: int) -> dict:
    state, (pytorch, kernel, update) = penalty_step(num_seqs)
    penalised = kernel()
    same = bool(torch.equal(pytorch(), penalised))
    update_ms = mean_ms(update)
    # what the draw after them costs: the sampling kernel on the bf16 logits a
    # batch without penalties hands it (16 passes a search), and on float32 (32)
    params = [SamplingParams(**SETTINGS["top_p"], seed=i) for i in range(num_seqs)]
    md = SamplingMetadata.from_requests(
        params, [[0]] * num_seqs, [[]] * num_seqs, VOCAB, device="cuda"
    )
    keys = stream_keys(md, None)
    draw = [md.temperature, md.top_k, md.top_p, md.min_p, keys, md.positions]
    bf16 = penalised.bfloat16()
    return {
        "num_seqs": num_seqs,
        "pytorch_ms": mean_ms(pytorch),
        "kernel_ms": mean_ms(kernel),
        "count_update_ms": update_ms,
        "same_logits": same,
        "sample_top_p_bf16_ms": mean_ms(lambda: sample(bf16, *draw)),
        "sample_top_p_fp32_ms": mean_ms(lambda: sample(penalised, *draw)),
        "counts_dtype": str(state.counts_dtype),
        # bytes the kernel must move: bf16 in, the counts, a mask byte, fp32 out
        "kernel_bytes": num_seqs * VOCAB * (2 + state.output_counts.element_size() + 5),
    }


def main_penalties() -> None:
    rows = []
    for num_seqs in (1, 64, 256):
        row = measure_penalties(num_seqs)
        row["kernel_gb_per_s"] = row["kernel_bytes"] / row["kernel_ms"] / 1e6
        rows.append(row)
        print(
            f"{num_seqs:4d} rows: PyTorch {row['pytorch_ms']:7.3f} ms, kernel "
            f"{row['kernel_ms']:6.3f} ms ({row['kernel_gb_per_s']:,.0f} GB/s), count "
            f"update {row['count_update_ms']:6.3f} ms, same {row['same_logits']}; "
            f"top-p draw: bf16 {row['sample_top_p_bf16_ms']:.3f} ms, float32 "
            f"{row['sample_top_p_fp32_ms']:.3f} ms",
            flush=True,
        )
    record = {
        "benchmark": "sampler_penalties",
        "environment": environment(),
        "workload": {
            "vocab": VOCAB,
            "dtype": "bfloat16",
            "logits": "2 * N(0, 1)",
            "penalties": PENALTIES,
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
            "max_model_len": MAX_MODEL_LEN,
            "tokens": "uniform over the vocabulary, seed num_seqs",
        },
        "rows": rows,
    }
    print("wrote", save("sampler_penalties", record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--penalties", action="store_true", help="time the penalty step alone"
    )
    parser.add_argument("--name", default="sampler", help="the results file's prefix")
    parser.add_argument("--out", type=Path, default=None, help="default: results/")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sampler.py times a GPU kernel: no CUDA device found")
    if args.penalties:
        return main_penalties()
    rows = []
    for num_seqs in (1, 64, 256):
        for setting in SETTINGS:
            row = measure(num_seqs, setting)
            rows.append(row)
            print(
                f"{num_seqs:4d} rows {setting:12}: chapter 7 {row['chapter7_ms']:6.3f} "
                f"ms, kernel {row['kernel_ms']:6.3f} ms, same tokens "
                f"{row['same_tokens']}",
                flush=True,
            )
    record = {
        "benchmark": "sampler",
        "environment": environment(),
        "workload": {
            "vocab": VOCAB,
            "dtype": "bfloat16",
            "logits": "2 * N(0, 1)",
            "settings": SETTINGS,
            "seeded": True,
        },
        "rows": rows,
    }
    out = args.out or Path(__file__).resolve().parent / "results"
    print("wrote", save(args.name, record, out))


if __name__ == "__main__":
    main()
