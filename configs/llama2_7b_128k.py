"""Llama-2-7B at 128K context, TriForce's setting, for launch.plan_memory (shapes only: no weights).

  python -m launch.plan_memory --shapes=configs/llama2_7b_128k.py --topology=v5e:2x4

The target is LWM-Text-128K's shape (Llama-2-7B, RoPE theta 1e7, 131,072 positions), in
bfloat16: 13.5 GB of weights and a full cache of 0.5 MB per token (64 GiB at 128K). The stack
is TriForce's: a 68M-parameter draft (JackFram/llama-68m's shape) over a StreamingLLM cache of
16 sinks + 234 recent tokens proposes to the target over a 4K retrieval cache, which buffers 6
tokens for the target.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      target=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                  num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=1e7,
                  max_position_embeddings=131072, dtype="bfloat16"),
      draft=dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=2, num_heads=12,
                 num_kv_heads=12, head_dim=64, max_position_embeddings=131072, dtype="bfloat16"),
      prompt_tokens=130560, max_new_tokens=256, batch=1,
      budget=4096, sinks=16, window=234, gamma1=1, gamma2=6))
