"""Speculative decoding (`sd`: a chain, `tree`: a token tree) as one on-device program.

Each round: the drafter fills the tree after the last emitted token (the
root); one target forward runs root + all nodes with the tree mask
(positions: committed length + depth); `verify` accepts a path and draws the
next token; `commit` gathers the root's and the accepted nodes' keys/values
into contiguous slots. Rows accept different numbers of tokens: each has its
own cache length and output cursor, nothing changes shape.

A DynamicTree (EAGLE-2) is chosen by the drafter in the round, per row: the
round then reads each row's own depths, mask and children (dynamic_tree.RowTrees)
instead of the static tree's; shapes are the same, so nothing recompiles.

Caches as in decoding.py: the long cache is read-only inside a block of
rounds, whose keys/values go to a short `recent` cache that is appended to the
long one when it could not hold another round.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax import decoding
from hitree_jax.config import ModelConfig
from hitree_jax.drafters import DraftWeights, ModelDrafter, round_attend, tree_attend_mask
from hitree_jax.kv_cache import KVCache
from hitree_jax.model import forward
from hitree_jax.sampling import SamplingParams, probabilities, sample
from hitree_jax.tree import DynamicTree, TokenTree
from hitree_jax.verify import verify


def recent_slots(tree: TokenTree | DynamicTree) -> int:
  return max(decoding.RECENT_SLOTS, 4 * (tree.size + 1))


@functools.partial(jax.jit, static_argnums=(1, 5, 6, 7))
def _spec_loop(params, config: ModelConfig, cache: KVCache, first_logits, sampling: SamplingParams,
               max_new_tokens: int, tree: TokenTree | DynamicTree, drafter, eos_id, key, history, history_len,
               draft: DraftWeights | None, draft_cache: KVCache | None):
  """Returns (tokens [B, N + slack] (-1 padded), n_tokens [B], rounds [B], accepted_per_depth [D]).

  rounds[b]: target forwards in which row b was still generating. draft /
  draft_cache: a ModelDrafter's weights and prefilled cache (else None).
  """
  batch, n_nodes = first_logits.shape[0], tree.size
  span = n_nodes + 1                                    # root + nodes written per round
  width = recent_slots(tree)
  dynamic = isinstance(tree, DynamicTree)   # each row's tree is chosen in the round
  rows = jnp.arange(batch)

  key, sub = jax.random.split(key)
  first = sample(sub, first_logits, sampling)
  out = jnp.full((batch, max_new_tokens + span), -1, jnp.int32).at[:, 0].set(first)
  n_out = jnp.ones((batch,), jnp.int32)
  done = (first == eos_id) | (n_out >= max_new_tokens)
  history = history.at[rows, history_len].set(first)
  history_len = history_len + 1
  stats = (jnp.zeros((batch,), jnp.int32), jnp.zeros((tree.max_depth,), jnp.int32))

  def one_round(state, caches):
    cache, draft_cache = caches
    (recent, draft_recent), out, n_out, done, history, history_len, key, (rounds, per_depth) = state
    key, k_draft, k_verify = jax.random.split(key, 3)
    root = history[rows, history_len - 1]
    base = cache.lengths + recent.lengths                              # committed tokens
    inputs = dict(history=history, history_len=history_len, params=params, config=config,
                  root=root, base=base, long=cache, recent=recent, sampling=sampling,
                  draft=draft, draft_long=draft_cache, draft_recent=draft_recent)
    if dynamic:
      tokens, trees, draft_recent = drafter.propose_dynamic(tree, **inputs)
      tree_mask, children = trees.attend, trees.children
      positions, q = base[:, None] + jnp.pad(trees.depth, ((0, 0), (1, 0))), None  # [B, span]
    else:
      positions = base[:, None] + jnp.asarray(np.concatenate([[0], tree.depth]), jnp.int32)
      tokens, q, draft_recent = drafter.propose(k_draft, tree, positions=positions, **inputs)
      tree_mask, children = tree_attend_mask(tree), None
    fed = jnp.concatenate([root[:, None], tokens], axis=1)             # [B, span]
    attend = round_attend(recent.lengths, width, tree_mask)
    logits, _, recent = forward(params, config, fed, positions, recent, attend, context=(cache,))
    verdict = verify(k_verify, tree, tokens, probabilities(logits, sampling), q, drafter.mode,
                     children)

    # Commit root + accepted path; emit accepted tokens + the next token.
    n_acc = jnp.where(done, 0, verdict.n_accepted)
    path_slots = recent.lengths[:, None] + 1 + jnp.maximum(verdict.path, 0)
    slots = jnp.concatenate([recent.lengths[:, None], path_slots], axis=1)
    recent = recent.commit(slots, jnp.where(done, 0, 1 + n_acc))
    if draft_recent is not None:  # the draft wrote the same slots: keep the same path
      draft_recent = draft_recent.commit(slots, jnp.where(done, 0, 1 + n_acc))
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(verdict.path, 0), axis=1)
    j = jnp.arange(tree.max_depth + 1)[None, :]
    emitted = jnp.where(j < n_acc[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))),
                        verdict.next_token[:, None])                   # [B, D+1]
    n_emit = jnp.where(done, 0, n_acc + 1)
    is_eos = (emitted == eos_id) & (j < n_emit[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, tree.max_depth + 1), axis=1)
    n_emit = jnp.minimum(n_emit, first_eos + 1)
    valid = j < n_emit[:, None]
    out = out.at[rows[:, None], n_out[:, None] + j].set(jnp.where(valid, emitted, -1), mode="drop")
    history = history.at[rows[:, None], history_len[:, None] + j].set(emitted, mode="drop")
    n_out = n_out + n_emit
    history_len = history_len + n_emit
    done = done | (first_eos < n_emit) | (n_out >= max_new_tokens)
    live = (n_emit > 0).astype(jnp.int32)
    per_depth = per_depth + jnp.sum(
        (jnp.arange(tree.max_depth)[None, :] < n_acc[:, None]) * live[:, None], axis=0)
    return ((recent, draft_recent), out, n_out, done, history, history_len, key,
            (rounds + live, per_depth))

  def block(state):
    (cache, draft_cache), out, n_out, done, history, history_len, key, stats = state
    recent = KVCache.init(config, batch, width)
    draft_recent = None if draft_cache is None else KVCache.init(drafter.config, batch, width)
    inner = ((recent, draft_recent), out, n_out, done, history, history_len, key, stats)
    has_room = lambda s: jnp.max(s[0][0].lengths) + span <= width
    inner = jax.lax.while_loop(lambda s: has_room(s) & ~jnp.all(s[3]),
                               lambda s: one_round(s, (cache, draft_cache)), inner)
    (recent, draft_recent), out, n_out, done, history, history_len, key, stats = inner
    if draft_cache is not None:
      draft_cache = draft_cache.append(draft_recent)
    return (cache.append(recent), draft_cache), out, n_out, done, history, history_len, key, stats

  state = ((cache, draft_cache), out, n_out, done, history, history_len, key, stats)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s[3]), block, state)
  _, out, n_out, _, _, _, _, (rounds, per_depth) = state
  return out, jnp.minimum(n_out, max_new_tokens), rounds, per_depth


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, tree: TokenTree | DynamicTree,
             drafter, max_new_tokens: int, sampling: SamplingParams | None = None, seed: int = 0,
             stop_at_eos: bool = True, draft: DraftWeights | None = None
             ) -> decoding.GenerationResult:
  """Speculative generation; same result type as `decoding.generate`, plus round statistics.

  draft: the weights of a ModelDrafter (required for one, ignored otherwise).
  """
  sampling = sampling or SamplingParams.create()
  drafter.check(tree, config)
  if isinstance(drafter, ModelDrafter) and draft is None:
    raise ValueError("a ModelDrafter needs its weights: pass draft=DraftWeights.create(params, vocab)")
  batch = decoding.make_batch(prompts, config, max_new_tokens)
  span = tree.size + 1
  counts_before = decoding.COMPILED.counts()
  # Room for a round's candidates past the last kept token.
  slots = decoding.cache_slots(batch.tokens.shape[1], max_new_tokens, extra=recent_slots(tree))
  cache = KVCache.init(config, batch.batch, slots)

  start = time.perf_counter()
  first_logits, cache = decoding.prefill(params, config, cache, batch)
  draft_cache = None
  if isinstance(drafter, ModelDrafter):
    draft_batch = dataclasses.replace(batch, tokens=np.asarray(draft.to_draft(batch.tokens)))
    _, draft_cache = decoding.prefill(draft.params, drafter.config,
                                      KVCache.init(drafter.config, batch.batch, slots), draft_batch)
  else:
    draft = None
  first_logits.block_until_ready()
  prefill_s = time.perf_counter() - start - (decoding.COMPILED.compile_s - counts_before[0])

  history_width = decoding.round_up(batch.tokens.shape[1] + max_new_tokens + span, 128)
  history = np.zeros((batch.batch, history_width), np.int32)
  history[:, :batch.tokens.shape[1]] = batch.tokens
  eos = jnp.int32(config.eos_token_id if stop_at_eos and config.eos_token_id is not None else -1)
  args = (params, config, cache, first_logits, sampling, max_new_tokens, tree, drafter, eos,
          jax.random.key(seed), jnp.asarray(history), jnp.asarray(batch.lengths), draft,
          draft_cache)
  loop = decoding.COMPILED.get(("spec", config, max_new_tokens, tree, drafter,
                                decoding._shape_key(args)), _spec_loop, *args)
  start = time.perf_counter()
  out, n_tokens, rounds, per_depth = loop(*[a for i, a in enumerate(args) if i not in (1, 5, 6, 7)])
  out, n_tokens = np.asarray(out), np.asarray(n_tokens)
  decode_s = time.perf_counter() - start
  return decoding.GenerationResult(
      tokens=[out[b, :n_tokens[b]].tolist() for b in range(batch.batch)],
      prefill_s=prefill_s, decode_s=decode_s,
      **decoding.compile_counts(counts_before),
      target_forwards=int(np.max(rounds)), rounds_per_row=np.asarray(rounds).tolist(),
      accepted_per_depth=np.asarray(per_depth).tolist())
