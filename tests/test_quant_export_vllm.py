"""Chapter 19's GPTQ and AWQ exports, loaded in the real vLLM (0.32, its CPU build).

Runs only where `make vllm` has made .venv-vllm (CI has none: there,
tests/test_quant_export_layout.py checks every weight against the formats' layouts).
vLLM runs in a subprocess of its own venv, in bfloat16 (its GPTQ and AWQ paths take
half or bfloat16 activations), on the tiny model's exports (head_dim 64, every
projection a multiple of 32: what vLLM's CPU int4 kernel, CPUWNA16LinearKernel,
needs). minillm reads the same folder in float32. Compared: the log-probabilities
vLLM gives the prompt tokens, and whether each token vLLM generates greedily is
minillm's most likely one, within the rounding of bfloat16.
"""

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from minillm.quantization import apply
from minillm.quantization.calibration import capture, token_windows
from minillm.quantization.checkpoint import export_quantized, load_quantized_checkpoint
from minillm.tiny import tiny_model_path

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason="no .venv-vllm (make vllm)"
)
# bfloat16 activations in vLLM against float32 in minillm, in nats: measured 0.01 mean
# |difference| on the tiny model's correct folders, 0.32 on a folder whose asymmetric
# codes were labelled sym (the bug this guards against); a rare token may differ
# more in bfloat16 alone, so the prompt is judged by the mean
MEAN_TOLERANCE, GREEDY_TOLERANCE = 0.05, 0.25

VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

folder, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
try:
    llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, max_model_len=512)
except Exception as e:
    print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        prompt_logprobs=0)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                    use_tqdm=False)
print("RESULT " + json.dumps([
    {"tokens": list(o.outputs[0].token_ids),
     "prompt_logprobs": [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]}
    for p, o in zip(prompts, outs)]))
"""


def run_vllm(folder: Path, prompts: list[list[int]], max_tokens: int):
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SCRIPT, str(folder), json.dumps(prompts),
         str(max_tokens)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def exports(tiny, tmp_path_factory):
    model, tokenizer = tiny
    stats = capture(model, token_windows(tokenizer, "train", 8, 128))
    root = tmp_path_factory.mktemp("exports")
    for name, fmt, method, sym in (("gptq", "gptq", "gptq", True),
                                   ("awq", "awq", "awq", False),
                                   ("gptq-asym", "gptq", "gptq", False)):  # fmt: skip
        src = copy.deepcopy(model)
        codes = apply.int4_codes(src, method, stats, 128, sym=sym, awq_grid=5)
        export_quantized(
            src, codes, root / name, fmt, source=tiny_model_path(progress=False)
        )
    prompts = token_windows(tokenizer, "held_out", 3, 48).tolist()
    return root, prompts


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_vllm_computes_what_minillm_computes_from_the_folder(exports, name):
    root, prompts = exports
    result = run_vllm(root / name, prompts, max_tokens=16)
    assert "error" not in result, result
    model = load_quantized_checkpoint(root / name)
    diffs = []
    for prompt, theirs in zip(prompts, result):
        ids = torch.tensor([prompt + theirs["tokens"]])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))
        logp = logits[0].double().log_softmax(-1)  # (T, V)
        ours = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        diffs.append((ours - torch.tensor(theirs["prompt_logprobs"])).abs())
        for j, token in enumerate(theirs["tokens"]):  # vLLM's greedy choice is ours
            row = logp[len(prompt) - 1 + j]
            assert row.max() - row[token] < GREEDY_TOLERANCE, (name, j)
    assert torch.cat(diffs).mean() < MEAN_TOLERANCE, (name, torch.cat(diffs).mean())


def test_vllm_refuses_asymmetric_gptq_rather_than_misreading_it(exports):
    root, prompts = exports
    config = json.loads((root / "gptq-asym" / "config.json").read_text())
    assert config["quantization_config"]["sym"] is False
    result = run_vllm(root / "gptq-asym", prompts[:1], max_tokens=1)
    assert "Unsupported quantization config: bits=4, sym=False" in result["error"]
