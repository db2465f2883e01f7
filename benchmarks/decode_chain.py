"""The fixed cost of a decode step's kernels: chains of launches replayed from one CUDA
graph, with and without programmatic dependent launch (PDL), and chapter 14's skinny
product at the four projection shapes of a Qwen3-0.6B layer at batch 1.

Three measurements, each a CUDA graph of many launches in a row, median of 5 replays:

- `empty`: a chain of 200 launches of a kernel that reads and writes one number per
  program; its time per launch is the fixed cost a kernel pays in a graph replay;
- `shapes`: for each projection (qkv, o, gate_up, down with the SiLU·mul in its load),
  28 calls on 28 different weights (as the 28 layers of a step: W comes from HBM), for
  a grid of the kernel's knobs with and without PDL, next to cuBLAS;
- `layers`: the four products of 28 layers chained as in a step (each reads the
  previous one's output), with a small element-wise kernel between them standing for
  the norms, for the default knobs, the best knobs of `shapes`, each with and without
  PDL, and cuBLAS.

Every variant's output is compared with the default's (bit for bit) and with F.linear.

    python benchmarks/decode_chain.py   # on a GPU; writes results/decode_chain-*.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    RESULTS,
    copy_bandwidth,
    environment,
    require_committed,
    save,
)
from minillm.kernels.skinny_gemm import (  # noqa: E402
    silu_mul,
    skinny_linear,
)

# projection -> (N, K, gated) of a Qwen3-0.6B layer
SHAPES = {
    "qkv_proj": (4096, 1024, False),
    "o_proj": (1024, 2048, False),
    "gate_up_proj": (6144, 1024, False),
    "down_proj": (1024, 3072, True),
}
LAYERS = 28


@triton.jit
def _touch_kernel(x_ptr, PDL: tl.constexpr):
    i = tl.program_id(0)
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)


def graph_us(calls: list, per: int) -> float:
    """Microseconds per `per`-th of the calls, all captured in one graph."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times)


def empty_chain(pdl: int, programs: int, n: int = 200) -> float:
    x = torch.zeros(programs, device="cuda")

    def call():
        _touch_kernel[(programs,)](x, PDL=pdl, num_warps=4, launch_pdl=pdl > 0)

    us = graph_us([call] * n, n)
    return us


def knob_grid(K: int) -> list[dict]:
    """Today's configuration first, then the likeliest; K split only when long."""
    out = [dict(block_n=16, block_k=256, num_stages=3, num_warps=4, split_k=4)]
    for bn, bk, st, nw in [(8, 1024, 1, 4), (4, 1024, 1, 4), (8, 512, 2, 4),
                           (4, 512, 2, 2), (32, 256, 3, 8)]:  # fmt: skip
        for split in (1, 2, 4) if K > 1024 and bn <= 8 else (1,) if K <= 1024 else (4,):
            out.append(dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw,
                            split_k=split))  # fmt: skip
    if K <= 1024:
        out[0]["split_k"] = 1
    return [dict(use_dot=False, **c) for c in out]


# one step of K per program: a program's whole slice of W is in flight before it waits
ONE_STEP = {
    "qkv": dict(block_n=4, block_k=1024, num_stages=1, split_k=1),
    "o": dict(block_n=4, block_k=1024, num_stages=1, split_k=2),
    "gate_up": dict(block_n=4, block_k=1024, num_stages=1, split_k=1),
    "down": dict(block_n=4, block_k=1024, num_stages=1, split_k=4),
}


def real_layers(
    record: dict, max_len: int = 2064, seq_len: int = 256, modes=(0, 1, 2), knobs=None
) -> None:
    """28 Qwen3-0.6B layers at batch 1 as the engine's fused layers run them: qkv with
    the input norm, q/k norm + rotation + cache write, decode attention (+ reduce), o,
    gate-up with the post-attention norm, down with the activation; by launch mode."""
    from minillm.kernels.paged_decode import paged_decode
    from minillm.kernels.qk_norm_rope import qk_norm_rope_write

    bf16, dev, eps = torch.bfloat16, "cuda", 1e-6
    heads, kv_heads, hd, bs = 16, 8, 128, 16

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=dev, dtype=bf16) * scale

    layers = [
        dict(
            qkv=rand(4096, 1024, scale=1024**-0.5),
            o=rand(1024, 2048, scale=2048**-0.5),
            gate_up=rand(6144, 1024, scale=1024**-0.5),
            down=rand(1024, 3072, scale=3072**-0.5),
            g1=rand(1024) * 0.1 + 1,
            g2=rand(1024) * 0.1 + 1,
            gqk=rand(heads + kv_heads, hd) * 0.1 + 1,
            kc=rand(max_len // bs + 2, bs, kv_heads, hd),
            vc=rand(max_len // bs + 2, bs, kv_heads, hd),
        )
        for _ in range(LAYERS)
    ]
    table = torch.arange(max_len // bs + 2, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([seq_len], device=dev, dtype=torch.int32)
    slot = torch.tensor([seq_len - 1], device=dev, dtype=torch.int64)
    x0 = rand(1, 1024)
    angles = torch.rand(1, hd, device=dev) * 6
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    rows = []
    outs = {}
    kn = knobs or {name: {} for name in ONE_STEP}
    for mode in modes:
        state = {}

        def first():
            state["h"], state["r"] = x0 * 1.0, x0 * 1.0

        def layer(w, mode=mode):
            h, r = state["h"], state["r"]
            sums = torch.empty_like(h)
            qkv = skinny_linear(h, w["qkv"], norm=(w["g1"], eps, r, sums), pdl=mode,
                                **kn["qkv"])  # fmt: skip
            q = qk_norm_rope_write(
                qkv, w["gqk"], eps, cos, sin, w["kc"], w["vc"], slot, heads,
                pdl=mode,
            )  # fmt: skip
            a = paged_decode(q, w["kc"], w["vc"], table, lens, max_len, pdl=mode)
            o = skinny_linear(a.reshape(1, heads * hd), w["o"], pdl=mode, **kn["o"])
            sums2 = torch.empty_like(o)
            gu = skinny_linear(o, w["gate_up"], norm=(w["g2"], eps, sums, sums2),
                               pdl=mode, **kn["gate_up"])  # fmt: skip
            state["h"] = skinny_linear(gu, w["down"], gated=True, pdl=mode,
                                       **kn["down"])  # fmt: skip
            state["r"] = sums2

        calls = [first] + [lambda w=w: layer(w) for w in layers]
        try:
            us = graph_us(calls, LAYERS)
        except Exception as e:  # noqa: BLE001
            print(f"real layers pdl={mode} failed: {e!r}", flush=True)
            continue
        outs[mode] = state["h"].clone()
        outs.setdefault(0, outs[mode])
        row = dict(max_seq_len=max_len, pdl=mode, us_per_layer=us)
        row["knobs"] = "one step" if knobs else "default"
        row["same_bits_as_pdl0"] = bool(torch.equal(outs[mode], outs[0]))
        rows.append(row)
        print(f"real layers {row}", flush=True)
    record.setdefault("real_layers", []).extend(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=70, help="cap for shapes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--only-real-layers", action="store_true", help="only the engine's layers"
    )
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    t0 = time.perf_counter()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    record = {
        "benchmark": "decode_chain",
        "environment": environment(),
        "workload": {
            "dtype": "bfloat16",
            "rows": 1,
            "layers": LAYERS,
            "shapes": {k: list(v) for k, v in SHAPES.items()},
            "timing": "CUDA-graph replay of a chain of launches, median of 5",
            "pdl": "0 off; 1 launch dependents after gdc_wait; 2 at program start",
        },
        "copy_bandwidth_bytes_per_s": copy_bw,
        "empty": [],
        "shapes": [],
        "layers": [],
    }
    if args.only_real_layers:
        for max_len in (400, 2064):
            for knobs in (None, ONE_STEP):  # saved as it goes: a cut run keeps some
                real_layers(record, max_len, modes=(0, 1), knobs=knobs)
                save("decode_chain_real_layers", record, args.out)
        return
    for programs in (1, 132, 512):
        for pdl in (0, 1, 2):
            try:
                us = empty_chain(pdl, programs)
            except Exception as e:  # noqa: BLE001
                print(f"empty x{programs} pdl={pdl} failed: {e!r}", flush=True)
                continue
            record["empty"].append(dict(programs=programs, pdl=pdl, us_per_launch=us))
            print(f"empty x{programs} pdl={pdl}: {us:.2f} us/launch", flush=True)
    save("decode_chain", record, args.out)

    # attention of one token at batch 1: the cache write, then decode (+ reduce)
    from minillm.kernels.paged_decode import paged_decode
    from minillm.kernels.reshape_and_cache import triton_reshape_and_cache

    record["attention"] = []
    heads, kv_heads, hd, bs, seq_len = 16, 8, 128, 16, 256
    cache = [
        torch.randn(64, bs, kv_heads, hd, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    ]
    table = torch.randperm(64, device="cuda", dtype=torch.int32)[None, :]
    lens = torch.tensor([seq_len], device="cuda", dtype=torch.int32)
    slot = torch.tensor([seq_len - 1], device="cuda", dtype=torch.int64)
    q0 = torch.randn(1, heads, hd, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 1, kv_heads, hd, device="cuda", dtype=torch.bfloat16)
    for max_len in (400, 2064):
        for pdl in (False, True):

            def attn(max_len=max_len, pdl=pdl):
                triton_reshape_and_cache(kv[0], kv[1], *cache, slot)
                return paged_decode(q0, *cache, table, lens, max_len, pdl=pdl)

            try:
                us = graph_us([attn] * LAYERS, LAYERS)
            except Exception as e:  # noqa: BLE001
                print(f"attention {max_len} {pdl} failed: {e!r}")
                continue
            row = dict(max_seq_len=max_len, pdl=pdl, us=us)
            row["same_bits"] = bool(
                torch.equal(attn(), paged_decode(q0, *cache, table, lens, max_len,
                                                 pdl=False))
            )  # fmt: skip
            record["attention"].append(row)
            print(f"attention {row}", flush=True)
    save("decode_chain", record, args.out)

    # 28 layers of weights, and x for each shape
    weights = {
        name: [
            torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            for _ in range(LAYERS)
        ]
        for name, (N, K, _) in SHAPES.items()
    }
    best = {}
    for name, (N, K, gated) in SHAPES.items():
        x = torch.randn(1, 2 * K if gated else K, device="cuda", dtype=torch.bfloat16)
        ws = weights[name]
        ref = F.linear(silu_mul(x) if gated else x, ws[0])
        base = skinny_linear(x, ws[0], gated=gated)

        def cublas_call(w, x=x, gated=gated):
            return lambda: F.linear(silu_mul(x) if gated else x, w)

        us = graph_us([cublas_call(w) for w in ws], LAYERS)
        row = dict(shape=name, N=N, K=K, knobs="cublas", pdl=0, us=us)
        row["fraction_of_copy"] = N * K * 2 / (us * 1e-6) / copy_bw
        record["shapes"].append(row)
        print(f"{name} cublas {us:.2f} us", flush=True)
        shape_start = time.perf_counter()
        for knobs in knob_grid(K):
            for pdl in (0, 2, 1):
                if pdl > 0 and knobs != knob_grid(K)[0]:
                    continue  # launched early: on today's configuration only
                if time.perf_counter() - shape_start > args.budget_s / len(SHAPES):
                    break
                cfg = dict(knobs, pdl=pdl)
                try:
                    y = skinny_linear(x, ws[0], gated=gated, **cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    record["shapes"].append(dict(shape=name, knobs=cfg, error=repr(e)))
                    print(f"{name} {cfg} failed: {e!r}", flush=True)
                    continue

                def call(w, x=x, gated=gated, cfg=cfg):
                    return lambda: skinny_linear(x, w, gated=gated, **cfg)

                us = graph_us([call(w) for w in ws], LAYERS)
                err = ((y.float() - ref.float()).abs().max() / ref.abs().max()).item()
                row = dict(
                    shape=name,
                    N=N,
                    K=K,
                    knobs=cfg,
                    us=us,
                    fraction_of_copy=N * K * 2 / (us * 1e-6) / copy_bw,
                    relative_error=err,
                    same_bits_as_pdl0=None,
                )
                if pdl > 0:
                    y0 = skinny_linear(x, ws[0], gated=gated, **dict(knobs, pdl=0))
                    row["same_bits_as_pdl0"] = bool(torch.equal(y, y0))
                record["shapes"].append(row)
                print(
                    f"{name} {cfg}: {us:.2f} us ({row['fraction_of_copy']:.0%} of "
                    f"copy) err {err:.1e} same={row['same_bits_as_pdl0']} "
                    f"default_same={torch.equal(y, base)}",
                    flush=True,
                )
                if err < 2e-2 and us < best.get((name, pdl), (1e9, None))[0]:
                    best[(name, pdl)] = (us, knobs)
        save("decode_chain", record, args.out)
    record["best"] = [
        dict(shape=n, pdl=p, us=us, knobs=k) for (n, p), (us, k) in best.items()
    ]

    # layer chain: [norm] qkv [attention] o [norm] gate_up down, where a one-kernel
    # stand-in (y * 0.5) takes the place of each norm and of the attention; with
    # fused norms, qkv and gate_up make the residual sum and the norm themselves
    xs = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5

    def layer_calls(cfgs, cublas=False, fuse_norms=False):
        calls, state = [], {}

        def first():
            state["h"], state["r"] = xs * 1.0, xs * 1.0

        calls.append(first)
        for i in range(LAYERS):

            def step(i=i):
                h, r = state["h"], state["r"]
                for name, (_, _, gated) in SHAPES.items():
                    w = weights[name][i]
                    normed = name in ("qkv_proj", "gate_up_proj")
                    if cublas:
                        h = F.linear(silu_mul(h) if gated else h * 0.5, w)
                    elif normed and fuse_norms:
                        sums = torch.empty_like(h)
                        h = skinny_linear(h, w, norm=(g, 1e-6, r, sums), **cfgs[name])
                        r = sums
                    else:
                        h = h * 0.5 if normed else h  # stands for the norm
                        h = skinny_linear(h, w, gated=gated, **cfgs[name])
                    if name == "qkv_proj":
                        h = h[:, :2048] * 0.5  # stands for the attention
                state["h"], state["r"] = h, r

            calls.append(step)
        return calls, state

    variants = {"default": ({n: {} for n in SHAPES}, False)}
    for pdl in (1, 2):
        variants[f"default_pdl{pdl}"] = ({n: dict(pdl=pdl) for n in SHAPES}, False)
    if all((n, 0) in best for n in SHAPES):
        for pdl in (0, 2):
            cfgs = {n: dict(best[(n, 0)][1], pdl=pdl) for n in SHAPES}
            variants[f"best_pdl{pdl}"] = (cfgs, False)
        variants["best_pdl2_fused_norms"] = (cfgs, True)
    variants["default_pdl2_fused_norms"] = ({n: dict(pdl=2) for n in SHAPES}, True)
    outs = {}
    for vname, (cfgs, fuse_norms) in list(variants.items()) + [
        ("cublas", (None, False))
    ]:
        calls, state = layer_calls(cfgs, cfgs is None, fuse_norms)
        try:
            us = graph_us(calls, LAYERS)
        except Exception as e:  # noqa: BLE001
            print(f"layers {vname} failed: {e!r}", flush=True)
            record["layers"].append(dict(variant=vname, error=repr(e)))
            continue
        outs[vname] = state["h"].clone()
        row = dict(variant=vname, knobs=cfgs, fused_norms=fuse_norms, us_per_layer=us)
        row["same_bits_as_default"] = bool(torch.equal(outs[vname], outs["default"]))
        record["layers"].append(row)
        print(f"layers {vname}: {us:.2f} us/layer same={row['same_bits_as_default']}")
    record["seconds"] = time.perf_counter() - t0
    save("decode_chain", record, args.out)


if __name__ == "__main__":
    main()
