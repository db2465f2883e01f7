"""What every benchmark records next to its numbers: hardware, software versions, date,
commit.

Benchmarks run on the GPU box (see README); each writes one JSON file to
benchmarks/results/.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def engine_settings(engine) -> dict:
    """What the engine chose where its options left it a choice: the parts it resolved
    (chapter 7's seam) and the fast-path flags its runner resolved (chapter 11's).
    """
    runner = engine.model_runner
    flags = ("cuda_graphs", "torch_compile", "async_scheduling")
    return {
        "runner": type(runner).__name__,
        **{k: v for k, v in engine.parts.items() if k != "device"},
        **{name: getattr(runner, name, False) for name in flags},
    }


def kernel_knobs() -> dict:
    """Chapters 10 and 11's kernel choices in force: the batch from which decode
    programs start the longest sequence first (and their knobs there), the bf16 prefill
    tile, the tokens a program of the q/k norm-rotation-write kernel takes, whether
    start-up runs the LM head at every row count."""
    from minillm import gpu_model_runner
    from minillm.kernels import paged_attention, paged_prefill, qk_norm_rope

    return {
        "order_decodes_from": paged_attention.ORDER_DECODES_FROM,
        "ordered_decode_knobs": dict(paged_attention.ORDERED_DECODE_KNOBS),
        "prefill_knobs_bf16": dict(paged_prefill.PREFILL_KNOBS[2]),
        "qk_rope_one_token_up_to": qk_norm_rope.ONE_TOKEN_UP_TO,
        "qk_rope_tokens_per_program": qk_norm_rope.TOKENS_PER_PROGRAM,
        "warm_lm_head": gpu_model_runner.WARM_LM_HEAD,
    }


# earlier choices, run against today's in one process (throughput.py --knobs-before)
KNOBS_BEFORE = {
    # before decodes started longest first and the prompt kernel's new tile (817c6c4)
    "order_and_prefill": {
        "order_decodes_from": 0,
        "ordered_decode_knobs": {},
        "prefill_knobs_bf16": dict(
            rows=128,
            block_n=32,
            num_warps=8,
            num_stages=3,
            diag_n=32,
            align_end=False,
            maxnreg=None,
        ),
    },
    # before the q/k norm-rotation-write kernel took tiles of tokens (af252ad)
    "qk_rope_tile": {"qk_rope_tokens_per_program": 1},
    # before start-up ran the LM head at every row count (ff5dec8); the stalls it
    # removes come in a process's first engine only: compare separate processes
    "lm_head_cold": {"warm_lm_head": False},
}


@contextlib.contextmanager
def knobs_set(knobs: dict):
    """Within the block, the choices in knobs (kernel_knobs' form; those it does not
    name stay as they are)."""
    from minillm import gpu_model_runner
    from minillm.kernels import paged_attention, paged_prefill, qk_norm_rope

    saved = kernel_knobs()

    def apply(k: dict) -> None:
        if "order_decodes_from" in k:
            paged_attention.ORDER_DECODES_FROM = k["order_decodes_from"]
        if "ordered_decode_knobs" in k:
            paged_attention.ORDERED_DECODE_KNOBS = dict(k["ordered_decode_knobs"])
        if "prefill_knobs_bf16" in k:
            paged_prefill.PREFILL_KNOBS[2] = dict(k["prefill_knobs_bf16"])
        if "qk_rope_one_token_up_to" in k:
            qk_norm_rope.ONE_TOKEN_UP_TO = k["qk_rope_one_token_up_to"]
        if "qk_rope_tokens_per_program" in k:
            qk_norm_rope.TOKENS_PER_PROGRAM = k["qk_rope_tokens_per_program"]
        if "warm_lm_head" in k:
            gpu_model_runner.WARM_LM_HEAD = k["warm_lm_head"]

    try:
        apply(knobs)
        yield
    finally:
        apply(saved)


def code_hash() -> str:
    """sha256 (first 16 hex digits) of minillm/**/*.py and benchmarks/*.py, paths
    included: `python -c "from benchmarks.common import code_hash; print(code_hash())"`
    in a checkout says whether it is the code a stored result ran."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    files = sorted(
        [*(root / "minillm").rglob("*.py"), *(root / "benchmarks").glob("*.py")]
    )
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(),
    }
    for name in ("transformers", "triton"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout

        info["commit"] = git("rev-parse", "--short", "HEAD").strip() or None
        # uncommitted edits to the code (results and scratch files aside) mean the
        # commit is not the whole story
        changed = [
            line[3:]
            for line in git("status", "--porcelain").splitlines()
            if line[3:].startswith(("minillm/", "chapters/", "benchmarks/"))
            and "results/" not in line
        ]
        info["uncommitted_changes"] = changed[:20]
    except OSError:
        info["commit"] = None
    # what ran, whatever git says (a copied tree's .git can be stale): the package's
    # and the benchmarks' sources, hashed in path order
    info["code_sha256"] = code_hash()
    # a copy of the tree without its .git (the GPU device's) names its commit here
    if os.environ.get("MINILLM_CODE_COMMIT"):
        info["commit"] = os.environ["MINILLM_CODE_COMMIT"]
        info["uncommitted_changes"] = []
    return info


def copy_bandwidth(num_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


class StepTimeline:
    """Every engine step of a run: wall time, sequences and tokens scheduled. Wraps the
    engine in place.

    With async scheduling a step() call returns while its own step still runs on the
    device and waits for the previous one, so a call's time is the previous step's:
    exact over a run (the last calls, which only collect tokens, count as "no step"),
    approximate per step.
    """

    # decode steps are grouped by batch size: 1, 2-8, 9-32, ...
    BATCHES = (1, 8, 32, 64, 128, 256)

    def __init__(self, engine):
        # (seconds, sequences, tokens) per step() call
        self.rows: list[tuple[float, int, int]] = []
        # tokens already cached for the step's sequences: the K/V its attention reads
        self.contexts: list[int] = []
        schedule, step, scheduled = engine.scheduler.schedule, engine.step, {}

        def counting_schedule():
            output = schedule()
            scheduled.update(
                seqs=len(output.scheduled_requests),
                tokens=output.total_num_scheduled_tokens,
                context=sum(r.num_computed_tokens for r in output.scheduled_requests),
            )
            return output

        def timed_step():
            scheduled.clear()
            start = time.perf_counter()
            outputs = step()
            self.rows.append(
                (
                    time.perf_counter() - start,
                    scheduled.get("seqs", 0),
                    scheduled.get("tokens", 0),
                )
            )
            self.contexts.append(scheduled.get("context", 0))
            return outputs

        engine.scheduler.schedule, engine.step = counting_schedule, timed_step

    def kind(self, seqs: int, tokens: int) -> str:
        if seqs == 0:
            return "no step"
        if tokens > seqs:
            return "with prompt tokens"
        low = 1
        for high in self.BATCHES:
            if seqs <= high:
                return (
                    f"decode, batch {low}-{high}"
                    if high > low
                    else f"decode, batch {low}"
                )
            low = high + 1
        return f"decode, batch > {self.BATCHES[-1]}"

    def summary(self, floor=None) -> dict:
        """Steps, seconds and tokens by kind of step, and every step's (ms,
        sequences, tokens) and context tokens. floor(seqs, tokens, context), if
        given: a step's least seconds, summed by kind as "floor_seconds".
        """
        kinds: dict[str, dict] = {}
        for (seconds, seqs, tokens), context in zip(self.rows, self.contexts):
            k = kinds.setdefault(
                self.kind(seqs, tokens), {"steps": 0, "seconds": 0.0, "tokens": 0}
            )
            k["steps"] += 1
            k["seconds"] += seconds
            k["tokens"] += tokens
            if floor is not None and seqs:
                k["floor_seconds"] = k.get("floor_seconds", 0.0) + floor(
                    seqs, tokens, context
                )
        for k in kinds.values():
            k["ms_per_step"] = 1e3 * k["seconds"] / k["steps"]
        return {
            "steps": len(self.rows),
            "seconds": sum(r[0] for r in self.rows),
            "by_kind": kinds,
            "per_step_ms_seqs_tokens": [
                (round(1e3 * s, 3), n, t) for s, n, t in self.rows
            ],
            "per_step_context_tokens": self.contexts,
        }


def save(name: str, record: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = record.get("environment", {}).get("gpu", "cpu").replace(" ", "-")
    stamp = record.get("environment", {}).get("date", "")[:10]
    path = out_dir / f"{name}-{gpu}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
