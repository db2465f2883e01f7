"""examples/dropin.py, a script written for vLLM's offline API, runs unchanged on
minillm (chapter 29): `from minillm import LLM, SamplingParams` is the only change.

The run against vLLM itself needs .venv-vllm (`make vllm`) and minutes; it runs only
when MINILLM_TEST_VLLM=1 is set (chapter 29's live run does the same comparison).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.tiny import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "dropin.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def run(python, engine: str, out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.pop("PYTHONPATH")
    subprocess.run(
        [
            str(python),
            str(SCRIPT),
            "--engine",
            engine,
            "--model",
            str(tiny_model_path()),
        ]
        + ["--out", str(out)],
        check=True,
        env=env,
        capture_output=True,
        timeout=900,
    )
    record = json.loads(out.read_text())
    assert record["engine"] == engine
    return record["outputs"]


def test_the_vllm_script_runs_unchanged_on_minillm(tmp_path):
    rows = run(sys.executable, "minillm", tmp_path / "out.json")
    assert len(rows) == 6
    first, by_ids, stopped, sampled = rows[0], rows[3], rows[4], rows[5]
    assert first["prompt"] == 'The "for" statement' and first["token_ids"]
    # the token-id prompt (vLLM's TokensPrompt) is the first prompt's ids: greedy,
    # so its tokens start as the first prompt's did, and ignore_eos gives exactly 8
    assert by_ids["prompt"] is None
    assert by_ids["prompt_token_ids"] == first["prompt_token_ids"]
    n = min(8, len(first["token_ids"]))
    assert by_ids["token_ids"][:n] == first["token_ids"][:n]
    assert len(by_ids["token_ids"]) == 8 and by_ids["finish_reason"] == "length"
    assert "\n" not in stopped["text"]
    assert stopped["finish_reason"] in ("stop", "length")
    assert 1 <= len(sampled["token_ids"]) <= 8


@pytest.mark.skipif(
    not (VLLM_PYTHON.exists() and os.environ.get("MINILLM_TEST_VLLM") == "1"),
    reason="needs .venv-vllm (make vllm) and MINILLM_TEST_VLLM=1",
)
def test_the_script_gives_the_same_greedy_outputs_on_both_engines(tmp_path):
    ours = run(sys.executable, "minillm", tmp_path / "minillm.json")
    theirs = run(VLLM_PYTHON, "vllm", tmp_path / "vllm.json")
    greedy = slice(0, 5)  # the last output is sampled: each engine has its own RNG
    assert [r["token_ids"] for r in ours[greedy]] == [
        r["token_ids"] for r in theirs[greedy]
    ]
    assert [r["text"] for r in ours[greedy]] == [r["text"] for r in theirs[greedy]]


def test_llm_takes_vllms_dtype_names_and_prompt_dicts():
    import torch

    from minillm import LLM, SamplingParams

    llm = LLM(dtype="float32", num_kv_blocks=64)
    assert next(llm.engine.model.parameters()).dtype == torch.float32
    ids = llm.engine.tokenizer.encode("A class")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate([ids, "A class"], greedy, use_tqdm=False)
    dicts = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt": "A class"}], greedy, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in dicts] == [
        o.outputs[0].token_ids for o in plain
    ]
    assert dicts[1].prompt == "A class" and dicts[0].prompt_token_ids == ids


def test_a_bad_dtype_name_or_prompt_dict_is_a_clear_error():
    from minillm import LLM

    with pytest.raises(ValueError, match="not a torch dtype name"):
        LLM(dtype="float33")
    with pytest.raises(ValueError, match="not a torch dtype name"):
        LLM(dtype="Tensor")  # an attribute of torch, not a dtype
    llm = LLM(num_kv_blocks=64)
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "A class"}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
