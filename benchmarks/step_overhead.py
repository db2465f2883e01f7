"""The engine's CPU work per decode step, without the model: what a GPU waits for
between steps.

A stand-in model that does no arithmetic (it returns zeros of the right shapes) runs
through the real engine — scheduler, KV-cache manager, input preparation, sampling,
update, stop checks — with --num-requests requests of 100–1000 random prompt tokens
(seed 0) decoding together; the script times --steps engine steps with chapter 9's
runner and with chapter 15's persistent batch, in the same run. Runs anywhere (CPU
timings are noisy: compare the two numbers of one run).

    python benchmarks/step_overhead.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.model import ModelConfig  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


class NullModel(torch.nn.Module):
    """Right shapes, no arithmetic: leaves only the engine's own work to time."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, positions, attn_metadata=None, kv_cache=None):
        return torch.zeros(input_ids.shape[0], self.config.hidden_size)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.config.vocab_size)


def ms_per_step(persistent: bool, num_requests: int, steps: int) -> float:
    config = ModelConfig(
        vocab_size=64,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
    )
    engine = LLMEngine(
        NullModel(config),
        None,
        EngineConfig(
            max_num_seqs=num_requests,
            max_num_batched_tokens=16384,
            num_kv_blocks=num_requests * 80,
            max_model_len=2048,
            persistent_batch=persistent,
        ),
    )
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0, max_tokens=1000, ignore_eos=True, output_kind="final_only"
    )
    for i in range(num_requests):
        engine.add_request(
            str(i), [rng.randrange(64) for _ in range(rng.randint(100, 1000))], params
        )
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # every prompt prefilled
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    plain = ms_per_step(False, args.num_requests, args.steps)
    persistent = ms_per_step(True, args.num_requests, args.steps)
    print(
        f"CPU work per {args.num_requests}-request decode step: chapter 9's runner "
        f"{plain:.2f} ms, persistent batch {persistent:.2f} ms"
    )


if __name__ == "__main__":
    main()
