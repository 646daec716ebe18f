"""SmolLM2-135M at its 8K context, for launch.level_cost and launch.plan_memory (shapes only: no weights).

  python -m launch.level_cost --shapes=configs/smollm2_8k.py --prompt_tokens=2048,8064 --widths=1,4,8,16

The target is SmolLM2-135M-Instruct's shape in bfloat16 (270 MB of weights, 15 KB of cache per
token); the draft is the shipped distilled draft's (3 of its layers, drafts/smollm2-draft.gguf).
The stack is the long-context one measured on a CPU (docs/performance.md): the draft over a
StreamingLLM cache of 16 sinks + 240 recent tokens proposes to the target over a 1024-slot
retrieval cache.
"""

from ml_collections import config_dict

_SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                dtype="bfloat16")


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      target=dict(_SMOLLM2, num_layers=30),
      draft=dict(_SMOLLM2, num_layers=3),
      prompt_tokens=7680, max_new_tokens=256, batch=1,
      budget=1024, sinks=16, window=240, gamma1=1, gamma2=6))
