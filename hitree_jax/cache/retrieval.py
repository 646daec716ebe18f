"""TriForce's retrieval cache: the target's own weights over a budget of chosen KV chunks.

After prefill, each row's committed slots of the target's full cache are cut
into chunks of `chunk` slots. A chunk's score is the post-RoPE query of the
last prompt token dotted with the mean of the chunk's post-RoPE keys, per
layer and KV head (with GQA, the scores of the query heads sharing a KV head
are summed). What is kept, within a static `budget` (a multiple of `chunk`):

  * chunk 0, the attention sink;
  * the row's last chunk, possibly partial: the tokens right before the ones
    being drafted are the ones a next token attends to most reliably, and a
    partial chunk's mean is not comparable with full chunks' anyway. A partial
    last chunk does not give its unused slots to another chunk, so a row keeps
    `budget - (chunk - its last chunk's size)` slots (at most `budget`);
  * the top-scoring complete chunks in between, as many as fit.

A row whose committed length is <= budget keeps everything, so a budget >=
the context gives exactly the full cache's attention.

Each (layer, KV head) gathers its own chunks, packed in ascending chunk order
into slots [0, kept[b]) of a buffer of `budget + tail` slots; every head of a
row keeps the same number of slots, so `lengths` stays per row and the result
is a KVCache: model.forward reads it as a `context` cache, and `append`
writes generated tokens into the tail after the kept slots (never over chosen
chunks). Keys stay post-RoPE at their original positions, so a new token's
position is `lengths + dropped`, not `lengths`.

`select` takes the queries it scores with; this module knows nothing of the model (cache/ does
not import model/). The model does not return queries: decode/retrieve.py has it recompute the
last prompt token once against the prefilled cache (model/llama.py last_token_projections).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.cache.full import ROWS, KVCache, axes_field
from hitree_jax.errors import UsageError


@flax.struct.dataclass
class RetrievalCache(KVCache):
  """A KVCache of kept chunks (slots [0, budget)) plus a tail for generated tokens.

  Inherits append/commit/advance: they act on slots after `lengths`, i.e. the tail.
  """
  chunks: jax.Array = axes_field((None, "batch", "kv_heads", None))  # [L, B, KVH, budget // chunk] int32:
  #   kept chunk indices, ascending
  dropped: jax.Array = axes_field(ROWS)   # [B] int32: full-cache slots not kept (position = slot + dropped
  #   past the kept ones)
  selected: jax.Array = axes_field(ROWS)  # [B] int32: the full cache's length when the chunks were chosen
  chunk: int = flax.struct.field(pytree_node=False)

  @property
  def budget(self) -> int:
    return self.chunks.shape[-1] * self.chunk

  @property
  def tail(self) -> int:
    return self.max_len - self.budget

  @property
  def next_positions(self) -> jax.Array:
    """[B] original position of the next token written at slot `lengths`."""
    return self.lengths + self.dropped

  def slot_shards(self) -> int:
    """1: a retrieval cache is split by KV head only (its chunks differ per head)."""
    return 1


def chunk_scores(query: jax.Array, keys: jax.Array, lengths: jax.Array, chunk: int) -> jax.Array:
  """Scores [B, KVH, C] float32 of each chunk: (sum of the group's queries) . (mean committed key).

  query [B, H, D] post-RoPE; keys [B, KVH, D, S] with S a multiple of chunk.
  The mean is taken over the chunk's committed slots (a chunk without any
  scores 0). Dot-then-average equals average-then-dot and needs no [.., D] temporary.
  """
  batch, kvh, _, slots = keys.shape
  grouped = query.reshape(batch, kvh, -1, query.shape[-1]).sum(axis=2)  # [B, KVH, D]
  per_slot = jnp.einsum("bkd,bkds->bks", grouped, keys, preferred_element_type=jnp.float32)
  committed = jnp.arange(slots)[None, :] < lengths[:, None]               # [B, S]
  per_slot = jnp.where(committed[:, None, :], per_slot, 0.0)
  counts = committed.reshape(batch, 1, slots // chunk, chunk).sum(axis=-1)  # [B, 1, C]
  return per_slot.reshape(batch, kvh, slots // chunk, chunk).sum(axis=-1) / jnp.maximum(counts, 1)


def top_k_indices(x: jax.Array, k: int, shards: int = 1) -> jax.Array:
  """jax.lax.top_k's indices [..., k] of x [..., C], found as a top-k within each of `shards`
  equal slices of C, then a top-k of the winners.

  The same indices as one top-k: an element of the top k has fewer than k
  elements before it in its own slice, and equal values go to the lower index
  at both steps. On a cache split by slots over `shards` devices, each device
  ranks its own chunks and only its k winners cross devices (a 128K cache's
  chunk scores are never gathered).
  """
  c = x.shape[-1]
  if shards == 1 or c % shards:
    return jax.lax.top_k(x, k)[1]
  width = c // shards
  local_values, local_index = jax.lax.top_k(x.reshape(*x.shape[:-1], shards, width), min(k, width))
  local_index = local_index + (jnp.arange(shards) * width)[:, None]
  flat = lambda a: a.reshape(*x.shape[:-1], -1)
  _, best = jax.lax.top_k(flat(local_values), k)
  return jnp.take_along_axis(flat(local_index), best, axis=-1)


def choose_chunks(scores: jax.Array, lengths: jax.Array, chunk: int, budget: int,
                  shards: int = 1) -> jax.Array:
  """Kept chunk indices [B, KVH, budget // chunk] int32, ascending: sink, top-k middle, last.

  A row with lengths <= budget keeps chunks 0 .. budget//chunk - 1 (all of it;
  indices past the row's end are harmless, `lengths` hides their slots).
  shards: the slices the top-k ranks apart first (top_k_indices), the cache's slot shards.
  """
  batch, kvh, n_chunks = scores.shape
  n_keep = budget // chunk
  everything = jnp.broadcast_to(jnp.arange(n_keep, dtype=jnp.int32), (batch, kvh, n_keep))
  if n_keep >= n_chunks:  # no row can be longer than the budget
    return everything
  last = (jnp.maximum(lengths, 1) - 1) // chunk                                    # [B]
  index = jnp.arange(n_chunks)
  middle = (index[None, :] >= 1) & (index[None, :] < last[:, None])               # [B, C]
  candidates = jnp.where(middle[:, None, :], scores, -jnp.inf)
  top = top_k_indices(candidates, n_keep - 2, shards)                               # [B, KVH, k]
  sink = jnp.zeros((batch, kvh, 1), jnp.int32)
  recent = jnp.broadcast_to(last[:, None, None], (batch, kvh, 1)).astype(jnp.int32)
  chosen = jnp.concatenate([sink, jnp.sort(top, axis=-1).astype(jnp.int32), recent], axis=-1)
  return jnp.where((lengths <= budget)[:, None, None], everything, chosen)


def kept_lengths(lengths: jax.Array, chunk: int, budget: int) -> jax.Array:
  """[B] slots a row keeps: all of them, less the complete middle chunks that did not fit."""
  n_chunks = (lengths + chunk - 1) // chunk
  return lengths - jnp.maximum(n_chunks - budget // chunk, 0) * chunk


def _gather_chunks(buf: jax.Array, chunks: jax.Array, chunk: int, tail: int) -> jax.Array:
  """The chosen chunks' slots of buf (keys or values [B, KVH, D, S]), chunks [B, KVH, N] ->
  [B, KVH, D, N * chunk + tail] (tail zeroed)."""
  batch, kvh, slots = buf.shape[0], buf.shape[1], buf.shape[3]
  index = chunks[..., None] * chunk + jnp.arange(chunk)                  # [B, KVH, N, chunk]
  index = jnp.minimum(index.reshape(batch, kvh, -1), slots - 1)          # past-the-end: hidden by lengths
  kept = jnp.take_along_axis(buf, index[:, :, None, :], axis=3)
  return jnp.pad(kept, ((0, 0), (0, 0), (0, 0), (0, tail)))


def select(full: KVCache, queries: jax.Array, budget: int, chunk: int = 8,
           tail: int = 0, shards: int = 1) -> RetrievalCache:
  """Builds the retrieval cache from a full cache and per-layer queries [L, B, H, D] (post-RoPE).

  budget, chunk, tail, shards (choose_chunks) are static. full.max_len must be a multiple of chunk.
  """
  if chunk < 1 or budget % chunk or budget < 2 * chunk:
    raise UsageError(f"budget={budget} must be a multiple of chunk={chunk} and hold >= 2 chunks "
                     "(the sink and the last chunk)")
  if full.max_len % chunk:
    raise UsageError(f"the full cache's {full.max_len} slots are not a multiple of chunk={chunk}")
  if tail < 0:
    raise UsageError(f"tail={tail} must be >= 0")
  chunks, keys, values = [], [], []
  for query, k_buf, v_buf in zip(queries, full.keys, full.values):
    chosen = choose_chunks(chunk_scores(query, k_buf, full.lengths, chunk), full.lengths, chunk, budget,
                           shards)
    chunks.append(chosen)
    keys.append(_gather_chunks(k_buf, chosen, chunk, tail))
    values.append(_gather_chunks(v_buf, chosen, chunk, tail))
  kept = kept_lengths(full.lengths, chunk, budget)
  return RetrievalCache(keys=tuple(keys), values=tuple(values), lengths=kept,
                        chunks=jnp.stack(chunks), dropped=full.lengths - kept,
                        selected=full.lengths, chunk=chunk)


