"""Converted parameters as an orbax checkpoint: restoring skips dequantization and renaming.

Layout of a checkpoint folder:
  hitree_config.json   ModelConfig.to_dict()
  params/              orbax StandardCheckpointer tree (float32)
  tokenizer/           the HF tokenizer, saved alongside so the folder stands alone
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from hitree_jax.errors import NotFound, UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import without_decode_head

CONFIG_FILE = "hitree_config.json"


def is_checkpoint(path: str | pathlib.Path) -> bool:
  return (pathlib.Path(path) / CONFIG_FILE).is_file()


def save_checkpoint(path: str | pathlib.Path, config: ModelConfig, params, tokenizer=None) -> None:
  path = pathlib.Path(path).resolve()
  path.mkdir(parents=True, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  params = without_decode_head(params, config)  # load_model adds it back
  checkpointer.save(path / "params", jax.tree.map(np.asarray, params), force=True)
  checkpointer.wait_until_finished()
  (path / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path / "tokenizer"))


def read_config(path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
  path = pathlib.Path(path).resolve()
  if not is_checkpoint(path):
    raise NotFound(f"{path}: not a hitree_jax checkpoint (no {CONFIG_FILE})")
  try:
    return ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text())).replace(dtype=dtype)
  except (ValueError, TypeError) as e:   # cut JSON, or fields that are not a config's
    raise UsageError(f"{path / CONFIG_FILE}: not a whole config ({type(e).__name__}: {e})") from None


def restore(folder: pathlib.Path):
  """The tree orbax saved in `folder`; a missing, cut or corrupt one is one line naming it."""
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(pathlib.Path(folder).absolute())
  except Exception as e:  # orbax and tensorstore raise many kinds; each means the same here
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise UsageError(f"{folder}: not a whole orbax checkpoint ({type(e).__name__}: {first})") from None


def load_checkpoint(path: str | pathlib.Path, dtype: str = "float32"):
  """(config, params as numpy float32) from a folder written by `save_checkpoint`."""
  path = pathlib.Path(path).resolve()
  config = read_config(path, dtype)
  return config, jax.tree.map(np.asarray, restore(path / "params"))
