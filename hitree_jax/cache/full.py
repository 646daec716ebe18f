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
  # a full copy of every layer's cache per decoded token).
  keys: tuple[jax.Array, ...]    # per layer [B, KVH, S, D]
  values: tuple[jax.Array, ...]  # per layer [B, KVH, S, D]
  lengths: jax.Array             # [B] int32: committed slots per row

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = dtype or jnp.dtype(config.dtype)
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(keys=zeros(), values=zeros(), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.keys[0].shape[2]

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
    move = lambda buf: buf.at[rows, :, dest].set(buf[rows, :, slots], mode="drop")
    return self.replace(keys=tuple(map(move, self.keys)),
                        values=tuple(map(move, self.values)),
                        lengths=self.lengths + n_accepted)

  def append(self, other: "KVCache") -> "KVCache":
    """Appends the committed slots of `other` (a short cache) after this cache's committed slots."""
    keys = tuple(write_slots(buf, new.transpose(0, 2, 1, 3), self.lengths)
                 for buf, new in zip(self.keys, other.keys))
    values = tuple(write_slots(buf, new.transpose(0, 2, 1, 3), self.lengths)
                   for buf, new in zip(self.values, other.values))
    return self.replace(keys=keys, values=values, lengths=self.lengths + other.lengths)


def write_slots(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, KVH, D] into buffer [B, KVH, S, D] at slots start[b] + 0..T-1."""
  batch, t = new.shape[:2]
  rows = jnp.arange(batch)[:, None]
  cols = start[:, None] + jnp.arange(t)[None, :]
  # Advanced indices split by a slice index as [B, T, KVH, D]: no transpose of `new`.
  return buffer.at[rows, :, cols].set(new.astype(buffer.dtype), mode="drop")


def causal_attend(start: jax.Array, t: int, max_len: int) -> jax.Array:
  """Mask [B, T, S] for T new tokens written at start[b] + i: slot s <= start + i."""
  query_slot = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
  return jnp.arange(max_len)[None, None, :] <= query_slot[:, :, None]
