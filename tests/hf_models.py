"""The small random Hugging Face models the engine tests compare with: one shape, as
a Llama (grouped-query attention, untied embeddings) and as a Qwen3 (one KV head,
tied embeddings). `MODELS` parametrizes a test over both, with the `hf_checkpoint`
fixture of conftest.py.
"""

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SHAPE = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=512,
)
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
