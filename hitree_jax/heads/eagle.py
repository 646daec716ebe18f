"""EAGLE's feature draft: one decoder layer, autoregressive over the target's features.

The target's feature of position i is its final-normed hidden state there,
f_i, the vector its LM head turns into the distribution of token i+1. The
draft reads, at position i, the token x_i (through the target's own
embedding) together with f_{i-1}, and predicts f_i; the target's LM head,
restricted to the draft's vocabulary (vocab.py), turns that into the draft's
distribution of token i+1 (EAGLE, Li et al. 2024):

  f^_i = norm(layer(fc([embed(x_i), f_{i-1}])))     logits_{i+1} = f^_i @ head

On the committed sequence f_{i-1} is the target's true feature (the engine
hands it down from the verify forward); inside a round's tree a node reads
the feature its parent predicted. The draft's own cache therefore only ever
holds committed positions with true features: it keeps a round's pending
tokens and forgets the tree.

Only the layer, `fc` and the output norm are the draft's own (about 4.2M
parameters at SmolLM2's width); the embedding and the head are the target's
and are never saved with the draft.

EAGLE-3 (Li et al. 2025) lets the draft read more of the target than its last
states: the outputs of a low, a middle and a high layer (`taps`) beside them.
Such a draft's feature of a committed position is the target's tapped states
and final states side by side, [(len(taps) + 1) E], and `fuse` maps them to
the E-wide f_{i-1} the layer reads (each tap RMS-normalised and scaled, then a
linear map); a tree node still reads its parent's predicted f^, E-wide. The
map starts as the identity on the final states, so an untrained fusion is
exactly EAGLE, and training adds what the taps say.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.model.config import ModelConfig
from hitree_jax.cache.rope import rope_cos_sin
from hitree_jax.model.llama import DecoderLayer, RMSNorm, rope_inv_freq
from hitree_jax.model.vocab import mask_other

OWN = ("fc", "layer", "norm")  # the layer's parameters; "head" is the target's
TRAINED = (*OWN, "fuse")       # what training changes and a saved draft holds ("fuse": with taps)


def layer_config(target: ModelConfig, vocab_size: int) -> ModelConfig:
  """The draft's shape: the target's width and heads, one layer, the draft's vocabulary."""
  return target.replace(num_layers=1, vocab_size=vocab_size)


class EagleLayer(nn.Module):
  config: ModelConfig  # layer_config(...)

  @nn.compact
  def __call__(self, embedded, prev_features, positions, attend, k_buf, v_buf, write_at, context=()):
    """embedded, prev_features [B,T,E]; positions [B,T]; one layer's cache and context as Llama's."""
    c, dtype = self.config, jnp.dtype(self.config.dtype)
    x = nn.Dense(c.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype, name="fc")(
        jnp.concatenate([embedded, prev_features.astype(dtype)], axis=-1))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(c))
    x, k_buf, v_buf = DecoderLayer(c, name="layer")(x, cos, sin, attend, k_buf, v_buf, write_at, context)
    return RMSNorm(c.rms_norm_eps, dtype, name="norm")(x), k_buf, v_buf


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig) -> EagleLayer:
  return EagleLayer(config)


def init_params(config: ModelConfig, key, taps: int = 0) -> dict:
  """Random trainable parameters (fc, layer, norm) for a layer_config; with taps, also the
  fusion of that many tapped layers, started as the identity on the final states (`fuse`)."""
  e, dtype = config.hidden_size, jnp.dtype(config.dtype)
  cache = KVCache.init(config, 1, 1)
  ones = jnp.ones((1, 1, e), dtype)
  zero = jnp.zeros((1, 1), jnp.int32)
  params = dict(_module(config).init(key, ones, ones, zero, jnp.ones((1, 1, 1), bool), cache.keys[0],
                                     cache.values[0], cache.lengths)["params"])
  if taps:
    kernel = jnp.zeros(((taps + 1) * e, e), dtype).at[taps * e:].set(jnp.eye(e, dtype=dtype))
    params["fuse"] = {"scale": jnp.ones((taps, e), dtype), "kernel": kernel}
  return params


def fuse(params, features):
  """features [..., (k+1)E], k tapped layers' states then the final ones -> [..., E] the f_{i-1}
  the layer reads: the final states themselves for a draft without taps."""
  if "fuse" not in params:
    return features
  scale, kernel = params["fuse"]["scale"], params["fuse"]["kernel"]
  e = kernel.shape[1]
  x = features.astype(jnp.float32)
  parts = [x[..., i * e:(i + 1) * e] for i in range(scale.shape[0])]
  normed = [p * jax.lax.rsqrt(jnp.mean(p * p, axis=-1, keepdims=True) + 1e-6) * s
            for p, s in zip(parts, scale.astype(jnp.float32))]
  fused = jnp.dot(jnp.concatenate([*normed, x[..., len(parts) * e:]], axis=-1).astype(kernel.dtype), kernel)
  return fused.astype(features.dtype)


def head_from_target(target_params, target_ids: np.ndarray | None) -> jax.Array:
  """[E, V'] the target's output head (an `lm_head` kernel: with_decode_head) on the draft's ids."""
  kernel = target_params["lm_head"]["kernel"]
  return kernel if target_ids is None else kernel[:, np.maximum(np.asarray(target_ids), 0)]


def features(params, config: ModelConfig, embedding, tokens, prev_features, positions, cache: KVCache,
             attend, write_at=None, context: tuple[KVCache, ...] = ()):
  """The draft's predicted features [B,T,E] of tokens [B,T] (target ids) that follow the
  features prev_features [B,T,E]; writes their keys/values into `cache` (one layer) at
  write_at (default: its length) without committing them, like llama.hidden_states."""
  write_at = cache.lengths if write_at is None else write_at
  own = {name: params[name] for name in OWN}
  out, k, v = _module(config).apply(
      {"params": own}, jnp.take(embedding, tokens, axis=0), prev_features, positions, attend,
      cache.keys[0], cache.values[0], write_at, tuple((c.keys[0], c.values[0], c.lengths) for c in context))
  return out, cache.replace(keys=(k,), values=(v,))


def logits(params, predicted, reduced: bool):
  """[..., E] predicted features -> float32 logits [..., V'] (a reduced vocabulary's OTHER masked)."""
  out = jnp.dot(predicted, params["head"]).astype(jnp.float32)
  return mask_other(out) if reduced else out


def shifted(hidden):
  """[B,T,E] the target's features -> [B,T,E] the feature each position reads (f_{i-1}; 0 first)."""
  return jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))[:, :-1]


@dataclasses.dataclass(frozen=True)
class EagleNet:
  """How our EAGLE draft computes a position's state and its logits: this module's functions.
  heads/drafter.py's EagleDrafter runs any such `net` (heads/eagle3.py: published EAGLE-3)."""

  def fuse(self, params, hidden):
    return fuse(params, hidden)

  def features(self, *args, **kwargs):
    return features(*args, **kwargs)

  def logits(self, params, predicted, reduced: bool):
    return logits(params, predicted, reduced)


@functools.partial(jax.jit, static_argnums=(1, 7), donate_argnums=(3,))
def _prefill_chunk(params, config: ModelConfig, embedding, cache: KVCache, tokens, prev, start, net):
  """Runs prompt tokens [B, C] (prev: their f_{i-1} [B, C, E]) at slots start.., then appends them."""
  batch, chunk = tokens.shape
  cache = cache.replace(lengths=jnp.full((batch,), start, jnp.int32))
  own = KVCache.init(config, batch, chunk)
  positions = start + jnp.broadcast_to(jnp.arange(chunk), (batch, chunk))
  _, own = net.features(params, config, embedding, tokens, prev, positions, own,
                        causal_attend(own.lengths, chunk, chunk), context=(cache,))
  return cache.append(own.advance(chunk))


def prefill(params, config: ModelConfig, embedding, cache: KVCache, tokens: np.ndarray, hidden,
            lengths, chunk: int, programs, net=EagleNet()):
  """The draft's cache of the prompts: tokens [B, P] (P a multiple of chunk), the target's
  features there hidden [B, P, E] (with taps: [B, P, (k+1)E]), lengths [B]; one compiled
  program per chunk shape."""
  from hitree_jax.decode.programs import shape_key
  prev = shifted(net.fuse(params, hidden))
  args = (params, config, embedding, cache, tokens[:, :chunk], prev[:, :chunk], jnp.int32(0), net)
  step = programs.get(("eagle_prefill", config, net, shape_key(args)), _prefill_chunk, *args)
  for start in range(0, tokens.shape[1], chunk):
    cache = step(params, embedding, cache, tokens[:, start:start + chunk], prev[:, start:start + chunk],
                 jnp.int32(start))
  return cache.replace(lengths=jnp.asarray(lengths))
