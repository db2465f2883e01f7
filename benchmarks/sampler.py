"""Chapter 11's sampling kernel against chapter 6's Sampler on the GPU.

For 1, 64 and 256 rows of bfloat16 logits over Qwen3's vocabulary (151,936), and four
settings (temperature alone; top-p 0.95; top-k 50 and top-p 0.95; min-p 0.05), every
row seeded: the time of chapter 6's `Sampler.sample` (float32 copy, sort for top-p, the
counter-based noise in PyTorch) and of `minillm.kernels.sample.sample` on the same
metadata, and whether they drew the same tokens. Times are means over repeated calls
after a warm-up, with the device synchronised around each batch of calls.

    # on a GPU; writes benchmarks/results/sampler-*.json
    python benchmarks/sampler.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, save  # noqa: E402
from minillm.kernels.sample import sample  # noqa: E402
from minillm.sampler import Sampler, stream_keys  # noqa: E402
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

    def chapter6():
        return sampler.sample(logits.float(), md)[0]

    same = bool(torch.equal(kernel(), chapter6()))
    return {
        "num_seqs": num_seqs,
        "setting": setting,
        "chapter6_ms": mean_ms(chapter6),
        "kernel_ms": mean_ms(kernel),
        "same_tokens": same,
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sampler.py times a GPU kernel: no CUDA device found")
    rows = []
    for num_seqs in (1, 64, 256):
        for setting in SETTINGS:
            row = measure(num_seqs, setting)
            rows.append(row)
            print(
                f"{num_seqs:4d} rows {setting:12}: chapter 6 {row['chapter6_ms']:6.3f} "
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
    print("wrote", save("sampler", record))


if __name__ == "__main__":
    main()
