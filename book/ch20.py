"""Chapter 20's helpers that are not the lesson: the table and figure of the stored
eight-bit speed runs, and the numbers of the stored FP8 KV cache runs.

The chapter (chapters/20_eight_bit.md) and its lab notes
(chapters/lab_notes/20_eight_bit_lab.md) import them; the layers themselves are in
minillm/quantization/ and minillm/kernels/w8a8.py.
"""

from __future__ import annotations

import matplotlib.pyplot as plt


def speed_ratio(run: dict, model: str, kind: str, what: str = "gemm") -> float:
    """bf16's product time over kind's (the bare product, or the whole layer),
    summed over the model's projections, at the prefill rows."""
    rows = [r for r in run["rows"] if r["model"] == model]
    return sum(r["gemm_bf16_ms"] for r in rows) / sum(
        r[f"{what}_{kind}_ms"] for r in rows
    )


def decode_ratio(run: dict, model: str, kind: str) -> float:
    """bf16's time over kind's layer at one row, summed over the projections."""
    rows = [r for r in run["rows"] if r["model"] == model]
    return sum(r["bf16_us"] for r in rows) / sum(r[f"{kind}_us"] for r in rows)


def print_speed_table(speed: dict) -> None:
    """The stored quant_gemm run: TFLOP/s at the prefill rows, microseconds at one."""
    env = speed["environment"]
    print(f"{env['gpu']}, torch {env['torch']}, {env['date'][:10]}; "
          f"M = {speed['workload']['prefill_rows']} rows\n")  # fmt: skip
    print(f"{'':27} {'TFLOP/s at M = 4096':^40} {'us at M = 1':^18}")
    print(f"{'':27} {'bf16':>5} {'int8':>5} {'cuBLAS':>6} {'layer':>5} {'fp8':>5}"
          f" {'layer':>5} {'bf16':>6} {'int8':>5} {'fp8':>5}")  # fmt: skip
    for r in speed["rows"]:
        print(f"{r['model'] + ' ' + r['projection']:27} {r['gemm_bf16_tflops']:5.0f} "
              f"{r['gemm_int8_tflops']:5.0f} {r['gemm_int8_cublas_tflops']:6.0f} "
              f"{r['layer_int8_tflops']:5.0f} {r['gemm_fp8_tflops']:5.0f} "
              f"{r['layer_fp8_tflops']:5.0f} {r['bf16_us']:6.1f} {r['int8_us']:5.1f} "
              f"{r['fp8_us']:5.1f}")  # fmt: skip


def plot_speed_vs_rows(speed: dict):
    """Speed-up over bf16 against the rows M of the product (one decode row, a
    prefill chunk), per model: each projection's layer (dots), all of them (line),
    the bare product (diamond)."""
    M = [speed["workload"]["decode_rows"], speed["workload"]["prefill_rows"]]
    models = list(dict.fromkeys(r["model"] for r in speed["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(8, 3.5), sharey=True)
    for ax, model in zip(axes, models):
        for i, kind in enumerate(["int8", "fp8"]):
            for r in [r for r in speed["rows"] if r["model"] == model]:
                each = [r["bf16_us"] / r[f"{kind}_us"],
                        r["gemm_bf16_ms"] / r[f"layer_{kind}_ms"]]  # fmt: skip
                ax.plot(M, each, ".", color=f"C{i}", alpha=0.4)
            whole = [decode_ratio(speed, model, kind),
                     speed_ratio(speed, model, kind, "layer")]  # fmt: skip
            ax.plot(M, whole, "o:", color=f"C{i}", ms=7,
                    label=f"{kind} layer, all projections")  # fmt: skip
            ax.plot(M[1], speed_ratio(speed, model, kind), "D", mfc="none", ms=7,
                    color=f"C{i}", label=f"{kind} bare product")  # fmt: skip
        ax.axhline(1.0, color="grey", ls="--", lw=1, label="bf16")
        ax.set(xscale="log", xlim=(M[0] / 2, M[1] * 2), xlabel="rows M",
               title=f"{model} shapes")  # fmt: skip
        ax.set_xticks(M, [str(m) for m in M])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"speed-up over bf16, {speed['environment']['gpu']}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def kv_throughput(run: dict) -> dict:
    """The engine's output tokens a second with each KV cache (one stored run of
    benchmarks/throughput.py --kv-cache-dtype auto fp8), by glue key."""
    bf16, fp8 = run["minillm"], run["kv_cache_dtypes"]["fp8"]
    return {
        "ch20_kv_tput_gpu": run["environment"]["gpu"],
        "ch20_kv_tput_bf16": bf16["output_tokens_per_s"],
        "ch20_kv_tput_fp8": fp8["output_tokens_per_s"],
        "ch20_kv_tput_speedup": fp8["output_tokens_per_s"]
        / bf16["output_tokens_per_s"],
        "ch20_kv_tput_blocks": fp8["num_kv_blocks"] / bf16["num_kv_blocks"],
    }


def kv_numbers(quality: dict, attention: dict) -> dict:
    """The numbers the prose quotes from the stored FP8 KV cache runs (quality on
    a CPU, decode attention on a GPU), by glue key."""
    rows = {r["cache"]: r for r in quality["rows"]}
    ratio, lo, hi = quality["ratios"]["fp8 measured / bf16"]
    agree, f32 = quality["greedy"]["fp8 measured"], quality["greedy"]["float32"]
    att = attention["rows"]
    assert att["fp8"]["kv_bytes_read"] * 2 == att["bf16"]["kv_bytes_read"]
    out = {
        "windows": quality["workload"]["windows"][0],
        "ppl_bf16": rows["bf16"]["ppl"],
        "ppl_fp8": rows["fp8 measured"]["ppl"],
        "ppl_delta": 100 * (ratio - 1),
        "ppl_lo": 100 * (lo - 1),
        "ppl_hi": 100 * (hi - 1),
        "ppl1_delta": 100 * (quality["ratios"]["fp8 scale 1 / bf16"][0] - 1),
        "agree_tokens": 100 * agree["tokens"],
        "agree_outputs": 100 * agree["outputs"],
        "agree_prefix": 100 * agree["prefix"],
        "f32_tokens": 100 * f32["tokens"],
        "f32_outputs": 100 * f32["outputs"],
        "prompts": quality["workload"]["prompts"][0],
        "new_tokens": quality["workload"]["prompts"][1],
        "attn_gpu": attention["environment"]["gpu"],
        "attn_seqs": attention["workload"]["num_seqs"],
        "attn_bf16_us": 1e3 * att["bf16"]["ms"],
        "attn_fp8_us": 1e3 * att["fp8"]["ms"],
        "attn_speedup": attention["speedup"],
        "attn_floor_us": 1e3 * att["fp8"]["floor_ms"],
    }
    for cache in ("bf16", "fp8"):  # the share of the copy bandwidth each reaches
        share = att[cache]["bytes_per_s"] / attention["copy_bandwidth_bytes_per_s"]
        out[f"attn_{cache}_bw"] = 100 * share
    return {f"ch13_kv_{key}": value for key, value in out.items()}
