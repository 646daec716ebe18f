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

from hitree_jax.errors import NotFound
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
  return ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text())).replace(dtype=dtype)


def load_checkpoint(path: str | pathlib.Path, dtype: str = "float32"):
  """(config, params as numpy float32) from a folder written by `save_checkpoint`."""
  path = pathlib.Path(path).resolve()
  config = read_config(path, dtype)
  params = ocp.StandardCheckpointer().restore(path / "params")
  return config, jax.tree.map(np.asarray, params)
