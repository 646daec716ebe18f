"""Helpers that several test modules share (imported from here, never from another test file)."""

import pathlib

import jax


def peaked(config, seed: int) -> dict:
  """Random weights, the matrices scaled 4x so that greedy decoding meets no near-ties (the two
  best logits far apart), so a speculative method's tokens equal ar's on every machine."""
  from hitree_jax.model.llama import init_params
  params = init_params(config, jax.random.key(seed))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)


def tiny_model_gguf(path: pathlib.Path, max_positions: int = 1024) -> pathlib.Path:
  """A one-layer random model with SmolLM2's tokenizer and chat template, written to `path`: for
  launcher tests of what does not depend on the model's size (it compiles in seconds, SmolLM2's
  30 layers in a minute)."""
  from hitree_jax.loading import resolve
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.model.config import ModelConfig
  config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, max_position_embeddings=max_positions)
  return save_gguf(path, config, peaked(config, 0), quantize=False, tokenizer_from=resolve("smollm2"))
