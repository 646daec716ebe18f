"""Llama-3.1-8B at 128K context for launch.plan_memory (shapes only: no weights).

  python -m launch.plan_memory --shapes=configs/llama3_8b_128k.py --mesh=model:8 --device=h100

Grouped-query attention (8 KV heads for 32 query heads) makes its full bfloat16 cache 0.125 MB
per token (16 GiB at 128K), a quarter of Llama-2-7B's; its 128K-token vocabulary makes the
weights 16 GB. The stack is TriForce's with a 2-layer draft of the target's vocabulary over a
StreamingLLM cache of 16 + 234, the target over a 4K retrieval cache buffering 6 tokens.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      target=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192),
                  max_position_embeddings=131072, dtype="bfloat16"),
      draft=dict(vocab_size=128256, hidden_size=768, intermediate_size=3072, num_layers=2, num_heads=12,
                 num_kv_heads=12, head_dim=64, max_position_embeddings=131072, dtype="bfloat16"),
      prompt_tokens=130560, max_new_tokens=256, batch=1,
      budget=4096, sinks=16, window=234, gamma1=1, gamma2=6))
