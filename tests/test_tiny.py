"""The shared tiny model: cached, keyed by recipe, safe when two processes ask at
once (chapter 1).
"""

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from minillm.tiny import recipe_hash, tiny_model_path
from minillm.train import TrainConfig

QUICK = TrainConfig(steps=3, batch_size=2, seq_len=32, eval_every=3)


def test_recipe_hash_changes_with_the_recipe():
    assert recipe_hash(QUICK) != recipe_hash(TrainConfig())
    assert recipe_hash(QUICK) == recipe_hash(
        TrainConfig(steps=3, batch_size=2, seq_len=32, eval_every=3)
    )


def test_the_seed_comes_from_the_environment_and_keys_the_cache(monkeypatch):
    from minillm.tiny import TINY_TRAIN, default_train_config

    monkeypatch.delenv("MINILLM_TINY_SEED", raising=False)
    assert default_train_config() == TINY_TRAIN and TINY_TRAIN.seed == 0
    monkeypatch.setenv("MINILLM_TINY_SEED", "7")
    assert default_train_config().seed == 7
    # another seed is another model: its own cache folder
    assert recipe_hash() == recipe_hash(dataclasses.replace(TINY_TRAIN, seed=7))
    assert recipe_hash() != recipe_hash(TINY_TRAIN)
    monkeypatch.setenv("MINILLM_TINY_SEED", "seven")
    with pytest.raises(ValueError, match="MINILLM_TINY_SEED"):
        default_train_config()


def test_two_processes_at_once_train_once_and_agree(tmp_path):
    code = (
        "import sys; from minillm.tiny import tiny_model_path; from minillm.train "
        "import TrainConfig; print(tiny_model_path(sys.argv[1], TrainConfig(steps=3, "
        "batch_size=2, seq_len=32, eval_every=3), progress=False))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    paths = [p.communicate(timeout=600)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert paths[0] == paths[1]
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    # one model, no temporary left over
    assert [f.name for f in folders] == [f"tiny-{recipe_hash(QUICK)}"]
    assert (
        json.loads((folders[0] / "training_log.json").read_text())["config"]["steps"]
        == 3
    )


def test_cached_model_loads_without_training(tmp_path):
    tiny_model_path(tmp_path, QUICK, progress=False)
    start = time.perf_counter()
    folder = tiny_model_path(tmp_path, QUICK, progress=False)
    assert time.perf_counter() - start < 5
    assert (folder / "model.safetensors").is_file() and (
        folder / "tokenizer.json"
    ).is_file()


def test_the_trained_tiny_model_learned_something(tiny):
    from minillm.tiny import training_log

    log = training_log()
    assert log["eval_loss"][-1] < log["eval_loss"][0] - 0.5
    model, tokenizer = tiny
    assert model.config.eos_token_id == tokenizer.eos_token_id
