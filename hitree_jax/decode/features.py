"""The ring of the target's features a feature drafter reads (EAGLE, Medusa: heads/drafter.py).

The level right above the drafter runs one forward per verification anyway; the engine keeps the
hidden states of the tokens it accepted here, indexed by sequence position mod the ring's length,
so that drafting the next round needs no target forward of its own.
"""

import jax
import jax.numpy as jnp


def feature_at(ring: jax.Array, positions: jax.Array) -> jax.Array:
  """ring [B, L, E] of features by position mod L -> [B, T, E] at positions [B, T] (0 before 0)."""
  picked = jnp.take_along_axis(ring, (jnp.maximum(positions, 0) % ring.shape[1])[:, :, None], axis=1)
  return jnp.where((positions >= 0)[:, :, None], picked, 0)


def keep_features(ring: jax.Array, hidden: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
  """Writes hidden [B, T, E] at positions [B, T] where valid [B, T] into the ring [B, L, E]."""
  slots = jnp.where(valid, positions % ring.shape[1], ring.shape[1])
  return ring.at[jnp.arange(ring.shape[0])[:, None], slots].set(hidden.astype(ring.dtype), mode="drop")
