"""Qwen3-8B with z-lab's DFlash block draft, for launch.plan_memory (shapes only).

  python -m launch.plan_memory --shapes=configs/qwen3_8b_dflash.py --topology=v5e:2x4
  python -m launch.plan_memory --shapes=configs/qwen3_8b_dflash.py --topology=v5e:2x4 \
      --shapes.levels="$(python -c 'import configs.qwen3_8b_dflash as c; print(c.TREE)')"

The draft is read from its config.json alone (configs/drafters/dflash-qwen3-8b: the shape fields
of z-lab/Qwen3-8B-DFlash-b16's config; no weights): five Qwen3 layers at the target's width that
read five of its layers and propose a block of 16 (the last token and 15 masks) in one forward.
The stack verifies the block as a chain of 15; TREE verifies a dynamic tree grown from the
block's per-position distributions instead. A chat of 32K tokens (Qwen3-8B's native context).
"""

import pathlib

from ml_collections import config_dict

DRAFT = pathlib.Path(__file__).resolve().parent / "drafters" / "dflash-qwen3-8b"
CHAIN, TREE = f"dflash:{DRAFT}/chain:15", f"dflash:{DRAFT}/dynamic:32,8"


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      target=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                  num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  qk_norm=True, max_position_embeddings=40960, dtype="bfloat16"),
      levels=CHAIN,
      prompt_tokens=32512, max_new_tokens=256, batch=1))
