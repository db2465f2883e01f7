"""Chapter 17's W4A16 products against bf16 cuBLAS and PyTorch's own INT4 kernel, and
batch-1 decode through the engine, int4 against bf16.

Products: for every projection of a Qwen3-0.6B, a Llama-3.2-1B and a Llama-3.1-8B
decoder layer (q/k/v and gate/up merged, as the engine runs them), M = 1 .. 256 rows of
bf16 activations, RTN weights with groups of 128. In the same run:

- `cublas`: F.linear on the bf16 weight (the unquantized baseline);
- `w4a16`: `w4a16_matmul` at its default knobs on the weights in the kernel's layout
  (`shuffle_int4`), one kernel for every M: what `Int4Linear` runs;
- `w4a16_plain`: the same kernel on `pack_int4`'s layout (the shuffle's A/B);
- `fused`: `int4_matmul` at its default knobs (the fused Triton kernel);
- `fused_nofold`: the same with fold=False (scale and zero applied to every weight),
  on the Llama-3.1-8B shapes;
- `gemv`: `int4_gemv` at its default knobs (the CUDA-core GEMV, a program per row),
  up to 16 rows;
- `dequant_cublas`: `dequantize_int4` then cuBLAS on the dense weight;
- `int4_linear`: what the engine runs on the shuffled weights (`w4a16` through the
  custom operator);
- `tinygemm`: `torch._weight_int4pack_mm` on the same codes, scales and zeros.

Each product is checked against the reference (the dequantized weight through
F.linear) before it is timed. Times are per call, from replaying a CUDA graph of many
calls in a row (benchmarks/decode_gemm.py's `graph_us`), each call on another copy of
the weights (at least 200 MB in rotation, four times the H200's L2), so that weights
come from HBM. Achieved bandwidth: the bytes of the weights as stored (bf16, or codes +
scales + zeros) over the time, next to the device-to-device copy bandwidth measured in
the same run.

--w4a16-sweep: a grid of w4a16_matmul's knobs on the four Llama-3.1-8B projections at
every M of --rows (where w4a16_config's knobs come from).
--methods: time only these methods (cublas and tinygemm are the baselines).
--sweep: a grid of the fused kernel's knobs on Llama-3.1-8B's down_proj and
gate_up_proj at M = 1, 16, 64, 256 (where default_config's knobs come from).
--gemv-sweep: a grid of int4_gemv's knobs on the same shapes at M = 1 (stored by
chapter 17 as `--gemv-sweep --no-products --name int4_gemm_gemv_sweep`).
--models, --rows: time only these models' shapes and these row counts.

--decode: batch-1 decode time per output token through LLMEngine with CUDA graphs
(prompt 128 random token ids, 128 output tokens, greedy, ignore_eos, median of 3), on
Llama-3.2-1B- and Llama-3.1-8B-shaped models with random weights in bf16, unquantized
and with quantization="int4", both with merged projections; with the KV-cache blocks
each engine got at gpu_memory_utilization 0.9, and the bandwidth limit of each model.

    # on a GPU; writes benchmarks/results/int4_gemm-*.json
    python benchmarks/int4_gemm.py --sweep --decode
    # a smoke test of the code paths on a CPU (tiny shapes, wall-clock times)
    TRITON_INTERPRET=1 python benchmarks/int4_gemm.py --quick
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import copy_bandwidth, environment, require_committed, save  # noqa: E402
from benchmarks.decode_gemm import LLAMA_8B_SHAPES  # noqa: E402
from benchmarks.decode_gemm import SHAPES as GEMM_SHAPES  # noqa: E402
from minillm.int4 import Int4Weight, quantize_rtn, shuffle_int4  # noqa: E402
from minillm.kernels.int4_gemm import (  # noqa: E402
    FUSED_MAX_M,
    GEMV_MAX_M,
    default_config,
    dequantize_int4,
    gemv_config,
    int4_gemv,
    int4_linear,
    int4_matmul,
    num_sms,
    w4a16_config,
    w4a16_matmul,
    w4a16_split,
)

# (model, projection) -> (N, K): out_features, in_features
SHAPES = {**GEMM_SHAPES, **LLAMA_8B_SHAPES}  # chapter 13's, and Llama-3.1-8B's
QUICK_SHAPES = {("tiny", "qkv_proj"): (96, 256), ("tiny", "down_proj"): (64, 512)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUP = 128
ROTATE_BYTES = 200 << 20
TOLERANCE = 2e-2  # max |y - reference| / max |reference| in bf16
METHODS = (
    "cublas",
    "w4a16",
    "w4a16_plain",
    "fused",
    "fused_nofold",
    "gemv",
    "dequant_cublas",
    "int4_linear",
    "tinygemm",
)

# decode shapes (minillm ModelConfig fields); random weights
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
)  # fmt: skip
LLAMA_3_1_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
)  # fmt: skip
DECODE_SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B}


def timer(device: torch.device):
    """per_call_us(calls): CUDA-graph replay on a GPU, wall clock on a CPU."""
    if device.type == "cuda":
        from benchmarks.decode_gemm import graph_us

        return graph_us

    def wall_us(calls: list) -> float:
        calls[0]()
        start = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - start) * 1e6 / len(calls)

    return wall_us


def tinygemm_weight(w: Int4Weight, inner_k_tiles: int = 8):
    """(packed, scales_and_zeros) for torch._weight_int4pack_mm from our codes: its
    weights are (code - 8) * scale + zero, so its zero is (8 - our zero) * scale.
    """
    codes, _, _ = w.to_codes()  # (N, K) uint8
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # (N, K / 2)
    packed = torch._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
    zero = (8 - w.zeros) * w.scales  # (K / g, N)
    return packed, torch.stack([w.scales, zero], dim=-1).contiguous()


def rotated_int4(w: Int4Weight, count: int) -> list[Int4Weight]:
    return [w] + [
        Int4Weight(w.qweight.roll(i, 1), w.scales.roll(i, 1), w.zeros.roll(i, 1), GROUP)
        for i in range(1, count)
    ]


def int4_bytes(w: Int4Weight) -> int:
    return w.qweight.nbytes + w.scales.nbytes + w.zeros.nbytes


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def products(args, device, per_call_us, copy_bw) -> list[dict]:
    rows, shapes = [], QUICK_SHAPES if args.quick else SHAPES
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for (model, name), (N, K) in shapes.items():
        if args.models and model not in args.models:
            continue
        g = torch.Generator().manual_seed(N + K)
        w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
        qw = quantize_rtn(w0, GROUP)
        dense = qw.dequantize(dtype)  # the reference's weight
        n_dense = max(2, math.ceil(ROTATE_BYTES / w0.nbytes))
        n_int4 = max(2, math.ceil(ROTATE_BYTES / int4_bytes(qw)))
        if args.quick:
            n_dense = n_int4 = 2
        dense_copies = [dense] + [dense.roll(i, 0) for i in range(1, n_dense)]
        int4_copies = rotated_int4(qw, n_int4)
        shuffled = Int4Weight(shuffle_int4(qw.qweight), qw.scales, qw.zeros, GROUP)
        shuffled_copies = rotated_int4(shuffled, n_int4)  # the kernel's layout
        tiny_copies = None
        if device.type == "cuda":
            try:
                tiny_copies = [tinygemm_weight(w) for w in int4_copies]
            except RuntimeError as e:
                print(f"tinygemm unavailable: {e}", file=sys.stderr)
        for M in (1, 4, 16) if args.quick else args.rows or ROWS:
            x = torch.randn(M, K, generator=g).to(device, dtype)
            ref = F.linear(x, dense)
            fns = {
                "cublas": lambda w: F.linear(x, w),
                "w4a16": lambda w: w4a16_matmul(x, w),
                "w4a16_plain": lambda w: w4a16_matmul(x, w, shuffled=False),
                "fused": lambda w: int4_matmul(x, w),
                # scale and zero applied per weight (the fold's baseline), 8B only
                "fused_nofold": lambda w: int4_matmul(x, w, fold=False),
                "gemv": lambda w: int4_gemv(x, w),  # up to 16 rows
                "dequant_cublas": lambda w: x @ dequantize_int4(w),
                "int4_linear": lambda w: int4_linear(x, w, shuffled=True),
                "tinygemm": lambda w: torch._weight_int4pack_mm(x, w[0], GROUP, w[1]),
            }
            row = dict(model=model, name=name, N=N, K=K, M=M)
            row.update(bf16_bytes=w0.nbytes, int4_bytes=int4_bytes(qw))
            row["config"] = default_config(M, N, K, GROUP, num_sms(device))
            row["gemv_config"] = gemv_config(M, N, K, GROUP, num_sms(device))
            cfg = w4a16_config(M, N, K, num_sms(device))
            bm, bn = cfg["block_m"], cfg["block_n"]
            split = w4a16_split(M, N, K, bm, bn, num_sms(device))
            row["w4a16_config"] = {**cfg, "split_k": split}
            for method, fn in fns.items():
                copies = dict(cublas=dense_copies, tinygemm=tiny_copies).get(
                    method, int4_copies
                )
                if method in ("w4a16", "int4_linear"):
                    copies = shuffled_copies
                if args.methods and method not in (*args.methods, "cublas"):
                    copies = None
                if method == "fused_nofold" and model != "Llama-3.1-8B":
                    copies = None
                if method == "gemv" and M > 16:
                    copies = None
                if copies is None:
                    row[f"{method}_us"] = None
                    continue
                try:
                    err = rel_error(fn(copies[0]), ref)
                except Exception as e:  # a kernel that fails to build: recorded
                    print(f"{model} {name} M={M} {method}: {e!r:.300}", flush=True)
                    row[f"{method}_us"], row[f"{method}_failure"] = None, repr(e)[:300]
                    continue
                row[f"{method}_error"] = err
                if err > TOLERANCE:
                    print(f"{model} {name} M={M} {method}: error {err:.3g}", flush=True)
                    row[f"{method}_us"] = None  # wrong: not timed
                    continue
                calls = max(20, len(copies))
                us = per_call_us(
                    [lambda c=copies[i % len(copies)]: fn(c) for i in range(calls)]
                )
                row[f"{method}_us"] = us
                nbytes = row["bf16_bytes" if method == "cublas" else "int4_bytes"]
                row[f"{method}_fraction_of_copy"] = nbytes / (us * 1e-6) / copy_bw
            rows.append(row)
            print(summary(row), flush=True)
    return rows


def summary(row: dict) -> str:
    """One line: times, w4a16 against bf16 and tinygemm, its fraction of the copy."""
    times = "  ".join(
        f"{m} {row[f'{m}_us']:.1f}" for m in METHODS if row.get(f"{m}_us")
    )
    line = f"{row['model']:12} {row['name']:12} M {row['M']:3}: {times}"
    ours = row.get("w4a16_us")
    if ours:
        line += f" | x{row['cublas_us'] / ours:.2f} bf16"
        if row.get("tinygemm_us"):
            line += f" x{row['tinygemm_us'] / ours:.2f} tinygemm"
        line += f" roofline {row['w4a16_fraction_of_copy']:.2f}"
    return line


SWEEP_SHAPES = (("Llama-3.1-8B", "down_proj"), ("Llama-3.1-8B", "gate_up_proj"))
SWEEP_ROWS = (1, 16, 64, 256)
GEMV_SWEEP_ROWS = (1,)


def grid(M: int) -> list[dict]:
    """The knobs --sweep tries at M rows, the likeliest first."""
    if M <= 16:
        return [
            dict(block_m=16, block_n=bn, block_k=bk, gather=ga, split_k=sk)
            for ga in (True, False)
            for sk in (4, 1)
            for bn in (64, 32, 128)
            for bk in (128, 64)
        ]
    return [
        dict(block_m=bm, block_n=bn, block_k=64, gather=ga, num_warps=nw, split_k=1)
        for ga in (True, False)
        for bm in (64, 128, 32)
        for bn in (128, 64)
        for nw in (4, 8)
    ]


def gemv_grid(M: int) -> list[dict]:
    """The knobs --gemv-sweep tries at M rows, the default split first."""
    return [
        dict(block_n=bn, block_k=bk, split_k=sk, num_warps=nw)
        for bk in (128, 64)
        for bn, nw in ((256, 4), (1024, 8), (512, 4), (256, 2))
        for sk in (None, 8, 16, 32)
    ]


def sweep(args, device, per_call_us, copy_bw, gemv=False) -> list[dict]:
    """Every (shape, rows) gets an equal share of the time budget."""
    rows_swept = GEMV_SWEEP_ROWS if gemv else SWEEP_ROWS
    out, share = [], args.sweep_budget_s / (len(SWEEP_SHAPES) * len(rows_swept))
    fn, knob_grid = (int4_gemv, gemv_grid) if gemv else (int4_matmul, grid)
    for model, name in SWEEP_SHAPES:
        N, K = SHAPES[model, name]
        g = torch.Generator().manual_seed(N + K)
        w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
        qw = quantize_rtn(w0, GROUP)
        copies = rotated_int4(qw, max(2, math.ceil(ROTATE_BYTES / int4_bytes(qw))))
        for M in rows_swept:
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            ref = F.linear(x, qw.dequantize(torch.bfloat16))
            stop = time.time() + share
            for knobs in knob_grid(M):
                if time.time() > stop:
                    break
                if gemv and knobs["split_k"] is None:  # the default split
                    knobs = {**knobs, "split_k": gemv_config(M, N, K, GROUP)["split_k"]}
                try:
                    err = rel_error(fn(x, qw, **knobs), ref)
                    us = per_call_us(
                        [
                            lambda c=copies[i % len(copies)]: fn(x, c, **knobs)
                            for i in range(max(20, len(copies)))
                        ]
                    )
                except Exception as e:  # a tile that does not fit: recorded
                    out.append(dict(name=name, M=M, knobs=knobs, error=repr(e)[:200]))
                    continue
                frac = int4_bytes(qw) / (us * 1e-6) / copy_bw
                out.append(
                    dict(name=name, N=N, K=K, M=M, knobs=knobs, us=us, rel_error=err)
                )
                out[-1]["fraction_of_copy"] = frac
            timed = [
                r for r in out if r.get("us") and r["name"] == name and r["M"] == M
            ]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                us, knobs = best["us"], best["knobs"]
                print(
                    f"{'gemv ' if gemv else ''}sweep {name} M {M}: {len(timed)} knobs, "
                    f"best {us:.1f} us {knobs}"
                )
    return out


def w4a16_grid(M: int) -> list[dict]:
    """The knobs --w4a16-sweep tries at M rows, the likeliest first."""
    c = []
    if M <= 2:  # the CUDA cores, a tile of rows as tall as the batch
        for bn, nw in ((256, 4), (128, 4), (512, 8), (256, 8)):
            for st in (3, 4):
                c.append(dict(dot=False, fold=True, block_m=M, block_n=bn,
                              num_warps=nw, num_stages=st))  # fmt: skip
    if M <= 16:  # tl.dot on 16 rows, zero point folded
        for bn, nw in ((128, 4), (64, 4), (256, 8), (128, 8)):
            for st in (3, 5):
                c.append(dict(dot=True, fold=True, block_m=16, block_n=bn,
                              num_warps=nw, num_stages=st))  # fmt: skip
        c.append(dict(dot=True, fold=False, block_m=16, block_n=128, num_warps=4,
                      num_stages=3))  # fmt: skip
        return c
    bms = (32, 64) if M <= 32 else (64, 128) if M <= 128 else (128, 64)
    for bm in bms:
        for bn, nw in ((128, 8), (256, 8), (128, 4)):
            for st in (3, 4):
                c.append(dict(dot=True, fold=False, block_m=bm, block_n=bn,
                              num_warps=nw, num_stages=st))  # fmt: skip
    c.append(dict(dot=True, fold=True, block_m=bms[0], block_n=128, num_warps=8,
                  num_stages=3))  # fmt: skip
    return c


def w4a16_sweep(args, device, per_call_us, copy_bw) -> list[dict]:
    """Every (projection, rows) gets an equal share of the time budget; each knob
    setting at its automatic split, and below 17 rows at twice that too."""
    shapes = [k for k in SHAPES if k[0] == "Llama-3.1-8B"]
    rows_swept = args.rows or ROWS
    out, share = [], args.sweep_budget_s / (len(shapes) * len(rows_swept))
    sms = num_sms(device)
    for model, name in shapes:
        N, K = SHAPES[model, name]
        g = torch.Generator().manual_seed(N + K)
        w0 = (torch.randn(N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
        qw = quantize_rtn(w0, GROUP)
        ref_w = qw.dequantize(torch.bfloat16)
        qs = Int4Weight(shuffle_int4(qw.qweight), qw.scales, qw.zeros, GROUP)
        copies = rotated_int4(qs, max(2, math.ceil(ROTATE_BYTES / int4_bytes(qw))))
        for M in rows_swept:
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            ref, stop, timed = F.linear(x, ref_w), time.time() + share, []
            for knobs in [w4a16_config(M, N, K, sms), *w4a16_grid(M)]:
                auto = w4a16_split(M, N, K, knobs["block_m"], knobs["block_n"], sms)
                for split in (auto, 2 * auto) if M <= 16 and timed else (auto,):
                    if time.time() > stop and timed:
                        break
                    kn = {**knobs, "split_k": split}
                    r = sweep_one(x, qs, copies, ref, kn, per_call_us, copy_bw)
                    out.append(dict(name=name, N=N, K=K, M=M, knobs=kn, **r))
                    timed += [out[-1]] if r.get("us") else []
            if timed:
                best = min(timed, key=lambda r: r["us"])
                print(f"w4a16 sweep {name} M {M}: {len(timed)} knobs, default "
                      f"{timed[0]['us']:.1f} us, best {best['us']:.1f} us "
                      f"{best['knobs']}", flush=True)  # fmt: skip
    return out


def sweep_one(x, w, copies, ref, knobs, per_call_us, copy_bw) -> dict:
    """One knob setting: checked against ref, then timed over the copies."""
    try:
        err = rel_error(w4a16_matmul(x, w, **knobs), ref)
        if err > TOLERANCE:
            return dict(rel_error=err, error="wrong result: not timed")
        calls = [
            lambda c=copies[i % len(copies)]: w4a16_matmul(x, c, **knobs)
            for i in range(max(20, len(copies)))
        ]
        us = per_call_us(calls)
    except Exception as e:  # a tile that does not fit: recorded
        return dict(error=repr(e)[:200])
    frac = int4_bytes(w) / (us * 1e-6) / copy_bw
    return dict(us=us, rel_error=err, fraction_of_copy=frac)


def generate(engine, request_id: str, prompt: list[int], n: int):
    from minillm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return final.outputs[0]


def model_bytes_per_step(model, dtype, prompt_len: int, output_len: int) -> dict:
    """What one decode step reads: the decoder layers' weights as stored, the final
    norm, the LM head, one embedding row (unless the head is the table), the KV cache.
    """
    from minillm.kv_cache import kv_cache_bytes_per_token

    layers = model.model.layers
    layer_bytes = sum(t.nbytes for t in [*layers.parameters(), *layers.buffers()])
    config = model.config
    tied = config.tie_word_embeddings
    parts = {
        "layer_bytes": layer_bytes,
        "norm_bytes": model.model.norm.weight.nbytes,
        "lm_head_bytes": model.lm_head.weight.nbytes,
        "embedding_row_bytes": 0 if tied else config.hidden_size * dtype.itemsize,
        "kv_bytes": kv_cache_bytes_per_token(config, dtype)
        * (prompt_len + output_len / 2),
    }
    return {**parts, "bytes": sum(parts.values())}


def decode(args, device, copy_bw) -> list[dict]:
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.merged_projections import merge_projections
    from minillm.model import CausalLM, ModelConfig
    from minillm.model_runner import reclaim_gpu_memory

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tiny = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    tiny.update(vocab_size=1024, num_attention_heads=4, num_key_value_heads=2)
    prompt_len, output_len = (128, 128) if not args.quick else (16, 8)
    rows = []
    for shape, kwargs in DECODE_SHAPES.items():
        if args.decode_shapes and shape not in args.decode_shapes:
            continue
        config = ModelConfig(**{**kwargs, **(tiny if args.quick else {})})
        rng = random.Random(0)
        prompt = [
            rng.randrange(min(10000, config.vocab_size)) for _ in range(prompt_len)
        ]
        row = {"shape": shape, "model_config": config.__dict__.copy()}
        for quant in (None, "int4"):
            if on_gpu:
                reclaim_gpu_memory()
            torch.manual_seed(0)
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    model = CausalLM(config).eval()
            finally:
                torch.set_default_dtype(before)
            merge_projections(model)  # both engines multiply merged matrices
            engine_config = EngineConfig(
                quantization=quant,
                attention_backend="triton" if on_gpu else "torch",
                cuda_graphs=on_gpu,
                torch_compile=False,
                max_num_seqs=1,
                max_num_batched_tokens=256,
                max_model_len=prompt_len + output_len + 16,
                gpu_memory_utilization=0.9,
            )
            start = time.perf_counter()
            engine = LLMEngine(model, None, engine_config)
            init_s = time.perf_counter() - start
            generate(engine, "warm-up", prompt[:16], 16)
            tpots, tokens = [], None
            for i in range(1 if args.quick else args.decode_repeats):
                completion = generate(engine, f"r{i}", prompt, output_len)
                tpots.append(completion.time_per_output_token)
                tokens = tokens or completion.token_ids
            step_bytes = model_bytes_per_step(model, dtype, prompt_len, output_len)
            key = quant or "bf16"
            row[key] = {
                "time_per_output_token_s": statistics.median(tpots),
                "values": tpots,
                "init_s": init_s,
                "kv_cache_blocks": engine.model_runner.kv_cache.num_blocks,
                "block_size": engine.config.block_size,
                "graph_steps": getattr(engine.model_runner, "num_graph_steps", None),
                "roofline": step_bytes,
                "min_time_per_output_token_s": step_bytes["bytes"] / copy_bw,
                "token_ids": tokens[:16],
            }
            print(
                f"decode {shape} {key}: {1e3 * statistics.median(tpots):.3f} ms/token, "
                f"limit {1e3 * step_bytes['bytes'] / copy_bw:.3f} ms, "
                f"KV blocks {row[key]['kv_cache_blocks']}",
                flush=True,
            )
            del engine, model
            gc.collect()
        row["speedup"] = (
            row["bf16"]["time_per_output_token_s"]
            / row["int4"]["time_per_output_token_s"]
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of knobs")
    parser.add_argument("--sweep-budget-s", type=float, default=120)
    parser.add_argument("--gemv-sweep", action="store_true", help="int4_gemv's knobs")
    parser.add_argument("--decode", action="store_true", help="batch-1 decode too")
    parser.add_argument("--models", nargs="*", default=None, help="e.g. Llama-3.1-8B")
    parser.add_argument("--methods", nargs="*", default=None, help="e.g. w4a16 fused")
    parser.add_argument("--w4a16-sweep", action="store_true", help="its knobs")
    parser.add_argument("--rows", nargs="*", type=int, default=None)
    parser.add_argument("--decode-shapes", nargs="*", default=None)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--no-products", action="store_true")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="int4_gemm", help="results name")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("benchmarks/int4_gemm.py times GPU kernels: no CUDA device found")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    per_call_us = timer(device)
    copy_bw = copy_bandwidth() if device.type == "cuda" else 1e11
    record = {
        "benchmark": "int4_gemm",
        "environment": environment(),
        "workload": {
            "dtype": "bfloat16",
            "group_size": GROUP,
            "quantization": "RTN, asymmetric 4-bit (minillm.int4.quantize_rtn)",
            "rows": list(args.rows or ROWS),
            "weights_rotated_bytes": ROTATE_BYTES,
            "timing": "CUDA-graph replay of many calls, median of 5 replays, per call",
            "fused_max_m": FUSED_MAX_M,
            "gemv_max_m": GEMV_MAX_M,
            "quick": args.quick,
        },
        "copy_bandwidth_bytes_per_s": copy_bw,
        "bandwidth_kind": "device-to-device copy",
    }
    if not args.no_products:
        record["rows"] = products(args, device, per_call_us, copy_bw)
    if args.sweep and device.type == "cuda":
        record["sweep"] = sweep(args, device, per_call_us, copy_bw)
    if args.w4a16_sweep and device.type == "cuda":
        record["w4a16_sweep"] = w4a16_sweep(args, device, per_call_us, copy_bw)
    if args.gemv_sweep and device.type == "cuda":
        record["gemv_sweep"] = sweep(args, device, per_call_us, copy_bw, gemv=True)
    if args.decode:
        record["decode"] = decode(args, device, copy_bw)
    if args.quick:
        print("quick run: nothing saved")
        return
    record["benchmark"] = args.name
    path = save(args.name, record, args.out or Path(__file__).parent / "results")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
