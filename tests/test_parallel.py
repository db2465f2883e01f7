"""Chapter 30: tensor- and pipeline-parallel training equal one process, the
tensor-parallel engine gives the tokens of one process, and no worker outlives a
test, a crash, Ctrl-C or a killed engine."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.parallel import pp, training
from minillm.parallel.distributed import WorkerError, launch
from minillm.sampling_params import SamplingParams

UNTIED = replace(training.SMALL, tie_word_embeddings=False)


def alive(pid: int) -> bool:
    """pid runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids, timeout_s=15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def workers_of_this_process() -> list[int]:
    """Live descendants of this process, other than multiprocessing's own helpers
    (the forkserver, the resource tracker), which live as long as this process."""
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        children = Path(f"/proc/{pid}/task/{pid}/children")
        for child in (
            map(int, children.read_text().split()) if children.exists() else []
        ):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if alive(child) and b"from multiprocessing." not in cmdline:
                found.append(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def reference():
    return training.reference_run(training.SMALL, 2, seed=0)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_training_equals_one_process(reference, world):
    runs = launch(training.tp_run, world, training.SMALL, 2, 0)
    loss_diff, grad_diff = training.max_difference(training.SMALL, reference, runs)
    assert loss_diff < 1e-5 and grad_diff < 1e-5
    assert all(len(run[1]) == 2 for run in runs)  # every rank reported every step
    assert wait_gone(workers_of_this_process()) == []


@pytest.mark.parametrize(
    "world, tp_size, schedule", [(2, 1, "gpipe"), (4, 1, "1f1b"), (4, 2, "1f1b")]
)
def test_pipeline_training_equals_one_process(world, tp_size, schedule):
    ref = training.reference_run(UNTIED, 2, seed=0)
    runs = launch(training.pp_run, world, UNTIED, 2, 0, tp_size, schedule, 4)
    loss_diff, grad_diff = training.max_difference(UNTIED, ref, runs, tp_size)
    assert loss_diff < 1e-5 and grad_diff < 1e-5
    last_stage = runs[-1]
    assert len(last_stage[0]) == 2  # the last stage reports the losses
    names = set().union(*(set(run[1][0]) for run in runs))
    assert names == set(dict(training.make_model(UNTIED, 0).named_parameters()))


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 5), (4, 3), (4, 8), (8, 2)])
def test_schedules_run_each_micro_batch_forward_then_backward(p, m):
    for schedule in pp.SCHEDULES.values():
        for stage in range(p):
            order = schedule(stage, p, m)
            assert sorted(order) == sorted(
                [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            )
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
    for stage in range(p):  # 1F1B keeps at most p - stage micro-batches in flight
        in_flight = peak = 0
        for kind, _ in pp.one_f_one_b_schedule(stage, p, m):
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(m, p - stage)


def test_pipeline_stage_rejects_bad_splits():
    with pytest.raises(ValueError, match="do not split into 3 stages"):
        pp.PipelineStage(training.make_model(UNTIED, 0), 0, 3)
    with pytest.raises(ValueError, match="untied"):
        pp.PipelineStage(training.make_model(training.SMALL, 0), 0, 2)


def test_a_raising_rank_is_reported_and_every_rank_ended():
    bad = replace(training.SMALL, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(WorkerError, match="do not split across 4"):
        launch(training.tp_run, 4, bad, 1, 0)
    assert wait_gone(workers_of_this_process()) == []


def test_a_slow_run_times_out_and_every_rank_is_ended():
    with pytest.raises(WorkerError, match="did not finish in"):
        launch(training.tp_run, 2, training.SMALL, 10_000, 0, timeout_s=1.0)
    assert wait_gone(workers_of_this_process()) == []


def run(engine, prompts, params) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200], list(range(40, 60))]


def test_tensor_parallel_engine_gives_the_tokens_of_one_process(tiny):
    model, tokenizer = tiny
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    # few blocks: requests are preempted and recomputed, chunked prefill splits
    small = dict(
        num_kv_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4
    )
    one = LLMEngine(model, tokenizer, EngineConfig(**small))
    two = LLMEngine(model, tokenizer, EngineConfig(tensor_parallel_size=2, **small))
    for params in (greedy, seeded):
        assert run(two, PROMPTS, params) == run(one, PROMPTS, params)
    assert two.num_preemptions > 0
    pids = two.model_runner.pids
    two.model_runner.shutdown()
    assert wait_gone(pids) == []


def test_a_killed_worker_is_reported_and_the_engine_shuts_down(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(
        model, tokenizer, EngineConfig(tensor_parallel_size=2, num_kv_blocks=16)
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run(engine, PROMPTS[:1], greedy)
    pids = engine.model_runner.pids
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"worker 0 \(pid \d+\) died"):
        run(engine, PROMPTS[:1], greedy)
    assert wait_gone(pids) == []
    with pytest.raises(WorkerError, match="died"):  # and stays down
        engine.add_request("again", PROMPTS[0], greedy)


def test_bad_parallel_options_fail_before_any_process_starts(tiny):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="preemption_mode='recompute'"):
        EngineConfig(tensor_parallel_size=2, preemption_mode="swap")
    before = workers_of_this_process()
    with pytest.raises(ValueError, match="persistent_batch=False"):
        LLMEngine(*tiny, EngineConfig(tensor_parallel_size=2, persistent_batch=True))
    with pytest.raises(WorkerError, match="do not split across 3"):
        LLMEngine(*tiny, EngineConfig(tensor_parallel_size=3, num_kv_blocks=8))
    assert wait_gone(workers_of_this_process()) == wait_gone(before)


ENGINE_SCRIPT = textwrap.dedent("""
    import sys, time
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.parallel import training
    if __name__ == "__main__":
        model = training.make_model(training.SMALL, 0)
        config = EngineConfig(tensor_parallel_size=2, num_kv_blocks=8)
        engine = LLMEngine(model, None, config)
        print(*engine.model_runner.pids, flush=True)
        time.sleep(120)
""")


def test_ctrl_c_in_the_engine_leaves_no_worker(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
        # A job started with & by a non-interactive shell inherits SIGINT ignored,
        # and Python then never raises KeyboardInterrupt: give the child the
        # disposition a terminal's foreground process has, whoever runs the tests.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=30)
        assert wait_gone(pids) == []
    finally:
        proc.kill()
        proc.wait()


def test_serve_flag_starts_a_tensor_parallel_engine(tiny):
    """minillm serve --tensor-parallel-size 2: a live server answers as TP=1 does."""
    pytest.importorskip("fastapi")
    from openai import OpenAI

    from minillm.server import ServerThread, build_engine, create_app, parse_args

    args = ["--tensor-parallel-size", "2", "--num-kv-blocks", "16", "--device", "cpu"]
    engine, name = build_engine(parse_args(args))
    executor = engine.model_runner
    assert type(executor).__name__ == "TPExecutor" and len(executor.pids) == 2
    one = LLMEngine(*tiny, EngineConfig(num_kv_blocks=16))
    want = run(
        one, [tiny[1].encode("The cat")], SamplingParams(max_tokens=8, temperature=0.0)
    )
    try:
        with ServerThread(create_app(engine, name)) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
            out = client.completions.create(
                model=name, prompt="The cat", max_tokens=8, temperature=0
            )
        assert out.choices[0].text == tiny[1].decode(want[0])
    finally:
        executor.shutdown()
    assert wait_gone(executor.pids) == []


@pytest.mark.parametrize(
    "option", [{"quantization": "int4"}, {"speculative_config": {"method": "ngram"}}]
)
def test_tensor_parallel_refuses_what_workers_cannot_run(option):
    with pytest.raises(ValueError, match="does not combine"):
        EngineConfig(tensor_parallel_size=2, **option)
