"""Shared fixtures: the trained tiny model (built once per cache folder), a live
server over it, and a quiet transformers. Shared helpers that are not fixtures are in
helpers.py (engine sizes, prompts, the server's clients), hf_models.py (the Hugging
Face references) and shapes.py (model shapes).
"""

import os

import pytest
import torch
from hypothesis import settings

# In CI (CI=true) property tests draw the same examples every run, so a red run is
# reproducible;
# locally they keep exploring new ones (and remember failures in .hypothesis/).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels run on the CPU; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the course's tiny model, float32 on CPU."""
    from minillm.tiny import tiny_model

    return tiny_model(progress=False)


@pytest.fixture(scope="session")
def fast_path():
    """fast_path(engine): which of chapters 13-16's paths an engine runs, as a dict:
    the parts it resolved (chapter 8's seam) and its runner's flags (chapter 16's).
    """

    def read(engine) -> dict:
        runner = engine.model_runner
        return {
            "attention_backend": engine.parts["attention_backend"],
            "persistent_batch": engine.parts["persistent_batch"],
            "cuda_graphs": getattr(runner, "cuda_graphs", False),
            "torch_compile": getattr(runner, "torch_compile", False),
            "async_scheduling": getattr(runner, "async_scheduling", False),
            "stepper": engine.stepper,  # chapter 16's overlapped step loop, or None
        }

    return read


@pytest.fixture(scope="session")
def device():
    """Where device-aware tests run: $MINILLM_TEST_DEVICE (e.g. cuda on the GPU box),
    else cpu.
    """
    return os.environ.get("MINILLM_TEST_DEVICE", "cpu")


@pytest.fixture
def hf_checkpoint(tmp_path, tiny):
    """make(cls, config): a random-initialised transformers model saved to tmp_path with
    the tiny tokenizer (prompts are token ids, so any tokenizer.json will do);
    returns (model, folder).
    """

    def make(cls, config):
        torch.manual_seed(0)
        reference = cls(config).eval()
        # random weights: generate every requested token
        reference.generation_config.eos_token_id = None
        reference.save_pretrained(tmp_path)
        tiny[1].save(tmp_path)
        return reference, tmp_path

    return make


@pytest.fixture(scope="module")
def live(tiny):
    """A live server (chapter 27) over chapter 9's engine on the tiny model, one per
    test module; live.engine is the engine. A module that serves another engine
    defines its own `live`."""
    from helpers import SERVER_SIZES, live_server

    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    with live_server(LLMEngine(*tiny, EngineConfig(**SERVER_SIZES))) as server:
        yield server
