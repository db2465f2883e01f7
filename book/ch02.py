"""Chapter 2's helpers that are not the lesson: the training run's figure, the
held-out loss that the GGUF check and the lab notes compute, and the Measured
section's timings of loading against training and against copying the bytes.

    from book.ch02 import plot_training, mean_nll, time_loading, plot_loading
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.cpu_timing import best_of
from minillm.convert import convert_gguf
from minillm.hf import load_pretrained


def plot_training(log: dict):
    """The tiny model's training run: the loss of every batch, and the held-out loss."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(log["step"], log["loss"], lw=1, label="training batch")
    ax.plot(log["eval_step"], log["eval_loss"], "o-", label="held-out topics")
    ax.set(
        xlabel="step",
        ylabel="cross-entropy (nats / token)",
        title="Training the tiny model (measured)",
    )
    ax.legend()
    fig.tight_layout()
    return fig


def mean_nll(model, ids: list[int], device="cpu") -> float:
    """Mean negative log-likelihood (nats) of ids[1:] given the tokens before."""
    x = torch.tensor(ids, device=device)
    positions = torch.arange(len(ids) - 1, device=device)
    with torch.inference_mode():
        logits = model.compute_logits(model(x[:-1], positions))
    return F.cross_entropy(logits.float(), x[1:]).item()


def total_nll(model, start_id: int, ids: list[int], window=128, device="cpu") -> float:
    """Summed NLL (nats) of every token of ids, read after start_id in windows of
    `window` tokens."""
    ids = [start_id] + ids
    return sum(
        mean_nll(model, ids[i : i + window + 1], device)
        * len(ids[i + 1 : i + window + 1])
        for i in range(0, len(ids) - 1, window)
    )


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    return total_nats / n_bytes / math.log(2)


def _copy_once(folder: Path) -> None:
    """The bytes of the folder's safetensors files, copied once from the page cache
    (mapped, as safetensors reads them) into fresh memory: the least a load can do."""
    for file in folder.glob("*.safetensors"):
        mapped = torch.from_numpy(np.memmap(file, dtype=np.uint8, mode="c"))
        torch.empty_like(mapped).copy_(mapped)


def time_loading(tiny_folder, smol_folder, smol_gguf, train_seconds) -> dict:
    """Seconds per way of getting weights, per model: {model: {way: s}}. Loads and
    reads are best of three (the files in the page cache, as after a first load);
    the conversion runs once, into a scratch folder."""
    rows = {}
    for name, folder in (("tiny", Path(tiny_folder)), ("SmolLM2", Path(smol_folder))):
        rows[name] = {
            "load the folder": best_of(lambda f=folder: load_pretrained(f), 3),
            "copy its bytes once": best_of(lambda f=folder: _copy_once(f), 3),
        }
    rows["tiny"]["train (the cache's log)"] = train_seconds
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        convert_gguf(smol_gguf, scratch)
        rows["SmolLM2"]["convert the GGUF file"] = time.perf_counter() - start
    return rows


def plot_loading(rows: dict):
    """The Measured figure: seconds per way of getting each model's weights."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels, values = [], []
    for model, ways in rows.items():
        for way, seconds in sorted(ways.items(), key=lambda kv: -kv[1]):
            labels.append(f"{model}: {way}")
            values.append(seconds)
    colors = ["gray" if "train" in s or "convert" in s else "tab:blue" for s in labels]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.set(xscale="log", xlabel="seconds (log scale)")
    ax.set_title("Getting the weights (this machine, this run)", fontsize=9)
    fig.tight_layout()
    return fig
