"""Writing a draft trained here in vLLM's `speculators` format, which vLLM and SGLang serve.

A speculators folder is config.json (`speculators_model_type`, the draft layer's own config as
`transformer_layer_config`, what it reads of its target, and `speculators_config`: its proposal
and its verifier) beside model.safetensors in HF's names (kernels [out, in]). The readers are
heads/eagle3.py and heads/dflash_format.py; tests check that speculators' own classes load what
this writes and compute the same logits. The target's embedding is not written: every reader
takes it from the verifier.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.numpy

from hitree_jax.heads import dflash_format, eagle3, published
from hitree_jax.heads.dflash import BlockSpec
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import ReducedVocab

VERSION = "0.9.0"   # the speculators release whose format this writes (requirements-reference.txt)


def hf_config(config: ModelConfig) -> dict:
  """A transformers config.json dict of a Llama (or, with per-head norms, Qwen3) of `config`'s shape."""
  qwen3 = config.qk_norm
  rope = {"rope_type": "default", **config.rope_scaling_dict, "rope_theta": config.rope_theta}
  return {"architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
          "model_type": "qwen3" if qwen3 else "llama", "vocab_size": config.vocab_size,
          "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
          "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
          "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
          "max_position_embeddings": config.max_position_embeddings, "rope_parameters": rope,
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
          "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}


def _verifier(target_path: str | None, target: ModelConfig) -> dict:
  """The verifier: its name as the format's readers load it (an HF id or folder; None unknown)."""
  return {"name_or_path": None if target_path is None else str(target_path),
          "architectures": ["Qwen3ForCausalLM" if target.qk_norm else "LlamaForCausalLM"]}


def write_eagle3(folder, params, target: ModelConfig, vocab: ReducedVocab, aux_layers, target_path: str | None,
                 speculative_tokens: int = 3) -> pathlib.Path:
  """An EAGLE-3 draft (heads/eagle3.load's layout, float32) as a speculators folder: its layers
  after `layer_config`'s shape, its vocabulary as d2t (draft id -> target id - draft id) and t2d
  (a target id's membership), aux_layers the target layers whose inputs it reads."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  layers = params["layers"]
  layer = hf_config(target.replace(num_layers=len(layers)))
  ids = np.asarray(vocab.target_ids[1:], np.int64)   # OTHER (draft id 0 here) is not a draft token
  config = {
      "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
      "speculators_version": VERSION, "transformer_layer_config": layer, "draft_vocab_size": int(ids.size),
      "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layers], "norm_before_residual": False,
      "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
      "target_hidden_size": None, "tie_word_embeddings": False,
      "speculators_config": {
          "algorithm": "eagle3", "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                "accept_tolerance": 0.0, "verifier_accept_k": 1}],
          "verifier": _verifier(target_path, target)}}
  tensors = {"fc.weight": np.ascontiguousarray(np.asarray(params["fc"], np.float32).T),
             "norm.weight": np.asarray(params["norm"], np.float32),
             "lm_head.weight": np.ascontiguousarray(np.asarray(params["lm_head"], np.float32).T),
             "d2t": ids - np.arange(ids.size), "t2d": np.isin(np.arange(target.vocab_size), ids)}
  for i, one in enumerate(layers):
    tensors.update(published.layer_tensors(_as_float32(one), f"layers.{i}.",
                                           eagle3.FIRST_LAYER_NORMS if i == 0 else None))
  safetensors.numpy.save_file(tensors, str(folder / eagle3.WEIGHTS))
  (folder / eagle3.CONFIG).write_text(json.dumps(config, indent=2))
  return folder


def write_dflash(folder, params, target: ModelConfig, spec: BlockSpec,
                 target_path: str | None) -> pathlib.Path:
  """A DFlash draft (heads/dflash.py's layout, float32; the target's head is not written) as a
  speculators folder: Qwen3 layers of the target's width, the block, its mask token, and the
  target layers it reads (speculators counts a layer's output as the next one's input: +1)."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  layers = params["layers"]
  layer = {**hf_config(target.replace(num_layers=len(layers), qk_norm=True)), "use_sliding_window": False,
           "layer_types": ["full_attention"] * len(layers)}
  config = {
      "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": VERSION,
      "transformer_layer_config": layer, "draft_vocab_size": target.vocab_size, "block_size": spec.block_size,
      "aux_hidden_state_layer_ids": [int(i) + 1 for i in spec.target_layer_ids],
      "mask_token_id": int(spec.mask_token_id), "sample_from_anchor": False, "sliding_window_non_causal": False,
      "target_hidden_size": None, "tie_word_embeddings": False,
      "speculators_config": {
          "algorithm": "dflash", "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1,
                                "accept_tolerance": 0.0, "verifier_accept_k": 1}],
          "verifier": _verifier(target_path, target)}}
  tensors = {"fc.weight": np.ascontiguousarray(np.asarray(params["fc"], np.float32).T),
             "hidden_norm.weight": np.asarray(params["hidden_norm"], np.float32),
             "norm.weight": np.asarray(params["norm"], np.float32)}
  for i, one in enumerate(layers):
    tensors.update(published.layer_tensors(_as_float32(one), f"layers.{i}."))
  safetensors.numpy.save_file(tensors, str(folder / dflash_format.WEIGHTS))
  (folder / dflash_format.CONFIG).write_text(json.dumps(config, indent=2))
  return folder


def _as_float32(tree: dict) -> dict:
  """A layer's arrays as float32 numpy."""
  return {key: np.asarray(value, np.float32) for key, value in tree.items()}
