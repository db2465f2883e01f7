"""Our model against Hugging Face transformers: three architectures, both directions
(chapter 2), then through the paged engine with chunked prefill, preemption and
prefix caching (chapters 6, 9 and 11).
"""

import json
import shutil

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from hf_models import SHAPE as HF_SHAPE
from hf_models import hf_greedy
from shapes import LLAMA_3_2_1B, QWEN3_0_6B

from minillm.hf import (
    UnsupportedModelError,
    config_from_hf,
    load_model,
    load_pretrained,
    save_pretrained,
)
from minillm.llm import LLM
from minillm.model import generate
from minillm.sampling_params import SamplingParams

transformers.logging.set_verbosity_error()

SHAPE = dict(HF_SHAPE, vocab_size=320, num_key_value_heads=2)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-gqa-untied": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False),
    ),
    "llama-gqa-tied-llama3-rope": (
        LlamaForCausalLM,
        lambda: LlamaConfig(
            **SHAPE, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
        ),
    ),
    "llama-mha": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**{**SHAPE, "num_key_value_heads": 4}),
    ),
    "qwen2-bias-tied": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**SHAPE, tie_word_embeddings=True),
    ),
    "qwen2-bias-untied": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**SHAPE, tie_word_embeddings=False),
    ),
    "qwen3-qknorm-tied": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(**SHAPE, tie_word_embeddings=True),
    ),
    "qwen3-qknorm-untied-gqa4": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(
            **{**SHAPE, "num_key_value_heads": 1}, tie_word_embeddings=False
        ),
    ),
}


def hf_checkpoint(tmp_path, case):
    cls, make_config = CASES[case]
    torch.manual_seed(0)
    reference = cls(make_config()).eval()
    # random init leaves biases and norm gains trivial: perturb them so they matter
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    reference.save_pretrained(tmp_path)
    return reference


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case, device):
    reference = hf_checkpoint(tmp_path, case).to(device)
    ours = load_model(tmp_path, device=device)
    ids = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    with torch.no_grad():
        theirs = reference(ids).logits
        mine = ours.compute_logits(
            ours(ids, torch.arange(40, device=device).expand(3, 40))
        )
    assert (mine - theirs).abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_32_tokens_match_transformers_generate(tmp_path, case, device):
    reference = hf_checkpoint(tmp_path, case).to(device)
    reference.generation_config.eos_token_id = None
    ours = load_model(tmp_path, device=device)
    prompts = [
        torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 17, 33)
    ]
    prompts[0][2] = 0  # token id 0 inside a prompt must be an ordinary token
    # one batch, mixed lengths, dense KV cache
    mine = generate(ours, prompts, max_new_tokens=32)
    for prompt, out in zip(prompts, mine):
        assert out == hf_greedy(reference, prompt, 32)


# --- the paged engine against transformers
# ---------------------------------------------------------


def random_prompt(length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, SHAPE["vocab_size"], (length,), generator=g).tolist()


def no_block_held(kv):
    """No request holds a block: every block is free, or (radix) held once by the
    tree as a cached prefix that eviction can free.
    """
    pool = kv.block_pool
    tree = getattr(kv, "tree", None)
    cached = {id(b) for n in tree.nodes() for b in n.value} if tree else set()
    return (
        not kv.req_to_blocks
        and all(b.ref_cnt == (id(b) in cached) for b in pool.blocks)
        and pool.get_num_free_blocks() + len(cached) == pool.num_blocks
    )


def test_qwen2_bias_through_the_paged_engine_matches_transformers(tmp_path):
    reference = hf_checkpoint(tmp_path, "qwen2-bias-untied")
    reference.generation_config.eos_token_id = None
    assert reference.model.layers[0].self_attn.q_proj.bias.abs().max() > 0.05
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 22, 31, 40, 47, 5, 58)]
    llm = LLM(
        tmp_path,
        device="cpu",
        dtype=torch.float32,
        skip_tokenizer_init=True,  # prompts are token ids
        num_kv_blocks=30,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # 120 slots cannot hold six sequences of up to 78 tokens; prompts over 16 chunk
    assert llm.engine.num_preemptions > 0
    assert max(map(len, prompts)) > 16
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 20)
    assert no_block_held(llm.engine.kv_cache_manager)


@pytest.mark.parametrize("impl", ["hash", "radix"])
def test_prefix_cache_with_chunks_and_preemption_matches_transformers(tmp_path, impl):
    reference = hf_checkpoint(tmp_path, "qwen3-qknorm-untied-gqa4")
    reference.generation_config.eos_token_id = None
    system = random_prompt(36, seed=100)  # 9 full blocks of 4
    prompts = [system + random_prompt(n, seed=200 + n) for n in (1, 4, 7, 10, 13)]
    prompts += [system[:18] + random_prompt(6, seed=300 + i) for i in range(2)]
    prompts += [random_prompt(25, seed=400)]
    # two repeats; prompts[1] has 40 tokens, a whole number of blocks: a full hit
    # must still compute its last token, for the logits
    prompts += [prompts[2], prompts[1]]
    assert len(prompts[-1]) % 4 == 0
    llm = LLM(
        tmp_path,
        device="cpu",
        dtype=torch.float32,
        skip_tokenizer_init=True,
        num_kv_blocks=36,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=20,
        prefix_cache_impl=impl,
    )
    scheduled, schedule = [0], llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        scheduled[0] += out.total_num_scheduled_tokens
        return out

    llm.engine.scheduler.schedule = counting
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    assert llm.engine.num_preemptions > 0 and max(map(len, prompts)) > 20
    assert kv.prefix_cache_hits > 0
    # hits that were used: fewer tokens computed than every prompt and output once
    assert scheduled[0] < sum(map(len, prompts)) + len(prompts) * (16 - 1)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 16)
    assert no_block_held(kv)


def test_sharded_checkpoint_loads(tmp_path):
    cls, make_config = CASES["qwen3-qknorm-tied"]
    torch.manual_seed(0)
    reference = cls(make_config()).eval()
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert (
            ours.compute_logits(ours(ids, ids)) - reference(ids).logits
        ).abs().max() < 1e-4


def test_bf16_load_keeps_dtype_and_ties(tmp_path):
    hf_checkpoint(tmp_path, "qwen3-qknorm-tied")
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_tiny_model_exports_as_llama_that_transformers_loads(tiny, tmp_path):
    model, tokenizer = tiny
    save_pretrained(model, tokenizer, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = 'The "try" statement specifies exception handlers'
    ids = tokenizer.encode(text)
    assert (
        hf_tok(text)["input_ids"] == ids
        and hf_tok.decode(ids, skip_special_tokens=True) == text
    )
    t = torch.tensor([ids])
    with torch.no_grad():
        assert (
            model.compute_logits(model(t, torch.arange(len(ids))[None])) - hf(t).logits
        ).abs().max() < 1e-4
    again, _ = load_pretrained(tmp_path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_dict().values(), model.state_dict().values())
    )


def test_unsupported_architecture_is_refused(tmp_path):
    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    ).save_pretrained(tmp_path)
    with pytest.raises(
        UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"
    ):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("use_sliding_window", True, "use_sliding_window"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_features_we_would_ignore_are_refused(field, value, message):
    config = {**SHAPE, "architectures": ["Qwen2ForCausalLM"], field: value}
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(config)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    hf_checkpoint(tmp_path, "llama-mha")
    shutil.move(tmp_path / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


def test_checkpoint_with_wrong_tensors_is_refused(tmp_path):
    hf_checkpoint(tmp_path, "llama-mha")
    config = json.loads((tmp_path / "config.json").read_text())
    # Qwen3 expects q_norm / k_norm tensors
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="missing.*q_norm"):
        load_model(tmp_path)


# Real shapes in bf16 on a GPU. Random weights give nearly flat logits, so bf16 rounding
# alone flips
# some argmaxes. The fair bar: measured against the float32 model, our bf16 model picks
# the same
# next token about as often as transformers' own bf16 model does (within one percentage
# point).
REAL_SHAPES = {
    "qwen3-0.6b": (Qwen3ForCausalLM, lambda: Qwen3Config(**QWEN3_0_6B)),
    "llama-3.2-1b": (LlamaForCausalLM, lambda: LlamaConfig(**LLAMA_3_2_1B)),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_bf16_real_shapes_agree_with_transformers_on_gpu(tmp_path, name):
    cls, make_config = REAL_SHAPES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = cls(make_config()).eval()
    reference.save_pretrained(tmp_path)
    ids = torch.randint(
        0, 32000, (8, 128), generator=torch.Generator().manual_seed(0)
    ).cuda()
    positions = torch.arange(128, device="cuda").expand(8, 128)
    with torch.no_grad():
        truth = reference(ids).logits.argmax(-1)  # float32
        del reference
        hf_bf16 = (
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
            .cuda()
            .eval()
        )
        theirs = hf_bf16(ids).logits.argmax(-1)
        del hf_bf16
        ours = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
        mine = ours.compute_logits(ours(ids, positions)).argmax(-1)
    ours_rate = (mine == truth).float().mean().item()
    hf_rate = (theirs == truth).float().mean().item()
    print(
        f"{name} bf16, next-token argmax agreement with float32: minillm "
        f"{ours_rate:.4f}, transformers {hf_rate:.4f}; minillm vs transformers "
        f"{(mine == theirs).float().mean().item():.4f}"
    )
    assert ours_rate >= hf_rate - 0.01
