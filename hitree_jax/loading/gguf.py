"""GGUF (llama.cpp) Llama weights, dequantized to float32 with the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k from HF's
rotate-half RoPE layout into interleaved pairs; we undo that here so the model
keeps a single (HF) RoPE layout. Parity with transformers' own GGUF loading is
tested in tests/test_smollm2.py.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np

from hitree_jax.config import ModelConfig
from hitree_jax.loading.hf import params_from_state_dict

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}

# Metadata we read; tokenizer vocab arrays are skipped (the tokenizer module reads them).
_SKIPPED_PREFIX = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: interleaved RoPE rows -> rotate-half rows. w [out, in]."""
  out = w.shape[0]
  return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader: gguf.GGUFReader) -> dict:
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith(_SKIPPED_PREFIX) or key.startswith("GGUF."):
      continue
    meta[key] = field.contents()
  return meta


def hf_name(gguf_name: str) -> str | None:
  base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
  if base.startswith("blk."):
    _, layer, kind = base.split(".", 2)
    mapped = _LAYER_NAMES.get(kind)
    return mapped and f"model.layers.{layer}.{mapped}.{suffix}"
  mapped = _GLOBAL_NAMES.get(base)
  return mapped and f"{mapped}.{suffix}"


def load_gguf(path: str | pathlib.Path, dtype: str = "float32"):
  """(config, params) from a GGUF file of architecture `llama`."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  reader = gguf.GGUFReader(str(path))
  tensor_names = {t.name for t in reader.tensors}
  config = ModelConfig.from_gguf_metadata(
      read_metadata(reader), dtype=dtype, tied="output.weight" not in tensor_names)
  state = {}
  for tensor in reader.tensors:
    name = hf_name(tensor.name)
    if name is None:
      continue  # e.g. rope_freqs: recomputed from the config
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    w = w.reshape(tuple(reversed([int(d) for d in tensor.shape])))  # ggml order -> [out, in]
    if name.endswith("q_proj.weight"):
      w = unpermute_rope_rows(w, config.num_heads)
    elif name.endswith("k_proj.weight"):
      w = unpermute_rope_rows(w, config.num_kv_heads)
    state[name] = w
  return config, params_from_state_dict(state, config)
