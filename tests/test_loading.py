"""Weight sources: HF safetensors folders (one or several files), orbax round trip, configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from hitree_jax.config import ModelConfig
from hitree_jax.kv_cache import KVCache, causal_attend
from hitree_jax.loading import load_model
from hitree_jax.loading.checkpoint import load_checkpoint, save_checkpoint
from hitree_jax.loading.gguf import unpermute_rope_rows
from hitree_jax.model import forward


def tiny_hf(tied):
  torch.manual_seed(1)
  config = transformers.LlamaConfig(
      vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
      tie_word_embeddings=tied, rope_theta=5e4)
  return transformers.LlamaForCausalLM(config).eval()


def our_logits(model, tokens):
  n = len(tokens)
  cache = KVCache.init(model.config, 1, n)
  logits, _, _ = forward(model.params, model.config, jnp.asarray([tokens]), jnp.arange(n)[None],
                         cache, causal_attend(cache.lengths, n, n))
  return np.asarray(logits[0])


@pytest.mark.parametrize("tied,shard", [(True, None), (False, "200KB")])
def test_safetensors_folder_matches_transformers(tmp_path, tied, shard):
  hf = tiny_hf(tied)
  kwargs = {"max_shard_size": shard} if shard else {}
  hf.save_pretrained(tmp_path, **kwargs)
  n_files = len(list(tmp_path.glob("*.safetensors")))
  assert (n_files == 1) if shard is None else (n_files > 1)
  model = load_model(str(tmp_path))
  assert model.config.tie_word_embeddings == tied and model.config.rope_theta == 5e4
  tokens = list(np.random.default_rng(0).integers(0, 67, 40))
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)


def test_orbax_round_trip_is_exact(tmp_path):
  hf = tiny_hf(False)
  hf.save_pretrained(tmp_path / "hf")
  model = load_model(str(tmp_path / "hf"))
  save_checkpoint(tmp_path / "ckpt", model.config, model.params)
  config, params = load_checkpoint(tmp_path / "ckpt")
  assert config == model.config
  for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), b)
  restored = load_model(str(tmp_path / "ckpt"))
  tokens = [1, 5, 9, 2]
  np.testing.assert_array_equal(our_logits(restored, tokens), our_logits(model, tokens))


def test_bfloat16_parameters_run_close_to_float32(tmp_path):
  hf = tiny_hf(True)
  hf.save_pretrained(tmp_path)
  f32, bf16 = load_model(str(tmp_path)), load_model(str(tmp_path), dtype="bfloat16")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
  tokens = list(range(3, 40))
  a, b = our_logits(f32, tokens), our_logits(bf16, tokens)
  assert b.dtype == np.float32 and np.isfinite(b).all()
  assert np.abs(a - b).max() < 0.05 * np.abs(a).max() + 0.05


def test_unpermute_inverts_llama_cpp_permutation():
  # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
  def permute(w, n_head):
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  w = np.random.default_rng(0).standard_normal((3 * 8, 5))
  np.testing.assert_array_equal(unpermute_rope_rows(permute(w, 3), 3), w)
  assert not np.array_equal(permute(w, 3), w)


def test_unsupported_rope_scaling_is_named():
  hf = tiny_hf(True).config.to_dict()
  hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
  with pytest.raises(ValueError, match="'yarn'"):
    ModelConfig.from_hf(hf)


def test_config_round_trips_through_json():
  config = ModelConfig.from_hf({**tiny_hf(True).config.to_dict(),
                                "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
  assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  hash(config)  # static under jit
