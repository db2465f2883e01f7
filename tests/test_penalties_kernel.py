"""Chapter 16, "Penalties in one kernel": the Triton kernel gives chapter 7's
penalised float32 logits bit for bit, for bfloat16, float16 and float32 logits, rows
with and without penalties, in any order of the state's rows.

On a CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py) at small
vocabularies; on a GPU also at Qwen3's vocabulary through the runner's state.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from minillm.kernels.penalties import BLOCK, apply_penalties  # noqa: E402
from minillm.logits_processors import apply_penalties as chapter7  # noqa: E402
from minillm.logits_processors import token_counts  # noqa: E402
from minillm.request import Request  # noqa: E402
from minillm.sampling_ahead import PenaltiesState  # noqa: E402
from minillm.sampling_metadata import SamplingMetadata, pad_token_ids  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(rng, num_rows, vocab, dtype, device=DEVICE, penalised=0.7, counts=torch.int32):
    """(logits, kernel arguments, chapter 7's logits) for random rows: a state of
    more slots than rows, rows mapped to slots in any order, some without a penalty."""
    num_slots = num_rows + 3
    params, prompts, outputs = [], [], []
    for _ in range(num_rows):
        with_penalty = rng.random() < penalised
        params.append(
            SamplingParams(
                repetition_penalty=rng.choice([1.0, 0.5, 0.8, 1.1, 2.0]),
                frequency_penalty=rng.choice([0.0, 0.5, -1.0, 1.7]),
                presence_penalty=rng.choice([0.0, 0.5, -0.3]),
            )
            if with_penalty
            else SamplingParams()
        )
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 20))])
        top = rng.choice([min(3, vocab), vocab])  # few distinct tokens: counts > 1
        outputs.append([rng.randrange(top) for _ in range(rng.randint(0, 30))])
    md = SamplingMetadata.from_requests(params, prompts, outputs, vocab)
    slots = rng.sample(range(num_slots), num_rows)
    counts_dtype = counts
    counts = torch.zeros(num_slots, vocab, dtype=counts_dtype)
    seen = torch.zeros(num_slots, vocab, dtype=torch.bool)
    padded = pad_token_ids(outputs, vocab)
    counts[slots] = token_counts(padded, vocab).to(counts_dtype)
    padded_prompts = pad_token_ids(prompts, vocab)
    seen[slots] = token_counts(padded_prompts, vocab) > 0
    state_rows = torch.tensor(
        [s if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
         else -1 for s, p in zip(slots, params)],
        dtype=torch.int32,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(num_rows, vocab, generator=g).round(decimals=1)  # ties, 0s
    logits[torch.rand(num_rows, vocab, generator=g) < 0.05] = float("-inf")  # masks
    logits = logits.to(dtype)
    names = ("presence_penalties", "frequency_penalties", "repetition_penalties")
    penalties = torch.stack([getattr(md, n) for n in names])
    expected = chapter7(
        logits.float(),
        padded_prompts,
        padded,
        *penalties,
    )
    args = [t.to(device) for t in (state_rows, counts, seen, penalties)]
    return logits.to(device), args, expected


@settings(max_examples=25, deadline=None)
@given(
    num_rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, 300, BLOCK + 37]),
    dtype=st.sampled_from(DTYPES),
    counts=st.sampled_from([torch.int16, torch.int32]),
    seed=st.integers(0, 2**20),
)
def test_kernel_is_chapter6s_penalties(num_rows, vocab, dtype, counts, seed):
    rng = random.Random(seed)
    logits, args, expected = case(rng, num_rows, vocab, dtype, counts=counts)
    got = apply_penalties(logits.clone(), *args)
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu(), expected)


def test_float32_logits_are_penalised_in_place_and_other_rows_untouched():
    logits, args, expected = case(random.Random(1), 4, 300, torch.float32, penalised=1)
    args[0][[1, 3]] = -1  # rows 1 and 3: no penalty
    before = logits.clone()
    got = apply_penalties(logits, *args)
    assert got.data_ptr() == logits.data_ptr()
    assert torch.equal(got[[1, 3]], before[[1, 3]])
    assert not torch.equal(got[[0, 2]], before[[0, 2]])


def test_bad_arguments_are_refused_and_change_nothing():
    logits, (state_rows, counts, seen, penalties), _ = case(
        random.Random(2), 3, 50, torch.float32
    )
    before = logits.clone()
    for bad in [
        (state_rows[:2], counts, seen, penalties),
        (state_rows, counts, seen, penalties[:2]),
        (state_rows, counts.float(), seen, penalties),
        (state_rows, counts.long(), seen, penalties),
        (state_rows, counts[:, :49], seen, penalties),
        (state_rows, counts, seen[:, :49], penalties),
    ]:
        with pytest.raises(ValueError):
            apply_penalties(logits, *bad)
        assert torch.equal(logits, before)


@pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3's vocabulary: a GPU's size")
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_chapter6s_at_qwen3s_vocabulary(dtype):
    rng = random.Random(7)
    logits, args, expected = case(rng, 64, 151_936, dtype, penalised=0.9)
    assert torch.equal(apply_penalties(logits.clone(), *args).cpu(), expected)


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel path of PenaltiesState")
def test_state_kernel_path_is_its_elementwise_path():
    """PenaltiesState.apply (the kernel on a GPU) against apply_elementwise (chapter
    7's formula in PyTorch) on bfloat16 logits, through the state's own counts."""
    vocab, rng = 151_936, random.Random(9)
    state = PenaltiesState(16, torch.device("cuda"))
    requests, params = [], []
    for i in range(12):
        p = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.5 * (i % 3),
                           presence_penalty=0.5)  # fmt: skip
        r = Request(str(i), [rng.randrange(vocab) for _ in range(300)], p)
        r.append_output_token_ids([rng.randrange(vocab) for _ in range(200)])
        requests.append(r)
        params.append(p)
    rows = rng.sample(range(16), 12)
    state.update(rows, requests, vocab, None)
    md = SamplingMetadata.from_requests(params, [[0]] * 12, [[]] * 12, vocab)
    logits = (2 * torch.randn(12, vocab, device="cuda")).bfloat16()
    sel = list(range(0, 12, 2))  # half the rows penalised
    got = state.apply(logits.clone(), sel, [rows[j] for j in sel], md)
    want = state.apply_elementwise(logits.clone(), sel, [rows[j] for j in sel], md)
    assert torch.equal(got, want)


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="forces the interpreted kernel on a CPU engine; on a GPU the engine runs "
    "the kernel itself (tests/test_sampling_ahead.py, tests/test_cuda_graph.py)",
)
def test_engine_through_the_kernel_draws_chapter7s_tokens(tiny, monkeypatch):
    """The runner's penalties through the kernel (interpreted on a CPU), steps
    launched ahead: the synchronous engine's tokens."""
    from minillm.llm import LLM

    rng = random.Random(4)
    prompts = [[rng.randrange(1, 2048) for _ in range(rng.randint(3, 20))]
               for _ in range(5)]  # fmt: skip
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=10, ignore_eos=True,
                       repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for i, (t, r, f, p) in enumerate(
            [(0, 1.5, 0.5, 0.5), (0.9, 1.0, 1.0, 0), (0, 0.8, 0, -0.5),
             (0.8, 1.0, 0, 0), (1.1, 1.2, -0.3, 1.0)]
        )
    ]  # fmt: skip
    common = dict(device="cpu", num_kv_blocks=40, block_size=4, max_num_seqs=8)

    def run(**options):
        llm = LLM(**common, **options)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm

    expected, _ = run(persistent_batch=False)
    calls = []

    def through_kernel(self, logits, sel, rows, md):
        calls.append(len(sel))
        return self.apply_kernel(logits, sel, rows, md)

    monkeypatch.setattr(PenaltiesState, "apply", through_kernel)
    got, ahead = run(persistent_batch=True, async_scheduling=True)
    assert got == expected
    assert ahead.engine.stepper.num_in_step == 0 and sum(calls) > 0


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minillm.kernels import penalties
pointers = dict(logits_ptr="*bf16", out_ptr="*fp32", state_rows_ptr="*i32",
                counts_ptr="*i32", seen_ptr="*u8", penalties_ptr="*fp32")
sizes = dict.fromkeys(["num_rows", "V", "logits_stride", "out_stride",
                       "state_stride"], "i32")
constants = dict(IN_PLACE=False, BLOCK=penalties.BLOCK, PRECISE=True)
source = ASTSource(penalties._penalties_kernel, {**pointers, **sizes}, constants)
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                        options=dict(enable_fp_fusion=False))
ptx = kernel.asm["ptx"]
print(ptx.count("fma.rn.f32"), ptx.count("div.rn.f32"), ptx.count("div.full.f32"))
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU compares the kernel's results")
def test_compiled_kernel_rounds_as_pytorch_does():
    """The kernel as launched, compiled for sm_90 (no GPU needed): correctly rounded
    divisions and no fused multiply-add, so x - f * c rounds twice, as PyTorch's."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    fma, div_rn, div_approx = map(int, run.stdout.split())
    assert fma == 0 and div_rn > 0 and div_approx == 0
