"""FasterDecoding's published Medusa heads, as `--draft=medusa:PATH` reads them.

A folder holds `config.json` (MedusaConfig: `medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.safetensors`, the state dict of its heads:
head k is `k.0` .. `k.{L-1}` residual blocks (`k.l.linear.weight` [E, E], `.bias` [E]) then
`k.L.weight` [V, E], its own output matrix over the target's vocabulary. (Medusa's code applies
one block object L times, so a saved head holds L equal copies; each is read as it is.) Some
exports prefix every name with `medusa_head.`.

The older releases ship `medusa_lm_head.pt`, a pickle: it is never opened at run time, since
unpickling runs code; `python -m launch.convert --medusa=PATH` rewrites it as safetensors.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors

from hitree_jax.errors import UsageError
from hitree_jax.heads import published

CONFIG = "config.json"
WEIGHTS = "medusa_lm_head.safetensors"
PICKLES = ("medusa_lm_head.pt", "medusa_lm_head.bin")
CHECKED = ("hidden_size", "target_vocab_size")   # what its shapes say of the target it was trained for


def rewrite_pickle(folder: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  """Rewrites a Medusa folder's pickled heads as out/WEIGHTS (config.json copied; needs torch)."""
  return published.rewrite_pickle(folder, out, kind="medusa", weights=WEIGHTS, config=CONFIG,
                                  pickles=PICKLES, marks="medusa_num_heads")


def read_meta(folder: pathlib.Path) -> dict:
  """heads.json's fields for published heads, from config.json and the tensors' shapes alone."""
  folder = pathlib.Path(folder)
  config = json.loads((folder / CONFIG).read_text())
  weights = published.weights_file(folder, WEIGHTS, CONFIG, PICKLES, "medusa")
  heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
  with safetensors.safe_open(weights, framework="numpy") as f:
    prefix = "medusa_head." if any(k.startswith("medusa_head.") for k in f.keys()) else ""
    name = f"{prefix}0.{layers}.weight"
    if name not in f.keys():
      raise UsageError(f"{weights} lacks {name} (config.json: {heads} heads of {layers} blocks)")
    vocab, hidden = f.get_slice(name).get_shape()
  return {"kind": "medusa", "format": "medusa", "medusa_heads": heads, "medusa_layers": layers,
          "hidden_size": int(hidden), "target_vocab_size": int(vocab), "vocab_size": None,
          "checked": list(CHECKED), "base_model": config.get("base_model_name_or_path")}


def load_params(folder: pathlib.Path, meta: dict) -> dict:
  """{"blocks" [K, L, E, E] (kernels: in, out), "bias" [K, L, E], "heads" [K, E, V]}, float32:
  every tensor accounted for, a missing or unexpected one named with the file."""
  weights = pathlib.Path(folder) / WEIGHTS
  k_heads, layers = meta["medusa_heads"], meta["medusa_layers"]
  e, v = meta["hidden_size"], meta["target_vocab_size"]
  with published.Tensors(weights) as tensors:
    tensors.prefix = "medusa_head." if any(n.startswith("medusa_head.") for n in tensors.names) else ""
    take = tensors.take
    blocks = [[take(f"{k}.{l}.linear.weight", (e, e)).T for l in range(layers)] for k in range(k_heads)]
    bias = [[take(f"{k}.{l}.linear.bias", (e,)) for l in range(layers)] for k in range(k_heads)]
    heads = [take(f"{k}.{layers}.weight", (v, e)).T for k in range(k_heads)]
    tensors.finish(f"these {k_heads} heads of {layers} blocks do not use")
  return {"blocks": np.ascontiguousarray(np.stack([np.stack(b) for b in blocks])),
          "bias": np.stack([np.stack(b) for b in bias]),
          "heads": np.ascontiguousarray(np.stack(heads))}
