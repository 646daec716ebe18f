"""A retrieval cache chosen by the target: its last tokens' queries, which the model recomputes
(model/llama.py last_token_projections), score a prefilled full cache's chunks
(cache/retrieval.py select, which knows nothing of the model, so cache/ does not import model/)."""

from __future__ import annotations

import jax

from hitree_jax.cache.full import KVCache
from hitree_jax.cache.retrieval import RetrievalCache, select
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import last_token_projections


def from_full(params, config: ModelConfig, full: KVCache, last_tokens: jax.Array, budget: int,
              chunk: int = 8, tail: int = 0, shards: int = 1) -> RetrievalCache:
  """The retrieval cache of a prefilled full cache, chosen by its last tokens' queries.

  last_tokens [B]: the token at slot lengths-1 of each row (the last prompt token).
  """
  return select(full, queries(params, config, full, last_tokens), budget, chunk, tail, shards)


def queries(params, config: ModelConfig, full: KVCache, last_tokens: jax.Array) -> jax.Array:
  """[L, B, H, D]: the last tokens' post-RoPE queries, which score the chunks (whatever the budget)."""
  return last_token_projections(params, config, full, last_tokens)["q_proj"]
