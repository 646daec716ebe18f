"""Hugging Face Llama weights -> our parameter tree.

`params_from_state_dict` is the single place that knows HF's tensor names; the
safetensors and GGUF loaders both produce an HF-named state dict and go
through it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Mapping

import numpy as np
import safetensors.numpy

from hitree_jax.errors import NotFound, UsageError
from hitree_jax.model.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def params_from_state_dict(state: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
  """HF names -> nested params; linear weights [out, in] become kernels [in, out]."""
  dtype = np.dtype("float32")  # converted on the device to config.dtype (numpy has no bfloat16)
  missing = []

  def take(name, transpose=False):
    if name not in state:
      missing.append(name)
      return None
    w = np.asarray(state[name], dtype=dtype)
    return np.ascontiguousarray(w.T) if transpose else w

  params = {"embed_tokens": {"embedding": take("model.embed_tokens.weight")},
            "norm": {"weight": take("model.norm.weight")}}
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    params[f"layers_{i}"] = {
        "self_attn": {n: {"kernel": take(p + f"self_attn.{n}.weight", True)} for n in _ATTN},
        "mlp": {n: {"kernel": take(p + f"mlp.{n}.weight", True)} for n in _MLP},
        "input_layernorm": {"weight": take(p + "input_layernorm.weight")},
        "post_attention_layernorm": {"weight": take(p + "post_attention_layernorm.weight")},
    }
  if not config.tie_word_embeddings:
    params["lm_head"] = {"kernel": take("lm_head.weight", True)}
  if missing:
    raise UsageError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
  return params


def read_config(path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
  """The config of an HF folder, from its config.json."""
  config_file = pathlib.Path(path) / "config.json"
  if not config_file.is_file():
    raise NotFound(f"{path}: no config.json (expected an HF model folder)")
  hf_config = json.loads(config_file.read_text())
  if "tie_word_embeddings" not in hf_config:
    hf_config["tie_word_embeddings"] = False
  return ModelConfig.from_hf(hf_config, dtype=dtype)


def load_safetensors_dir(path: str | pathlib.Path, dtype: str = "float32"):
  """(config, params) from an HF folder: config.json + one or several *.safetensors."""
  folder = pathlib.Path(path)
  config = read_config(folder, dtype)
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise NotFound(f"{folder}: no *.safetensors files")
  state = {}
  for f in files:
    state.update(safetensors.numpy.load_file(str(f)))
  if config.tie_word_embeddings:
    state.pop("lm_head.weight", None)
  return config, params_from_state_dict(state, config)
