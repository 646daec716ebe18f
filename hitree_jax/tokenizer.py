"""The model's own Hugging Face tokenizer, for every weight source.

Building a tokenizer from a GGUF file takes ~10 s (transformers converts the
embedded vocabulary), so the result is saved once under
`<assets>/tokenizers/<gguf name>/` and reloaded from there.
"""

from __future__ import annotations

import pathlib

import transformers

from hitree_jax.data import assets_dir
from hitree_jax.loading import checkpoint


def load_tokenizer(path: str | pathlib.Path):
  """Tokenizer for a resolved model path (see `hitree_jax.loading.resolve`)."""
  path = pathlib.Path(path)
  if path.suffix == ".gguf":
    cached = assets_dir() / "tokenizers" / path.stem
    if (cached / "tokenizer_config.json").is_file():
      return transformers.AutoTokenizer.from_pretrained(str(cached))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(cached))
    return tokenizer
  if checkpoint.is_checkpoint(path):
    path = path / "tokenizer"
  if not path.is_dir():
    raise FileNotFoundError(f"no tokenizer at {path}")
  return transformers.AutoTokenizer.from_pretrained(str(path))


def chat_prompt(tokenizer, user_text: str) -> list[int]:
  """Token ids of one user turn in the model's chat template, ready for the reply."""
  if not tokenizer.chat_template:
    raise ValueError("this tokenizer has no chat template; drop --chat")
  ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                      add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
