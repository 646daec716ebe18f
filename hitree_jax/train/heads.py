"""Training drafts on the target's features (heads/); a trained one is saved by heads/saved.py.

Data: the teacher's features (final-normed hidden states) and top-k next-token
log-probabilities on book windows (distill.prepare_labels(features=True)).

EAGLE's objective at position i, reading token x_i and the feature f_{i-1}:

  cross-entropy of the draft's distribution of x_{i+1} to the teacher's top-k
  + feature_weight x Huber(f^_i, f_i)          (EAGLE's feature regression)
  + the cross-entropy of a second pass that reads the first pass's predicted
    features instead of the true ones, attending to the first pass's keys of
    earlier positions: exactly what a depth-2 tree node sees while drafting
    (a one-step "training-time test", EAGLE-3).

Medusa's objective: head k at position i, reading f_i, against the teacher's
distribution of token i+1+k (its labels at position i+k), weighted 0.8^(k-1)
as in Medusa.

The embedding and the output head are the target's, frozen (`frozen`); only
the draft's own parameters train (EAGLE: fc, the layer, the output norm;
Medusa: the residual blocks). A trained draft is a folder: an orbax
checkpoint plus `heads.json` (its kind, shape, vocabulary and how it was made).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.heads import eagle, medusa
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import final_states


def token_cross_entropy(logits, ids, probs):
  """[...] per position: the cross-entropy of logits [..., V'] to the teacher's top-k (ids, probs
  [..., k]; a zero probability, e.g. a token outside a reduced vocabulary, counts nothing)."""
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ids, axis=-1)
  return -jnp.sum(jnp.where(probs > 0, probs * picked, 0.0), axis=-1)


def _cross_entropy(logits, ids, probs):
  """(mean token_cross_entropy, top-1 agreement with the teacher)."""
  return token_cross_entropy(logits, ids, probs).mean(), jnp.mean(jnp.argmax(logits, axis=-1) == ids[..., 0])


def two_passes(params, config: ModelConfig, embedding, tokens, features, unroll: bool = True, *,
               before=None, positions=None, context: tuple[KVCache, ...] = ()):
  """The draft over windows tokens [B,T] with the target's features [B,T,E] (with taps
  [B,T,(k+1)E]) -> (f^ [B,T,E] read from the true features; f^ [B,T,E] read from the first pass's
  predictions, or None): the second pass's position i sees the first pass's keys before it and
  its own key.

  By default a window starts the sequence (position 0 reads a zero feature). Continuing one
  instead (planner/profile.py): before [B,E] (or [B,(k+1)E]), the feature its first token reads;
  positions [B,T]; context, the draft's caches of the tokens before it, which both passes attend to."""
  batch, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
  cache = KVCache.init(config, batch, 2 * t)                 # slots: pass 1, then pass 2
  earlier = causal_attend(cache.lengths, t, t)
  prev = eagle.shifted(eagle.fuse(params, features))
  if before is not None:
    prev = prev.at[:, 0].set(eagle.fuse(params, before).astype(prev.dtype))
  predicted, cache = eagle.features(params, config, embedding, tokens, prev, positions, cache,
                                    jnp.pad(earlier, ((0, 0), (0, 0), (0, t))), context=context)
  if not unroll:
    return predicted, None
  own = jnp.broadcast_to(jnp.eye(t, dtype=bool), (batch, t, t))
  again, _ = eagle.features(params, config, embedding, tokens, eagle.shifted(predicted), positions,
                            cache, jnp.concatenate([earlier & ~own, own], axis=2),
                            write_at=jnp.full((batch,), t, jnp.int32), context=context)
  return predicted, again


@functools.lru_cache(maxsize=None)
def eagle_objective(config: ModelConfig, reduced: bool, feature_weight: float = 1.0, unroll: bool = True):
  """loss(params, frozen, tokens [B,T] target ids, features [B,T,E] (with taps [B,T,(k+1)E]),
  ids [B,T,k] draft ids, probs [B,T,k]) -> (loss, first-pass top-1 agreement); one object per
  setting (jit-static). The regression's target is the final states (a tree node reads them)."""

  def loss(params, frozen, tokens, features, ids, probs):
    features = features.astype(jnp.float32)
    full = dict(params, head=frozen["head"])
    predicted, again = two_passes(full, config, frozen["embedding"], tokens, features, unroll)
    ce, agree = _cross_entropy(eagle.logits(full, predicted, reduced), ids, probs)
    total = ce + feature_weight * jnp.mean(optax.huber_loss(predicted, final_states(features, config)))
    if again is not None:
      total = total + _cross_entropy(eagle.logits(full, again, reduced), ids, probs)[0]
    return total, agree

  return loss


@functools.lru_cache(maxsize=None)
def medusa_objective(num_heads: int, reduced: bool, decay: float = 0.8):
  """loss(params, frozen, tokens, features, ids, probs) -> (loss, head 1's top-1 agreement)."""

  def loss(params, frozen, tokens, features, ids, probs):
    del tokens
    logits = medusa.logits(dict(params, head=frozen["head"]), features.astype(jnp.float32), reduced)
    total, agree = 0.0, None
    for h in range(num_heads):                      # head h + 1 at i guesses token i + h + 2
      k = h + 1
      ce, hits = _cross_entropy(logits[:, :-k, h], ids[:, k:], probs[:, k:])
      total = total + decay ** h * ce
      agree = hits if agree is None else agree
    return total, agree

  return loss
