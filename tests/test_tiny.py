"""The shared tiny model: cached, keyed by recipe, safe when two processes ask at
once (chapter 2).
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import minillm.tiny
from minillm.hf import load_pretrained
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


# Each process loads the model through the cache, counts its own calls of
# build_tiny_model, and writes down what it loaded: the weights and how its tokenizer
# encodes a text.
CHILD = """
import json, sys
import torch
import minillm.tiny as tiny
from minillm.hf import load_pretrained
from minillm.train import TrainConfig

builds = []
build = tiny.build_tiny_model
tiny.build_tiny_model = lambda *a, **k: (builds.append(1), build(*a, **k))
config = TrainConfig(steps=3, batch_size=2, seq_len=32, eval_every=3)
folder = tiny.tiny_model_path(sys.argv[1], config, progress=False)
model, tokenizer = load_pretrained(folder)
torch.save(model.state_dict(), sys.argv[2])
ids = tokenizer.encode(sys.argv[3])
print(json.dumps({"builds": len(builds), "ids": ids, "text": tokenizer.decode(ids)}))
"""
TEXT = 'The "try" statement specifies exception handlers'


def test_two_processes_at_once_train_once_and_agree(tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(cache), str(tmp_path / f"{i}.pt"), TEXT],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    reports = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    # one of them trained, the other waited for it and loaded its model
    assert sorted(r["builds"] for r in reports) == [0, 1]
    folders = [p for p in cache.iterdir() if p.is_dir()]
    # one model, no temporary left over
    assert [f.name for f in folders] == [f"tiny-{recipe_hash(QUICK)}"]
    assert (
        json.loads((folders[0] / "training_log.json").read_text())["config"]["steps"]
        == 3
    )
    # both loaded the same weights, the ones on disk, and the same tokenizer
    on_disk, tokenizer = load_pretrained(folders[0])
    expected = on_disk.state_dict()
    for i in range(2):
        loaded = torch.load(tmp_path / f"{i}.pt")
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 1
    assert all(r["ids"] == ids and r["text"] == TEXT for r in reports)


def test_cached_model_loads_without_training(tmp_path, monkeypatch):
    folder = tiny_model_path(tmp_path, QUICK, progress=False)

    def snapshot():
        return {
            f.relative_to(tmp_path): (f.stat().st_mtime_ns, f.read_bytes())
            for f in sorted(tmp_path.rglob("*"))
            if f.is_file()
        }

    before = snapshot()
    assert (folder / "model.safetensors").is_file() and (
        folder / "tokenizer.json"
    ).is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    # the tokenizer and the model are trained by these two, as minillm.tiny sees them
    monkeypatch.setattr(minillm.tiny, "train", no_training)
    monkeypatch.setattr(minillm.tiny, "train_tokenizer", no_training)
    assert tiny_model_path(tmp_path, QUICK, progress=False) == folder
    model, tokenizer = load_pretrained(folder)
    assert tokenizer.encode("x = 1") and model.config.vocab_size == tokenizer.vocab_size
    assert snapshot() == before  # nothing written, nothing touched
    # the patch is in the path that trains: an empty cache reaches it
    with pytest.raises(AssertionError, match="trained again"):
        tiny_model_path(tmp_path / "empty", QUICK, progress=False)
    # ...and a failed build leaves no half-written model behind
    assert not [p for p in (tmp_path / "empty").iterdir() if p.is_dir()]


def test_the_trained_tiny_model_learned_something(tiny):
    from minillm.tiny import training_log

    log = training_log()
    assert log["eval_loss"][-1] < log["eval_loss"][0] - 0.5
    model, tokenizer = tiny
    assert model.config.eos_token_id == tokenizer.eos_token_id
