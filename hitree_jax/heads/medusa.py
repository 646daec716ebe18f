"""Medusa's heads: K residual blocks on the target's feature, head k guessing k tokens further.

The feature f_{r-1} of the token before the root r is what the target's LM
head turned into the root's distribution. Medusa head k (1..K) turns it into
a guess at the token k places after the root (Cai et al. 2024):

  x_k = f;  x_k <- x_k + SiLU(x_k W_kl + b_kl) for each of its L blocks;  logits_k = x_k @ head_k

A head reads no token and keeps no cache, so a round costs K small products
and no forward of any model; but head k's guess cannot depend on the tokens
between the root and its own position, and its acceptance falls quickly with
depth.

Two parameter sets take this form. Ours (launch.distill --kind=medusa): one block per head
without a bias, W_k zero at the start, and every head_k the target's own head on the draft's
vocabulary (vocab.py). FasterDecoding's published heads (heads/medusa_format.py): L blocks
with biases, and each head its own output matrix over the whole vocabulary.
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
  """feature [..., E] -> each head's input to its output matrix [..., K, E].

  params["blocks"]: [K, E, E] (one block each) or [K, L, E, E]; params["bias"] [K, L, E] if any."""
  blocks = params["blocks"]
  blocks = blocks[:, None] if blocks.ndim == 3 else blocks                    # [K, L, E, E]
  x = jnp.broadcast_to(feature[..., None, :], (*feature.shape[:-1], blocks.shape[0], feature.shape[-1]))
  for layer in range(blocks.shape[1]):
    h = jnp.einsum("...ke,kef->...kf", x, blocks[:, layer])
    if "bias" in params:
      h = h + params["bias"][:, layer]
    x = x + jax.nn.silu(h)
  return x


def logits(params, feature, reduced: bool):
  """feature [..., E] -> float32 logits [..., K, V'] (a reduced vocabulary's OTHER masked): each
  head's own output matrix (params["heads"] [K, E, V]) or the target's (params["head"] [E, V'])."""
  x = head_features(params, feature)
  if "heads" in params:
    out = jnp.einsum("...ke,kev->...kv", x, params["heads"]).astype(jnp.float32)
  else:
    out = jnp.dot(x, params["head"]).astype(jnp.float32)
  return mask_other(out) if reduced else out
