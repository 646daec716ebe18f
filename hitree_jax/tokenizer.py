"""The model's own Hugging Face tokenizer, for every weight source.

A GGUF holds no tokenizer.json, only llama.cpp's tokenizer metadata. We read it
with the `gguf` package and hand it to transformers' own converter, as
`AutoTokenizer.from_pretrained(folder, gguf_file=...)` does; that call itself
reads the file with transformers' GGUF reader, which imports torch, a test-only
dependency here.

Converting takes seconds, so the result is saved under
`<assets>/tokenizers/<gguf stem>/<key>/`. The key names the file (path, size,
mtime) and the transformers version, so a rewritten GGUF or a new converter
gets a fresh entry; an entry is written to a temporary folder and renamed into
place, so a concurrent reader sees all of it or none. Entries for older
versions of a file stay (a few MB each) until the folder is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import uuid
import warnings

from hitree_jax.errors import NotFound, UsageError

# Without torch (a test-only package here) transformers advises that "PyTorch was not
# found. Models won't be available": we use it for tokenizers only, so that advice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import transformers  # noqa: E402
from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

from hitree_jax.data import assets_dir
from hitree_jax.loading import checkpoint
from hitree_jax.loading import gguf as gguf_loading

_SOURCE = "source.json"  # in each cache entry: which file (version) it was built from
# transformers' `get_gguf_tokenizer`: special token -> the GGUF key of its id.
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def tokenizer_path(path: str | pathlib.Path) -> pathlib.Path:
  """Where a resolved model path keeps its tokenizer: a GGUF in itself, an orbax checkpoint in
  its tokenizer/ folder, a Hugging Face folder in itself."""
  path = pathlib.Path(path)
  return path / "tokenizer" if checkpoint.is_checkpoint(path) else path


def gguf_tokenizer_source(path: str | pathlib.Path) -> pathlib.Path | None:
  """What `save_gguf(tokenizer_from=)` copies a model's tokenizer from: its GGUF, or a folder
  with a tokenizer.json; None where the model has neither."""
  source = tokenizer_path(path)
  return source if source.suffix == ".gguf" or (source / "tokenizer.json").is_file() else None


def load_tokenizer(path: str | pathlib.Path):
  """Tokenizer for a resolved model path (see `hitree_jax.loading.resolve`)."""
  path = tokenizer_path(path)
  if path.suffix == ".gguf":
    return _cached_gguf_tokenizer(path)
  if not path.is_dir():
    raise NotFound(f"no tokenizer at {path}")
  return transformers.AutoTokenizer.from_pretrained(str(path))


def gguf_tokenizer(path: str | pathlib.Path) -> transformers.PreTrainedTokenizerFast:
  """The tokenizer a GGUF describes, built as transformers' `gguf_file=` path builds it."""
  architecture, tokenizer_dict, tokenizer_config = _read_gguf_tokenizer(path)
  backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
  return transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                              **{**tokenizer_config, **extra})


def _read_gguf_tokenizer(path) -> tuple[str, dict, dict]:
  """transformers' `get_gguf_tokenizer`, reading with `gguf` (shared with the weights' loader)."""
  fields = gguf_loading.open_reader(path).fields
  if "tokenizer.ggml.tokens" not in fields:
    raise NotFound(f"no tokenizer in {path}: it has no tokenizer.ggml.* metadata "
                            "(save_gguf copies one with tokenizer_from=)")
  value = lambda key: fields[key].contents() if key in fields else None
  tokenizer, config = ({name: value(f"tokenizer.{key}") for key, name in renames.items()
                        if f"tokenizer.{key}" in fields}
                       for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"],
                                       GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
  if tokenizer.get("tokenizer_type") == "llama":
    config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
  elif tokenizer.get("tokenizer_type") == "gemma4":
    config["add_bos_token"] = False  # its chat template writes <bos> itself
  for name, key in _SPECIAL_TOKENS.items():
    token_id = value(f"tokenizer.ggml.{key}")
    config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
  return value("general.architecture"), tokenizer, config


def _cached_gguf_tokenizer(path: pathlib.Path):
  """`gguf_tokenizer(path)`, built once per file version and then loaded from the assets."""
  source = path.resolve()
  if not source.is_file():
    raise NotFound(f"GGUF file not found: {path}")
  stat = source.stat()
  record = {"gguf": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__}
  key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
  entry = assets_dir() / "tokenizers" / path.stem / key
  if (entry / _SOURCE).is_file():
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(entry))
  tokenizer = gguf_tokenizer(source)
  try:
    _write_entry(tokenizer, entry, record)
  except OSError as e:
    warnings.warn(f"tokenizer cache {entry} not written ({e}); it is built again next time")
  return tokenizer


def _write_entry(tokenizer, entry: pathlib.Path, record: dict) -> None:
  """Saves under a temporary name, then renames: atomic, and a concurrent twin's rename wins."""
  entry.parent.mkdir(parents=True, exist_ok=True)
  tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    tokenizer.save_pretrained(str(tmp))
    (tmp / _SOURCE).write_text(json.dumps(record, indent=1))
    try:
      tmp.rename(entry)
    except OSError:
      if not (entry / _SOURCE).is_file():
        raise  # not another process having written the same entry first
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def same_tokenizer(a, b) -> bool:
  """Whether `a` and `b` turn text into the same ids and back: a draft must share its target's."""
  def spec(tokenizer):
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("truncation", None), state.pop("padding", None)  # call settings, not the tokenizer
    return state, tokenizer.all_special_tokens, tokenizer.bos_token_id, tokenizer.eos_token_id
  return spec(a) == spec(b)


def chat_prompt(tokenizer, user_text: str) -> list[int]:
  """Token ids of one user turn in the model's chat template, ready for the reply."""
  return conversation_prompt(tokenizer, [user_text], [])


def conversation_prompt(tokenizer, user_turns, answers) -> list[int]:
  """Token ids of a conversation in the model's chat template, ready for the next reply:
  user_turns[i] then answers[i] (the model's own, as text), ending on the last user turn."""
  if not tokenizer.chat_template:
    raise UsageError("this tokenizer has no chat template, so it cannot read --text=chat")
  if len(answers) != len(user_turns) - 1:
    raise UsageError(f"a conversation ready for a reply has one answer fewer than user turns, "
                     f"not {len(answers)} for {len(user_turns)}")
  messages = []
  for i, text in enumerate(user_turns):
    messages.append({"role": "user", "content": text})
    if i < len(answers):
      messages.append({"role": "assistant", "content": answers[i]})
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
