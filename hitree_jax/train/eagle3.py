"""Training an EAGLE-3 draft (heads/eagle3.py) in JAX, as its authors train it: along chains.

An EAGLE-3 draft reads three of its target's layers (fused by `fc`) and drafts with its own
`lm_head` over a draft vocabulary. Training feeds it the target's states and teaches it, at
once, every depth of a chain (the authors' "training-time test"): step 0 reads, at position p,
token x_p and the fused states of p-1 and predicts x_{p+1}; step k reads token x_{p+k} and the
state step k-1 made at p, attending to the prefix (step 0's slots up to p) and to its own
earlier steps, and predicts x_{p+k+1}. That is what a chain rooted at p drafts, with the true
tokens fed in (teacher forcing):

  slots of step k (k*T .. k*T+T-1);  index p of step k attends  slot s < T with s <= p,
                                                                 and slot j*T + p for 1 <= j <= k

Loss: the cross-entropy of each step's distribution to the teacher's top-k at that position,
weighted decay^k. The embedding is the target's (frozen); `fc`, the layer, `norm` and `lm_head`
train; `lm_head` starts as the target's head on the draft's ids. The trained draft is written in
vLLM's speculators format (train/speculators.py), which this library and vLLM both load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache
from hitree_jax.errors import UsageError
from hitree_jax.heads import eagle, eagle3, published
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import ReducedVocab
from hitree_jax.train.heads import token_cross_entropy


def default_aux_layers(target: ModelConfig) -> tuple[int, ...]:
  """EAGLE-3's default: the inputs of layers 2, L/2 and L-3 (our taps: the outputs one below);
  a target too shallow for three distinct ones is refused, naming them."""
  n = target.num_layers
  aux = (2, n // 2, n - 3)
  if not 2 <= aux[1] < aux[2]:
    raise UsageError(f"EAGLE-3's default layers (the inputs of 2, L/2, L-3) are {aux} for a {n}-layer "
                     "target: not three distinct layers in order; name the ones to read")
  return aux


def layer_config(target: ModelConfig) -> ModelConfig:
  """The draft layer's shape: the target's width, heads and RoPE, one layer, no attention biases
  (a Llama layer, or a Qwen3 one with its per-head norms for a Qwen3 target)."""
  return target.replace(num_layers=1, qkv_bias=False, o_bias=False)


def init_params(target: ModelConfig, target_params, vocab: ReducedVocab, key, aux: int = 3,
                scale: float = 0.02) -> dict:
  """heads/eagle3.load's layout (kernels [in, out]), float32: random `fc` and layer (normal,
  `scale`; the norms ones), `lm_head` the target's head on the draft's ids (OTHER dropped)."""
  config, e = layer_config(target), target.hidden_size
  fc_key, layer_key = jax.random.split(key)
  layer = published.random_layer(config, 2 * e, layer_key, scale, eagle3.FIRST_LAYER_NORMS)
  head = eagle.head_from_target(target_params, vocab.target_ids[1:])
  return {"fc": scale * jax.random.normal(fc_key, (aux * e, e), jnp.float32),
          "norm": jnp.ones((e,), jnp.float32), "layers": (layer,),
          "lm_head": jnp.asarray(head, jnp.float32)}


def chain_attend(t: int, steps: int, step: int):
  """[T, steps*T] bool: what index p of `step` attends (the module docstring's slots)."""
  slot, p = np.arange(steps * t)[None, :], np.arange(t)[:, None]
  return ((slot < t) & (slot <= p)) | ((slot >= t) & (slot % t == p) & (slot < (step + 1) * t))


def chain_logits(net: eagle3.Eagle3Net, params, config: ModelConfig, embedding, tokens, features,
                 steps: int, reduced: bool = True) -> list:
  """Each step's logits [B, T, V'] (reduced: OTHER first, at -inf) over windows tokens [B, T]
  with the target's features [B, T, (aux+1)E] (its tapped layers, then its final states): at
  index p, step k's logits are the draft's distribution of x_{p+k+1}."""
  b, t = tokens.shape
  cache = KVCache.init(config, b, steps * t)
  state, fed, out = eagle.shifted(net.fuse(params, features)), tokens, []
  for k in range(steps):
    attend = jnp.broadcast_to(chain_attend(t, steps, k), (b, t, steps * t))
    positions = jnp.broadcast_to(jnp.arange(t) + k, (b, t))
    state, cache = net.features(params, config, embedding, fed, state, positions, cache, attend,
                                write_at=jnp.full((b,), k * t, jnp.int32))
    out.append(net.logits(params, state, reduced))
    fed = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))   # the true next tokens
  return out


@functools.lru_cache(maxsize=None)
def objective(net: eagle3.Eagle3Net, config: ModelConfig, steps: int = 3, decay: float = 0.8):
  """loss(params, frozen, tokens [B,T], features [B,T,(aux+1)E], ids [B,T,k] draft ids,
  probs [B,T,k]) -> (loss, step 0's top-1 agreement); one object per setting (jit-static)."""

  def loss(params, frozen, tokens, features, ids, probs):
    every = chain_logits(net, params, config, frozen["embedding"], tokens, features.astype(jnp.float32), steps)
    total = 0.0
    for k, logits in enumerate(every):   # step k at p guesses x_{p+k+1}: the labels of p + k
      t = tokens.shape[1] - k
      total = total + decay ** k * token_cross_entropy(logits[:, :t], ids[:, k:], probs[:, k:]).mean()
    agree = jnp.mean(jnp.argmax(every[0], axis=-1) == ids[..., 0])
    return total, agree

  return loss
