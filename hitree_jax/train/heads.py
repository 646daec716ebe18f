"""Training drafts on the target's features (heads/), and saving and loading them.

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
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.heads import eagle, medusa
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import final_states
from hitree_jax.model.vocab import ReducedVocab

META = "heads.json"
KINDS = {"eagle": eagle.TRAINED, "medusa": medusa.OWN}  # each kind's trained parameters


def frozen_arrays(target_params, vocab: ReducedVocab | None) -> dict:
  """What the draft reads from its target: the embedding [V, E] and the head on its ids [E, V']."""
  return {"embedding": target_params["embed_tokens"]["embedding"],
          "head": eagle.head_from_target(target_params, None if vocab is None else vocab.target_ids)}


def _cross_entropy(logits, ids, probs):
  log_q = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(log_q, ids, axis=-1)
  loss = -jnp.sum(jnp.where(probs > 0, probs * picked, 0.0), axis=-1).mean()
  return loss, jnp.mean(jnp.argmax(log_q, axis=-1) == ids[..., 0])


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


def save(path: pathlib.Path, kind: str, params, target_config: ModelConfig, vocab: ReducedVocab | None,
         meta: dict) -> None:
  """Writes the trained parameters and the vocabulary with orbax, and heads.json."""
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  own = {name: jax.tree.map(np.asarray, params[name]) for name in KINDS[kind] if name in params}
  tree = {"params": own, "target_ids": np.asarray(vocab.target_ids if vocab else [-1], np.int32)}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path / "checkpoint", tree, force=True)
  shape = dict(hidden_size=target_config.hidden_size, num_heads=target_config.num_heads,
               num_kv_heads=target_config.num_kv_heads, head_dim=target_config.head_dim,
               intermediate_size=target_config.intermediate_size,
               target_vocab_size=target_config.vocab_size, vocab_size=vocab.size if vocab else None)
  if kind == "medusa":
    shape["medusa_heads"] = int(params["blocks"].shape[0])
  (path / META).write_text(json.dumps({"kind": kind, **shape, **meta}, indent=1))


def read_meta(path, kind: str | None = None) -> dict:
  """heads.json of a saved draft (no weights read): FileNotFoundError naming the path, or
  ValueError when it is not of `kind`."""
  meta = pathlib.Path(path) / META
  if not meta.is_file():
    raise FileNotFoundError(f"{kind or 'feature'} draft {str(path)!r} not found: expected a folder "
                            f"with {META} (written by `python -m launch.distill --kind={kind or 'eagle'}`)")
  meta = json.loads(meta.read_text())
  if kind is not None and meta["kind"] != kind:
    raise ValueError(f"{str(path)!r} holds {meta['kind']} heads, not {kind}: use {meta['kind']}:{path}")
  return meta


def drafter(meta: dict, target_config: ModelConfig, mode: str = "deterministic"):
  """The EagleDrafter or MedusaDrafter a saved draft (its heads.json) describes."""
  from hitree_jax.heads.drafter import EagleDrafter, MedusaDrafter
  size = meta.get("vocab_size")
  reduced = target_config.vocab_size if size else None
  size = size or target_config.vocab_size
  if meta["kind"] == "medusa":
    return MedusaDrafter(meta["medusa_heads"], size, mode, reduced)
  return EagleDrafter(eagle.layer_config(target_config, size), mode, reduced,
                      taps=tuple(meta.get("taps", ())))


def check_target(meta: dict, target_config: ModelConfig, path) -> None:
  """Refuses a draft trained for a target of another shape (from heads.json alone)."""
  want = dict(hidden_size=target_config.hidden_size, num_heads=target_config.num_heads,
              num_kv_heads=target_config.num_kv_heads, target_vocab_size=target_config.vocab_size)
  wrong = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
  if wrong:
    raise ValueError(f"{meta['kind']} draft {str(path)!r} was trained for another target: " + ", ".join(
        f"{k} {got} (this target: {need})" for k, (got, need) in wrong.items()))


def load(path, target_params, target_config: ModelConfig, kind: str | None = None):
  """(heads.json, its params with the target's head on its ids, ReducedVocab or None)."""
  meta = read_meta(path, kind)
  check_target(meta, target_config, path)
  path = pathlib.Path(path).absolute()
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.restore(path / "checkpoint")
  ids = np.asarray(tree["target_ids"])
  vocab = ReducedVocab(ids, target_config.vocab_size) if ids.size > 1 else None
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(target_config.dtype)), tree["params"])
  params["head"] = frozen_arrays(target_params, vocab)["head"]
  return meta, params, vocab
