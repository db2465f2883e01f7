"""Chapter 20's speed table: W8A8 int8 (chapter 20's Triton kernel, and cuBLAS
through torch._int_mm) and FP8 (torch._scaled_mm) matrix products against bf16
(cuBLAS), and batch-1 decode through the engine.

For every projection of a Llama-3.1-8B and a Qwen3-0.6B decoder layer (q/k/v and
gate/up merged, as the engine runs them on a GPU):

* prefill, M = 4096 rows: TFLOP/s of the bare product (bf16 F.linear; int8
  int8_scaled_mm, scales applied in its epilogue, and _int_mm, int32 out; FP8
  rowwise _scaled_mm) and of the whole layer (Int8Linear and Fp8Linear of
  minillm.quantization: per-token activation quantization, product, rescale);
* decode, M = 1 row: microseconds per layer call, replayed in a CUDA graph, each
  call on another copy of the weight so that it comes from HBM.

Every layer is checked against bf16 F.linear before it is timed. Then, if time is
left (--engine-budget-s), batch-1 decode of a random Qwen3-0.6B-shaped model
through LLM(quantization=None | "w8a8" | "fp8"): time per output token.

    python benchmarks/quant_gemm.py          # on a GPU; writes benchmarks/results/
    python benchmarks/quant_gemm.py --int8-sweep   # int8_scaled_mm's knobs, per M
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from benchmarks.decode_gemm import LLAMA_8B_SHAPES  # noqa: E402
from benchmarks.decode_gemm import SHAPES as GEMM_SHAPES  # noqa: E402
from minillm.kernels.w8a8 import int8_mm_config, int8_scaled_mm  # noqa: E402
from minillm.quantization.fp8 import Fp8Linear, quantize_fp8  # noqa: E402
from minillm.quantization.w8a8 import (  # noqa: E402
    Int8Linear,
    int8_mm,
    int8_mm_ref,
    quantize_int8,
)

# (model, projection) -> (N, K); layers per model
SHAPES = {
    **LLAMA_8B_SHAPES,
    **{key: nk for key, nk in GEMM_SHAPES.items() if key[0] == "Qwen3-0.6B"},
}
LAYERS = {"Llama-3.1-8B": 32, "Qwen3-0.6B": 28}
ROTATE_BYTES = 400 << 20


def cuda_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(calls: list) -> float:
    """Per-call microseconds of calls replayed in one CUDA graph (median of 5)."""
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def layers_for(n: int, k: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    linear.weight.data.copy_(w)
    return {"bf16": linear, "int8": Int8Linear.from_linear(linear),
            "fp8": Fp8Linear.from_linear(linear)}  # fmt: skip


def check(layers: dict, k: int) -> dict:
    """Relative error of each layer against bf16 F.linear on random rows."""
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    for rows in (x, x[:1]):  # cuBLAS, and the padded path of a decode step
        xq, _ = quantize_int8(rows)
        w8 = layers["int8"].qweight
        if not torch.equal(int8_mm(xq, w8), int8_mm_ref(xq, w8)):
            raise AssertionError("torch._int_mm differs from the exact product")
    ref = layers["bf16"](x).float()
    errors = {}
    for kind, layer in layers.items():
        y = layer(x).float()
        errors[kind] = float((y - ref).norm() / ref.norm())
        if errors[kind] > 0.08:
            raise AssertionError(f"{kind}: relative error {errors[kind]:.3f}")
    return errors


def prefill(layers: dict, n: int, k: int, m: int) -> dict:
    """TFLOP/s of the bare products and of the whole layers at m rows."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_int8(x)
    xf, xfs = quantize_fp8(x)
    w8, w8s = layers["int8"].qweight, layers["int8"].weight_scale
    wf, wfs = layers["fp8"].qweight, layers["fp8"].weight_scale.T.contiguous()
    bare = {
        "bf16": lambda: F.linear(x, layers["bf16"].weight),
        "int8": lambda: int8_scaled_mm(xq, xs, w8, w8s, torch.bfloat16),
        "int8_cublas": lambda: torch._int_mm(xq, w8.T),
        "fp8": lambda: torch._scaled_mm(xf, wf.T, scale_a=xfs, scale_b=wfs,
                                        out_dtype=torch.bfloat16),
    }  # fmt: skip
    whole = {kind: (lambda layer=layer: layer(x)) for kind, layer in layers.items()}
    flops = 2 * m * n * k
    out = {}
    for name, fns in (("gemm", bare), ("layer", whole)):
        for kind, fn in fns.items():
            ms = cuda_ms(fn)
            out[f"{name}_{kind}_ms"] = ms
            out[f"{name}_{kind}_tflops"] = flops / (ms * 1e-3) / 1e12
    return out


def decode(layers: dict, n: int, k: int) -> dict:
    """Microseconds per call at one row, each call on another copy of the weights."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = {}
    for kind, layer in layers.items():
        nbytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        copies = [layer] + [
            _clone(layer) for _ in range(max(0, ROTATE_BYTES // nbytes))
        ]
        out[f"{kind}_us"] = graph_us([lambda c=c: c(x) for c in copies])
        out[f"{kind}_weight_bytes"] = nbytes
        del copies
    return out


def _clone(layer):
    import copy

    return copy.deepcopy(layer)


def engine_decode(quantization: str | None, folder: Path, output_len: int) -> dict:
    """Batch-1 time per output token of LLM(folder, quantization=...), CUDA graphs
    on, torch.compile off (the same for every row)."""
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    start = time.perf_counter()
    extra = {"smoothquant_alpha": None} if quantization == "w8a8" else {}
    llm = LLM(folder, skip_tokenizer_init=True, quantization=quantization,
              cuda_graphs=True, torch_compile=False, max_model_len=512,
              gpu_memory_utilization=0.5, **extra)  # fmt: skip
    init_s = time.perf_counter() - start
    prompt = [[(7 * i) % 10000 for i in range(128)]]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    tpots = []
    for _ in range(3):
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        tpots.append(out.outputs[0].time_per_output_token)
    result = {"quantization": quantization, "init_s": init_s,
              "time_per_output_token_ms": 1e3 * statistics.median(tpots),
              "token_ids": out.outputs[0].token_ids[:16]}  # fmt: skip
    del llm
    torch.cuda.empty_cache()
    return result


SWEEP = [  # (BM, BN, BK, warps, stages)
    (16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 3), (16, 32, 512, 4, 3), (32, 64, 256, 4, 4),
    (64, 64, 256, 4, 4), (64, 128, 128, 4, 4), (64, 128, 256, 4, 3),
    (128, 128, 128, 4, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
    (128, 256, 128, 8, 4), (256, 128, 128, 8, 3), (128, 256, 64, 8, 4),
]  # fmt: skip


def int8_sweep(rows: list[int]) -> list[dict]:
    """Microseconds of int8_scaled_mm for every knob setting in SWEEP (tiles at most
    4x the rows high) on the Llama-3.1-8B shapes, replayed in a CUDA graph, each
    call on another copy of the weights (from HBM, as in a decode step)."""
    results = []
    for (model, proj), (n, k) in SHAPES.items():
        if model != "Llama-3.1-8B":
            continue
        copies = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
                  for _ in range(max(1, ROTATE_BYTES // (n * k)))]  # fmt: skip
        sb = torch.rand(n, device="cuda")
        for m in rows:
            a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
            sa = torch.rand(m, 1, device="cuda")
            row = {"projection": proj, "N": n, "K": k, "M": m, "default": None,
                   "us": {}}  # fmt: skip
            for cfg in [c for c in SWEEP if c[0] <= max(16, 4 * m)]:
                calls = [
                    partial(int8_scaled_mm, a, sa, w, sb, torch.bfloat16, config=cfg)
                    for w in copies
                ]
                row["us"][str(cfg)] = graph_us(calls)
            row["default"] = str(int8_mm_config(m))
            best = min(row["us"], key=row["us"].get)
            print(
                f"{proj:13} M={m:5} best {best} {row['us'][best]:.1f} us; default "
                f"{row['us'].get(row['default'], float('nan')):.1f} us",
                flush=True,
            )
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--engine-budget-s", type=float, default=120)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--int8-sweep",
        action="store_true",
        help="time int8_scaled_mm's knobs instead (M = 1 .. 4096)",
    )
    args = parser.parse_args()  # fmt: skip
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available():
        sys.exit("benchmarks/quant_gemm.py times GPU products: no CUDA device found")
    if args.int8_sweep:
        record = {"benchmark": "quant_gemm_int8_sweep", "environment": environment(),
                  "sweep": int8_sweep([1, 16, 64, 4096])}  # fmt: skip
        print("wrote", save("quant_gemm_int8_sweep", record, *filter(None, [args.out])))
        return
    t_start = time.perf_counter()
    record = {
        "benchmark": "quant_gemm",
        "environment": environment(),
        "workload": {"prefill_rows": args.rows, "decode_rows": 1,
                     "dtype": "bfloat16 activations; int8 / fp8 e4m3 W8A8",
                     "weights_rotated_bytes": ROTATE_BYTES,
                     "timing": "prefill: CUDA events, median of 20; decode: CUDA "
                               "graph replay of many calls, median of 5"},
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "rows": [], "engine": [],
    }  # fmt: skip
    for (model, proj), (n, k) in SHAPES.items():
        layers = layers_for(n, k)
        row = {"model": model, "projection": proj, "N": n, "K": k,
               "rel_error": check(layers, k)}  # fmt: skip
        row.update(prefill(layers, n, k, args.rows))
        row.update(decode(layers, n, k))
        record["rows"].append(row)
        print(f"{model:13} {proj:13} bf16 {row['gemm_bf16_tflops']:6.0f}  int8 "
              f"{row['gemm_int8_tflops']:6.0f} (cuBLAS "
              f"{row['gemm_int8_cublas_tflops']:5.0f}, "
              f"{row['layer_int8_tflops']:5.0f} layer)"
              f"  fp8 {row['gemm_fp8_tflops']:6.0f} ({row['layer_fp8_tflops']:5.0f}"
              f" layer) TFLOP/s | M=1 us: bf16 {row['bf16_us']:.1f} int8 "
              f"{row['int8_us']:.1f} fp8 {row['fp8_us']:.1f}", flush=True)  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        from benchmarks.latency import random_checkpoint

        folder = Path(tmp)
        random_checkpoint(folder, "qwen3-0.6b", False, "cuda", torch.bfloat16)
        for quantization in (None, "w8a8", "fp8"):
            if time.perf_counter() - t_start > args.engine_budget_s:
                record["engine"].append({"quantization": quantization,
                                         "skipped": "time budget"})  # fmt: skip
                continue
            try:
                row = engine_decode(quantization, folder, output_len=64)
                if row["quantization"] is not None and record["engine"]:
                    base = record["engine"][0].get("token_ids", [])
                    row["same_first_tokens_as_bf16"] = sum(
                        a == b for a, b in zip(base, row["token_ids"])
                    )
            except Exception as e:  # noqa: BLE001 -- record what failed, keep going
                row = {"quantization": quantization, "error": repr(e)[:300]}
            record["engine"].append(row)
            print("engine", row, flush=True)
    path = (
        save("quant_gemm", record, args.out) if args.out else save("quant_gemm", record)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
