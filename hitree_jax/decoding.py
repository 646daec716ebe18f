"""Prompt batching, chunked prefill and the `ar` (autoregressive) decoder.

Prefill is a host loop over fixed-size chunks: one compiled program per
(chunk size, cache bucket), one host dispatch per chunk, and a long prompt
never materialises a P x P score matrix. Decoding is one jitted program (two
nested `lax.while_loop`s, see `_ar_loop`): the host launches it once and
reads the finished tokens. Rows of a batch have their own prompt length and
cache cursor, so prompts of different lengths decode side by side.

Programs are compiled ahead of time (`jit(...).lower(...).compile()`) and
memoised by shape, so compile time is measured apart from run time and a
second generation of the same shape bucket compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax import compile_cache
from hitree_jax.config import ModelConfig
from hitree_jax.kv_cache import KVCache, causal_attend
from hitree_jax.model import forward, hidden_states, logits_from_hidden
from hitree_jax.sampling import SamplingParams, sample

CACHE_BUCKET = 256   # cache slots are rounded up to this, so nearby prompt lengths share programs
MAX_PREFILL_CHUNK = 512
RECENT_SLOTS = 32    # decode block: tokens written to a short cache before it is appended to the long one


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  tokens: np.ndarray   # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32

  @property
  def batch(self) -> int:
    return self.tokens.shape[0]


def make_batch(prompts: Sequence[Sequence[int]], config: ModelConfig,
               max_new_tokens: int) -> PromptBatch:
  """Validates prompts (lists of token ids, lengths may differ) and pads them."""
  if isinstance(prompts, np.ndarray) and prompts.ndim != 2:
    raise ValueError(f"prompts array must be [batch, length]; got shape {prompts.shape}")
  if len(prompts) == 0:
    raise ValueError("no prompts given")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  rows = []
  for i, p in enumerate(prompts):
    p = np.asarray(p)
    if p.ndim != 1:
      raise ValueError(f"prompt {i} must be a flat list of token ids; got shape {p.shape}")
    if p.size == 0:
      raise ValueError(f"prompt {i} is empty")
    if not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"prompt {i} has dtype {p.dtype}; token ids must be integers")
    bad = p[(p < 0) | (p >= config.vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {i} has token id {int(bad[0])} outside the vocabulary "
                       f"[0, {config.vocab_size})")
    total = p.size + max_new_tokens
    if total > config.max_position_embeddings:
      raise ValueError(
          f"prompt {i} has {p.size} tokens; with max_new_tokens={max_new_tokens} that is "
          f"{total} > the model's context of {config.max_position_embeddings}")
    rows.append(p.astype(np.int32))
  lengths = np.array([r.size for r in rows], np.int32)
  tokens = np.zeros((len(rows), lengths.max()), np.int32)
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


def compiler_options() -> dict:
  """XLA options for the decoding programs on the current backend.

  On CPU, XLA's YNNPACK dot fusions multiply a few rows (a speculative
  round's 2-16 tokens) by a weight matrix 2-3x slower than its Eigen kernels
  (SmolLM2, 4 tokens: 104 ms per target forward with them, 67 ms without);
  one row and long prompts run the same either way. Scoped to our programs, not
  set process-wide.
  """
  return {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else {}


class _Compiled:
  """Memo of AOT-compiled programs, with the time spent compiling.

  compiles counts programs XLA really compiled; cache_loads those the
  persistent compilation cache (compile_cache.enable) served from disk.
  """

  def __init__(self):
    self._programs = {}
    self.compile_s = 0.0
    self.compiles = 0
    self.cache_loads = 0

  def get(self, key, jitted, *example_args):
    if key not in self._programs:
      start = time.perf_counter()
      hits, misses = compile_cache.EVENTS.hits, compile_cache.EVENTS.misses
      self._programs[key] = jitted.lower(*example_args).compile(compiler_options())
      self.compile_s += time.perf_counter() - start
      if compile_cache.EVENTS.hits > hits and compile_cache.EVENTS.misses == misses:
        self.cache_loads += 1
      else:
        self.compiles += 1
    return self._programs[key]

  def counts(self) -> tuple[float, int, int]:
    """(compile_s, compiles, cache_loads) so far; subtract two to get one call's share."""
    return self.compile_s, self.compiles, self.cache_loads


COMPILED = _Compiled()


def _shape_key(tree) -> tuple:
  return tuple((x.shape, str(x.dtype)) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x
               for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _prefill_chunk(params, config: ModelConfig, cache: KVCache, tokens, start, lengths,
                   last_hidden):
  """Runs prompt tokens [B, C] at slots start..start+C-1; keeps each row's last-token hidden.

  The chunk attends causally to itself (a C-slot cache) and to the `start`
  slots already in `cache` (read-only context, in blocks), then is appended.
  """
  batch, chunk = tokens.shape
  cache = cache.replace(lengths=jnp.full((batch,), start, jnp.int32))
  own = KVCache.init(config, batch, chunk)
  positions = start + jnp.broadcast_to(jnp.arange(chunk), (batch, chunk))
  attend = causal_attend(own.lengths, chunk, chunk)
  hidden, own = hidden_states(params, config, tokens, positions, own, attend, context=(cache,))
  cache = cache.append(own.advance(chunk))
  index = lengths - 1 - start                                      # [B]
  picked = jnp.take_along_axis(hidden, jnp.clip(index, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
  in_chunk = (index >= 0) & (index < chunk)
  return cache, jnp.where(in_chunk[:, None], picked, last_hidden)


@functools.partial(jax.jit, static_argnums=(1,))
def _last_logits(params, config: ModelConfig, last_hidden):
  return logits_from_hidden(params, config, last_hidden)


def prefill(params, config: ModelConfig, cache: KVCache, batch: PromptBatch):
  """Fills the cache with the prompts; returns (logits [B, V] of each last prompt token, cache)."""
  chunk = prefill_chunk_size(int(batch.lengths.max()))
  padded = round_up(batch.tokens.shape[1], chunk)
  tokens = np.zeros((batch.batch, padded), np.int32)
  tokens[:, :batch.tokens.shape[1]] = batch.tokens
  lengths = jnp.asarray(batch.lengths)
  last_hidden = jnp.zeros((batch.batch, config.hidden_size), jnp.dtype(config.dtype))
  args = (params, config, cache, tokens[:, :chunk], jnp.int32(0), lengths, last_hidden)
  step = COMPILED.get(("prefill", config, _shape_key(args)), _prefill_chunk, *args)
  for start in range(0, padded, chunk):
    cache, last_hidden = step(params, cache, tokens[:, start:start + chunk], jnp.int32(start),
                              lengths, last_hidden)
  logits_fn = COMPILED.get(("logits", config, _shape_key((params, last_hidden))), _last_logits,
                           params, config, last_hidden)
  return logits_fn(params, last_hidden), cache.replace(lengths=lengths)


@functools.partial(jax.jit, static_argnums=(1, 5), donate_argnums=(2,))
def _ar_loop(params, config: ModelConfig, cache: KVCache, first_logits, sampling: SamplingParams,
             max_new_tokens: int, eos_id, key):
  """The whole autoregressive decode as one program of two nested while_loops.

  The long cache is read-only inside a block of RECENT_SLOTS tokens, whose
  keys/values go to a short cache; the block's end appends it to the long one.
  Writing the long cache on every token made XLA:CPU copy every layer's
  buffer per token (2-3x the cost of reading it); this way the copy happens
  once per block. Returns (tokens [B, N] (-1 after EOS), n_tokens [B], cache).
  """
  batch = first_logits.shape[0]
  key, sub = jax.random.split(key)
  first = sample(sub, first_logits, sampling)
  out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
  running = lambda step, done: (step < max_new_tokens) & ~jnp.all(done)

  def block(state):
    step, cache, last, out, done, n_tokens, key = state

    def token_step(inner):
      j, step, recent, last, out, done, n_tokens, key = inner
      key, sub = jax.random.split(key)
      positions = (cache.lengths + recent.lengths)[:, None]
      attend = causal_attend(recent.lengths, 1, recent.max_len)
      fed = jnp.maximum(last, 0)[:, None]  # finished rows hold -1; feed them any valid id
      logits, _, recent = forward(params, config, fed, positions, recent, attend, context=(cache,))
      token = jnp.where(done, -1, sample(sub, logits[:, 0], sampling))
      out = out.at[:, step].set(token)
      n_tokens = n_tokens + (~done).astype(jnp.int32)
      done = done | (token == eos_id)
      return j + 1, step + 1, recent.advance(1), token, out, done, n_tokens, key

    recent = KVCache.init(config, batch, RECENT_SLOTS)
    inner = (jnp.int32(0), step, recent, last, out, done, n_tokens, key)
    _, step, recent, last, out, done, n_tokens, key = jax.lax.while_loop(
        lambda s: (s[0] < RECENT_SLOTS) & running(s[1], s[5]), token_step, inner)
    return step, cache.append(recent), last, out, done, n_tokens, key

  state = (jnp.int32(1), cache, first, out, first == eos_id, jnp.ones((batch,), jnp.int32), key)
  _, cache, _, out, _, n_tokens, _ = jax.lax.while_loop(lambda s: running(s[0], s[4]), block, state)
  return out, n_tokens, cache


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]   # generated ids per row (up to and including EOS)
  prefill_s: float
  decode_s: float
  compile_s: float          # compile time spent inside this call
  compiles: int             # programs XLA compiled inside this call
  # Speculative methods only:
  target_forwards: int | None = None           # batched target forwards in the decode loop
  rounds_per_row: list[int] | None = None      # target forwards while each row was generating
  accepted_per_depth: list[int] | None = None  # draft tokens accepted at each tree depth, all rows
  cache_loads: int = 0      # programs the persistent compilation cache served inside this call
  levels: list[dict] | None = None  # per verifying level: forwards, proposed, accepted, acceptance

  @property
  def mean_accepted(self) -> float | None:
    """Tokens committed per target forward in the decode loop, averaged over rows (ar: 1)."""
    if not self.rounds_per_row:
      return None
    per_row = [(len(t) - 1) / r for t, r in zip(self.tokens, self.rounds_per_row) if r]
    return sum(per_row) / len(per_row) if per_row else None

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens produced by the decode loop (all but the first, which prefill yields) per second."""
    n = sum(max(len(t) - 1, 0) for t in self.tokens)
    return n / self.decode_s if self.decode_s > 0 else float("nan")


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams | None = None, seed: int = 0,
             stop_at_eos: bool = True) -> GenerationResult:
  """Autoregressive (`ar`) generation for a batch of prompts of any lengths."""
  sampling = sampling or SamplingParams.create()
  batch = make_batch(prompts, config, max_new_tokens)
  counts_before = COMPILED.counts()
  cache = KVCache.init(config, batch.batch, cache_slots(batch.tokens.shape[1], max_new_tokens))

  start = time.perf_counter()
  first_logits, cache = prefill(params, config, cache, batch)
  first_logits.block_until_ready()
  prefill_s = time.perf_counter() - start - (COMPILED.compile_s - counts_before[0])

  eos = jnp.int32(config.eos_token_id if stop_at_eos and config.eos_token_id is not None else -1)
  key = jax.random.key(seed)
  args = (params, config, cache, first_logits, sampling, max_new_tokens, eos, key)
  loop = COMPILED.get(("ar", config, max_new_tokens, _shape_key(args)), _ar_loop, *args)
  start = time.perf_counter()
  out, n_tokens, _ = loop(params, cache, first_logits, sampling, eos, key)
  out, n_tokens = np.asarray(out), np.asarray(n_tokens)
  decode_s = time.perf_counter() - start
  return GenerationResult(
      tokens=[out[b, :n_tokens[b]].tolist() for b in range(batch.batch)],
      prefill_s=prefill_s, decode_s=decode_s,
      **compile_counts(counts_before))


def compile_counts(before: tuple[float, int, int]) -> dict:
  """GenerationResult's compile fields for what COMPILED did since `before` (COMPILED.counts())."""
  compile_s, compiles, loads = (now - then for now, then in zip(COMPILED.counts(), before))
  return dict(compile_s=compile_s, compiles=compiles, cache_loads=loads)
