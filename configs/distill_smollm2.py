"""The recipe of the shipped draft, drafts/smollm2-draft.gguf: every setting, defaults included.

  python -m launch.distill --config=configs/distill_smollm2.py            # ~2 h on a 2-core CPU
  python -m launch.distill --config=configs/distill_smollm2.py --until=0  # only the teacher's labels

A 3-layer student started from SmolLM2's layers 0, 1 and 29, with the 8192
most frequent training tokens as its vocabulary, trained on the teacher's top-32
next-token log-probabilities over 1920 windows of 256 tokens from the training
books (held-out books: hitree_jax/train/corpus.py), then exported as Q8_0 GGUF
and evaluated at T 0.6 / top-p 0.9 (drafts/smollm2-draft.json).
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      teacher="smollm2",
      workdir="runs/draft",
      out="runs/draft/smollm2-draft.gguf",   # --out=drafts/smollm2-draft.gguf replaces the shipped one
      layers="0,1,29",
      vocab_size=8192,
      window=256,
      train_windows=1920,
      eval_windows=32,
      topk=32,
      steps=800,
      batch=8,
      lr=5e-4,
      warmup=20,
      seed=0,
      quantize=True,
      temperature=0.6,
      top_p=0.9,
      cost_context=512,
  ))
