"""Early launch (chapter 13's programmatic dependent launch) repeated: chains of
kernels that each read the previous one's output, captured in CUDA graphs and replayed
hundreds of times, give the bits of ordinary launches at every replay
(benchmarks/early_launch.py runs the same at length and stores the counts).

GPU only, Hopper or later: elsewhere no kernel launches early.
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a Hopper GPU",
)

from benchmarks import early_launch as el  # noqa: E402


@pytest.mark.parametrize("pdl", [1, 2])
def test_decode_chains_give_the_bits_of_ordinary_launches(pdl):
    gen = torch.Generator().manual_seed(0)
    kv = el.kv_cache([300, 17, 1000], gen)
    q = torch.randn(3, el.HEADS, el.HEAD_DIM, generator=gen).to("cuda", el.BF16)
    ref = el.decode_chain(q, kv, 0)

    def chain():
        return el.decode_chain(q, kv, pdl)

    assert el.replays(chain, ref, captures=2, n=200) == []  # (capture, replay) pairs
    assert el.eager(chain, ref, 50) == []


@pytest.mark.parametrize("pdl", [1, 2])
def test_engine_layers_give_the_bits_of_ordinary_launches(pdl):
    """28 Qwen3-0.6B layers at batch 1 as the engine's fused layers launch them."""
    run = el.layer_chain(torch.Generator().manual_seed(0))
    ref = run(0)
    assert el.replays(lambda: run(pdl), ref, captures=1, n=100) == []
