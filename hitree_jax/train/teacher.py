"""The teacher's next-token distributions over token windows, kept as top-k.

Why cache top-k rather than run the teacher in the training loop: a forward of
the 135M target costs about 9x a forward+backward of a 3-layer draft on this
CPU, so computing it once and reusing it for every epoch is the only way to
train for more than one pass in reasonable time. The top 32 tokens hold
nearly all of the mass of a language model's next-token distribution; the rest
is dropped and the top-k renormalised (`sparse_targets`).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward


def full_sequence(params, config: ModelConfig, tokens, taps: tuple[int, ...] = ()):
  """(logits [B, T, V] float32, final-normed hidden states [B, T, E]) of every position of
  windows tokens [B, T] (causal, positions 0..T-1); with taps, those layers' states come before
  the final ones in the hidden states [B, T, (len(taps)+1)E] (llama.Llama)."""
  batch, length = tokens.shape
  cache = KVCache.init(config, batch, length)
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  logits, hidden, _ = forward(params, config, tokens, positions, cache,
                              causal_attend(cache.lengths, length, length), taps=taps)
  return logits, hidden


def full_sequence_logits(params, config: ModelConfig, tokens):
  """Logits [B, T, V] float32 of every position of windows tokens [B, T] (causal, positions 0..T-1)."""
  return full_sequence(params, config, tokens)[0]


@functools.partial(jax.jit, static_argnums=(1, 3, 4))
def _topk_log_probs(params, config: ModelConfig, tokens, k: int, taps: tuple[int, ...]):
  logits, hidden = full_sequence(params, config, tokens, taps)
  values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
  return ids.astype(jnp.int32), values, hidden.astype(jnp.float16)


def teacher_topk(params, config: ModelConfig, windows: np.ndarray, k: int, batch: int = 4,
                 features: bool = False, taps: tuple[int, ...] = ()):
  """(ids [N, T, k] int32, log_probs [N, T, k] float32): the teacher's top-k at every position;
  with features, also its final-normed hidden states [N, T, E] in float16 (a feature draft's
  inputs and regression targets: heads/eagle.py), after the taps' states if any."""
  ids, values, hidden = [], [], []
  start = time.perf_counter()
  for i in range(0, len(windows), batch):
    chunk = windows[i:i + batch]
    pad = batch - len(chunk)
    chunk = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), chunk.dtype)]) if pad else chunk
    top_ids, top_values, chunk_hidden = _topk_log_probs(params, config, jnp.asarray(chunk), k, tuple(taps))
    ids.append(np.asarray(top_ids)[:batch - pad])
    values.append(np.asarray(top_values)[:batch - pad])
    if features:
      hidden.append(np.asarray(chunk_hidden)[:batch - pad])
    done = i + batch - pad
    logging.log_every_n_seconds(
        logging.INFO, "teacher: %d/%d windows, %.0f tokens/s", 30, done, len(windows),
        done * windows.shape[1] / (time.perf_counter() - start))
  out = np.concatenate(ids), np.concatenate(values)
  return (*out, np.concatenate(hidden)) if features else out


def own_continuations(params, config: ModelConfig, windows: np.ndarray, prompt_tokens: int, sampling,
                      seed: int = 0, batch: int = 64, progress=None) -> np.ndarray:
  """[N, T] windows whose first prompt_tokens are the book's and the rest the teacher's own
  continuation, sampled with `sampling`: the text a draft meets while decoding (ar, batched; the
  last batch is padded, so that one program serves every batch, and fewer windows than `batch`
  are one batch of their own size)."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.programs import Programs
  n, t = windows.shape
  batch = min(batch, n)
  out = windows.copy()
  programs = Programs()
  if progress:
    progress(0, -(-n // batch), "")
  for i in range(0, n, batch):
    rows = windows[i:i + batch, :prompt_tokens]
    pad = batch - len(rows)
    prompts = np.concatenate([rows, np.repeat(rows[-1:], pad, 0)]) if pad else rows
    result = engine.generate(params, config, prompts, max_new_tokens=t - prompt_tokens, sampling=sampling,
                             seed=seed + i, stop_at_eos=False, programs=programs)
    out[i:i + batch, prompt_tokens:] = np.asarray(result.tokens[:batch - pad], np.int32)
    if progress:
      progress(i // batch + 1, -(-n // batch), f"the teacher continued windows {i}-{i + len(rows)} of {n}")
  return out
