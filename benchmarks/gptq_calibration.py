"""One-shot against sequential GPTQ calibration on SmolLM2-135M-Instruct, at several
calibration sizes (chapter 18, "Sequential calibration").

For each number of calibration windows (256 tokens each, from the training split of
the course corpus), GPTQ int4 g64 with act-order, calibrated one-shot (every layer's
Hessians from the float model, `capture`) and sequentially (`gptq_sequential`), then
held-out perplexity on 4 windows of 256 tokens (the quality table's slice) and the
unquantized model's. A CPU measurement of quality, not of speed: the seconds are
wall time on a shared machine.

    python benchmarks/gptq_calibration.py            # writes benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment, require_committed, save  # noqa: E402
from minillm.convert import resolve_model  # noqa: E402
from minillm.hf import load_pretrained  # noqa: E402
from minillm.merged_projections import merge_projections  # noqa: E402
from minillm.quantization import apply  # noqa: E402
from minillm.quantization.calibration import capture, token_windows  # noqa: E402
from minillm.quantization.quality import evaluate  # noqa: E402


def fresh(folder: Path):
    model, tokenizer = load_pretrained(folder)
    merge_projections(model)  # as the quality table and the engine do
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    require_committed()  # before measuring: stored runs are of committed code
    torch.set_num_threads(args.threads)
    folder = resolve_model("smollm2")
    model, tokenizer = fresh(folder)
    held_out = token_windows(tokenizer, "held_out", 4, 256)
    base = evaluate(model, held_out)[0]
    rows = []
    record = {
        "benchmark": "gptq_calibration",
        "environment": environment() | {"threads": args.threads},
        "workload": {
            "model": "smollm2",
            "method": "GPTQ int4 act-order",
            "group_size": args.group_size,
            "held_out": [4, 256],
            "calibration_split": "train",
            "samples": args.samples,
        },
        "baseline_ppl": base,
        "rows": rows,
    }
    for n in args.samples:
        calib = token_windows(tokenizer, "train", n, 256)
        for mode in ("one-shot", "sequential"):
            t0 = time.perf_counter()
            model, _ = fresh(folder)
            settings = dict(group_size=args.group_size, act_order=True)
            if mode == "one-shot":
                codes = apply.int4_codes(
                    model, "gptq", capture(model, calib), **settings
                )
            else:
                codes = apply.int4_codes(
                    model, "gptq-seq", None, windows=calib, **settings
                )
            apply.fake_quantize_layers(model, codes)
            ppl = evaluate(model, held_out)[0]
            row = {"samples": n, "seq_len": 256, "mode": mode, "ppl": ppl,
                   "seconds": time.perf_counter() - t0}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            path = save("gptq_calibration", record)  # after every row: a partial
    print(path)  # run leaves the rows it finished


if __name__ == "__main__":
    main()
