"""Published DFlash drafts (heads/dflash.py), as `--draft=dflash:PATH` reads them, in two formats.

z-lab's: a folder holds `config.json`, a Qwen3 config of the draft's layers (`num_hidden_layers`
of them, at the target's width and vocabulary) with `block_size`, `num_target_layers` and a
`dflash_config` of `mask_token_id` and `target_layer_ids`, and `model.safetensors`: `fc.weight`
[E, nE], `hidden_norm.weight`, `norm.weight` and each layer's as a Qwen3 decoder layer names
them (`layers.i.self_attn.q_proj.weight`, `.q_norm.weight`, `layers.i.mlp.gate_proj.weight`,
...). The embedding and the LM head are the target's.

vLLM's speculators (`speculators_model_type: dflash`, what its converter writes from z-lab's):
the same tensors, the Qwen3 config as `transformer_layer_config`, `block_size` and
`mask_token_id` at the top, and the tapped layers as `aux_hidden_state_layer_ids`, counted from
the embedding (the output of layer i is its i + 1: z-lab's i).

What this module does not implement (DFlash2's convolutions and candidate selector,
sliding-window layers, a logit multiplier or soft cap, a scaled input embedding, speculators'
reduced draft vocabulary or drafting from the anchor) is refused in one line, naming it.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from hitree_jax.errors import UsageError
from hitree_jax.heads import published
from hitree_jax.heads.dflash import BlockSpec
from hitree_jax.model.config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CHECKED = ("hidden_size", "target_vocab_size", "num_layers")


def _setting(hf: dict, name: str, default=None):
  return hf["dflash_config"].get(name, hf.get(name, default))


def _from_speculators(hf: dict, where: str) -> dict:
  """A speculators DFlash config.json as z-lab's: the Qwen3 layers' config with its DFlash fields."""
  layer = dict(hf["transformer_layer_config"])
  if hf.get("sample_from_anchor"):
    raise UsageError(f"{where}: sample_from_anchor=true (drafting from the anchor too) is not supported")
  if hf.get("draft_vocab_size", layer.get("vocab_size")) != layer.get("vocab_size"):
    raise UsageError(f"{where}: a reduced draft vocabulary (draft_vocab_size={hf['draft_vocab_size']} of "
                     f"{layer.get('vocab_size')}) is not supported")
  aux = hf.get("aux_hidden_state_layer_ids")
  return {**layer, "block_size": hf.get("block_size"),
          "dflash_config": {"mask_token_id": hf.get("mask_token_id"),
                            "target_layer_ids": None if aux is None else [int(i) - 1 for i in aux]}}


def read_meta(folder: pathlib.Path) -> dict:
  """heads.json's fields for a DFlash folder, from its config.json alone."""
  folder = pathlib.Path(folder)
  hf = json.loads((folder / CONFIG).read_text())
  where = f"{folder / CONFIG}"
  speculators = hf.get("speculators_model_type") == "dflash"
  if speculators:
    hf = _from_speculators(hf, where)
  if "DFlash2DraftModel" in hf.get("architectures", ()) or "conv_kernel_size" in hf["dflash_config"]:
    raise UsageError(f"{where}: DFlash2 (its convolutions and candidate selector) is not supported")
  for name, plain in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
    if _setting(hf, name, plain) not in (plain, 0, 0.0):
      raise UsageError(f"{where}: {name}={_setting(hf, name)} is not supported")
  if "sliding_attention" in (hf.get("layer_types") or ()):
    raise UsageError(f"{where}: sliding-window layers are not supported")
  if _setting(hf, "mask_token_id") is None or _setting(hf, "target_layer_ids") is None:
    raise UsageError(f"{where}: lacks mask_token_id or the target's layers it reads (z-lab's "
                     "dflash_config.target_layer_ids, speculators' aux_hidden_state_layer_ids)")
  draft = ModelConfig.from_hf({**hf, "model_type": "qwen3", "use_sliding_window": False}, source=where)
  return {"kind": "dflash", "format": "speculators" if speculators else "dflash", "hidden_size": draft.hidden_size,
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
  weights = published.weights_file(pathlib.Path(folder), WEIGHTS, CONFIG, (), "dflash")
  c = ModelConfig.from_dict(meta["draft_config"])
  e, n = c.hidden_size, len(meta["target_layer_ids"])
  with published.Tensors(weights) as tensors:
    tensors.prefix = "model." if "model.fc.weight" in tensors.names else ""
    layers = tuple(published.decoder_layer(tensors, f"layers.{i}.", c, e) for i in range(c.num_layers))
    params = {"fc": np.ascontiguousarray(tensors.take("fc.weight", (e, n * e)).T),
              "hidden_norm": tensors.take("hidden_norm.weight", (e,)),
              "norm": tensors.take("norm.weight", (e,)), "layers": layers}
    tensors.finish("this DFlash draft does not use")
  return params
