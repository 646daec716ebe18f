"""One level's cache in the decode loop, and the arithmetic of a level's round.

A level's cache is two parts (model/llama.py's `hidden_states` says why): a `long` cache that
is read-only inside a block of rounds -- the full KVCache, a RetrievalCache or
a StreamingCache: all hold keys at their sequence positions, expose the
position of the next token (`next_positions`) and show every query their
committed slots [0, lengths) -- and a short `recent` KVCache that rounds
write to, appended to the long one at the block's end. Rounds write
speculative tokens past `recent.lengths`; `commit` packs the accepted ones in
front; `rollback` forgets what the level above rejected by lowering
`recent.lengths`. Only tokens every level agreed on are ever appended, so a
StreamingCache's ring never needs undoing.

The sequence all levels extend is one token buffer (`seq`, with an `end` per
row: the last token is the root of the next proposal). A level holds the
keys/values of the first `cached` tokens; the rest up to `end` -- one token,
the root, or more when a level above accepted everything this level handed
it -- are its *pending* tokens, fed in front of its next proposal. A level's
forward therefore has `lead` slots for them (its static maximum: one at the
top), right-aligned so the root is always last; unused lead slots are masked.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.cache.full import KVCache


@flax.struct.dataclass
class LevelCache:
  long: KVCache     # KVCache | RetrievalCache | StreamingCache: read-only within a block
  recent: KVCache   # W slots per layer: this block's tokens, then speculative ones

  @property
  def cached(self) -> jax.Array:
    """[B] tokens of the sequence whose keys/values this level holds."""
    return self.long.next_positions + self.recent.lengths

  def rollback(self, keep: jax.Array) -> "LevelCache":
    """Keeps at most the first keep [B] tokens of the sequence (what the level above accepted)."""
    lengths = jnp.minimum(self.recent.lengths, keep - self.long.next_positions)
    return self.replace(recent=self.recent.replace(lengths=lengths))

  def new_block(self, width: int) -> "LevelCache":
    """Moves the recent tokens into the long cache and starts an empty recent cache."""
    recent = self.recent
    return LevelCache(self.long.append(recent), recent.replace(
        keys=tuple(map(jnp.zeros_like, recent.keys)), values=tuple(map(jnp.zeros_like, recent.values)),
        lengths=jnp.zeros_like(recent.lengths)))


@flax.struct.dataclass
class Lead:
  """A level's pending tokens, right-aligned in `lead` slots (the root last)."""
  tokens: jax.Array     # [B, P] int32 (0 where unused)
  positions: jax.Array  # [B, P] int32
  valid: jax.Array      # [B, P] bool
  count: jax.Array      # [B] int32 in [1, P]

  @classmethod
  def of(cls, seq: jax.Array, end: jax.Array, cached: jax.Array, lead: int) -> "Lead":
    """The tokens seq[cached:end] of each row ([B, H], [B], [B]), right-aligned in `lead` slots."""
    count = end - cached
    positions = end[:, None] - lead + jnp.arange(lead)[None, :]
    valid = jnp.arange(lead)[None, :] >= (lead - count)[:, None]
    positions = jnp.maximum(positions, 0)
    tokens = jnp.where(valid, jnp.take_along_axis(seq, positions, axis=1), 0)
    return cls(tokens=tokens, positions=positions, valid=valid, count=count)

  @property
  def root(self) -> jax.Array:
    return self.tokens[:, -1]

  @property
  def size(self) -> int:
    return self.tokens.shape[1]


def round_mask(lead_valid: jax.Array, tree_mask) -> jax.Array:
  """[B, P+N, P+N] over a round's slots (P lead slots, the root last; then N tree nodes).

  lead_valid [B, P]; tree_mask [N+1, N+1] or [B, N+1, N+1] over (root, nodes)
  (drafters.tree_attend_mask). A pending token sees the valid ones before it;
  the root and the nodes see every valid pending token and what tree_mask allows.
  """
  batch, lead = lead_valid.shape
  tree_mask = jnp.broadcast_to(jnp.asarray(tree_mask), (batch, *jnp.shape(tree_mask)[-2:]))
  n = tree_mask.shape[-1] - 1
  earlier = lead_valid[:, None, :lead - 1]                                         # [B, 1, P-1]
  causal = jnp.tril(jnp.ones((lead - 1, lead - 1), bool))[None] & earlier
  pending_rows = jnp.concatenate([causal, jnp.zeros((batch, lead - 1, n + 1), bool)], axis=2)
  tree_rows = jnp.concatenate([jnp.broadcast_to(earlier, (batch, n + 1, lead - 1)), tree_mask], axis=2)
  return jnp.concatenate([pending_rows, tree_rows], axis=1)


def commit_slots(lead: Lead, path: jax.Array, base: jax.Array) -> jax.Array:
  """[B, P+D] recent-cache slots to keep, in order: the valid lead slots, then the accepted path.

  A round wrote lead slot t at base + t and node i at base + P + i; path [B, D] (-1 padded).
  """
  p = lead.size
  slots = jnp.concatenate([base[:, None] + jnp.arange(p)[None, :],
                           base[:, None] + p + jnp.maximum(path, 0)], axis=1)
  shift = p - lead.count                                                           # unused lead slots
  index = jnp.minimum(shift[:, None] + jnp.arange(slots.shape[1])[None, :], slots.shape[1] - 1)
  return jnp.take_along_axis(slots, index, axis=1)


def commit(cache: KVCache, lead: Lead, path: jax.Array, n_accepted: jax.Array, live: jax.Array,
           base: jax.Array | None = None) -> KVCache:
  """Keeps a round's valid lead tokens and accepted path in a recent cache (rows not live: nothing)."""
  base = cache.lengths if base is None else base
  n = jnp.where(live, lead.count + n_accepted, 0)
  return cache.commit(commit_slots(lead, path, base), n)
