"""What every benchmark records next to its numbers: hardware, software versions, date,
commit.

Benchmarks run on the GPU box (see README); each writes one JSON file to
benchmarks/results/.

A stored run is a run of committed code. Every benchmark that stores calls
`require_committed()` as soon as it has read its arguments, and `environment()` and
`save()` check again: each refuses, with `UncommittedCode`, a tree whose code under
minillm/ or benchmarks/ no commit holds: `git status` lists a changed file there
(untracked .py files included, benchmarks/results/ aside), or git cannot say. A copy
of the tree whose .git is stale or missing (the GPU device's) names its commit in
$MINILLM_CODE_COMMIT; its code is checked against that commit's files by
`code_hash()`, read from git where the copy's .git holds the commit, else from
$MINILLM_CODE_SHA256, which `python -m benchmarks.common` prints, with the commit, on
a clean committed tree.

To store a run of uncommitted code anyway (a smoke test, a diagnostic), set
MINILLM_FORCE_STORE=1: the run goes ahead, and its environment says
`"forced": true` and lists the files that differ (`uncommitted_changes`, null where git
could not say).
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
from pathlib import Path, PurePosixPath

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FORCE_STORE = "MINILLM_FORCE_STORE"  # set to 1: store a run of uncommitted code
CODE_DIRS = ("minillm", "benchmarks")  # the code a stored run names by its commit


def engine_settings(engine) -> dict:
    """What the engine chose where its options left it a choice: the parts it resolved
    (chapter 8's seam) and the fast-path flags its runner resolved (chapter 16's).
    """
    runner = engine.model_runner
    flags = ("cuda_graphs", "torch_compile", "async_scheduling")
    return {
        "runner": type(runner).__name__,
        **{k: v for k, v in engine.parts.items() if k != "device"},
        **{name: getattr(runner, name, False) for name in flags},
    }


def kernel_knobs() -> dict:
    """Chapters 13 and 15's kernel choices in force: the batch from which decode
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


def code_files(paths) -> list[str]:
    """The paths (relative, "/"-separated) that code_hash covers, in its order:
    minillm/**/*.py and benchmarks/*.py."""
    covered = [
        p
        for p in paths
        if p.endswith(".py")
        and (
            p.startswith("minillm/")
            or (p.startswith("benchmarks/") and p.count("/") == 1)
        )
    ]
    return sorted(covered, key=lambda p: PurePosixPath(p).parts)


def code_hash(root: Path | None = None) -> str:
    """sha256 (first 16 hex digits) of minillm/**/*.py and benchmarks/*.py, paths
    included: `python -c "from benchmarks.common import code_hash; print(code_hash())"`
    in a checkout says whether it is the code a stored result ran."""
    root, digest = root or ROOT, hashlib.sha256()
    found = [*(root / "minillm").rglob("*.py"), *(root / "benchmarks").glob("*.py")]
    for path in code_files([p.relative_to(root).as_posix() for p in found]):
        digest.update(path.encode() + b"\0" + (root / path).read_bytes())
    return digest.hexdigest()[:16]


def git(root: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    """git's output in root, or None where it fails (no git, no repository)."""
    try:
        done = subprocess.run(
            ["git", *args], input=stdin, capture_output=True, cwd=root, check=False
        )
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def committed_code_hash(commit: str, root: Path | None = None) -> str | None:
    """code_hash() of the files commit holds, read from root's git (None where it
    cannot read that commit, e.g. a copy whose .git is stale)."""
    root = root or ROOT
    listing = git(root, "ls-tree", "-r", "--name-only", "-z", commit, "--", *CODE_DIRS)
    if listing is None:
        return None
    paths = code_files(listing.decode().split("\0"))
    batch = git(
        root,
        "cat-file",
        "--batch",
        stdin="".join(f"{commit}:{p}\n" for p in paths).encode(),
    )
    if batch is None:
        return None
    digest, at = hashlib.sha256(), 0
    for path in paths:  # each blob: "<sha> blob <size>\n<content>\n"
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        blob = batch[header_end + 1 : header_end + 1 + size]
        digest.update(path.encode() + b"\0" + blob)
        at = header_end + 1 + size + 1
    return digest.hexdigest()[:16]


def uncommitted_code(root: Path | None = None) -> list[str] | None:
    """The files under minillm/ and benchmarks/ that differ from the checked-out
    commit: changed tracked files of any kind and untracked .py files, as `git status`
    lists them, benchmarks/results/ aside. None where git cannot say (no git, or root
    is not the top of a repository)."""
    root = root or ROOT
    top = git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.decode().strip()).resolve() != root.resolve():
        return None
    status = git(
        root, "status", "--porcelain", "-z", "--untracked-files=all", "--", *CODE_DIRS
    )
    if status is None:
        return None
    changed, entries = [], iter(status.decode().split("\0"))
    for entry in entries:
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        if code[0] in "RC":  # a rename or copy: the next entry is the old path
            next(entries, None)
        if path.startswith("benchmarks/results/"):
            continue
        if code == "??" and not path.endswith(".py"):
            continue
        changed.append(path)
    return changed


def code_provenance(env=None, root: Path | None = None) -> dict:
    """Which commit's code this tree is, and whether that is checked: commit,
    code_sha256, committed (True only when checked), uncommitted_changes (None where
    git cannot say) and checked_by (how, or why it could not be)."""
    env, root = os.environ if env is None else env, root or ROOT
    here = code_hash(root)
    info = {"commit": None, "code_sha256": here, "committed": False}
    claimed = env.get("MINILLM_CODE_COMMIT")
    if claimed:  # a copied tree whose .git may be stale: its code against the commit's
        info["commit"] = claimed
        theirs, how = committed_code_hash(claimed, root), f"git show {claimed}"
        if theirs is None and env.get("MINILLM_CODE_SHA256"):
            theirs, how = env["MINILLM_CODE_SHA256"], "MINILLM_CODE_SHA256"
        if theirs is None:
            how = f"git here cannot read {claimed} and MINILLM_CODE_SHA256 is not set"
        info["committed"] = theirs == here
        changed = [] if info["committed"] else None
        if theirs is not None and not info["committed"]:
            how += f": code_sha256 {here}, the commit's {theirs}"
        return info | {"uncommitted_changes": changed, "checked_by": how}
    changed = uncommitted_code(root)
    head = git(root, "rev-parse", "--short", "HEAD")
    info["commit"] = head.decode().strip() if head else None
    info["committed"] = changed == [] and info["commit"] is not None
    how = "git status" if changed is not None else "git cannot say (no repository?)"
    return info | {"uncommitted_changes": changed, "checked_by": how}


def forced_by(env) -> bool:
    """Whether env forces storing a run of uncommitted code (MINILLM_FORCE_STORE=1)."""
    return env.get(FORCE_STORE, "").strip().lower() in ("1", "true", "yes")


class UncommittedCode(RuntimeError):
    """A run of code that no commit holds, refused before it is stored."""


def require_committed(env=None, root: Path | None = None) -> dict:
    """code_provenance(), plus "forced": raises UncommittedCode unless the code is
    committed or MINILLM_FORCE_STORE=1 forces the run (then "forced" is True)."""
    env = os.environ if env is None else env
    info = code_provenance(env, root)
    info["forced"] = forced_by(env) and not info["committed"]
    if info["committed"] or info["forced"]:
        return info
    changed = info["uncommitted_changes"]
    listed = (
        ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else "")
        if changed
        else ""
    )
    raise UncommittedCode(
        "refusing to store a run of uncommitted code ("
        + (f"changed: {listed}" if listed else info["checked_by"])
        + "). Commit first (a stored run names the commit that ran), or set "
        f"{FORCE_STORE}=1 to store it marked forced."
    )


def environment() -> dict:
    """Hardware, software versions, date and the code's provenance
    (require_committed: raises UncommittedCode for uncommitted code, unless forced)."""
    provenance = require_committed()
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
    return info | provenance


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
    """Write record to out_dir/{name}-{gpu}-{day}.json. Refuses (UncommittedCode) the
    run of code that is not committed now, or that changed since the run began (the
    record's environment.code_sha256), unless MINILLM_FORCE_STORE=1, which marks it
    forced."""
    now, env = require_committed(), record.setdefault("environment", {})
    ran = env.get("code_sha256", now["code_sha256"])
    if ran != now["code_sha256"]:  # the files changed under the running benchmark
        if not forced_by(os.environ):
            raise UncommittedCode(
                f"refusing to store the run: the code changed while it ran "
                f"(code_sha256 {ran} at its start, {now['code_sha256']} now); run it "
                f"again, or set {FORCE_STORE}=1 to store it marked forced."
            )
        env.update(forced=True, code_sha256_at_save=now["code_sha256"])
    for key, value in now.items():  # a record made without environment()
        env.setdefault(key, value)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = record.get("environment", {}).get("gpu", "cpu").replace(" ", "-")
    stamp = record.get("environment", {}).get("date", "")[:10]
    path = out_dir / f"{name}-{gpu}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


if __name__ == "__main__":  # on a clean committed tree, what a copied tree's run needs
    provenance = require_committed({})  # git status here; never forced
    print(
        f"MINILLM_CODE_COMMIT={provenance['commit']} "
        f"MINILLM_CODE_SHA256={provenance['code_sha256']}"
    )
