"""Schema coverage on folders of real-world JSON Schemas (JSONSchemaBench's subsets),
minillm's compiler next to xgrammar's, on the CPU.

For every schema file, each library compiles it (a refusal is classified: minillm's
GrammarError naming a keyword, another failure, or the time limit); then, for each
library that compiled it, a seeded "random model" (a uniform choice among the tokens
the mask allows) writes a few outputs in compact JSON, and jsonschema checks every
output that finished. Each mask is timed twice: wall-clock, and as the thread's CPU
time (which leaves out the time the OS gave other processes: on a shared machine the
wall-clock p99 is mostly that). minillm also writes one walk with jump-forward
decoding (the forced bytes' tokens appended without a model step), counted apart.
Each (schema, library) job runs in a forked child with a time limit, so a compile
that hangs (in Python or in C++) is counted and stopped.

    python benchmarks/schema_coverage.py /path/to/jsonschemabench/data/Glaiveai2K \
        /path/to/jsonschemabench/data/Github_medium --limit 50 \
        --source Glaiveai2K=OWNER/REPO@COMMIT --source Github_medium=OWNER/REPO@COMMIT

Writes benchmarks/results/schema_coverage-cpu-DATE.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import random
import sys
import time
import warnings
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, require_committed, save  # noqa: E402
from minillm.structured.ir import GrammarError  # noqa: E402
from minillm.structured.matcher import jump_forward_tokens  # noqa: E402
from minillm.structured.processor import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
)
from minillm.structured.schema_ops import guaranteed  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402

LICENSE = (
    "no LICENSE file in the stored copy of guidance-ai/jsonschemabench; its README "
    "says the schemas come from json-schema-corpus and glaive-function-calling-v2. "
    "Only derived counts and file names are stored here, never the schemas."
)


def model_folder(model: str) -> Path:
    if model == "tiny":
        from minillm.tiny import tiny_model_path

        return tiny_model_path(progress=False)
    from minillm.convert import resolve_model

    return resolve_model(model)


class Libraries:
    """Both libraries on one tokenizer, as chapter 23's lab notes set them up."""

    def __init__(self, folder: Path):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.compiler = GrammarCompiler(Tokenizer.from_pretrained(folder))
        self.index = self.compiler.index
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        self.xgr = xgr
        self.xgr_info = xgr.TokenizerInfo.from_huggingface(
            hf_tok, stop_token_ids=self.index.eos_token_ids
        )
        self.xgr_compiler = xgr.GrammarCompiler(
            self.xgr_info, max_threads=1, cache_enabled=False
        )
        self.pieces = hf_tok.convert_ids_to_tokens(list(range(self.index.vocab_size)))

    def text(self, ids: list[int]) -> tuple[str, int]:
        """The output's text and how many special tokens (no bytes of their own in
        our index: <|im_start|> and the like) it holds, written as their names."""
        raw = self.index.token_bytes
        parts = [raw[t] if raw[t] is not None else self.pieces[t].encode() for t in ids]
        return b"".join(parts).decode(errors="replace"), sum(
            raw[t] is None for t in ids
        )

    def minillm(self, schema, rng, walks, max_tokens, send):
        """Compile with minillm (compact JSON, a budget of max_tokens), then walk."""
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                params.logits_processor(self.compiler, max_tokens=max_tokens)
        except GrammarError as e:
            keyword, message = getattr(e, "keyword", None), str(e).splitlines()[0]
            if "is too few for this schema" in message:  # compiled; cannot finish
                send(("compiled", 1e3 * (time.perf_counter() - t0), []))
                return send(("outputs", [{"end": "over_budget"}] * walks, ([], [])))
            kind = "unsupported" if keyword else "refused"
            return send(("refused", kind, keyword or message[:120], message[:200]))
        ms = 1e3 * (time.perf_counter() - t0)
        send(("compiled", ms, [str(w.message)[:160] for w in caught]))
        eos, outputs, mask_us, mask_cpu = set(self.index.eos_token_ids), [], [], []
        for _ in range(walks):
            proc = params.logits_processor(self.compiler, max_tokens=max_tokens)
            out, done = [], None
            for _ in range(max_tokens + 1):
                t0, c0 = time.perf_counter(), time.thread_time()
                words = proc.next_token_mask(out)  # the mask alone, timed
                mask_us.append(1e6 * (time.perf_counter() - t0))
                mask_cpu.append(1e6 * (time.thread_time() - c0))
                bits = torch.from_numpy(words.view("int32"))[:, None] >> SHIFTS & 1
                allowed = torch.nonzero(bits.flatten()[: self.index.vocab_size])
                allowed = allowed.flatten().tolist()
                if not allowed:
                    done = "stuck"  # the mask allowed nothing: a bug, counted apart
                    break
                token = rng.choice(allowed)
                if token in eos:
                    done = "finished"
                    break
                out.append(token)
            text, special = self.text(out)
            outputs.append(
                {"end": done or "unfinished", "text": text, "special": special}
            )
        jump = self.jump_forward_walk(params, rng, max_tokens)
        send(("outputs", outputs, (mask_us, mask_cpu), [jump]))

    def jump_forward_walk(self, params, rng, max_tokens):
        """One more walk, with jump-forward: the forced bytes' canonical tokens
        (less the last) appended without a model step; counts both."""
        proc = params.logits_processor(self.compiler, max_tokens=max_tokens)
        eos, out, steps, done = set(self.index.eos_token_ids), [], 0, None
        appended = 0
        while len(out) <= max_tokens and done is None:
            forced = jump_forward_tokens(proc.matcher(out))[: max_tokens - len(out)]
            out += forced
            appended += len(forced)
            bits = torch.from_numpy(proc.next_token_mask(out).view("int32"))
            bits = (bits[:, None] >> SHIFTS & 1).flatten()[: self.index.vocab_size]
            allowed = torch.nonzero(bits).flatten().tolist()
            steps += 1  # one model step: a token sampled under the mask
            if not allowed:
                done = "stuck"
            elif (token := rng.choice(allowed)) in eos:
                done = "finished"
            elif len(out) < max_tokens:
                out.append(token)
            else:
                break
        text, special = self.text(out)
        end = done or "unfinished"
        return {"end": end, "text": text, "special": special, "tokens": len(out),
                "model_steps": steps, "appended": appended}  # fmt: skip

    def xgrammar(self, schema, rng, walks, max_tokens, send):
        """Compile with xgrammar (compact JSON, its own defaults otherwise), walk."""
        xgr, t0 = self.xgr, time.perf_counter()
        try:
            compiled = self.xgr_compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False
            )
        except Exception as e:  # xgrammar raises RuntimeError or ValueError
            message = str(e).splitlines()[0]
            return send(("refused", "refused", message[:120], message[:200]))
        send(("compiled", 1e3 * (time.perf_counter() - t0)))
        bitmask = xgr.allocate_token_bitmask(1, self.xgr_info.vocab_size)
        outputs, mask_us, mask_cpu = [], [], []
        for _ in range(walks):
            m, out, done = xgr.GrammarMatcher(compiled), [], None
            for _ in range(max_tokens + 1):
                t0, c0 = time.perf_counter(), time.thread_time()
                m.fill_next_token_bitmask(bitmask)
                mask_us.append(1e6 * (time.perf_counter() - t0))
                mask_cpu.append(1e6 * (time.thread_time() - c0))
                bits = (bitmask[0, :, None] >> SHIFTS) & 1  # (words, 32)
                allowed = torch.nonzero(bits.flatten()).flatten().tolist()
                if not allowed:
                    done = "stuck"
                    break
                token = rng.choice(allowed)
                if token in self.index.eos_token_ids:
                    done = "finished"
                    break
                if not m.accept_token(token):
                    done = "stuck"
                    break
                out.append(token)
            text, special = self.text(out)
            outputs.append(
                {"end": done or "unfinished", "text": text, "special": special}
            )
        send(("outputs", outputs, (mask_us, mask_cpu)))


SHIFTS = torch.arange(32, dtype=torch.int32)


def run_job(libs, lib, schema, seed, walks, max_tokens, limit_s):
    """One library on one schema in a forked child: its compile status and its
    outputs, or a timeout (the child is killed)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            getattr(libs, lib)(
                schema, random.Random(seed), walks, max_tokens, send.send
            )
        except Exception as e:  # anything else (RecursionError too): an error
            message = f"{type(e).__name__}: {e}"
            send.send(("refused", "error", message[:120], message[:200]))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    row, deadline = {"status": "timeout"}, time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0 and recv.poll(left):
        try:
            message = recv.recv()
        except EOFError:  # the child died (a crash in C++, say)
            row.setdefault("detail", f"child exited with {proc.exitcode}")
            if row["status"] == "timeout":
                row["status"] = "error"
            break
        if message[0] == "refused":
            row.update(status=message[1], detail=message[2], message=message[3])
            break
        if message[0] == "compiled":
            row.update(status="compiled", compile_ms=round(message[1], 2))
            if len(message) > 2 and message[2]:
                row["warnings"] = message[2]
        if message[0] == "outputs":
            row["outputs"], (row["mask_us"], row["mask_cpu_us"]) = message[1:3]
            if len(message) > 3:  # minillm's jump-forward walk
                row["jump"] = message[3]
            break
    proc.kill()
    proc.join()
    if row["status"] == "timeout":
        row["detail"] = f"compile over {limit_s:g} s"
    return row


def checker(schema):
    """jsonschema's validator for the schema's own draft (formats checked), or None
    where jsonschema itself rejects the schema. A schema that names no draft but
    uses `dependencies` gets draft 7, which defines it (2020-12 ignores it)."""
    default = jsonschema.validators.validator_for({})  # the latest draft
    if "$schema" not in schema and '"dependencies"' in json.dumps(schema):
        default = jsonschema.Draft7Validator
    cls = jsonschema.validators.validator_for(schema, default=default)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def judge(validator, outputs, relaxed=None):
    """Each output: unfinished / stuck, or finished and valid / invalid; a finished
    output that jsonschema cannot check (a $ref it cannot resolve) is "unchecked".
    "approximated": invalid, but valid against relaxed (the schema with the
    approximations both libraries state: oneOf as anyOf, uniqueItems dropped)."""
    verdicts = []
    for o in outputs:
        if o["end"] != "finished":
            verdicts.append(o["end"])
            continue
        try:
            value = json.loads(o["text"])
            ok = validator is not None and validator.is_valid(value)
            if not ok and relaxed is not None and relaxed.is_valid(value):
                verdicts.append("approximated")
                continue
            verdicts.append("valid" if ok else "invalid")
        except ValueError:
            verdicts.append("invalid")  # not JSON at all
        except Exception:  # referencing's Unresolvable and the like
            verdicts.append("unchecked")
    return verdicts


def mask_percentiles(times: list[float], name: str = "mask_us") -> dict:
    """p50 / p99 of the per-token mask times (microseconds), over every step:
    wall-clock ("mask_us"), or the thread's CPU time ("mask_cpu_us": the time
    the mask took, less the time the OS gave other processes meanwhile)."""
    if not times:
        return {f"{name}_p50": None, f"{name}_p99": None, "mask_steps": 0}
    times = sorted(times)
    p50, p99 = (
        times[len(times) // 2],
        times[min(len(times) - 1, len(times) * 99 // 100)],
    )
    return {f"{name}_p50": round(p50, 1), f"{name}_p99": round(p99, 1),
            "mask_steps": len(times)}  # fmt: skip


def relaxed_checker(schema):
    """checker() of guaranteed(schema), or None where the two are the same."""
    loose = guaranteed(schema)
    return None if loose == schema else checker(loose)


def jump_summary(jobs) -> dict:
    """The jump-forward walks: tokens written, model steps taken, verdicts."""
    walks = [o for j in jobs for o in j.get("jump", [])]
    if not walks:
        return {}
    verdicts = collections.Counter(v for j in jobs for v in j.get("jump_verdicts", []))
    tokens = sum(o["tokens"] for o in walks)
    steps = sum(o["model_steps"] for o in walks)
    return {"jump_forward": {
        "walks": len(walks), "tokens": tokens, "model_steps": steps,
        "tokens_appended": sum(o["appended"] for o in walks),
        "finished": sum(verdicts[v] for v in ("valid", "invalid", "approximated",
                                              "unchecked")),
        "valid": verdicts["valid"], "invalid": verdicts["invalid"],
        "approximated": verdicts["approximated"],
    }}  # fmt: skip


def summarize(rows):
    out = {"schemas": len(rows)}
    out["jsonschema_rejects"] = sum(not r["jsonschema_ok"] for r in rows)
    for lib in ("minillm", "xgrammar"):
        status = collections.Counter(r[lib]["status"] for r in rows)
        verdicts = collections.Counter(
            v for r in rows for v in r[lib].get("verdicts", [])
        )
        ms = sorted(r[lib]["compile_ms"] for r in rows if "compile_ms" in r[lib])
        out[lib] = {
            "compiled": status["compiled"],
            "status": dict(status),
            "outputs": sum(verdicts.values()),
            "finished": sum(
                verdicts[v] for v in ("valid", "invalid", "unchecked", "approximated")
            ),
            **{
                v: verdicts[v]
                for v in (
                    "valid",
                    "invalid",
                    "approximated",
                    "unchecked",
                    "unfinished",
                    "over_budget",
                    "timeout",
                    "stuck",
                )
            },
            "compile_ms_median": ms[len(ms) // 2] if ms else None,
            **mask_percentiles([t for r in rows for t in r[lib].get("mask_us", [])]),
            **mask_percentiles(
                [t for r in rows for t in r[lib].get("mask_cpu_us", [])], "mask_cpu_us"
            ),
            "schemas_with_warnings": sum(bool(r[lib].get("warnings")) for r in rows),
            "outputs_with_special_tokens": sum(r[lib].get("special", 0) for r in rows),
            "refusals": dict(
                collections.Counter(
                    r[lib]["detail"] for r in rows if r[lib]["status"] != "compiled"
                ).most_common()
            ),
            **jump_summary([r[lib] for r in rows]),
            "schemas_all_valid": sum(
                bool(r[lib].get("verdicts")) and set(r[lib]["verdicts"]) == {"valid"}
                for r in rows
            ),
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="folders of *.json schemas")
    parser.add_argument(
        "--limit", type=int, default=80, help="first N files per dir (0: all)"
    )
    parser.add_argument(
        "--every", type=int, default=1, help="every Nth file (a spread sample)"
    )
    parser.add_argument("--walks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--time-limit", type=float, default=10.0, help="s per job")
    parser.add_argument("--model", default="smollm2", help="tokenizer: smollm2, tiny")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        help="SUBSET=OWNER/REPO@COMMIT, where a folder came from",
    )
    parser.add_argument("--name", default="schema_coverage")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    require_committed()  # before measuring: stored runs are of committed code

    t0 = time.perf_counter()
    libs = Libraries(model_folder(args.model))
    setup_s = time.perf_counter() - t0
    sources = dict(s.split("=", 1) for s in args.source)
    subsets = {}
    for folder in args.dirs:
        files = sorted(folder.glob("*.json"))[:: args.every][: args.limit or None]
        rows = []
        for i, path in enumerate(files):
            schema = json.loads(path.read_text())
            row = {"file": path.name}
            validator, relaxed = checker(schema), relaxed_checker(schema)
            row["jsonschema_ok"] = validator is not None
            for lib in ("minillm", "xgrammar"):
                seed = f"{path.name}:{lib}"
                job = run_job(
                    libs,
                    lib,
                    schema,
                    seed,
                    args.walks,
                    args.max_tokens,
                    args.time_limit,
                )
                outputs = job.pop("outputs", [])
                job["verdicts"] = judge(validator, outputs, relaxed)
                if job["status"] == "compiled" and not outputs:  # the walks ran out
                    job["verdicts"] = ["timeout"] * args.walks
                job["invalid_outputs"] = [  # what was let through, for reading
                    o.get("text", "")[:300]
                    for o, v in zip(outputs, job["verdicts"])
                    if v == "invalid"
                ]
                job["special"] = sum(o.get("special", 0) > 0 for o in outputs)
                if "jump" in job:  # judged as the others; its text is not kept
                    job["jump_verdicts"] = judge(validator, job["jump"], relaxed)
                    for o in job["jump"]:
                        o.pop("text")
                row[lib] = job
            rows.append(row)
            print(
                f"{folder.name} {i + 1}/{len(files)} {path.name}: "
                f"minillm {row['minillm']['status']} {row['minillm']['verdicts']}, "
                f"xgrammar {row['xgrammar']['status']} {row['xgrammar']['verdicts']}",
                flush=True,
            )
        subsets[folder.name] = {
            "source": sources.get(folder.name),
            "summary": summarize(rows),
            "rows": rows,
        }
        for row in rows:  # the per-step times live on in the summary's percentiles
            for lib in ("minillm", "xgrammar"):
                row[lib].pop("mask_us", None)
                row[lib].pop("mask_cpu_us", None)
    from importlib.metadata import version

    env = environment()
    env.update(xgrammar=version("xgrammar"), jsonschema=version("jsonschema"))
    record = {
        "benchmark": "schema_coverage",
        "environment": env,
        "workload": {
            "tokenizer": args.model,
            "vocab_size": libs.index.vocab_size,
            "walks_per_schema": args.walks,
            "max_tokens": args.max_tokens,
            "time_limit_s": args.time_limit,
            "files_per_subset": args.limit or "all",
            "every_nth_file": args.every,
            "compact_json": True,
            "setup_s": round(setup_s, 1),
            "random_model": "uniform over the allowed tokens, seeded by file name",
        },
        "dataset": {"name": "JSONSchemaBench", "license": LICENSE},
        "subsets": subsets,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    path = save(args.name, record, args.out) if args.out else save(args.name, record)
    for name, sub in subsets.items():
        s = sub["summary"]
        print(
            f"{name}: {s['schemas']} schemas; compiled minillm "
            f"{s['minillm']['compiled']}, xgrammar {s['xgrammar']['compiled']}; "
            f"valid/finished minillm {s['minillm']['valid']}/"
            f"{s['minillm']['finished']}, xgrammar {s['xgrammar']['valid']}/"
            f"{s['xgrammar']['finished']}"
        )
        for lib in ("minillm", "xgrammar"):
            t = s[lib]
            print(
                f"  {lib}: compile median {t['compile_ms_median']} ms; mask p50/p99 "
                f"{t['mask_us_p50']}/{t['mask_us_p99']} us wall, "
                f"{t['mask_cpu_us_p50']}/{t['mask_cpu_us_p99']} us CPU"
            )
        if "jump_forward" in s["minillm"]:
            print(f"  jump-forward: {s['minillm']['jump_forward']}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
