"""The full key/value cache: a pytree with a committed length per row.

The cache knows nothing about models or trees. It holds per-layer key/value
buffers of a fixed number of slots and, per row, how many leading slots are
committed. New tokens are written at explicit slots (scatter with
`mode="drop"`, so a write past the end is ignored rather than clamped onto
live data); what the new tokens may see is an explicit boolean mask built by
the caller. Speculation writes candidate tokens past the committed length and
then `commit`s the accepted ones: a gather of the chosen slots into contiguous
slots after the committed length. Rejected slots are forgotten simply by not
advancing the length.

A decoder may keep two caches: a long one that is only read (as `context`,
see model.hidden_states) and a short one that new tokens are written to,
`append`ed to the long one now and then. XLA:CPU copies a buffer that is read
and written in the same loop step, so this split is what keeps long-context
decoding cheap.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  # Heads before slots: attention is then a batched matmul over (B, KVH) with
  # no per-step transpose of the whole cache (a [B, S, KVH, D] layout cost XLA:CPU
  # a full copy of every layer's cache per decoded token). Keys keep their slots
  # last, so queries . keys is a plain [R, D] x [D, S] product: over 7.9K slots a
  # 1-token SmolLM2 forward took 31 ms instead of 37 with keys [B, KVH, S, D].
  keys: tuple[jax.Array, ...]    # per layer [B, KVH, D, S]
  values: tuple[jax.Array, ...]  # per layer [B, KVH, S, D]
  lengths: jax.Array             # [B] int32: committed slots per row

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None,
           key_dtype=None) -> "KVCache":
    """An empty cache: values in `dtype`, keys in `key_dtype` (defaults: the config's)."""
    dtype = dtype or jnp.dtype(config.dtype)
    key_dtype = key_dtype or jnp.dtype(config.cache_key_dtype)
    kvh, d = config.num_kv_heads, config.head_dim
    zeros = lambda shape, dt: tuple(jnp.zeros(shape, dt) for _ in range(config.num_layers))
    return cls(keys=zeros((batch, kvh, d, max_len), key_dtype),
               values=zeros((batch, kvh, max_len, d), dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.values[0].shape[2]

  @property
  def next_positions(self) -> jax.Array:
    """[B] sequence position of the next token written at slot `lengths` (a full cache: lengths)."""
    return self.lengths

  def advance(self, n: jax.Array) -> "KVCache":
    """Marks `n` [B] (or a scalar) more slots of each row as committed."""
    return self.replace(lengths=self.lengths + n)

  def commit(self, slots: jax.Array, n_accepted: jax.Array) -> "KVCache":
    """Moves chosen slots to the end of the committed prefix and commits them.

    slots: [B, A] slot indices (e.g. the accepted path of a token tree, in
    order); only the first `n_accepted[b]` of row b are committed. Their keys
    and values are copied to slots `lengths[b] + 0 .. A-1`.
    """
    batch, width = slots.shape
    rows = jnp.arange(batch)[:, None]
    dest = self.lengths[:, None] + jnp.arange(width)[None, :]
    move_key = lambda buf: buf.at[rows, :, :, dest].set(buf[rows, :, :, slots], mode="drop")
    move_value = lambda buf: buf.at[rows, :, dest].set(buf[rows, :, slots], mode="drop")
    return self.replace(keys=tuple(map(move_key, self.keys)),
                        values=tuple(map(move_value, self.values)),
                        lengths=self.lengths + n_accepted)

  def append(self, other: "KVCache") -> "KVCache":
    """Appends the committed slots of `other` (a short cache) after this cache's committed slots."""
    keys = tuple(write_key_slots(buf, new.transpose(0, 3, 1, 2), self.lengths)
                 for buf, new in zip(self.keys, other.keys))
    values = tuple(write_slots(buf, new.transpose(0, 2, 1, 3), self.lengths)
                   for buf, new in zip(self.values, other.values))
    return self.replace(keys=keys, values=values, lengths=self.lengths + other.lengths)


def dtypes_of(cache) -> dict:
  """KVCache.init's dtype arguments for a cache storing what `cache` (any with keys and values)
  stores."""
  return dict(dtype=cache.values[0].dtype, key_dtype=cache.keys[0].dtype)


def _slots(new: jax.Array, start: jax.Array):
  batch, t = new.shape[:2]
  return jnp.arange(batch)[:, None], start[:, None] + jnp.arange(t)[None, :]


def write_slots(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes values new [B, T, KVH, D] into buffer [B, KVH, S, D] at slots start[b] + 0..T-1."""
  rows, cols = _slots(new, start)
  # Advanced indices split by a slice index as [B, T, KVH, D]: no transpose of `new`.
  return buffer.at[rows, :, cols].set(new.astype(buffer.dtype), mode="drop")


def write_key_slots(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes keys new [B, T, KVH, D] into buffer [B, KVH, D, S] at slots start[b] + 0..T-1."""
  rows, cols = _slots(new, start)
  return buffer.at[rows, :, :, cols].set(new.astype(buffer.dtype), mode="drop")


def causal_attend(start: jax.Array, t: int, max_len: int) -> jax.Array:
  """Mask [B, T, S] for T new tokens written at start[b] + i: slot s <= start + i."""
  query_slot = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
  return jnp.arange(max_len)[None, None, :] <= query_slot[:, :, None]
