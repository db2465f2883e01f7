"""What several test files share: the engine sizes that force preemption and chunked
prefill, random prompts, polling, and a live server over the tiny model with the
clients that talk to it (chapter 27)."""

import time
from contextlib import contextmanager

import torch

# a small cache of 4-token blocks on the CPU: its 160 slots cannot hold 16 of the
# mixed_prompts below with 24 generated tokens each, so requests are preempted, and
# long prompts are prefilled in chunks of 24
TIGHT = dict(
    device="cpu", num_kv_blocks=40, block_size=4, max_num_seqs=8,
    max_num_batched_tokens=24,
)  # fmt: skip


def mixed_prompts(n, vocab, seed=0, longest=59):
    """n prompts of random token ids in [1, vocab), of 3 to `longest` tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            1,
            vocab,
            (int(torch.randint(3, longest + 1, (1,), generator=g)),),
            generator=g,
        ).tolist()
        for _ in range(n)
    ]


def assert_replays_equal(graph, out, expected, replays=100):
    """Each of `replays` replays of a captured CUDA graph, its output `out` zeroed
    first, gives `expected`: a race shows in some replays only."""
    differ = torch.zeros(replays, dtype=torch.bool, device=out.device)
    for r in range(replays):
        out.zero_()
        graph.replay()
        differ[r] = (out != expected).any()
    assert not differ.any(), f"replays {differ.nonzero().flatten().tolist()} differ"


def wait_for(predicate, timeout=5.0):
    """Whether predicate() turns true within timeout seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# --- a live server (chapter 27)

MODEL = "minillm-tiny"  # the name the servers below serve the tiny model under
SERVER_SIZES = dict(num_kv_blocks=256, max_model_len=512, max_num_seqs=16)


@contextmanager
def live_server(engine, name=MODEL):
    """A live server over engine on 127.0.0.1; server.engine is the engine."""
    from minillm.server import ServerThread, create_app

    with ServerThread(create_app(engine, name)) as server:
        server.engine = engine
        yield server


def openai_client(server, timeout=30):
    """The official client of a live server, failing at once (no retries)."""
    from openai import OpenAI

    return OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout
    )


def metric(http, name, **labels):
    """One sample's value from /metrics (model_name label implied)."""
    want = sorted(f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items())
    for line in http.get("/metrics").text.splitlines():
        if not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            head, _, rest = key.partition("{")
            if head == name and sorted(rest.rstrip("}").split(",")) == want:
                return float(value)
    raise KeyError(f"{name} {want}")
