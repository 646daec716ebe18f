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

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp

class CacheShape(Protocol):
  """What a cache is shaped by: a model's config (model/config.py ModelConfig), which the cache
  does not import (the model imports the cache)."""
  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  cache_key_dtype: str


KV_AXES = ("batch", "kv_heads", "head_dim", "sequence")   # a layer's keys or values [B, KVH, D, S]
ROWS = ("batch",)                                         # a number per row [B]


def axes_field(axes: tuple, **kwargs):
  """A cache field and the logical axes of its arrays (of each, for a tuple of per-layer arrays):
  sharding.cache_axes maps them to a mesh, and refuses an array field that declares none."""
  return flax.struct.field(metadata={"axes": axes}, **kwargs)


@flax.struct.dataclass
class KVCache:
  # Heads before slots: attention is then a batched matmul over (B, KVH) with
  # no per-step transpose of the whole cache (a [B, S, KVH, D] layout cost XLA:CPU
  # a full copy of every layer's cache per decoded token). Slots last: queries .
  # keys is a plain [R, D] x [D, S] product (over 7.9K slots a 1-token SmolLM2
  # forward took 31 ms instead of 37 with keys [B, KVH, S, D] on XLA:CPU), and
  # values are stored the same way: a TPU lays a [.., S, 64] array out slots-minor
  # anyway (no padding of 64 to its 128 lanes), and with values [B, KVH, S, D] its
  # 1-token decode copied the whole value cache into a head_dim-minor layout for
  # the probabilities x values reduction, every call.
  keys: tuple[jax.Array, ...] = axes_field(KV_AXES)    # per layer [B, KVH, D, S]
  values: tuple[jax.Array, ...] = axes_field(KV_AXES)  # per layer [B, KVH, D, S]
  lengths: jax.Array = axes_field(ROWS)                # [B] int32: committed slots per row

  @classmethod
  def init(cls, config: CacheShape, batch: int, max_len: int, dtype=None,
           key_dtype=None) -> "KVCache":
    """An empty cache: values in `dtype`, keys in `key_dtype` (defaults: the config's)."""
    dtype = dtype or jnp.dtype(config.dtype)
    key_dtype = key_dtype or jnp.dtype(config.cache_key_dtype)
    kvh, d = config.num_kv_heads, config.head_dim
    zeros = lambda shape, dt: tuple(jnp.zeros(shape, dt) for _ in range(config.num_layers))
    return cls(keys=zeros((batch, kvh, d, max_len), key_dtype),
               values=zeros((batch, kvh, d, max_len), dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.values[0].shape[3]

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
    move = lambda buf: buf.at[rows, :, :, dest].set(buf[rows, :, :, slots], mode="drop")
    return self.replace(keys=tuple(map(move, self.keys)), values=tuple(map(move, self.values)),
                        lengths=self.lengths + n_accepted)

  def slot_shards(self) -> int:
    """The devices this cache's slots are split over: a full cache's are, over the mesh's
    `sequence` axis (sharding.cache_axes)."""
    return slot_shards()

  def append(self, other: "KVCache") -> "KVCache":
    """Appends the committed slots of `other` (a short cache) after this cache's committed slots."""
    shards = self.slot_shards()
    keys = tuple(put_slots(buf, new, self.lengths, shards) for buf, new in zip(self.keys, other.keys))
    values = tuple(put_slots(buf, new, self.lengths, shards) for buf, new in zip(self.values, other.values))
    return self.replace(keys=keys, values=values, lengths=self.lengths + other.lengths)


def dtypes_of(cache) -> dict:
  """KVCache.init's dtype arguments for a cache storing what `cache` (any with keys and values)
  stores."""
  return dict(dtype=cache.values[0].dtype, key_dtype=cache.keys[0].dtype)


SLOT_AXIS = "sequence"  # the mesh axis a full cache's slots are split over (sharding.RULES)


def slot_shards() -> int:
  """How many devices a full cache's slots are split over: the `sequence` axis of the mesh that
  programs are being traced under (jax.set_mesh; sharding.use), 1 without one."""
  return dict(jax.sharding.get_abstract_mesh().shape).get(SLOT_AXIS, 1)


def put_slots(buffer: jax.Array, block: jax.Array, start: jax.Array, shards: int = 1) -> jax.Array:
  """Writes block's slots into buffer's at start[b] + 0..W-1, row by row; slots outside the
  buffer are dropped, as a scatter with mode="drop" would.

  buffer [B, KVH, D, S]; block [B, KVH, D, W]; start [B]. Each row is one dynamic_update_slice,
  which every backend updates in place. A scatter made the TPU compiler give the whole cache a
  layout of its own, slots major, so the decode loop copied every layer's long cache into it
  and back each block (SmolLM2 at 7.5K on a v5e: 0.66 GiB of temporaries for a 0.18 GiB cache;
  Llama-2-7B at 128K: 19.5 GB, over a v5e's HBM). shards: the devices buffer's slots are split
  over (slot_shards()); each writes the part of the block that falls in its own slots (a
  dynamic_update_slice at a dynamic offset of a split axis would gather the whole buffer).
  """
  if shards == 1:
    return _put_rows(buffer, block, start)
  spec = jax.sharding.PartitionSpec
  split = spec(None, None, None, SLOT_AXIS)
  first = jnp.arange(shards) * (buffer.shape[3] // shards)               # each shard's first slot
  local = lambda buffer, block, start, first: _put_rows(buffer, block, start - first[0])
  return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(split, spec(), spec(), spec(SLOT_AXIS)), out_specs=split,
                       axis_names={SLOT_AXIS}, check_vma=False)(buffer, block, start, first)


UNROLLED_ROWS = 8  # put_slots writes up to this many rows one by one, more in a loop over rows


def _put_rows(buffer: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
  """put_slots on one device: start may lie anywhere, before the buffer's first slot too.

  A few rows (decoding) are written one by one at static row indices, which a mesh splitting rows
  partitions; many (a sampling test's thousands) in a fori_loop, or the program would grow with
  the batch (it compiled out of memory)."""
  size, width = buffer.shape[3], block.shape[3]
  window = min(width, size)                                   # slots of buffer a row can touch

  def put_row(row, buffer):
    at = jnp.clip(start[row], 0, size - window)
    index = at - start[row] + jnp.arange(window)              # the block's slot for each one written
    inside = (index >= 0) & (index < width)
    new = jax.lax.dynamic_index_in_dim(block, row, keepdims=False)
    moved = jnp.take(new, jnp.clip(index, 0, width - 1), axis=2).astype(buffer.dtype)
    old = jax.lax.dynamic_slice(buffer, (row, 0, 0, at), (1, *buffer.shape[1:3], window))[0]
    return jax.lax.dynamic_update_slice(buffer, jnp.where(inside, moved, old)[None], (row, 0, 0, at))

  if buffer.shape[0] > UNROLLED_ROWS:
    return jax.lax.fori_loop(0, buffer.shape[0], put_row, buffer)
  for row in range(buffer.shape[0]):
    buffer = put_row(row, buffer)
  return buffer


def write_slots(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes keys or values new [B, T, KVH, D] into buffer [B, KVH, D, S] at slots start[b] + 0..T-1
  (past-the-end slots dropped). A scatter: what a forward writes to is a short cache (a level's
  recent one, a prefill chunk's own), which a copy costs little; put_slots writes long caches."""
  rows = jnp.arange(new.shape[0])[:, None]
  cols = start[:, None] + jnp.arange(new.shape[1])[None, :]
  # Advanced indices split by a slice index as [B, T, KVH, D]: no transpose of `new`.
  return buffer.at[rows, :, :, cols].set(new.astype(buffer.dtype), mode="drop")


def causal_attend(start: jax.Array, t: int, max_len: int) -> jax.Array:
  """Mask [B, T, S] for T new tokens written at start[b] + i: slot s <= start + i."""
  query_slot = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
  return jnp.arange(max_len)[None, None, :] <= query_slot[:, :, None]
