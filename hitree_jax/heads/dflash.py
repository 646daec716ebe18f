"""DFlash's block drafter (z-lab's block-diffusion draft): one forward proposes a whole block.

The draft is a small stack of Qwen3-style layers that never runs its own guesses. Its context is
the target's: the outputs of a few target layers (`target_layer_ids`, e.g. five spread over
Qwen3-8B's 36) at each committed position, side by side, mapped to the draft's width by `fc` and
normalised (`hidden_norm`). Every draft layer reads that context through its own key and value
projections (the context does not run through the layers), so the draft's cache holds, per
layer, the keys and values of every committed position.

A round's block is the root (the last emitted token) followed by block_size - 1 mask tokens at
the next positions, embedded with the target's embedding. The block's rows attend to the whole
context and to each other, in both directions; after the last layer and `norm`, the target's own
LM head turns row d (1 .. block_size - 1) into the distribution of the token d places after the
root:

  c_p = hidden_norm(fc([x_p at each target layer]))        the context of position p
  layer l: keys/values of c_p  k_norm(c_p Wk_l) (roped at p), c_p Wv_l;  of the block the same
           from its own rows;  queries q_norm(x Wq_l) of the block's rows;  a Qwen3 MLP
  logits_d = norm(block row d) @ lm_head

Row d does not depend on the tokens drafted before it (the block holds masks), so a round
offers, at every depth d, row d's top tokens: a chain (row d's argmax, as the authors' decoder
does) or a tree (the top few of each row under every parent), as Medusa's heads are read
(heads/drafter.py), but computed by one forward that reads the context.

Slots: the engine's caches count tokens, and the slot of sequence position i holds what the
drafter derived from the target's state at i - 1 (as EAGLE's does, heads/eagle.py): here the
context of position i - 1, roped at i - 1. Slot 0 (a context before the first token) holds
nothing and is never attended.

Parameters (`load`, from the authors' folders: heads/dflash_format.py), kernels [in, out]:
  {"fc" [nE, E], "hidden_norm" [E], "norm" [E], "head" [E, V] (the target's),
   "layers": ({"q", "k", "v", "o", "q_norm", "k_norm", "input_norm", "post_norm",
               "gate", "up", "down"}, ...)}
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hitree_jax.cache.full import KVCache, write_slots
from hitree_jax.model.config import ModelConfig
from hitree_jax.cache.rope import apply_rope, rope_cos_sin
from hitree_jax.model.llama import attention, rms_norm, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class BlockSpec:
  """What besides its layers' shape a DFlash draft is: its block and what it reads."""
  block_size: int                     # the root and block_size - 1 masks: the deepest tree it fills
  mask_token_id: int                  # the target's id whose embedding fills the block
  target_layer_ids: tuple[int, ...]   # the target layers whose outputs form its context


def _project(x, layer, name):
  out = jnp.dot(x, layer[name])
  return out + layer[f"{name}_bias"] if f"{name}_bias" in layer else out


def context(params, config: ModelConfig, features):
  """features [B, T, nE] (the target layers' outputs at T positions) -> the context [B, T, E]."""
  return rms_norm(jnp.dot(features.astype(params["fc"].dtype), params["fc"]), params["hidden_norm"],
               config.rms_norm_eps)


def _keys_values(layer, config: ModelConfig, x, cos, sin):
  """x [B, T, E] -> this layer's keys (normed, roped) and values [B, T, KVH, D]."""
  b, t, _ = x.shape
  k = _project(x, layer, "k").reshape(b, t, config.num_kv_heads, config.head_dim)
  v = _project(x, layer, "v").reshape(b, t, config.num_kv_heads, config.head_dim)
  return apply_rope(rms_norm(k, layer["k_norm"], config.rms_norm_eps), cos, sin), v


def write_context(params, config: ModelConfig, cache: KVCache, features, positions, write_at) -> KVCache:
  """Writes the context of features [B, T, nE] (the target's, at positions [B, T]) into every
  layer of `cache` at slots write_at[b] + 0..T-1, uncommitted (the caller commits)."""
  ctx = context(params, config, features)
  cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
  keys, values = [], []
  for layer, k_buf, v_buf in zip(params["layers"], cache.keys, cache.values):
    k, v = _keys_values(layer, config, ctx, cos, sin)
    keys.append(write_slots(k_buf, k, write_at))
    values.append(write_slots(v_buf, v, write_at))
  return cache.replace(keys=tuple(keys), values=tuple(values))


def _attend(q, contexts, k_block, v_block, layer_index: int):
  """q [B, T, H, D] over each context's committed slots [start, length) (keys, values per layer
  [B, KVH, D, S], lengths [B], start [B]) and over the block's own keys/values [B, T, KVH, D], in
  both directions: the target's attention (model.llama.attention), one online softmax over all
  of them, a long context read block by block, so no [T, S] scores of it are kept whole."""
  b, t, h, d = q.shape
  own_keys, own_values = (jnp.transpose(x, (0, 2, 3, 1)) for x in (k_block, v_block))   # [B, KVH, D, T]
  every = jnp.ones((b, t, t), bool)
  read = tuple((keys[layer_index], values[layer_index], lengths, start) for keys, values, lengths, start in contexts)
  return attention(q, own_keys, own_values, every, read).reshape(b, t, h * d)


def block_hidden(params, config: ModelConfig, embedded, positions, contexts):
  """The block's final states [B, T, E]: embedded [B, T, E] at positions [B, T], attending to
  contexts (per-layer keys, per-layer values, lengths [B], first visible slot [B]) and to itself."""
  eps, (b, t, _) = config.rms_norm_eps, embedded.shape
  cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
  x = embedded
  for i, layer in enumerate(params["layers"]):
    h = rms_norm(x, layer["input_norm"], eps)
    q = _project(h, layer, "q").reshape(b, t, config.num_heads, config.head_dim)
    q = apply_rope(rms_norm(q, layer["q_norm"], eps), cos, sin)
    k, v = _keys_values(layer, config, h, cos, sin)
    x = x + _project(_attend(q, contexts, k, v, i).astype(x.dtype), layer, "o")
    h = rms_norm(x, layer["post_norm"], eps)
    x = x + jnp.dot(jax.nn.silu(jnp.dot(h, layer["gate"])) * jnp.dot(h, layer["up"]), layer["down"])
  return rms_norm(x, params["norm"], eps)


def block_logits(params, config: ModelConfig, spec: BlockSpec, embedding, root, root_position, contexts):
  """[B, block_size - 1, V] float32: row d's logits for the token d places after the root [B]
  at root_position [B] (the block's first row, the root, proposes nothing)."""
  batch = root.shape[0]
  tokens = jnp.concatenate([root[:, None], jnp.full((batch, spec.block_size - 1), spec.mask_token_id,
                                                    root.dtype)], axis=1)
  positions = root_position[:, None] + jnp.arange(spec.block_size)[None, :]
  hidden = block_hidden(params, config, jnp.take(embedding, tokens, axis=0), positions, contexts)
  return jnp.dot(hidden[:, 1:], params["head"]).astype(jnp.float32)


def first_visible(first_position) -> jax.Array:
  """[B] the first slot a block attends to, of a cache whose slot 0 is sequence position
  first_position [B]: past the empty slot of position 0."""
  return jnp.maximum(1 - first_position, 0)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def prefill(params, config: ModelConfig, cache: KVCache, hidden, lengths):
  """The draft's cache of the prompts: hidden [B, P, (n+1)E], the target's tapped layers then its
  final states at every prompt position; slot i gets the context of position i - 1."""
  features = hidden[..., :hidden.shape[-1] - config.hidden_size]
  shifted = jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :-1]
  positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]) - 1, hidden.shape[:2])
  cache = write_context(params, config, cache, shifted, positions, jnp.zeros_like(lengths))
  return cache.replace(lengths=lengths)
