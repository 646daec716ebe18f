"""An EAGLE draft for chat (issue: Spec-Bench), drafts/smollm2-eagle-chat: the shipped EAGLE
recipe (configs/distill_eagle.py) with chat as its training text.

  python -m launch.distill --config=configs/distill_eagle_chat.py            # ~40 min on a 2-core CPU
  python -m launch.distill --config=configs/distill_eagle_chat.py --until=0  # only the teacher's labels

The shipped EAGLE layer was trained on book windows; a chat model's answers are another text.
Here each training window is an instruction over a passage of the training books in SmolLM2's
chat template (summarise, continue, answer about, rewrite, extract, ask and answer:
hitree_jax/train/instructions.py), 128 tokens, then the teacher's own answer, sampled at
T 0.6 / top-p 0.9, 128 tokens: EAGLE's recipe of training on the target's own responses,
without Spec-Bench's questions (its test data; tests/test_spec_bench.py checks that no 13-word
run is shared). Evaluated on the same kind of windows over the held-out books. Every other
setting is the book recipe's.
"""

from ml_collections import config_dict

from hitree_jax import shipped


def get_config() -> config_dict.ConfigDict:
  config = shipped.config("distill_eagle")
  config.update(dict(
      workdir="runs/eagle_chat",
      out="runs/eagle-chat/smollm2-eagle-chat",   # --out=drafts/smollm2-eagle-chat replaces it
      train_windows=1536,
      steps=1200,
      text="chat",
  ))
  with config.unlocked():
    config.own_prompt_tokens = 128
  return config
