"""Prompt batching and chunked prefill.

Prefill is a host loop over fixed-size chunks: one compiled program per
(chunk size, cache bucket), one host dispatch per chunk, and a long prompt
never materialises a P x P score matrix. Rows of a batch have their own
prompt length and cache cursor, so prompts of different lengths decode side
by side.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.decode.programs import CPU_COPY_FREE, Programs, shape_key
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import final_states, hidden_states, logits_from_hidden

CACHE_BUCKET = 256   # cache slots are rounded up to this, so nearby prompt lengths share programs
MAX_PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  tokens: np.ndarray   # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32

  @property
  def batch(self) -> int:
    return self.tokens.shape[0]


def make_batch(prompts: Sequence[Sequence[int]], config: ModelConfig,
               max_new_tokens: int, width: int = 0) -> PromptBatch:
  """Validates prompts (lists of token ids, lengths may differ) and pads them to the longest, or
  to `width` tokens where that is more (the caches and programs are sized from the padded width)."""
  if isinstance(prompts, np.ndarray) and prompts.ndim != 2:
    raise UsageError(f"prompts array must be [batch, length]; got shape {prompts.shape}")
  if len(prompts) == 0:
    raise UsageError("no prompts given")
  if max_new_tokens < 1:
    raise UsageError(f"max_new_tokens={max_new_tokens} must be >= 1")
  rows = []
  for i, p in enumerate(prompts):
    p = np.asarray(p)
    if p.ndim != 1:
      raise UsageError(f"prompt {i} must be a flat list of token ids; got shape {p.shape}")
    if p.size == 0:
      raise UsageError(f"prompt {i} is empty")
    if not np.issubdtype(p.dtype, np.integer):
      raise UsageError(f"prompt {i} has dtype {p.dtype}; token ids must be integers")
    bad = p[(p < 0) | (p >= config.vocab_size)]
    if bad.size:
      raise UsageError(f"prompt {i} has token id {int(bad[0])} outside the vocabulary "
                       f"[0, {config.vocab_size})")
    total = p.size + max_new_tokens
    if total > config.max_position_embeddings:
      raise UsageError(
          f"prompt {i} has {p.size} tokens; with max_new_tokens={max_new_tokens} that is "
          f"{total} > the model's context of {config.max_position_embeddings}")
    rows.append(p.astype(np.int32))
  lengths = np.array([r.size for r in rows], np.int32)
  if width < 0 or width + max_new_tokens > config.max_position_embeddings:
    raise UsageError(f"caches sized for {width}-token prompts: with max_new_tokens={max_new_tokens} that "
                     f"is outside the model's context of {config.max_position_embeddings}")
  tokens = np.zeros((len(rows), max(int(lengths.max()), width)), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :r.size] = r
  return PromptBatch(tokens, lengths)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def prefill_chunk_size(prompt_len: int) -> int:
  """Power of two >= 16 covering short prompts, capped at MAX_PREFILL_CHUNK."""
  return min(MAX_PREFILL_CHUNK, max(16, 1 << math.ceil(math.log2(prompt_len))))


def cache_slots(prompt_len: int, max_new_tokens: int, extra: int = 0) -> int:
  return round_up(prompt_len + max_new_tokens + extra, CACHE_BUCKET)


@functools.partial(jax.jit, static_argnums=(1, 7), donate_argnums=(2,))
def prefill_chunk(params, config: ModelConfig, cache: KVCache, tokens, start, lengths,
                   last_hidden, taps: tuple[int, ...] = ()):
  """Runs prompt tokens [B, C] at slots start..start+C-1; keeps each row's last-token hidden
  and returns the chunk's hidden states [B, C, E] too (a feature draft's prefill reads them;
  with taps, [B, C, (len(taps)+1)E]: llama.hidden_states).

  The chunk attends causally to itself (a C-slot cache) and to the `start`
  slots already in `cache` (read-only context, in blocks), then is appended.
  """
  batch, chunk = tokens.shape
  cache = cache.replace(lengths=jnp.full((batch,), start, jnp.int32))
  own = KVCache.init(config, batch, chunk)
  positions = start + jnp.broadcast_to(jnp.arange(chunk), (batch, chunk))
  attend = causal_attend(own.lengths, chunk, chunk)
  hidden, own = hidden_states(params, config, tokens, positions, own, attend, context=(cache,), taps=taps)
  cache = cache.append(own.advance(chunk))
  index = lengths - 1 - start                                      # [B]
  picked = jnp.take_along_axis(hidden, jnp.clip(index, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
  in_chunk = (index >= 0) & (index < chunk)
  return cache, jnp.where(in_chunk[:, None], picked, last_hidden), hidden


@functools.partial(jax.jit, static_argnums=(1,))
def _last_logits(params, config: ModelConfig, last_hidden):
  return logits_from_hidden(params, config, last_hidden)


def chunked_tokens(batch: PromptBatch) -> tuple[np.ndarray, int]:
  """(the prompts padded to a whole number of chunks [B, P'], the chunk size)."""
  chunk = prefill_chunk_size(batch.tokens.shape[1])
  padded = round_up(batch.tokens.shape[1], chunk)
  tokens = np.zeros((batch.batch, padded), np.int32)
  tokens[:, :batch.tokens.shape[1]] = batch.tokens
  return tokens, chunk


def distinct_rows(batch: PromptBatch) -> tuple[PromptBatch, np.ndarray]:
  """(the batch's distinct prompts, in the order they first appear; index [B]: each row's among
  them)."""
  seen, index = {}, []
  for row, length in zip(batch.tokens, batch.lengths):
    index.append(seen.setdefault(row[:length].tobytes(), len(seen)))
  firsts = np.unique(np.asarray(index), return_index=True)[1]
  return PromptBatch(batch.tokens[firsts], batch.lengths[firsts]), np.asarray(index, np.int32)


def prefill(params, config: ModelConfig, cache: KVCache, batch: PromptBatch, programs: Programs,
            all_hidden: bool = False, taps: tuple[int, ...] = ()):
  """Fills the cache with the prompts; returns (logits [B, V] of each last prompt token, cache),
  and with all_hidden the hidden states of every position [B, P', E] (chunked_tokens' P') too
  (with taps, [B, P', (len(taps)+1)E], those layers' states first).
  Rows with the same prompt (several samples of one prompt) are prefilled once and copied: at
  7.5K tokens a row's prefill is 15 s on 2 cores. Only on one device: a cache split over a mesh is
  filled row by row as it lies."""
  distinct, index = distinct_rows(batch)
  if distinct.batch < batch.batch and len(cache.lengths.sharding.device_set) == 1:
    once = KVCache.init(config, distinct.batch, cache.max_len, cache.values[0].dtype, cache.keys[0].dtype)
    logits, once, *hidden = prefill(params, config, once, distinct, programs, all_hidden, taps)
    copies = lambda x: jnp.take(x, jnp.asarray(index), axis=0)
    return (copies(logits), jax.tree.map(copies, once), *map(copies, hidden))
  tokens, chunk = chunked_tokens(batch)
  padded = tokens.shape[1]
  lengths = jnp.asarray(batch.lengths)
  width = (len(taps) + 1) * config.hidden_size
  last_hidden = jnp.zeros((batch.batch, width), jnp.dtype(config.dtype))
  args = (params, config, cache, tokens[:, :chunk], jnp.int32(0), lengths, last_hidden, tuple(taps))
  step = programs.get(("prefill", config, shape_key(args)), prefill_chunk, *args, extra_cpu_options=CPU_COPY_FREE)
  hidden = []
  for start in range(0, padded, chunk):
    cache, last_hidden, chunk_hidden = step(params, cache, tokens[:, start:start + chunk],
                                            jnp.int32(start), lengths, last_hidden)
    if all_hidden:
      hidden.append(chunk_hidden)
  last_hidden = final_states(last_hidden, config)
  logits_fn = programs.get(("logits", config, shape_key((params, last_hidden))), _last_logits,
                           params, config, last_hidden)
  out = logits_fn(params, last_hidden), cache.replace(lengths=lengths)
  return (*out, jnp.concatenate(hidden, axis=1)) if all_hidden else out
