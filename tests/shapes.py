"""Model shapes the tests build with random weights, as config keyword arguments
(transformers' names, which chapter 3's ModelConfig shares).

`SMALL` is the shape of the few-second models (2 layers, grouped-query attention);
`QWEN3_0_6B` and `LLAMA_3_2_1B` are the real models' shapes, as benchmarks/ spells
them (benchmarks/throughput.py, benchmarks/latency.py). The Hugging Face pair of the
engine tests is in hf_models.py.
"""

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)  # fmt: skip
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)  # fmt: skip
