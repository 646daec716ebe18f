"""Book text for distillation: a split by whole book, cut into token windows.

The held-out books are never trained on, so evaluation measures how the draft
does on prose it has not seen (the benchmark prompts of `data.book_prompts`
are spread over every book of a corpus; see the note in launch/distill.py).
"""

from __future__ import annotations

import numpy as np

from hitree_jax.data import CORPORA, assets_dir
from hitree_jax.errors import NotFound, UsageError

HELD_OUT_BOOKS = {"austen": ("persuasion",), "shakespeare": ("hamlet", "tempest"),
                  "milton": ("paradise_regained",)}
# Share of training windows per corpus: mostly Austen, the default benchmark corpus.
CORPUS_WEIGHTS = {"austen": 0.5, "shakespeare": 0.35, "milton": 0.15}


def split_texts(split: str) -> dict[str, str]:
  """{corpus: text} of the 'train' or 'eval' books of every corpus, in sorted file order."""
  if split not in ("train", "eval"):
    raise UsageError(f"split={split!r}: expected 'train' or 'eval'")
  texts = {}
  for corpus in CORPORA:
    files = sorted((assets_dir() / "books" / corpus).glob("*.txt"))
    if not files:
      raise NotFound(f"no books for {corpus!r}: run `python -m launch.fetch_assets`")
    chosen = [f for f in files if (f.stem in HELD_OUT_BOOKS[corpus]) == (split == "eval")]
    texts[corpus] = "\n\n".join(f.read_text(encoding="utf-8").strip("\n") for f in chosen)
  return texts


def evenly_spaced_windows(ids: np.ndarray, window: int, n: int) -> np.ndarray:
  """n windows [n, window] starting at evenly spaced offsets of ids (overlap only if ids is short)."""
  if len(ids) < window:
    raise UsageError(f"{len(ids)} tokens cannot fill a window of {window}")
  starts = np.linspace(0, len(ids) - window, n).astype(np.int64)
  return np.stack([ids[s:s + window] for s in starts]).astype(np.int32)


def token_windows(tokenizer, split: str, window: int, n_windows: int) -> np.ndarray:
  """[n_windows, window] token ids from the split's books, shared out by CORPUS_WEIGHTS."""
  texts = split_texts(split)
  counts = {c: int(round(n_windows * w)) for c, w in CORPUS_WEIGHTS.items()}
  counts["austen"] += n_windows - sum(counts.values())
  parts = []
  for corpus, text in texts.items():
    if counts[corpus]:
      ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
      parts.append(evenly_spaced_windows(ids, window, counts[corpus]))
  return np.concatenate(parts)


def token_counts(tokenizer, vocab_size: int) -> np.ndarray:
  """[vocab_size] occurrences of each token in the training books (to choose a draft vocabulary)."""
  counts = np.zeros(vocab_size, np.int64)
  for text in split_texts("train").values():
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False))
    counts += np.bincount(ids, minlength=vocab_size)
  return counts
