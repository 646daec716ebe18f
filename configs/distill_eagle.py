"""The recipe of the shipped EAGLE draft, drafts/smollm2-eagle: every setting, defaults included.

  python -m launch.distill --config=configs/distill_eagle.py            # ~65 min on a 2-core CPU
  python -m launch.distill --config=configs/distill_eagle.py --until=0  # only the teacher's labels

EAGLE's one decoder layer on SmolLM2's features (hitree_jax/heads/eagle.py),
the 8192 most frequent training tokens as its vocabulary, trained on the
teacher's features and top-32 next-token log-probabilities over 4608 windows
of 256 tokens from the training books (25 minutes of labelling, 1.6 GB in the
workdir), 2400 steps (40 minutes), then evaluated at T 0.6 / top-p 0.9 on
held-out books (its heads.json). 1536 windows and 1200 steps gave a greedy
agreement of 0.50; these give 0.55.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      kind="eagle",
      teacher="smollm2",
      workdir="runs/eagle",
      out="runs/eagle/smollm2-eagle",   # --out=drafts/smollm2-eagle replaces the shipped one
      vocab_size=8192,
      window=256,
      train_windows=4608,
      eval_windows=32,
      topk=32,
      steps=2400,
      batch=8,
      lr=1e-3,
      warmup=50,
      seed=0,
      feature_weight=1.0,
      unroll=True,
      text="books",
      temperature=0.6,
      top_p=0.9,
      cost_context=512,
  ))
