"""What every benchmark records next to its numbers: hardware, software versions, date, commit.

Benchmarks run on the GPU box (see README); each writes one JSON file to benchmarks/results/.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout

        info["commit"] = git("rev-parse", "--short", "HEAD").strip() or None
        # uncommitted edits to the code (results and scratch files aside) mean the commit is not the whole story
        changed = [line[3:] for line in git("status", "--porcelain").splitlines()
                   if line[3:].startswith(("minillm/", "chapters/", "benchmarks/")) and "results/" not in line]
        info["uncommitted_changes"] = changed[:20]
    except OSError:
        info["commit"] = None
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


def save(name: str, record: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = record.get("environment", {}).get("gpu", "cpu").replace(" ", "-")
    stamp = record.get("environment", {}).get("date", "")[:10]
    path = out_dir / f"{name}-{gpu}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
