"""Whether a greedy run that parted from `ar` parted at a near-tie of the target.

Greedy speculative decoding commits the target's argmax at every position, as `ar` does, but
reads it from forwards of other widths (a round verifies several tokens at once). Their products
round differently: on a GPU float32 products use TF32 by JAX's default, and in bfloat16 any
accelerator rounds coarsely. Where the target's two best logits are within that rounding of each
other, the two runs can pick different tokens and go on differently from there. The margin
between the target's two best logits where the runs part tells a near-tie (a margin far below
the answer's typical one) from a fault (a wide margin overruled).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward


def top2_margins(params, config: ModelConfig, prompt: list[int], answer: list[int]) -> np.ndarray:
  """[len(answer) + 1] float32: the target's top-1 minus top-2 logit at each answer position and
  at the one after it, from one causal forward over prompt + answer (each row predicts the next
  token)."""
  tokens = list(prompt) + list(answer)
  n = len(tokens)
  if not prompt or n > config.max_position_embeddings:
    raise ValueError(f"top2_margins: {len(prompt)} prompt + {len(answer)} answer tokens do not fit "
                     f"1..{config.max_position_embeddings} positions")
  cache = KVCache.init(config, 1, n)
  logits, _, _ = forward(params, config, jnp.asarray([tokens]), jnp.arange(n)[None], cache,
                         causal_attend(cache.lengths, n, n))
  rows = np.asarray(logits[0, len(prompt) - 1:], np.float32)          # [len(answer) + 1, V]
  best_two = np.partition(rows, -2, axis=-1)[:, -2:]                 # the two largest, unordered
  return best_two.max(-1) - best_two.min(-1)


def parting(margins: np.ndarray, at: int) -> dict:
  """What the margin where two runs part says, against the margins of the rest of the answer:
  {margin, smaller_in_answer (how many positions had a smaller one), median_margin}."""
  return {"margin": float(margins[at]), "smaller_in_answer": int((margins < margins[at]).sum()),
          "median_margin": float(np.median(margins))}
