"""Chapter 16's sampling kernel against chapter 7's Sampler: the same tokens for the
same rows and seeds.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) at small
vocabularies; on a GPU also at Qwen3's vocabulary in bfloat16, where exact ties
between logits are common.
"""

import random

import pytest
import torch

triton = pytest.importorskip("triton")

from minillm.kernels.sample import sample  # noqa: E402
from minillm.sampler import Sampler, stream_keys  # noqa: E402
from minillm.sampling_metadata import SamplingMetadata  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows of random settings per check: the interpreter runs the rows one after another
ROWS = 16 if DEVICE == "cuda" else 8


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Any mix of the settings the kernel takes; every sampled row seeded."""
    if rng.random() < 0.2:
        return SamplingParams(temperature=0)
    return SamplingParams(
        temperature=rng.choice([0.3, 0.8, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, vocab // 3, vocab]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.5, 0.1]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        seed=rng.randrange(-(2**40), 2**40),
    )


def both(logits: torch.Tensor, params: list[SamplingParams], outputs=None):
    """(the kernel's tokens, chapter 7's) for the rows of logits."""
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    md = SamplingMetadata.from_requests(
        params, [[0]] * n, outputs, logits.shape[1], device=logits.device
    )
    keys = stream_keys(md, None)  # every random row is seeded: its own seed
    got = sample(logits, md.temperature, md.top_k, md.top_p, md.min_p, keys,
                 md.positions)  # fmt: skip
    want = Sampler().sample(logits.to(torch.float32, copy=True), md)[0]
    return got.tolist(), want.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 300])
def test_kernel_draws_chapter6s_tokens(dtype, vocab):
    rng = random.Random(vocab)
    for trial in range(2):
        params = [random_params(rng, vocab) for _ in range(ROWS)]
        g = torch.Generator().manual_seed(trial)
        logits = (3 * torch.randn(ROWS, vocab, generator=g)).to(DEVICE, dtype)
        outputs = [[0] * rng.randrange(50) for _ in params]  # positions differ
        got, want = both(logits, params, outputs)
        assert got == want


@pytest.mark.parametrize("block", [64, 128])
def test_rows_of_several_blocks_draw_chapter6s_tokens(monkeypatch, block):
    """Rows longer than a block: per-lane sums over several blocks, the search
    passes' exp2 and the top-p target from pass 1 when every token is live; ties
    on a coarse grid included."""
    import minillm.kernels.sample as kernel

    monkeypatch.setattr(kernel, "BLOCK", block)
    vocab, rng = 300, random.Random(block)
    g = torch.Generator().manual_seed(block)
    for dtype in (torch.float32, torch.bfloat16):
        params = [random_params(rng, vocab) for _ in range(ROWS - 4)]
        params += [
            SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(4)
        ]
        logits = (3 * torch.randn(ROWS, vocab, generator=g)).to(DEVICE, dtype)
        got, want = both(logits, params, [[0] * rng.randrange(50) for _ in params])
        assert got == want
    grid = torch.randint(-4, 4, (ROWS // 2, vocab), generator=g).float().to(DEVICE)
    params = [
        SamplingParams(temperature=1.0, top_p=p, seed=i)
        for i, p in enumerate((0.3, 0.7, 0.9, 0.5) * (ROWS // 8))
    ]
    got, want = both(grid.bfloat16(), params)
    assert got == want


def test_ties_at_the_cut_stay_together():
    """bfloat16 logits on a coarse grid: many exact ties at every threshold."""
    vocab = 256
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-4, 4, (32, vocab), generator=g).float().to(DEVICE)
    params = [
        SamplingParams(temperature=1.0, top_p=p, top_k=k, seed=i)
        for i, (p, k) in enumerate([(0.3, 0), (0.7, 10), (0.9, 100), (0.5, 3)] * 8)
    ]
    got, want = both(logits.bfloat16(), params)
    assert got == want


def test_a_row_depends_on_its_own_settings_only():
    """The same request alone and in a batch of others gets the same token."""
    vocab, rng = 300, random.Random(1)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, vocab, generator=g).to(DEVICE)
    params = [random_params(rng, vocab) for _ in range(16)]
    batch, _ = both(logits, params)
    alone = [both(logits[i : i + 1], params[i : i + 1])[0][0] for i in (0, 7, 15)]
    assert alone == [batch[0], batch[7], batch[15]]


def test_rejects_rows_that_are_not_contiguous():
    logits = torch.randn(8, 4, device=DEVICE).t()
    md = SamplingMetadata.from_requests(
        [SamplingParams(seed=0)] * 4, [[0]] * 4, [[]] * 4, 8, device=DEVICE
    )
    with pytest.raises(ValueError, match="contiguous"):
        sample(logits, md.temperature, None, None, None, md.seeds, md.positions)


@pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3's vocabulary: a GPU's size")
def test_kernel_at_qwen3s_vocabulary():
    vocab, rng = 151_936, random.Random(2)
    params = [random_params(rng, vocab) for _ in range(64)]
    g = torch.Generator().manual_seed(2)
    logits = (2 * torch.randn(64, vocab, generator=g)).to(DEVICE, torch.bfloat16)
    got, want = both(logits, params)
    assert got == want
