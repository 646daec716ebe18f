"""Medusa's heads: K residual blocks on the target's feature, head k guessing k tokens further.

The feature f_{r-1} of the token before the root r is what the target's LM
head turned into the root's distribution. Medusa head k (1..K) turns it into
a guess at the token k places after the root (Cai et al. 2024):

  logits_k = (f + SiLU(f W_k)) @ head          W_k [E, E], zero at the start

A head reads no token and keeps no cache, so a round costs K small products
and no forward of any model; but head k's guess cannot depend on the tokens
between the root and its own position, and its acceptance falls quickly with
depth. The head is the target's, on the draft's vocabulary (vocab.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hitree_jax.model.vocab import mask_other

OWN = ("blocks",)


def init_params(num_heads: int, hidden_size: int, dtype=jnp.float32) -> dict:
  """Zero residual blocks: every head starts as the target's own LM head (Medusa's init)."""
  return {"blocks": jnp.zeros((num_heads, hidden_size, hidden_size), dtype)}


def head_features(params, feature):
  """feature [..., E] -> each head's input to the output head [..., K, E]."""
  return feature[..., None, :] + jax.nn.silu(jnp.einsum("...e,kef->...kf", feature, params["blocks"]))


def logits(params, feature, reduced: bool):
  """feature [..., E] -> float32 logits [..., K, V'] (a reduced vocabulary's OTHER masked)."""
  out = jnp.dot(head_features(params, feature), params["head"]).astype(jnp.float32)
  return mask_other(out) if reduced else out
