"""An EAGLE draft for chat (issue: Spec-Bench), drafts/smollm2-eagle-chat: every setting.

  python -m launch.distill --config=configs/distill_eagle_chat.py            # ~40 min on a 2-core CPU
  python -m launch.distill --config=configs/distill_eagle_chat.py --until=0  # only the teacher's labels

The shipped EAGLE layer (configs/distill_eagle.py) was trained on book windows; a chat model's
answers are another text. Here each training window is an instruction over a passage of the
training books in SmolLM2's chat template (summarise, continue, answer about, rewrite, extract,
ask and answer: hitree_jax/train/instructions.py), 128 tokens, then the teacher's own answer,
sampled at T 0.6 / top-p 0.9, 128 tokens: EAGLE's recipe of training on the target's own
responses, without Spec-Bench's questions (its test data; tests/test_spec_bench.py checks that no
13-word run is shared). Evaluated on the same kind of windows over the held-out books.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      kind="eagle",
      teacher="smollm2",
      workdir="runs/eagle_chat",
      out="drafts/smollm2-eagle-chat",
      vocab_size=8192,
      window=256,
      train_windows=1536,
      eval_windows=32,
      topk=32,
      steps=1200,
      batch=8,
      lr=1e-3,
      warmup=50,
      seed=0,
      feature_weight=1.0,
      unroll=True,
      train_text="chat",
      own_prompt_tokens=128,
      temperature=0.6,
      top_p=0.9,
      cost_context=512,
  ))
