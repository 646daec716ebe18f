"""Book text for distillation: a split by whole book, cut into token windows.

The held-out books are never trained on, so evaluation measures how the draft
does on prose it has not seen (the benchmark prompts of `data.book_prompts`
are spread over every book of a corpus; see the note in launch/distill.py).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import uuid
import warnings
import zipfile

import numpy as np

from hitree_jax.data import CORPORA, assets_dir
from hitree_jax.errors import NotFound, UsageError

HELD_OUT_BOOKS = {"austen": ("persuasion",), "shakespeare": ("hamlet", "tempest"),
                  "milton": ("paradise_regained",)}
# Share of training windows per corpus: mostly Austen, the default benchmark corpus.
CORPUS_WEIGHTS = {"austen": 0.5, "shakespeare": 0.35, "milton": 0.15}


def split_files(split: str) -> dict[str, list[pathlib.Path]]:
  """{corpus: book files} of the 'train' or 'eval' split of every corpus, in sorted order."""
  if split not in ("train", "eval"):
    raise UsageError(f"split={split!r}: expected 'train' or 'eval'")
  chosen = {}
  for corpus in CORPORA:
    files = sorted((assets_dir() / "books" / corpus).glob("*.txt"))
    if not files:
      raise NotFound(f"no books for {corpus!r}: run `python -m launch.fetch_assets`")
    chosen[corpus] = [f for f in files if (f.stem in HELD_OUT_BOOKS[corpus]) == (split == "eval")]
  return chosen


def split_texts(split: str) -> dict[str, str]:
  """{corpus: text} of the 'train' or 'eval' books of every corpus, in sorted file order."""
  return {corpus: "\n\n".join(f.read_text(encoding="utf-8").strip("\n") for f in files)
          for corpus, files in split_files(split).items()}


def split_ids(tokenizer, split: str) -> dict[str, np.ndarray]:
  """{corpus: int32 token ids} of the split's text (split_texts), each corpus encoded whole.

  Encoding the training books takes about 8 s on 2 cores (2.7M tokens), and a distillation
  run needed them twice (its vocabulary's counts, then its windows); so the ids are kept under
  <assets>/token_ids/, keyed by a digest of the tokenizer's definition and of the books' names,
  sizes and modification times, and reused by every later run (and within a process)."""
  files = split_files(split)
  try:
    definition = tokenizer.backend_tokenizer.to_str()
  except AttributeError:   # not a fast (Rust) tokenizer: nothing to key a kept copy by
    return _encoded(tokenizer, split)
  digest = hashlib.sha256(definition.encode())
  for corpus, chosen in files.items():
    for f in chosen:
      stat = f.stat()
      digest.update(f"{corpus}/{f.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
  key = f"{split}-{digest.hexdigest()[:16]}"
  if key not in _KEPT:
    _KEPT[key] = _kept_ids(tokenizer, split, assets_dir() / "token_ids" / f"{key}.npz")
  return _KEPT[key]


_KEPT: dict[str, dict[str, np.ndarray]] = {}   # split_ids' entries read in this process


def _encoded(tokenizer, split: str) -> dict[str, np.ndarray]:
  return {corpus: np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
          for corpus, text in split_texts(split).items()}


def _kept_ids(tokenizer, split: str, path: pathlib.Path) -> dict[str, np.ndarray]:
  """The split's ids read from `path`, else encoded and written there (under a temporary name,
  then renamed: a concurrent reader sees all of it or none). Read-only: they are shared."""
  ids = None
  if path.is_file():
    try:
      with np.load(path) as kept:
        ids = {corpus: kept[corpus] for corpus in kept.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
      warnings.warn(f"token ids {path} unreadable ({e}): the books are encoded again")
  if ids is None or list(ids) != list(CORPORA):
    ids = _encoded(tokenizer, split)
    _write(path, ids)
  for array in ids.values():
    array.setflags(write=False)
  return ids


def _write(path: pathlib.Path, ids: dict[str, np.ndarray]) -> None:
  tmp = path.parent / f".tmp-{path.stem}-{os.getpid()}-{uuid.uuid4().hex[:8]}.npz"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(tmp, **ids)
    os.replace(tmp, path)
  except OSError as e:
    warnings.warn(f"token ids {path} not written ({e}); the books are encoded again next time")
    tmp.unlink(missing_ok=True)


def evenly_spaced_windows(ids: np.ndarray, window: int, n: int) -> np.ndarray:
  """n windows [n, window] starting at evenly spaced offsets of ids (overlap only if ids is short)."""
  if len(ids) < window:
    raise UsageError(f"{len(ids)} tokens cannot fill a window of {window}")
  starts = np.linspace(0, len(ids) - window, n).astype(np.int64)
  return np.stack([ids[s:s + window] for s in starts]).astype(np.int32)


def token_windows(tokenizer, split: str, window: int, n_windows: int) -> np.ndarray:
  """[n_windows, window] token ids from the split's books, shared out by CORPUS_WEIGHTS."""
  counts = {c: int(round(n_windows * w)) for c, w in CORPUS_WEIGHTS.items()}
  counts["austen"] += n_windows - sum(counts.values())
  return np.concatenate([evenly_spaced_windows(ids, window, counts[corpus])
                         for corpus, ids in split_ids(tokenizer, split).items() if counts[corpus]])


def token_counts(tokenizer, vocab_size: int) -> np.ndarray:
  """[vocab_size] occurrences of each token in the training books (to choose a draft vocabulary)."""
  counts = np.zeros(vocab_size, np.int64)
  for ids in split_ids(tokenizer, "train").values():
    counts += np.bincount(ids, minlength=vocab_size)
  return counts
