"""z-lab's published DFlash drafts (heads/dflash.py), as `--draft=dflash:PATH` reads them.

A folder holds `config.json`, a Qwen3 config of the draft's layers (`num_hidden_layers` of them,
at the target's width and vocabulary) with `block_size`, `num_target_layers` and a
`dflash_config` of `mask_token_id` and `target_layer_ids`, and `model.safetensors`: `fc.weight`
[E, nE], `hidden_norm.weight`, `norm.weight` and each layer's as a Qwen3 decoder layer names
them (`layers.i.self_attn.q_proj.weight`, `.q_norm.weight`, `layers.i.mlp.gate_proj.weight`,
...). The embedding and the LM head are the target's. What this module does not implement
(DFlash2's convolutions and candidate selector, sliding-window layers, a logit multiplier or
soft cap, a scaled input embedding) is refused in one line, naming it.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors

from hitree_jax.errors import UsageError
from hitree_jax.heads.dflash import BlockSpec
from hitree_jax.model.config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CHECKED = ("hidden_size", "target_vocab_size", "num_layers")
_LAYER = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_LAYER_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "input_norm": "input_layernorm",
                "post_norm": "post_attention_layernorm"}


def is_folder(folder: pathlib.Path) -> bool:
  """Whether `folder` holds a DFlash draft (its config.json has a dflash_config)."""
  try:
    return "dflash_config" in json.loads((pathlib.Path(folder) / CONFIG).read_text())
  except (OSError, ValueError):
    return False


def _setting(hf: dict, name: str, default=None):
  return hf["dflash_config"].get(name, hf.get(name, default))


def read_meta(folder: pathlib.Path) -> dict:
  """heads.json's fields for a DFlash folder, from its config.json alone."""
  folder = pathlib.Path(folder)
  hf = json.loads((folder / CONFIG).read_text())
  where = f"{folder / CONFIG}"
  if "DFlash2DraftModel" in hf.get("architectures", ()) or "conv_kernel_size" in hf["dflash_config"]:
    raise UsageError(f"{where}: DFlash2 (its convolutions and candidate selector) is not supported")
  for name, plain in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
    if _setting(hf, name, plain) not in (plain, 0, 0.0):
      raise UsageError(f"{where}: {name}={_setting(hf, name)} is not supported")
  if "sliding_attention" in (hf.get("layer_types") or ()):
    raise UsageError(f"{where}: sliding-window layers are not supported")
  if _setting(hf, "mask_token_id") is None or _setting(hf, "target_layer_ids") is None:
    raise UsageError(f"{where}: dflash_config lacks mask_token_id or target_layer_ids")
  draft = ModelConfig.from_hf({**hf, "model_type": "qwen3", "use_sliding_window": False}, source=where)
  return {"kind": "dflash", "format": "dflash", "hidden_size": draft.hidden_size,
          "target_vocab_size": draft.vocab_size, "num_layers": hf.get("num_target_layers"),
          "checked": [k for k in CHECKED if k != "num_layers" or hf.get("num_target_layers")],
          "block_size": int(_setting(hf, "block_size", 16)),
          "mask_token_id": int(_setting(hf, "mask_token_id")),
          "target_layer_ids": [int(i) for i in _setting(hf, "target_layer_ids")],
          "draft_config": draft.to_dict()}


def spec(meta: dict) -> BlockSpec:
  return BlockSpec(meta["block_size"], meta["mask_token_id"], tuple(meta["target_layer_ids"]))


def load_params(folder: pathlib.Path, meta: dict) -> dict:
  """The draft's parameters (heads/dflash.py's layout), float32, every tensor checked: a missing,
  misshapen or unused one is named with the file."""
  weights = pathlib.Path(folder) / WEIGHTS
  if not weights.is_file():
    raise UsageError(f"{folder}: no {WEIGHTS} beside its {CONFIG}")
  c = ModelConfig.from_dict(meta["draft_config"])
  e, n = c.hidden_size, len(meta["target_layer_ids"])
  q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  linear = {"q": (q_width, e), "k": (kv_width, e), "v": (kv_width, e), "o": (e, q_width),
            "gate": (c.intermediate_size, e), "up": (c.intermediate_size, e), "down": (e, c.intermediate_size)}
  with safetensors.safe_open(weights, framework="numpy") as f:
    names = set(f.keys())
    prefix = "model." if "model.fc.weight" in names else ""
    used = set()

    def take(name, shape):
      name = prefix + name
      if name not in names:
        raise UsageError(f"{weights} lacks {name}")
      found = tuple(f.get_slice(name).get_shape())
      if found != shape:
        raise UsageError(f"{weights}: {name} has shape {found}, expected {shape}")
      used.add(name)
      return np.asarray(f.get_tensor(name), np.float32)

    layers = []
    for i in range(c.num_layers):
      layer = {key: np.ascontiguousarray(take(f"layers.{i}.{name}.weight", linear[key]).T)
               for key, name in _LAYER.items()}
      if c.qkv_bias:
        layer |= {f"{key}_bias": take(f"layers.{i}.{_LAYER[key]}.bias", (linear[key][0],)) for key in "qkvo"}
      layer |= {key: take(f"layers.{i}.{name}.weight", (c.head_dim if key in ("q_norm", "k_norm") else e,))
                for key, name in _LAYER_NORMS.items()}
      layers.append(layer)
    params = {"fc": np.ascontiguousarray(take("fc.weight", (e, n * e)).T),
              "hidden_norm": take("hidden_norm.weight", (e,)), "norm": take("norm.weight", (e,)),
              "layers": tuple(layers)}
  unused = sorted(names - used)
  if unused:
    raise UsageError(f"{weights}: {unused[0]}: a tensor this DFlash draft does not use")
  return params
