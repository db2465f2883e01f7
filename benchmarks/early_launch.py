"""Early launch (programmatic dependent launch, chapter 13) under stress: chains of
kernels that each read the previous one's output, captured in CUDA graphs several times
and replayed many times, every replay's output compared bit for bit with the same chain
launched ordinarily; per launch mode (0 ordinary, 1 and 2 early).

- `decode`: chapter 13's decode attention (the decode kernel and its reduction)
  chained 8 deep on its own output, on 3 sequences (those of
  tests/test_triton_attention.py's graph test) and on 32; (the stored run of
  2026-12-03, commit 538012f, also chained the combined reduction, since removed)
- `eager`: the same chains launched without a graph (the caching allocator hands a
  freed buffer to the very next launch);
- `layers`: 28 Qwen3-0.6B layers at batch 1 as the engine's fused layers run them
  (products with the norms in their load, q/k norm + rotation + cache write, decode
  attention and its reduction), with the engine's default knobs;
- `asm`: for each kernel compiled for early launch, the global loads, stores and atomics
  its PTX and SASS place before the grid-dependency wait (the wait's SASS is ACQBULK);
  the listings' heads go to asm.txt next to the JSON.

    python benchmarks/early_launch.py   # on a Hopper GPU; writes results/early_launch-*
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, environment, require_committed, save  # noqa: E402
from minillm.kernels import paged_decode as pd  # noqa: E402
from minillm.kernels import qk_norm_rope as qk  # noqa: E402
from minillm.kernels import reshape_and_cache as rc  # noqa: E402
from minillm.kernels import skinny_gemm as sg  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, MAX_LEN = 16, 8, 128, 16, 1024
BF16 = torch.bfloat16
DEVICE = "cuda"


def kv_cache(seq_lens: list[int], gen: torch.Generator) -> tuple:
    """Random K/V caches holding the sequences, their block tables and lengths."""
    n_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 1
    kc, vc = (
        torch.randn(n_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE, BF16)
        for _ in range(2)
    )
    free = torch.randperm(n_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), MAX_LEN // BLOCK, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, : -(-n // BLOCK)] = free[used : used + -(-n // BLOCK)]
        used += -(-n // BLOCK)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return kc, vc, tables.to(DEVICE), lens.to(DEVICE)


def attend(h, kv, pdl: int):
    kc, vc, tables, lens = kv
    return pd.paged_decode(h, kc, vc, tables, lens, MAX_LEN, pdl=pdl)


def decode_chain(q, kv, pdl: int, depth: int = 8):
    h = q * 1.0  # a kernel before, that the first launch must wait for
    for _ in range(depth):
        h = attend(h, kv, pdl)
    return h


def replays(fn, ref, captures: int, n: int) -> list[tuple[int, int]]:
    """(capture, replay) of every replay whose output differs from ref."""
    fn()
    torch.cuda.synchronize()
    bad = []
    flags = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    for c in range(captures):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for r in range(n):
            out.zero_()
            graph.replay()
            flags[r] = (out != ref).any()
        bad += [(c, r) for r in flags.nonzero().flatten().tolist()]
        del graph, out
    return bad


def eager(fn, ref, n: int) -> list[int]:
    flags = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    for r in range(n):
        flags[r] = (fn() != ref).any()
    return flags.nonzero().flatten().tolist()


def layer_chain(gen: torch.Generator, seq_len: int = 256):
    """A function running 28 engine layers at batch 1 in a launch mode."""
    eps = 1e-6

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, BF16)

    layers = []
    for _ in range(28):
        kv = kv_cache([seq_len], gen)
        layers.append(dict(
            qkv=rand(4096, 1024, scale=1024**-0.5),
            o=rand(1024, 2048, scale=2048**-0.5),
            gate_up=rand(6144, 1024, scale=1024**-0.5),
            down=rand(1024, 3072, scale=3072**-0.5),
            g1=rand(1024) * 0.1 + 1, g2=rand(1024) * 0.1 + 1,
            gqk=rand(HEADS + KV_HEADS, HEAD_DIM) * 0.1 + 1, kv=kv,
        ))  # fmt: skip
    for w in layers:  # the new token's slot, written by the q/k kernel, then read
        block = w["kv"][2][0, (seq_len - 1) // BLOCK].long()
        w["slot"] = (block * BLOCK + (seq_len - 1) % BLOCK)[None]
    x0 = rand(1, 1024)
    angles = torch.rand(1, HEAD_DIM, generator=gen).to(DEVICE) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)

    def run(pdl: int):
        h, r = x0 * 1.0, x0 * 1.0
        for w in layers:
            kc, vc = w["kv"][:2]
            sums = torch.empty_like(h)
            qkv = sg.skinny_linear(h, w["qkv"], norm=(w["g1"], eps, r, sums), pdl=pdl)
            q = qk.qk_norm_rope_write(qkv, w["gqk"], eps, cos, sin, kc, vc, w["slot"],
                                      HEADS, pdl=pdl)  # fmt: skip
            a = attend(q, w["kv"], pdl)
            o = sg.skinny_linear(a.reshape(1, HEADS * HEAD_DIM), w["o"], pdl=pdl)
            r = torch.empty_like(o)
            gu = sg.skinny_linear(
                o, w["gate_up"], norm=(w["g2"], eps, sums, r), pdl=pdl
            )
            h = sg.skinny_linear(gu, w["down"], gated=True, pdl=pdl)
        return h

    return run


def compiled(fn) -> list:
    out = []
    for entry in fn.device_caches.values():
        cache = entry if isinstance(entry, dict) else entry[0]
        out += list(cache.values())
    return out


def asm_report(asm_path: Path) -> list[dict]:
    """Memory instructions before the grid-dependency wait, per kernel launched
    early."""
    try:
        from triton.tools.disasm import get_sass
    except ImportError:  # pragma: no cover
        get_sass = None
    kernels = {
        "decode": pd._decode_kernel, "reduce": pd._reduce_kernel,
        "skinny": sg._skinny_kernel, "qk_norm_rope": qk._qk_norm_rope_write_kernel,
        "write_kv": rc._write_kv_kernel,
    }  # fmt: skip
    rows, text = [], []
    for name, fn in kernels.items():
        for k in compiled(fn):
            ptx = k.asm.get("ptx", "")
            if "griddepcontrol.wait" not in ptx:
                continue
            before = ptx.split("griddepcontrol.wait")[0]
            body = before.split("{", 1)[-1]
            row = dict(
                kernel=name,
                constants={str(a): str(b) for a, b in
                           getattr(getattr(k, "src", None), "constants", {}).items()},
                ptx_loads_before_wait=len(re.findall(r"\bld\.global", body)),
                ptx_stores_before_wait=len(re.findall(r"\bst\.global", body)),
                ptx_atomics_before_wait=len(re.findall(r"\b(atom|red)\.", body)),
                ptx_launch_dependents_before_wait="launch_dependents" in body,
            )  # fmt: skip
            text += [f"===== {name} {row['constants']}", "--- PTX up to 40 lines "
                     "after the wait"]  # fmt: skip
            lines = ptx.splitlines()
            at = next(i for i, s in enumerate(lines) if "griddepcontrol.wait" in s)
            text += lines[max(0, at - 60) : at + 40]
            if get_sass is not None:
                try:
                    sass = get_sass(k.asm["cubin"])
                    sl = sass.splitlines()
                    w = [i for i, s in enumerate(sl) if "ACQBULK" in s]
                    row["sass_wait_found"] = bool(w)
                    if w:
                        head = "\n".join(sl[: w[0]])
                        row["sass_loads_before_wait"] = len(re.findall(r"\bLDG", head))
                        row["sass_stores_before_wait"] = len(re.findall(r"\bSTG", head))
                        row["sass_atomics_before_wait"] = len(
                            re.findall(r"\b(ATOMG|RED)", head)
                        )
                    text += ["--- SASS head"] + sl[: (w[0] + 30 if w else 120)]
                except Exception as e:  # noqa: BLE001
                    row["sass_error"] = repr(e)
            rows.append(row)
            print(f"asm {row}", flush=True)
    asm_path.write_text("\n".join(text) + "\n")
    return rows


def decode_batch(record, bname, seq_lens, modes, gen, args) -> None:
    """Decode chains per launch mode, in graphs and eagerly."""
    kv = kv_cache(seq_lens, gen)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen).to(DEVICE, BF16)
    ref = decode_chain(q, kv, 0)
    for pdl in modes:
        t = time.perf_counter()
        bad = replays(lambda m=pdl: decode_chain(q, kv, m), ref, args.captures,
                      args.replays)  # fmt: skip
        row = dict(batch=bname, seqs=len(seq_lens), pattern="two_kernels", pdl=pdl,
                   replays=args.captures * args.replays, mismatches=len(bad),
                   first=bad[:20], seconds=time.perf_counter() - t)  # fmt: skip
        record["decode"].append(row)
        print(f"decode {row}", flush=True)
        if args.eager:
            bad = eager(lambda m=pdl: decode_chain(q, kv, m), ref, args.eager)
            row = dict(batch=bname, pattern="two_kernels", pdl=pdl, chains=args.eager,
                       mismatches=len(bad), first=bad[:20])  # fmt: skip
            record["eager"].append(row)
            print(f"eager {row}", flush=True)
    save("early_launch", record, args.out)


def layers(record, gen, modes, args) -> None:
    run = layer_chain(gen)
    ref = run(0)
    for pdl in modes:
        t = time.perf_counter()
        bad = replays(lambda m=pdl: run(m), ref, 2, args.layer_replays)
        row = dict(pdl=pdl, replays=2 * args.layer_replays, mismatches=len(bad),
                   first=bad[:20], seconds=time.perf_counter() - t)  # fmt: skip
        record["layers"].append(row)
        print(f"layers {row}", flush=True)
    save("early_launch", record, args.out)


def asm(record, out: Path) -> None:
    try:
        record["asm"] = asm_report(out / "early_launch_asm.txt")
    except Exception as e:  # noqa: BLE001
        record["asm_error"] = repr(e)
        print(f"asm failed: {e!r}", flush=True)
    save("early_launch", record, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--captures", type=int, default=4)
    parser.add_argument("--replays", type=int, default=500, help="per capture")
    parser.add_argument("--eager", type=int, default=200, help="eager chains per case")
    parser.add_argument("--layer-replays", type=int, default=200)
    parser.add_argument("--modes", default="0,1,2")
    parser.add_argument("--layer-modes", default="0,1,2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code
    modes = [int(m) for m in args.modes.split(",")]
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    record = {
        "benchmark": "early_launch",
        "environment": environment(),
        "workload": dict(
            heads=HEADS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            max_seq_len=MAX_LEN,
            dtype="bfloat16",
            decode_depth=8,
            captures=args.captures,
            replays_per_capture=args.replays,
            eager_chains=args.eager,
            layer_replays_per_capture=args.layer_replays,
            check="each replay's output against the chain launched ordinarily "
            "(two kernels, mode 0, eager), bit for bit; the output zeroed before "
            "each replay",
        ),  # fmt: skip
        "decode": [],
        "eager": [],
        "layers": [],
    }
    batches = {"test": [300, 17, 1000]}
    batches["wide"] = torch.randint(1, MAX_LEN + 1, (32,), generator=gen).tolist()
    decode_batch(record, "test", batches["test"], modes, gen, args)
    asm(record, args.out)
    layers(record, gen, [int(m) for m in args.layer_modes.split(",")], args)
    asm(record, args.out)
    decode_batch(record, "wide", batches["wide"], modes, gen, args)
    record["seconds"] = time.perf_counter() - t0
    print("wrote", save("early_launch", record, args.out), flush=True)


if __name__ == "__main__":
    main()
