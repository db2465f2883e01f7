"""RTN after folding the norms, with and without a rotation, on SmolLM2-135M-Instruct
(chapter 18, "Rotating the residual stream" and the quality table).

Three models, RTN int4 at one group size, held-out perplexity on the quality table's
slice (4 windows of 256 tokens): as loaded; with every norm's weight folded into the
projections that read it (`fold_norms`, no rotation); folded and rotated by a
randomized Hadamard matrix (`rotate_residual`). It tells apart the two steps of the
rotation, which the quality table runs together. A CPU measurement of quality; the
seconds are wall time on a shared machine.

    python benchmarks/rotation_rtn.py            # writes benchmarks/results/*.json
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
from minillm.quantization.calibration import token_windows  # noqa: E402
from minillm.quantization.quality import evaluate  # noqa: E402
from minillm.quantization.rotation import fold_norms, rotate_residual  # noqa: E402

STEPS = {
    "as loaded": lambda model, seed: None,
    "norms folded": lambda model, seed: fold_norms(model),
    "norms folded, Hadamard": lambda model, seed: rotate_residual(
        model, "hadamard", seed
    ),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    require_committed()  # before measuring: stored runs are of committed code
    torch.set_num_threads(args.threads)
    folder = resolve_model("smollm2")
    model, tokenizer = load_pretrained(folder)
    held_out = token_windows(tokenizer, "held_out", 4, 256)
    rows = []
    record = {
        "benchmark": "rotation_rtn",
        "environment": environment() | {"threads": args.threads},
        "workload": {
            "model": "smollm2",
            "method": "RTN int4",
            "group_size": args.group_size,
            "held_out": [4, 256],
            "rotation_seed": args.seed,
        },  # fmt: skip
        "baseline_ppl": evaluate(model, held_out)[0],
        "rows": rows,
    }
    for step, transform in STEPS.items():
        t0 = time.perf_counter()
        model, _ = load_pretrained(folder)
        merge_projections(model)  # as the quality table does
        transform(model, args.seed)
        unquantized = evaluate(model, held_out)[0]  # the same function: ~baseline
        codes = apply.int4_codes(model, "rtn", None, args.group_size)
        apply.fake_quantize_layers(model, codes)
        ppl = evaluate(model, held_out)[0]
        rows.append({"step": step, "unquantized_ppl": unquantized, "ppl": ppl,
                     "seconds": time.perf_counter() - t0})  # fmt: skip
        print(rows[-1], flush=True)
    print(save("rotation_rtn", record))


if __name__ == "__main__":
    main()
