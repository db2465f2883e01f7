"""Chapter 16's helpers that are not the lesson: the checks' engines, requests and
rows, the watch on the penalties' counts, the bytes of the penalties' passes,
reading the stored H200 step profiles, and the figures (the async timeline, the
sampled throughput).

The chapter (chapters/16_async_scheduling.md) imports them; the engine itself is in
minillm/.
"""

from __future__ import annotations

import random
from dataclasses import replace

import matplotlib.pyplot as plt

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams


def engine_with(model, tokenizer, prompts, params, **options) -> LLMEngine:
    """Chapter 9's engine with one request per prompt, ids "0", "1", ...; params is
    one SamplingParams for all or a list of one per prompt."""
    engine = LLMEngine(model, tokenizer, EngineConfig(**options))
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    return engine


def finish(engine: LLMEngine) -> list[list[int]]:
    """Runs the engine to the end: each request's tokens, in the order added."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[key] for key in sorted(done, key=int)]


def all_blocks_free(engine: LLMEngine) -> bool:
    """Whether every block of the engine's cache is back in its pool."""
    manager = engine.kv_cache_manager
    return manager.block_pool.get_num_free_blocks() == manager.num_blocks


def random_prompts(rng: random.Random, vocab: int, n: int, lo: int, hi: int):
    """n prompts of random token ids, each of lo to hi tokens."""
    return [
        [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)
    ]


def mixed_rows(rng: random.Random, n: int) -> list[SamplingParams]:
    """n rows of every sampling setting mixed, seeded; every fifth one greedy."""
    return [
        SamplingParams(temperature=0)
        if i % 5 == 0
        else SamplingParams(
            temperature=rng.choice([0.5, 0.8, 1.2]),
            top_k=rng.choice([0, 20, 200]),
            top_p=rng.choice([1.0, 0.95, 0.6]),
            min_p=rng.choice([0.0, 0.05]),
            seed=rng.randrange(2**40),
        )
        for i in range(n)
    ]


def rule_requests(vocab_size: int) -> tuple[list[SamplingParams], list[int], list[int]]:
    """Six requests, each with chapter 7's penalties or token rules (14 tokens each),
    and the stop set and allowed tokens two of them use."""
    stop_set = list(range(0, vocab_size, 3))  # a third of the vocabulary stops
    allowed = list(range(40, 140))
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=1, repetition_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=0.5),
        SamplingParams(temperature=1.0, seed=2, min_tokens=6, stop_token_ids=stop_set),
        SamplingParams(temperature=0.7, seed=3, allowed_token_ids=allowed),
        SamplingParams(temperature=0, banned_token_ids=list(range(10, 60))),
        SamplingParams(temperature=0.9, top_k=30, seed=4, presence_penalty=1.5),
    ]
    return [replace(p, max_tokens=14) for p in params], stop_set, allowed


def watch_counts(engine: LLMEngine, vocab_size: int) -> list[int]:
    """Wraps the runner's PenaltiesState.apply: before each application, every
    penalised row's counts must equal a count of its request's tokens on the CPU's
    list plus its token in flight (step N's, which the CPU has not read yet). Returns
    the list that gets, per row checked, its number of placeholders."""
    import torch

    from minillm.logits_processors import token_counts

    state, checked = engine.model_runner.penalties, []
    apply_penalties_ahead = state.apply

    def apply_and_check(logits, sel, rows, md):
        in_flight = engine.stepper.in_flight  # step N
        flight = {}
        if in_flight is not None:
            flight = dict(zip(map(id, in_flight.sampling), in_flight.tokens.tolist()))
        for row in rows:
            request = state.owner[row]
            tokens = list(request.output_token_ids)
            if request.num_output_placeholders:
                tokens.append(flight[id(request)])
            counted = token_counts(
                torch.tensor([tokens], dtype=torch.int64), vocab_size
            )
            assert torch.equal(state.output_counts[row].cpu().float(), counted[0])
            checked.append(request.num_output_placeholders)
        return apply_penalties_ahead(logits, sel, rows, md)

    state.apply = apply_and_check  # looking over the runner's shoulder
    return checked


def penalty_rows(vocab: int, seed: int = 5):
    """Four rows of chapter 7's penalties over vocab tokens, one without a penalty:
    (metadata, padded output ids, output counts, prompt mask, state rows (-1 for
    none), the stacked (3, rows) presence, frequency and repetition penalties)."""
    import torch

    from minillm.logits_processors import token_counts
    from minillm.sampling_metadata import SamplingMetadata, pad_token_ids

    rng = random.Random(seed)
    params = [
        SamplingParams(
            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
        ),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0),
        SamplingParams(temperature=0.8),  # no penalty: only converted
        SamplingParams(frequency_penalty=-0.25),
    ]
    prompts = [[rng.randrange(vocab) for _ in range(40)] for _ in params]
    outputs = [[rng.randrange(60) for _ in range(rng.randint(0, 90))] for _ in params]
    md = SamplingMetadata.from_requests(params, prompts, outputs, vocab)
    padded = pad_token_ids(outputs, vocab)
    counts = token_counts(padded, vocab)
    seen = token_counts(md.prompt_token_ids, vocab) > 0
    state_rows = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    names = ("presence_penalties", "frequency_penalties", "repetition_penalties")
    stacked = torch.stack([getattr(md, name) for name in names])
    return md, padded, counts, seen, state_rows, stacked


def print_resolution(runner_class) -> None:
    """What the fast-path options resolve to, for a few configurations on each kind
    of device: the lookup the engine starts with (no engine is built)."""
    from minillm.registry import ATTENTION_BACKENDS, MODEL_RUNNERS

    for device_type in ("cpu", "cuda"):
        for options in ({}, {"cuda_graphs": False}, {"attention_backend": "torch"}):
            config, parts = EngineConfig(**options), {"device": device_type}
            for registry in (ATTENTION_BACKENDS, MODEL_RUNNERS):
                value = getattr(config, registry.option)
                parts[registry.option] = registry.resolve(value, device_type)
            runner = MODEL_RUNNERS[parts["persistent_batch"]]
            flags = runner.fast_path(config, parts) if runner is runner_class else ()
            on = [n for n, f in zip(("graphs", "compile", "async"), flags) if f]
            print(
                f"{device_type:4} {str(options):30} -> {parts['attention_backend']:6} "
                f"{runner.__name__:15} {', '.join(on) or '-'}"
            )


# (operation, bytes read, bytes written) per logit of a penalised row, on the path
# before the kernel: bf16 logits (2 bytes), float32 values (4), boolean masks (1),
# float32 counts (4)
PENALTY_PASSES = [
    ("logits.float()", 2, 4),
    ("logits[at]", 4, 4),
    ("prompt_seen[here]", 1, 1),
    ("output_counts[here]", 4, 4),
    ("output_counts > 0", 4, 1),
    ("prompt_seen | output_seen", 2, 1),
    ("torch.where(seen, penalty, 1.0)", 1, 4),
    ("logits > 0", 4, 1),
    ("logits / scale", 8, 4),
    ("logits * scale", 8, 4),
    ("torch.where(positive, ...)", 9, 4),
    ("frequency * output_counts", 4, 4),
    ("logits -= ...", 8, 4),
    ("presence * output_seen", 1, 4),
    ("logits -= ... (presence)", 8, 4),
    ("logits[at] = ...", 4, 4),
]
# the kernel: bf16 logits in, int16 counts and a byte of prompt mask, float32 out
PENALTY_KERNEL_BYTES = 2 + 2 + 1 + 4


def penalty_bytes(copy_bw: float | None, rows=256, vocab=151_936) -> dict:
    """The glued numbers of the penalties' passes against one kernel, for rows of
    Qwen3's vocabulary (and at the copy bandwidth, if given); prints the passes."""
    for op, read, written in PENALTY_PASSES:
        print(f"{op:32} reads {read}, writes {written} bytes per logit")
    per_logit = sum(r + w for _, r, w in PENALTY_PASSES)
    gb = {"": per_logit * rows * vocab / 1e9}
    gb["fused_"] = PENALTY_KERNEL_BYTES * rows * vocab / 1e9
    numbers = {"ch12_pen_passes": len(PENALTY_PASSES), "ch12_pen_bytes": per_logit}
    numbers["ch12_pen_fused_bytes"] = PENALTY_KERNEL_BYTES
    numbers["ch12_pen_gb"] = f"{gb['']:.1f}"
    numbers["ch12_pen_fused_gb"] = f"{gb['fused_']:.2f}"
    if copy_bw:  # the measured copy bandwidth: the least time the bytes take
        numbers["ch12_pen_ms"] = f"{gb[''] * 1e12 / copy_bw:.1f}"
        numbers["ch12_pen_fused_ms"] = f"{gb['fused_'] * 1e12 / copy_bw:.2f}"
    print(
        f"{len(PENALTY_PASSES)} passes, {per_logit} bytes per logit: {gb['']:.1f} GB "
        f"a step at {rows} rows x {vocab:,} tokens; one kernel: "
        f"{PENALTY_KERNEL_BYTES} bytes per logit, {gb['fused_']:.2f} GB"
    )
    return numbers


def chapter7_ms(row: dict) -> float:
    """A stored benchmarks/sampler.py row's time for chapter 7's sampler (runs stored
    before the chapters were renumbered name it chapter6_ms)."""
    return row["chapter7_ms"] if "chapter7_ms" in row else row["chapter6_ms"]


# the stored benchmarks/profile_step.py runs: (name, what was profiled)
PROFILES = {
    "batch1": "batch 1, synchronous steps",
    "batch256_sync": "256 requests, synchronous steps",
    "batch256_async": "256 requests, async scheduling",
}


def profile_numbers(runs: dict) -> dict:
    """The glued numbers of the three stored profiles: wall time and GPU idle time
    per step, synchronous, and the wall time with async scheduling."""
    return {
        "ch12_sync1_ms": runs["batch1"]["wall_ms_per_step"],
        "ch12_idle1_ms": runs["batch1"]["gpu_idle_ms_per_step"],
        "ch12_sync256_ms": runs["batch256_sync"]["wall_ms_per_step"],
        "ch12_idle256_ms": runs["batch256_sync"]["gpu_idle_ms_per_step"],
        "ch12_async256_ms": runs["batch256_async"]["wall_ms_per_step"],
    }


def print_profiles(runs: dict) -> None:
    """Each stored profile: wall time, kernel time and GPU idle time per step."""
    for name, what in PROFILES.items():
        prof = runs[name]
        print(
            f"{what:32}: {prof['wall_ms_per_step']:5.2f} ms per step, kernels "
            f"{prof['gpu_ms_per_step']:5.2f} ms, GPU idle "
            f"{max(0.0, prof['gpu_idle_ms_per_step']):4.2f} ms "
            f"({prof['environment']['gpu']}, measured)"
        )


def draw_timeline(sync: dict, ahead: dict, steps: int = 3):
    """Three steps of the synchronous loop and of async scheduling, drawn from the
    stored profiles of 256 requests: a schematic in which every step takes the
    profiled averages and the CPU's work is the synchronous run's GPU idle time."""
    cpu_ms, gpu_ms = sync["gpu_idle_ms_per_step"], sync["gpu_ms_per_step"]
    fig, axes = plt.subplots(2, 1, figsize=(9, 2.8), sharex=True)
    mid = dict(ha="center", va="center", fontsize=7)
    for ax, title, ahead_of_gpu in [
        (axes[0], "synchronous (chapter 9's loop)", False),
        (axes[1], "async scheduling (the CPU one step ahead)", True),
    ]:
        cpu_free, gpu_ends = 0.0, [0.0]
        for step in range(1, steps + 1):
            # the CPU starts a step once done with the last and, running ahead, once
            # it has the tokens of the step before the last; synchronous: the last's
            waits_for = gpu_ends[-2] if ahead_of_gpu and step > 1 else gpu_ends[-1]
            cpu_start = max(cpu_free, waits_for)
            cpu_free = cpu_start + cpu_ms
            gpu_start = max(cpu_free, gpu_ends[-1])
            gpu_ends.append(gpu_start + gpu_ms)
            bar = dict(edgecolor="white")
            ax.broken_barh([(cpu_start, cpu_ms)], (1, 0.8), color="tab:orange", **bar)
            ax.broken_barh([(gpu_start, gpu_ms)], (0, 0.8), color="tab:blue", **bar)
            ax.text(gpu_start + gpu_ms / 2, 0.4, f"step {step}", color="white", **mid)
            ax.text(cpu_start + cpu_ms / 2, 1.4, f"{step}", **mid)
        ax.set(yticks=[0.4, 1.4], yticklabels=["GPU", "CPU"], title=title)
        ax.title.set_fontsize(9)
    axes[1].set_xlabel(
        f"ms (per step: GPU {gpu_ms:.1f} ms of kernels, CPU {cpu_ms:.1f} ms; measured "
        f"steps {sync['wall_ms_per_step']:.1f} ms synchronous, "
        f"{ahead['wall_ms_per_step']:.1f} ms async)"
    )
    plt.tight_layout()
    plt.show()


# the stored throughput run's sampled shares of greedy, and their bar labels
SAMPLING_SHARES = {
    "sampled": "sampled,\non the device",
    "seeded": "seeded,\non the device",
    "sampled_unfused": "sampled,\nchapter 6 in step",
    "seeded_unfused": "seeded,\nchapter 6 in step",
}


def plot_sampling(tput: dict):
    """The standard workload's sampled throughput as a share of greedy: chapter 7's
    sampler in step against the sampling kernel ahead."""
    order = ["sampled_unfused", "sampled", "seeded_unfused", "seeded"]
    shares = [tput["sampling"][name]["fraction_of_greedy"] for name in order]
    fig, bx = plt.subplots(figsize=(5, 3.4))
    bx.bar([SAMPLING_SHARES[name] for name in order], shares,
           color=["0.7", "tab:green"] * 2)  # fmt: skip
    bx.axhline(1.0, ls=":", color="grey")
    bx.text(-0.4, 1.02, "greedy", fontsize=8, color="grey")
    bx.set(ylim=(0, 1.1), ylabel="output tok/s, share of greedy")
    env = tput["environment"]
    bx.set_title(
        f"sampled, 256 requests, top-p 0.95, {env['gpu']} ({env['date'][:10]})",
        fontsize=9,
    )
    bx.tick_params(axis="x", labelsize=7)
    plt.tight_layout()
    plt.show()
