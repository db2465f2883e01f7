"""Choosing GPTQ's default: held-out perplexity of SmolLM2-135M-Instruct under bf16,
RTN and GPTQ variants, each against bf16 with a paired bootstrap interval (chapter
19, "Choosing GPTQ's default").

The held-out windows are the quality table's (`SMOLLM2_TABLE`: 64 windows of 256
tokens spread over the held-out split, each scored on its last tokens, none twice);
the calibration windows come from the training split (32 of 256 tokens, the engine's
default). Every row starts from fresh weights, is quantized by
`quality.quantize_for_table` (fake-quantized weights, as the quality table's rows)
and keeps its per-window losses, so that any two rows can be compared window by
window (`quality.ppl_ratio`). A row's `ratio` is its perplexity over bf16's, with
the 95% interval of that ratio; `verdict` is "met" where the whole interval is at
or below 1 + `--target`, "missed" where it is all above, else "undecided". A CPU
measurement of quality: the seconds are wall time on a shared machine (on a CPU
box shared with other jobs, --threads 1 runs faster than 2).

    python benchmarks/gptq_quality.py            # writes benchmarks/results/*.json
    python benchmarks/gptq_quality.py --rows gptq-g64 --out /tmp/x  # a subset
    python benchmarks/gptq_quality.py --model tiny --calib 4 64 --held-out 64 64 \
        --rows rtn-g64 default --out /tmp/x    # a smoke test, in seconds
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, environment, require_committed, save  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.convert import resolve_model  # noqa: E402
from minillm.hf import load_pretrained  # noqa: E402
from minillm.merged_projections import merge_projections  # noqa: E402
from minillm.quantization import apply, quality  # noqa: E402
from minillm.quantization.calibration import split_tokens, token_windows  # noqa: E402
from minillm.quantization.calibration import window_starts  # noqa: E402
from minillm.quantization.methods import gptq_group_size, rotation_of  # noqa: E402
from minillm.quantization.quality import SMOLLM2_TABLE  # noqa: E402
from minillm.tiny import tiny_model_path  # noqa: E402

SEQ = {"act_order": True}  # the sequential GPTQ rows: act-order, static groups
HADAMARD = {"rotation": ("hadamard", 0)}  # the engine's quant_rotation_seed=0
ROWS = {  # key: (label, method, settings)
    "bf16": ("bf16 (unquantized)", None, {}),
    **{
        f"rtn-g{g}{'-mse' * mse}": (
            f"RTN g{g}" + ", searched ranges" * mse,
            "rtn",
            {"group_size": g, "mse": mse},
        )
        for g in (32, 64, 128)
        for mse in (False, True)
    },
    **{
        f"gptq-g{g}{'-mse' * mse}{'-had' * had}": (
            f"GPTQ g{g}" + ", searched ranges" * mse + ", Hadamard" * had,
            "gptq-seq",
            {"group_size": g, "mse": mse, **SEQ, **(HADAMARD if had else {})},
        )
        for g in (32, 64, 128)
        for mse in (False, True)
        for had in (False, True)
    },
}


# the stored run's rows; "default": the engine's own (a grid row where one is the same)
STORED_ROWS = ["rtn-g64", "gptq-g64", "gptq-g64-had", "gptq-g64-mse"]
STORED_ROWS += ["gptq-g64-mse-had", "gptq-g32-mse", "gptq-g32-had", "gptq-g32-mse-had"]
STORED_ROWS += ["default"]


def engine_default(model) -> tuple[str, dict]:
    """(method, settings) of what LLM(..., quantization="gptq") builds for model
    with EngineConfig's defaults, in quantize_for_table's terms."""
    c = EngineConfig()
    if not c.gptq_sequential:
        raise NotImplementedError("one-shot GPTQ as the default: add its statistics")
    settings = {"group_size": gptq_group_size(c), "act_order": c.gptq_act_order,
                "damp": c.gptq_damp, "sym": c.gptq_sym, "mse": c.gptq_mse}  # fmt: skip
    hidden = model.model.embed_tokens.weight.shape[1]
    if (rotation := rotation_of("gptq", c, hidden)) is not None:
        settings["rotation"] = (rotation, c.quant_rotation_seed)
    return "gptq-seq", settings


def same_row(a: tuple[str, dict], b: tuple[str, dict]) -> bool:
    """Whether two (method, settings) quantize alike (unset: int4_codes' default)."""
    unset = inspect.signature(apply.int4_codes).parameters
    unset = {k: p.default for k, p in unset.items() if p.default is not p.empty}
    return a[0] == b[0] and unset | a[1] == unset | b[1]


def held_out_windows(tokenizer, count: int, seq_len: int) -> tuple[torch.Tensor, int]:
    """The quality table's held-out windows [count, seq_len] and how many last tokens
    of each are scored (those before the next window's start: none twice)."""
    ids = split_tokens(tokenizer, "held_out")
    starts = window_starts(len(ids), count, seq_len)
    scored = min(b - a for a, b in zip(starts, starts[1:]))
    return torch.stack([ids[s : s + seq_len] for s in starts]), scored


def verdict(lo: float, hi: float, limit: float) -> str:
    return "met" if hi <= limit else "missed" if lo > limit else "undecided"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help='"smollm2", or "tiny" (a test)')
    p.add_argument("--rows", nargs="+", default=STORED_ROWS, choices=[*ROWS, "default"])
    p.add_argument("--calib", type=int, nargs=2, help="default: the engine's")
    p.add_argument("--held-out", type=int, nargs=2, default=SMOLLM2_TABLE["held_out"])
    p.add_argument("--target", type=float, default=0.05, help="allowed ppl increase")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline", type=Path, help="take the bf16 row from this run")
    p.add_argument("--out", type=Path, default=RESULTS, help="the JSON's folder")
    args = p.parse_args(argv)
    if args.calib is None:
        c = EngineConfig()
        args.calib = (c.calibration_samples, c.calibration_seq_len)
    require_committed()  # before measuring: stored runs are of committed code
    torch.set_num_threads(args.threads)
    tiny = args.model == "tiny"
    folder = tiny_model_path(progress=False) if tiny else resolve_model(args.model)
    model, tokenizer = load_pretrained(folder)
    windows, scored = held_out_windows(tokenizer, *args.held_out)
    calib = token_windows(tokenizer, "train", *args.calib)
    rows = []
    record = {
        "benchmark": "gptq_quality",
        "environment": environment() | {"threads": args.threads},
        "workload": {
            "model": args.model,
            "calib": list(args.calib),
            "calibration_split": "train",
            "held_out": list(args.held_out),
            "scored_per_window": scored,
            "target": args.target,
            "bootstrap": {
                "resamples": quality.RESAMPLES,
                "level": quality.LEVEL,
                "seed": quality.SEED,
            },  # fmt: skip
        },
        "rows": rows,
    }
    default = engine_default(model)
    rows_to_run = dict.fromkeys(["bf16", *args.rows])  # the baseline first
    if "default" in rows_to_run:  # unless a grid row is the same
        del rows_to_run["default"]
        if not any(same_row(default, ROWS[k][1:]) for k in rows_to_run):
            g, mse = default[1]["group_size"], default[1]["mse"]
            label = f"engine default: GPTQ g{g}" + ", searched ranges" * mse
            label += f", {default[1]['rotation'][0]}" * ("rotation" in default[1])
            ROWS["default"] = (label, *default)
            rows_to_run["default"] = None
    record["engine_default"] = {"method": default[0], "settings": default[1]}
    for key in rows_to_run:
        label, method, settings = ROWS[key]
        if key == "bf16" and args.baseline:  # the same windows, measured before
            before = json.loads(args.baseline.read_text())
            same = ("model", "held_out")
            assert all(before["workload"][k] == record["workload"][k] for k in same)
            rows.append(before["rows"][0] | {"reused_from": args.baseline.name})
            continue
        t0 = time.perf_counter()
        model, _ = load_pretrained(folder)  # fresh weights for each row
        merge_projections(model)  # as the quality table and the engine do
        quality.quantize_for_table(model, method, settings, None, calib)
        nll, _ = quality.window_nll(model, windows, scored)
        row = {"key": key, "label": label, "method": method, "settings": settings,
               "engine_default": same_row(default, (method, settings)),
               "ppl": math.exp(float(nll.mean())),
               "ppl_interval": quality.ppl_interval(nll),
               "window_nll": nll.tolist(),
               "seconds": time.perf_counter() - t0}  # fmt: skip
        rows.append(row)
        r, lo, hi = quality.ppl_ratio(record, label, ROWS["bf16"][0])
        row |= {"ratio": r, "ratio_interval": [lo, hi],
                "verdict": verdict(lo, hi, 1 + args.target)}  # fmt: skip
        print(f"{label:40} ppl {row['ppl']:7.3f}  ratio {r:.4f} [{lo:.4f}, {hi:.4f}] "
              f"{row['verdict']:9} {row['seconds']:6.0f} s", flush=True)  # fmt: skip
        path = save("gptq_quality", record, args.out)  # after every row: a partial
    print(path)  # run leaves the rows it finished


if __name__ == "__main__":
    main()
