"""The small random Hugging Face models the engine tests compare with: one shape, as
a Llama (grouped-query attention, untied embeddings) and as a Qwen3 (one KV head,
tied embeddings). `MODELS` parametrizes a test over both, with the `hf_checkpoint`
fixture of conftest.py; `hf_greedy` is transformers' greedy continuation, the
reference the engine's tokens are compared with.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SHAPE = dict(
    vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, head_dim=32, max_position_embeddings=512,
)  # fmt: skip
MODELS = [
    (
        LlamaForCausalLM,
        LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    (
        Qwen3ForCausalLM,
        Qwen3Config(**SHAPE, num_key_value_heads=1, tie_word_embeddings=True),
    ),
]


def hf_greedy(reference, prompt, max_new_tokens):
    """The token ids transformers' `generate` appends to one prompt (a list of ids),
    greedily, on the reference's device. The mask is explicit: else transformers takes
    every id 0 (a BOS of 0, say) for padding."""
    ids = torch.tensor([prompt], device=reference.device)
    with torch.no_grad():
        return reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
