"""Parity of our Flax Llama with transformers' PyTorch LlamaForCausalLM (tiny random configs)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.loading.hf import params_from_state_dict
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward

ROPE_SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def tiny_hf_model(num_kv_heads, tied, rope_scaling, seed=0):
  torch.manual_seed(seed)
  hf_config = transformers.LlamaConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
      max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
      tie_word_embeddings=tied, rope_scaling=rope_scaling)
  model = transformers.LlamaForCausalLM(hf_config).eval()
  # Random init leaves norms at 1; perturb so a swapped norm would show.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model


def to_ours(model):
  config = ModelConfig.from_hf(model.config.to_dict())
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  return config, params_from_state_dict(state, config)


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
@pytest.mark.parametrize("num_kv_heads,tied", [(2, True), (4, False), (1, False)])
def test_logits_match_transformers(num_kv_heads, tied, rope):
  model = tiny_hf_model(num_kv_heads, tied, ROPE_SCALINGS[rope])
  config, params = to_ours(model)
  assert config.tie_word_embeddings == tied
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 200))
  with torch.no_grad():
    expected = model(torch.tensor(tokens)).logits.numpy()
  cache = KVCache.init(config, 2, 256)
  positions = jnp.broadcast_to(jnp.arange(200), (2, 200))
  logits, _, _ = forward(params, config, jnp.asarray(tokens), positions, cache,
                         causal_attend(cache.lengths, 200, 256))
  np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-4, rtol=1e-4)
