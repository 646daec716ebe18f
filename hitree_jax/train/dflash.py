"""Training a DFlash block drafter (heads/dflash.py) in JAX, on the target's features.

A DFlash draft proposes a whole block in one forward: the root (the last emitted token) and
block_size - 1 mask tokens, attending to the target's context before the root and to each
other. Training cuts blocks out of labelled windows: at an anchor a (a position of the window),
the block's root is x_a, its context the target's tapped states at positions before a, and its
row d (1 .. block_size - 1) learns the teacher's distribution of x_{a+d} (its labels at a+d-1),
weighted exp(-(d-1)/gamma) as its authors weigh them: an early row's miss ends the chain.

The block goes through heads/dflash.block_logits, the function decoding runs, so what is
trained is what drafts: each anchor is a row of a batch whose context is the window's cache cut
at the anchor. Anchors are drawn once per window (`anchors`), at random, from the positions
whose whole block has labels. The embedding and the LM head are the target's (frozen); `fc`,
`hidden_norm`, the layers (Qwen3-style, with per-head norms, whatever the target) and `norm`
train. The trained draft is written in vLLM's speculators format (train/speculators.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache
from hitree_jax.errors import UsageError
from hitree_jax.heads import dflash, published
from hitree_jax.heads.dflash import BlockSpec
from hitree_jax.model.config import ModelConfig
from hitree_jax.train.heads import token_cross_entropy


def default_target_layers(num_target_layers: int, draft_layers: int) -> tuple[int, ...]:
  """DFlash's default context: one target layer per draft layer, spread evenly from layer 1 to
  layer L-3 and rounded (the middle one for a one-layer draft); our taps, the layers' outputs."""
  if draft_layers == 1:
    return (num_target_layers // 2,)
  first, last = 1, num_target_layers - 3
  layers = tuple(round(first + i * (last - first) / (draft_layers - 1)) for i in range(draft_layers))
  if len(set(layers)) < draft_layers or last <= first:
    raise UsageError(f"DFlash's default target layers for {draft_layers} draft layers over a "
                     f"{num_target_layers}-layer target are {layers}: not distinct; name the ones to read")
  return layers


def layer_config(target: ModelConfig, draft_layers: int) -> ModelConfig:
  """The draft's layers: the target's width, heads and RoPE, Qwen3's per-head norms, no biases."""
  return target.replace(num_layers=draft_layers, qk_norm=True, qkv_bias=False, o_bias=False)


def init_params(config: ModelConfig, taps: int, key, scale: float = 0.02) -> dict:
  """heads/dflash.py's layout (kernels [in, out]), float32, without the target's head: random
  `fc` and layers (normal, `scale`; the norms ones)."""
  e = config.hidden_size
  keys = jax.random.split(key, config.num_layers + 1)
  layers = tuple(published.random_layer(config, e, layer_key, scale) for layer_key in keys[1:])
  return {"fc": scale * jax.random.normal(keys[0], (taps * e, e), jnp.float32),
          "hidden_norm": jnp.ones((e,), jnp.float32), "norm": jnp.ones((e,), jnp.float32), "layers": layers}


def anchors(n_windows: int, window: int, block_size: int, per_window: int, seed: int) -> np.ndarray:
  """[N, A] int32, sorted: per window, A distinct anchors among those whose block has labels
  (0 .. window - block_size)."""
  valid = window - block_size + 1
  if not 1 <= per_window <= valid:
    raise UsageError(f"{per_window} anchors per window: expected 1 .. {valid} (a window of {window} "
                     f"tokens holds {valid} blocks of {block_size})")
  rng = np.random.default_rng(seed)
  return np.sort(np.stack([rng.choice(valid, per_window, replace=False) for _ in range(n_windows)]),
                 axis=1).astype(np.int32)


def anchor_logits(params, config: ModelConfig, spec: BlockSpec, embedding, tokens, features, at):
  """[W, A, block_size - 1, V] float32: the block rooted at each anchor at [W, A] of windows
  tokens [W, T] with the target's tapped states there, features [W, T, nE]."""
  w, t = tokens.shape
  a = at.shape[1]
  cache = KVCache.init(config, w, t + 1)   # slot i: the context of position i - 1 (slot 0: none)
  positions = jnp.broadcast_to(jnp.arange(t), (w, t))
  cache = dflash.write_context(params, config, cache, features, positions, jnp.ones((w,), jnp.int32))
  every = lambda x: jnp.repeat(x, a, axis=0)           # one batch row per anchor: [W*A, ...]
  keys, values = tuple(map(every, cache.keys)), tuple(map(every, cache.values))
  roots = at.reshape(-1)
  visible = ((keys, values, roots + 1, jnp.ones_like(roots)),)   # the positions before the root
  root_tokens = jnp.take_along_axis(tokens, at, axis=1).reshape(-1)
  logits = dflash.block_logits(params, config, spec, embedding, root_tokens, roots, visible)
  return logits.reshape(w, a, spec.block_size - 1, -1)


def row_weights(block_size: int, gamma: float) -> np.ndarray:
  """[block_size - 1]: row d's weight exp(-(d-1)/gamma)."""
  return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def block_labels(labels, at, block_size: int):
  """labels [W, T, k] -> [W, A, block_size - 1, k]: row d of the block at a reads those at a+d-1."""
  index = at[:, :, None] + jnp.arange(block_size - 1)[None, None, :]     # [W, A, B-1]
  w, a, rows = index.shape
  picked = labels[jnp.arange(w)[:, None], index.reshape(w, a * rows)]    # [W, A*(B-1), k]
  return picked.reshape(w, a, rows, labels.shape[-1])


def full_targets(ids: np.ndarray, log_probs: np.ndarray):
  """The teacher's top-k (target ids, log-probs) -> (ids, probs renormalised over the k): a DFlash
  draft speaks the target's whole vocabulary through its head."""
  probs = np.exp(log_probs.astype(np.float32))
  return ids.astype(np.int32), (probs / probs.sum(-1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def objective(config: ModelConfig, spec: BlockSpec, gamma: float = 4.0):
  """loss(params, frozen, tokens [W,T], features [W,T,nE], anchors [W,A], ids [W,T,k] target ids,
  probs [W,T,k]) -> (loss, row 1's top-1 agreement); frozen: the target's embedding and head."""
  weights = jnp.asarray(row_weights(spec.block_size, gamma))

  def loss(params, frozen, tokens, features, at, ids, probs):
    logits = anchor_logits(dict(params, head=frozen["head"]), config, spec, frozen["embedding"], tokens,
                           features.astype(jnp.float32), at)
    ids, probs = block_labels(ids, at, spec.block_size), block_labels(probs, at, spec.block_size)
    per_row = token_cross_entropy(logits, ids, probs).mean(axis=(0, 1))   # [B-1]
    agree = jnp.mean(jnp.argmax(logits[:, :, 0], axis=-1) == ids[:, :, 0, 0])
    return jnp.sum(weights * per_row) / jnp.sum(weights), agree

  return loss
