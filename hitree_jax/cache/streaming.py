"""StreamingLLM cache: `sinks` first tokens plus a ring of the `window` most recent ones.

The bottom draft of the hierarchy reads a fixed `sinks + window` slots however
long the context grows. Keys stay post-RoPE at their original positions, as
the full cache stores them, so the cache is just another read-only `context`
for model.forward: the ring fills in order, its valid slots are always the
prefix [0, lengths[b]), and attention does not care about slot order.

Contract: only committed (verified) tokens go in, through `append`. A ring
overwrite cannot be undone, so a draft writes its speculative tokens to its
own short cache (with this one as context), and after verification appends
that short cache with `lengths` set to the accepted count (after
`KVCache.commit` has packed a tree's accepted path in front). Nothing here
rolls back; nothing needs to.

Positions. A ring token keeps the position it had in the sequence, so its
distance to a new query is the one the full cache gives. StreamingLLM proper
re-indexes positions inside the cache (sinks at 0..s-1, the ring's tokens at
s..s+w-1, the query at s+w): the ring's distances are the same as here, and
only the sinks move, to distance s+w-i instead of the full length. With
`shift_freq` (the model's RoPE frequencies) this cache does that: at each
append, the sink keys (post-RoPE) are rotated forward by how far the ring
moved, RoPE's rotations composing, so they sit right before the ring's
oldest token (`sink_shift` [B] records by how much). Queries are unchanged.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.cache.full import KV_AXES, ROWS, CacheShape, KVCache, axes_field
from hitree_jax.errors import UsageError
from hitree_jax.cache.rope import apply_rope, rope_cos_sin


def held_positions(seen: jax.Array, sinks: int, window: int) -> jax.Array:
  """[B, sinks + window] int32: the position each slot holds after `seen` [B] tokens, -1 if empty.

  Slot j < sinks holds position j; ring slot sinks + r holds the latest
  position p < seen with p >= sinks and (p - sinks) % window == r.
  """
  sink = jnp.broadcast_to(jnp.arange(sinks), (seen.shape[0], sinks))
  sink = jnp.where(sink < seen[:, None], sink, -1)
  ring = jnp.arange(window)[None, :]
  laps = (seen[:, None] - 1 - sinks - ring) // window  # floor: negative while the slot is unused
  ring = jnp.where(laps >= 0, sinks + ring + window * laps, -1)
  return jnp.concatenate([sink, ring], axis=1).astype(jnp.int32)


def _ring_slots(positions: jax.Array, sinks: int, window: int) -> jax.Array:
  """Slot of each position [..] (>= 0): itself among the sinks, else its place in the ring."""
  return jnp.where(positions < sinks, positions, sinks + (positions - sinks) % window)


@flax.struct.dataclass
class StreamingCache:
  keys: tuple[jax.Array, ...] = axes_field(KV_AXES)    # per layer [B, KVH, D, sinks + window]
  values: tuple[jax.Array, ...] = axes_field(KV_AXES)  # per layer [B, KVH, D, sinks + window]
  lengths: jax.Array = axes_field(ROWS)  # [B] int32: valid slots, min(seen, sinks + window)
  seen: jax.Array = axes_field(ROWS)     # [B] int32: tokens committed so far = position of the next token
  sinks: int = flax.struct.field(pytree_node=False)
  window: int = flax.struct.field(pytree_node=False)
  # [D/2] RoPE inverse frequencies: re-index the sinks (None: don't)
  shift_freq: jax.Array | None = axes_field((None,), default=None)
  sink_shift: jax.Array | None = axes_field(ROWS, default=None)  # [B] int32: positions the sinks moved forward by

  @classmethod
  def init(cls, config: CacheShape, batch: int, sinks: int, window: int,
           dtype=None) -> "StreamingCache":
    """An empty cache (prefill may stream prompt chunks in through `append`)."""
    _check(sinks, window)
    kv = KVCache.init(config, batch, sinks + window, dtype)
    return cls(keys=kv.keys, values=kv.values, lengths=kv.lengths, seen=kv.lengths,
               sinks=sinks, window=window)

  @classmethod
  def from_prefill(cls, full: KVCache, sinks: int, window: int,
                   shift_freq: jax.Array | None = None) -> "StreamingCache":
    """Keeps each row's first `sinks` and last `window` committed slots of a full cache.

    Assumes slot s of `full` holds position s (a prefilled or plainly decoded cache).
    shift_freq: the model's rope_inv_freq, to re-index the sinks (module docstring).
    """
    _check(sinks, window)
    held = held_positions(full.lengths, sinks, window)
    index = jnp.maximum(held, 0)  # empty slots read slot 0, hidden by lengths
    gather = lambda buf: jnp.take_along_axis(buf, index[:, None, None, :], axis=3)
    cache = cls(keys=tuple(map(gather, full.keys)), values=tuple(map(gather, full.values)),
                lengths=jnp.minimum(full.lengths, sinks + window), seen=full.lengths,
                sinks=sinks, window=window, shift_freq=shift_freq,
                sink_shift=None if shift_freq is None else jnp.zeros_like(full.lengths))
    return cache._shift_sinks()

  def _shift_sinks(self) -> "StreamingCache":
    """Rotates the sink keys so they sit right before the ring's oldest token (if re-indexing)."""
    if self.shift_freq is None or self.sinks == 0:
      return self
    shift = jnp.maximum(self.seen - self.sinks - self.window, 0)                   # [B]
    cos, sin = rope_cos_sin((shift - self.sink_shift)[:, None], self.shift_freq)   # [B, 1, D]

    def rotate(buf):                                                               # [B, KVH, D, S]
      sink = buf[:, :, :, :self.sinks].transpose(0, 3, 1, 2)                       # [B, s, KVH, D]
      cos_s, sin_s = (jnp.broadcast_to(x, (buf.shape[0], self.sinks, x.shape[-1])) for x in (cos, sin))
      return buf.at[:, :, :, :self.sinks].set(apply_rope(sink, cos_s, sin_s).transpose(0, 2, 3, 1))

    return self.replace(keys=tuple(map(rotate, self.keys)), sink_shift=shift)

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.sinks + self.window

  @property
  def next_positions(self) -> jax.Array:
    """[B] position of the next token (as RetrievalCache.next_positions; not `lengths`)."""
    return self.seen

  def positions(self) -> jax.Array:
    """[B, sinks + window] original position held by each slot, -1 if empty."""
    return held_positions(self.seen, self.sinks, self.window)

  def append(self, recent: KVCache) -> "StreamingCache":
    """Writes the committed slots [0, recent.lengths[b]) of a short cache as the next positions.

    Rows may commit different counts; a row committing more than `window`
    keeps only the last `window` of them in the ring (earlier ones are
    dropped, not written, so no two writes hit one slot).
    """
    batch, t = self.batch, recent.max_len
    count = recent.lengths
    offset = jnp.arange(t)[None, :]
    positions = self.seen[:, None] + offset                                   # [B, T]
    survives = (offset < count[:, None]) & (
        (positions < self.sinks) | (positions >= (self.seen + count)[:, None] - self.window))
    slots = jnp.where(survives, _ring_slots(positions, self.sinks, self.window), self.max_len)
    rows = jnp.arange(batch)[:, None]
    # Advanced indices split by a slice index as [B, T, KVH, D]; past-the-end slots are dropped.
    write = lambda buf, new: buf.at[rows, :, :, slots].set(
        new.transpose(0, 3, 1, 2).astype(buf.dtype), mode="drop")                 # new [B, KVH, D, T]
    seen = self.seen + count
    return self.replace(keys=tuple(map(write, self.keys, recent.keys)),
                        values=tuple(map(write, self.values, recent.values)),
                        lengths=jnp.minimum(seen, self.max_len), seen=seen)._shift_sinks()


def _check(sinks: int, window: int):
  if sinks < 0 or window < 1:
    raise UsageError(f"sinks={sinks} must be >= 0 and window={window} >= 1")
