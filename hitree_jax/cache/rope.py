"""RoPE's rotation, which needs no model: the angles at positions for given inverse frequencies,
and HF's rotate-half applied with them. The model rotates its queries and keys with it
(model/llama.py, which also works out the frequencies from its config: rope_inv_freq), and a
StreamingLLM cache re-rotates its sinks' keys (cache/streaming.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
  """cos, sin [..., D] of RoPE's angles at positions [...] for inverse frequencies [D/2]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF rotate-half RoPE. x [B, T, H, D]; cos, sin [B, T, D]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
