"""Each level's long cache, built from the prompt: the target's full cache by prefill, a draft
model's, and from them the retrieval and StreamingLLM caches the levels read (and a feature
drafter's own, by its prefill_cache)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax import sharding
from hitree_jax.decode import retrieve
from hitree_jax.cache.full import KVCache
from hitree_jax.cache.retrieval import select
from hitree_jax.cache.streaming import StreamingCache
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode.loop import Weights
from hitree_jax.decode.sizes import LevelPlan, StackSizes
from hitree_jax.cache.kinds import Full, Streaming
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import rope_inv_freq

def prefill_levels(sizes: StackSizes, weights: Weights, config: ModelConfig, batch: prefill_lib.PromptBatch,
                   slots: int, tail: int, programs: programs_lib.Programs):
  """Prefills what each level keeps: -> ((first logits [B, V], the last prompt tokens' hidden
  states [B, E] for a feature drafter, else None), long caches per level)."""
  params, mesh = weights.target, sizes.mesh
  full = sizes.levels[-1].place_long(KVCache.init(config, batch.batch, slots), mesh)
  first_logits, full, *hidden = prefill_lib.prefill(params, config, full, batch, programs,
                                                    all_hidden=sizes.reads_features,
                                                    taps=sizes.feature_taps)
  draft_full = None
  if sizes.stack.draft_config is not None:
    draft = weights.draft
    draft_batch = dataclasses.replace(batch, tokens=np.asarray(draft.to_draft(batch.tokens)))
    draft_empty = sharding.place_cache(KVCache.init(sizes.draft, batch.batch, slots), mesh,
                                       heads=sharding.splits(sizes.draft, mesh))
    _, draft_full = prefill_lib.prefill(draft.params, sizes.draft, draft_empty, draft_batch, programs)
  last_tokens = jnp.asarray(batch.tokens[np.arange(batch.batch), batch.lengths - 1])
  longs = []
  for level in sizes.levels:
    if level.is_drafter and sizes.drafter.prefills_own_cache:  # e.g. EAGLE's, from the prompt's features
      empty = level.place_long(KVCache.init(level.config, batch.batch, slots), mesh)
      longs.append(sizes.drafter.prefill_cache(weights.draft.params, params, level.config, empty, batch,
                                               hidden[0] if hidden else None, programs))
      continue
    long = derived_long_cache(sizes, level, full, draft_full, params, last_tokens, tail)
    # Each level's cache is its own buffer (the decode loop donates them).
    longs.append(jax.tree.map(jnp.copy, long) if any(long is c for c in longs) else long)
  last_hidden = hidden[0][np.arange(batch.batch), batch.lengths - 1] if hidden else None
  return (first_logits, last_hidden), tuple(level.place_long(c, mesh) for level, c in zip(sizes.levels, longs))


def derived_long_cache(sizes: StackSizes, level: LevelPlan, full: KVCache, draft_full: KVCache | None, params,
                       last_tokens, tail: int):
  """A level's long cache, made from the prefilled full caches of the target and of the draft
  model (None for a level without one). Traceable: memory_plan takes its shapes with eval_shape."""
  kind = level.cache
  source = draft_full if level.weights == "draft" else full
  if kind is None:
    return None
  if isinstance(kind, Full):
    return source
  if isinstance(kind, Streaming):
    shift_freq = jnp.asarray(rope_inv_freq(level.config)) if kind.reindex else None
    return streaming_cache(source, kind.sinks, kind.window, shift_freq)
  return select_retrieval(params, sizes.target, full, last_tokens, kind.budget, kind.chunk, tail,
                          sharding.sequence_shards(sizes.mesh))


@functools.partial(jax.jit, static_argnums=(1, 2))
def streaming_cache(full: KVCache, sinks: int, window: int, shift_freq) -> StreamingCache:
  """A StreamingLLM cache of `sinks` + `window` slots kept from a prefilled full cache (jitted)."""
  return StreamingCache.from_prefill(full, sinks, window, shift_freq)


@functools.partial(jax.jit, static_argnums=(1, 4, 5, 6, 7))
def select_retrieval(params, config, full, last_tokens, budget: int, chunk: int, tail: int, shards: int):
  """A retrieval cache of `budget` slots (+ `tail`) chosen from a prefilled full cache by its last
  tokens' queries (jitted; shards: the full cache's slot shards, sharding.sequence_shards)."""
  return retrieve.from_full(params, config, full, last_tokens, budget, chunk, tail, shards)


# select_retrieval in two programs, for several budgets over one cache (the planner's profile): the
# queries run the model's layers, a program of several seconds to compile (5 s at 7.5K tokens on
# 2 cores); the choice per budget is a small one.
retrieval_queries = jax.jit(retrieve.queries, static_argnums=(1,))
select_by_queries = jax.jit(select, static_argnums=(2, 3, 4, 5))
