"""A distilled draft for chat, drafts/smollm2-draft-chat.gguf: the shipped draft's recipe
(configs/distill_smollm2.py) with chat as its training text, on the chat EAGLE draft's labels.

  python -m launch.distill --config=configs/distill_smollm2_chat.py

The shipped draft was trained on book windows. Here each training window is an instruction over
a passage of the training books in SmolLM2's chat template (hitree_jax/train/instructions.py),
128 tokens, then the teacher's own answer sampled at T 0.6 / top-p 0.9, 128 tokens, as for
configs/distill_eagle_chat.py, whose workdir it shares: labels made for a feature draft hold a
token draft's, so with that recipe run first no label is computed again. The draft's vocabulary
is the chat windows' 8192 most frequent tokens. Evaluated on the same kind of windows over the
held-out books; never trained on Spec-Bench's questions (tests/test_spec_bench.py).
"""

from ml_collections import config_dict

from hitree_jax import shipped


def get_config() -> config_dict.ConfigDict:
  config = shipped.config("distill_smollm2")
  with config.unlocked():
    config.update(dict(
        workdir="runs/eagle_chat",
        out="runs/draft-chat/smollm2-draft-chat.gguf",   # --out=drafts/smollm2-draft-chat.gguf replaces it
        train_windows=1536,
        text="chat",
        own_prompt_tokens=128,
    ))
  return config
