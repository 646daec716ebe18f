"""A DFlash block drafter for SmolLM2's chat (drafts/smollm2-eagle-chat's labels and text).

  python -m launch.distill --config=configs/distill_dflash_chat.py            # ~1 h on a 2-core CPU
  python -m launch.distill --config=configs/distill_dflash_chat.py --until=0  # only the teacher's labels

The chat EAGLE recipe's text (configs/distill_eagle_chat.py: an instruction over a training
book's passage in SmolLM2's chat template, 128 tokens, then the teacher's own answer at T 0.6 /
top-p 0.9; never Spec-Bench's questions), labelled with the outputs of the teacher layers the
draft reads (1, 14, 27: DFlash's default for three draft layers over 30). Three Qwen3-style
layers of SmolLM2's width propose a block of 16 (the published drafts' block) from those states;
16 blocks per window at random anchors, rows weighted exp(-(d-1)/7). Written in vLLM's
speculators format (train/speculators.py).

Measured (docs/results/specbench/specbench_history.md, 2026-11-28): 44 min of training after 30 of
labelling; on Spec-Bench it commits 1.21 tokens per target forward as a chain and 1.40 as a tree,
below the chat EAGLE's 1.39 and 1.62, so it is not shipped.
"""

from hitree_jax import shipped


def get_config():
  config = shipped.config("distill_eagle_chat")
  config.update(dict(kind="dflash", workdir="runs/eagle_chat", out="runs/dflash-chat/smollm2-dflash-chat",
                     steps=800, warmup=50))
  with config.unlocked():
    config.block_size = 16
    config.draft_layers = 3
    config.anchors = 16
    config.loss_gamma = 7.0
  return config
