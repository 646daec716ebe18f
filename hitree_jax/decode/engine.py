"""One decoder for every stack (stack.py): `ar`, `sd` / `tree`, and hierarchies, on device.

Levels M0 (the drafter) < M1 ... < MK (the target), HSD's semantics. A top
round: the level below the target hands it a proposal -- the drafter's tree,
or an intermediate level's buffered chain -- and one target forward over
(root, proposal) with the tree mask is verified exactly (verify.py); the
accepted tokens and the next token are emitted. An intermediate level j
builds its chain by rounds of its own: ask level j-1 for a proposal, verify
it with one forward of its own model over its own cache, append what it
accepted plus its correction (or bonus) token, and the distribution it would
have sampled each of those from, until it holds at least gamma_j tokens.
Those distributions are the q the level above verifies with ("iid" rule on
a chain), so every level's output is distributed exactly as its own model's
and the top's as the target's. When a level rejects, every level below rolls
back to the accepted point (levels.LevelCache.rollback).

All levels extend one token buffer (`seq`): the prompt, the output, then
the buffers of the levels above the one working now. Rows keep their own
lengths and cursors at every level; nothing changes shape, and the whole
generation is one jitted program of nested while_loops: blocks (long caches
read-only inside, see levels.py), top rounds, and each intermediate level's
rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hitree_jax import sharding
from hitree_jax.cache import retrieval
from hitree_jax.cache.full import KVCache, dtypes_of
from hitree_jax.cache.streaming import StreamingCache
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode.drafters import DraftInputs, DraftWeights, Drafter, Proposal, round_attend, tree_attend_mask
from hitree_jax.decode.features import keep_features
from hitree_jax.decode.levels import Lead, LevelCache, commit, round_mask
from hitree_jax.decode.result import GenerationResult
from hitree_jax.decode.sampling import SamplingParams, probabilities, sample
from hitree_jax.decode.stack import Full, Retrieval, Stack, Streaming
from hitree_jax.decode.verify import verify
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward, rope_inv_freq
from hitree_jax.tree import shapes as tree_lib
from hitree_jax.tree.shapes import DynamicTree, TokenTree

MIN_RECENT_SLOTS = 32  # a block's recent cache: tokens a level writes before they go to its long one


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sizes of a stack's levels (index 0 = the drafter ... K = the target), and the mesh
  the program is partitioned over (None: one device)."""
  stack: Stack
  target: ModelConfig
  draft: ModelConfig | None
  mesh: Mesh | None = None

  @property
  def top(self) -> int:
    return self.stack.num_levels - 1

  @property
  def drafter(self) -> Drafter | None:
    return self.stack.drafter

  def is_drafter(self, j: int) -> bool:
    """Whether level j is the drafter (level 0 of a stack with more than the target)."""
    return j == 0 and self.top > 0

  def config(self, j: int) -> ModelConfig:
    if self.is_drafter(j):
      return self.drafter.level_config(self.target, self.draft)
    return self.draft if self.weights(j) == "draft" else self.target

  @property
  def reads_features(self) -> bool:
    """Whether the drafter reads the features of the level above's verify forwards."""
    return self.drafter is not None and self.drafter.reads_features

  @property
  def feature_taps(self) -> tuple[int, ...]:
    """The target's layers whose states a feature drafter reads beside the final ones (EAGLE-3)."""
    return () if self.drafter is None else tuple(self.drafter.taps)

  def weights(self, j: int) -> str | None:
    """Whose weights fill level j's long cache: "target", "draft", or None (the drafter's own)."""
    if j == self.top:
      return "target"
    if j == 0:
      return self.drafter.cache_weights
    return self.stack.verifiers[j - 1].weights

  def cache_kind(self, j: int):
    """The long cache of level j, or None for a level without one (n-gram, self-draft)."""
    if j == self.top:
      return Full()
    if j == 0:
      return self.drafter.cache
    return self.stack.verifiers[j - 1].cache

  def lead(self, j: int) -> int:
    """Most pending tokens level j can have: its root, one more for each level above that may
    accept all it was handed, and for a drafter with a static tree the leaf it never runs."""
    if j == 0 and self.cache_kind(0) is None:
      return self.lead(1)
    if self.is_drafter(j) and not self.drafter.keeps_tree:
      return self.top + self.stack.tree.max_depth  # it keeps none of its tree: the accepted path waits
    if j == 0 and isinstance(self.stack.tree, DynamicTree):
      return self.top  # it runs its whole tree: an accepted leaf is in its cache
    return self.top - j + 1

  def splits_heads(self, j: int) -> bool:
    """Whether level j's caches are split by KV head: those of the target's weights, which are."""
    return self.weights(j) == "target"

  def long_axes(self, j: int, cache):
    """The logical axes of level j's long cache: split by KV head (splits_heads), and by slot
    if it is a full cache."""
    return sharding.cache_axes(cache, heads=self.splits_heads(j), slots=isinstance(self.cache_kind(j), Full))

  def place_long(self, j: int, cache):
    """Level j's long cache on the mesh (long_axes)."""
    if self.mesh is None or cache is None:
      return cache
    return sharding.place(cache, self.long_axes(j, cache), self.mesh)

  def gamma(self, j: int) -> int:
    return self.stack.verifiers[j - 1].gamma

  def proposal_depth(self, j: int) -> int:
    """Most tokens a proposal of level j can hold on one path (its tree's depth, or buffer)."""
    return self.stack.tree.max_depth if j == 0 else self.buffer(j)

  def proposal_size(self, j: int) -> int:
    return self.stack.tree.size if j == 0 else self.buffer(j)

  def buffer(self, j: int) -> int:
    """Slots of level j's buffer: it stops at >= gamma, after a round of at most depth + 1."""
    return self.gamma(j) - 1 + self.proposal_depth(j - 1) + 1

  @property
  def round_extent(self) -> int:
    """A bound on the slots any level's recent cache can grow by, or write past, in a top round."""
    if self.top == 0:
      return 1
    buffers = sum(self.buffer(j) for j in range(1, self.top))
    widest = max(self.proposal_size(j) for j in range(self.top))
    return buffers + self.proposal_depth(0) + 1 + self.lead(0) + self.top + widest

  @property
  def recent_slots(self) -> int:
    return max(MIN_RECENT_SLOTS, 4 * self.round_extent)

  @property
  def max_emitted(self) -> int:
    """Most tokens one top round emits."""
    return 1 if self.top == 0 else self.proposal_depth(self.top - 1) + 1


@flax.struct.dataclass
class Stats:
  rounds: jax.Array     # [B] top rounds while each row was generating
  per_depth: jax.Array  # [D] the target's accepted proposal tokens at each depth, all rows
  forwards: jax.Array   # [K+1] batched forwards of each verifying level (0 for the drafter)
  proposed: jax.Array   # [K+1] tokens proposed to each level on the paths it could accept, live rows
  accepted: jax.Array   # [K+1] of those, accepted
  stopped: jax.Array    # [K+1] row-rounds whose accepted path stopped before the proposal's deepest token
  reselected: jax.Array  # [K+1] times each retrieval level chose its chunks again (Retrieval.reselect)


@flax.struct.dataclass
class LoopState:
  caches: tuple         # per level: LevelCache, or None (a drafter without a cache)
  seq: jax.Array        # [B, H] prompt + output + the buffers of levels above the working one
  end: jax.Array        # [B] sequence length; the root is seq[end - 1]
  out: jax.Array        # [B, N + slack] emitted tokens, -1 padded
  n_out: jax.Array      # [B]
  done: jax.Array       # [B]
  key: jax.Array
  stats: Stats
  features: jax.Array | None  # [B, L, E] level 1's features by position mod L, for a feature drafter


@flax.struct.dataclass
class Weights:
  """The jit arguments that are weights: the target's, and a draft model's (or None)."""
  target: dict
  draft: DraftWeights | None


@flax.struct.dataclass
class DecodeStart:
  """What the decode loop starts from beside the long caches (all traced: a new prompt, key or
  setting of the same shapes reuses the program)."""
  first: tuple               # (the last prompt tokens' logits [B, V], their features [B, F] or None)
  sampling: SamplingParams
  eos_id: jax.Array          # int32 scalar; -1: none
  key: jax.Array
  seq: jax.Array             # [B, S] the token history: each row's prompt, then room for its output
  end: jax.Array             # [B] each row's prompt length


@dataclasses.dataclass(frozen=True)
class Prefilled:
  """A generation after prefill, ready for `decode`: the stack's layout, the placed weights,
  every level's long cache (donated to the decode loop: used once), and the loop's start."""
  layout: Layout
  weights: Weights
  long_caches: tuple
  start: DecodeStart
  max_new_tokens: int


def _chain_proposal(seq, start, count, buffer_q, size: int) -> Proposal:
  """An intermediate level's buffer seq[start : start + count] as a chain the level above verifies."""
  index = start[:, None] + jnp.arange(size)[None, :]
  tokens = jnp.take_along_axis(seq, jnp.minimum(index, seq.shape[1] - 1), axis=1)
  # Position i (the root, then node i-1) has node i as its child while the chain holds it.
  position = jnp.arange(size + 1)[None, :]
  children = jnp.where(position < count[:, None], position, -1)[:, :, None]      # [B, size+1, 1]
  chain = tree_lib.chain(size)
  return Proposal(tokens=tokens, q=buffer_q, start=start, depth=jnp.asarray(chain.depth),
                  attend=jnp.asarray(tree_attend_mask(chain)), children=children.astype(jnp.int32))


class _Decoder:
  """The traced program for one Layout: closures over static sizes, pure in the arrays."""

  def __init__(self, layout: Layout, weights: Weights, sampling: SamplingParams, eos_id,
               max_new_tokens: int):
    self.layout, self.weights, self.sampling = layout, weights, sampling
    self.eos_id, self.max_new_tokens = eos_id, max_new_tokens
    self.width = layout.recent_slots

  # --- one level's forward and verification -------------------------------------------------

  def _level_probs(self, j: int, fed, positions, cache: LevelCache, attend, first: int):
    """Level j's forward over fed [B, T] (target ids) -> (probs [B, T - first, V_target] of the
    positions from `first` on, hidden states [B, T, E] (level 1's with the drafter's taps:
    llama.hidden_states), its recent cache with fed's keys/values written)."""
    layout = self.layout
    config = layout.config(j)
    if layout.weights(j) == "draft":
      draft = self.weights.draft
      logits, hidden, recent = forward(draft.params, config, draft.to_draft(fed), positions, cache.recent,
                                       attend, context=(cache.long,))
      probs = probabilities(draft.never_other(logits[:, first:]), self.sampling)
      return draft.target_probs(probs, layout.target.vocab_size), hidden, recent
    taps = layout.feature_taps if j == 1 else ()
    logits, hidden, recent = forward(self.weights.target, config, fed, positions, cache.recent, attend,
                                     context=(cache.long,), taps=taps)
    return probabilities(logits[:, first:], self.sampling), hidden, recent

  def _check(self, j: int, st: LoopState, prop: Proposal, mode: str, length, key, live):
    """Level j verifies `prop` with one forward; commits its cache (and a drafter's below);
    writes the emitted tokens after prop.start; rolls the levels below back.

    Returns (state, emitted [B, D+1], n_accepted [B], probs [B, D+1, V] each emitted token's law).
    """
    layout = self.layout
    cache = st.caches[j]
    lead = Lead.of(st.seq, prop.start, cache.cached, layout.lead(j))
    p = lead.size
    batch = prop.tokens.shape[0]
    depth = jnp.broadcast_to(prop.depth, prop.tokens.shape)
    positions = jnp.concatenate([lead.positions, prop.start[:, None] - 1 + depth], axis=1)
    attend = round_attend(cache.recent.lengths, self.width, round_mask(lead.valid, prop.attend))
    fed = jnp.concatenate([lead.tokens, prop.tokens], axis=1)
    probs, hidden, recent = self._level_probs(j, fed, positions, cache, attend, first=p - 1)  # root, nodes
    tree = self._proposal_tree(j - 1)
    verdict = verify(key, tree, prop.tokens, probs, prop.q, mode, prop.children)
    n_acc = jnp.where(live, verdict.n_accepted, 0)
    caches = list(st.caches)
    caches[j] = cache.replace(recent=commit(recent, lead, verdict.path, n_acc, live,
                                            base=cache.recent.lengths))
    if prop.committed:          # a drafter's own cache that holds what it keeps
      caches[j - 1] = prop.cache
    elif prop.cache is not None:  # a drafter's own cache, written in its round: keep the same path
      below = prop.cache
      below_lead = Lead.of(st.seq, prop.start, below.cached, layout.lead(j - 1))
      held = jnp.minimum(n_acc, prop.cached_depth)   # an accepted leaf waits in its next lead
      caches[j - 1] = below.replace(recent=commit(below.recent, below_lead, verdict.path, held, live))
    keep = prop.start + n_acc
    for i in range(j):
      if caches[i] is not None:
        caches[i] = caches[i].rollback(keep)

    rows = jnp.arange(batch)
    path = jnp.maximum(verdict.path, 0)
    k = jnp.arange(tree.max_depth + 1)[None, :]
    path_tokens = jnp.pad(jnp.take_along_axis(prop.tokens, path, axis=1), ((0, 0), (0, 1)))
    emitted = jnp.where(k < n_acc[:, None], path_tokens, verdict.next_token[:, None])  # [B, D+1]
    at = jnp.where(live[:, None] & (k <= n_acc[:, None]), prop.start[:, None] + k, st.seq.shape[1])
    seq = st.seq.at[rows[:, None], at].set(emitted, mode="drop")
    end = jnp.where(live, prop.start + n_acc + 1, prop.start)
    emitted_probs = jnp.take_along_axis(probs, jnp.concatenate(
        [jnp.zeros((batch, 1), jnp.int32), path + 1], axis=1)[:, :, None], axis=1)  # [B, D+1, V]

    stats = st.stats
    proposed = jnp.sum(jnp.where(live, length, 0))
    stats = stats.replace(forwards=stats.forwards.at[j].add(jnp.any(live).astype(jnp.int32)),
                          proposed=stats.proposed.at[j].add(proposed),
                          accepted=stats.accepted.at[j].add(jnp.sum(n_acc)),
                          stopped=stats.stopped.at[j].add(jnp.sum(live & (n_acc < length))))
    st = st.replace(caches=tuple(caches), seq=seq, end=end, stats=stats)
    if j == 1 and layout.reads_features:  # the features of what this forward accepted
      k = jnp.arange(path.shape[1])[None, :]
      nodes = jnp.take_along_axis(hidden[:, p:], path[:, :, None], axis=1)
      st = st.replace(features=keep_features(
          st.features, jnp.concatenate([hidden[:, :p], nodes], axis=1),
          jnp.concatenate([lead.positions, prop.start[:, None] + k], axis=1),
          jnp.concatenate([lead.valid, k < n_acc[:, None]], axis=1) & live[:, None]))
    return st, emitted, n_acc, emitted_probs

  def _proposal_tree(self, j: int):
    """The static shape of level j's proposals: the stack's tree, or a chain (a buffer)."""
    return self.layout.stack.tree if j == 0 else tree_lib.chain(self.layout.buffer(j))

  # --- proposals ------------------------------------------------------------------------------

  def _propose(self, j: int, st: LoopState, key):
    """-> (state, Proposal, its drawing rule, [B] tokens on its longest path): level j's
    proposal after the root seq[end - 1]."""
    if j > 0:
      return self._fill(j, st, key)
    layout, drafter, tree = self.layout, self.layout.stack.drafter, self.layout.stack.tree
    own = st.caches[0]
    cache = own if own is not None else st.caches[1]
    reader = 0 if own is not None else 1
    inputs = DraftInputs(seq=st.seq, end=st.end,
                         lead=Lead.of(st.seq, st.end, cache.cached, layout.lead(reader)),
                         cache=cache, params=self.weights.target, draft=self.weights.draft,
                         sampling=self.sampling, config=layout.target, features=st.features)
    if isinstance(tree, DynamicTree):
      prop = drafter.propose_dynamic(tree, inputs)
    else:
      prop = drafter.propose(key, tree, inputs)
    return st, prop, drafter.mode, jnp.full(st.end.shape, tree.max_depth, jnp.int32)

  def _fill(self, j: int, st: LoopState, key):
    """Level j's rounds until it holds >= gamma_j tokens (rows done stay as they are)."""
    layout = self.layout
    size, gamma = layout.buffer(j), layout.gamma(j)
    batch = st.end.shape[0]
    start = st.end
    buffer_q = jnp.zeros((batch, size + 1, layout.target.vocab_size), jnp.float32)
    count = jnp.zeros((batch,), jnp.int32)
    rows = jnp.arange(batch)[:, None]

    def live_rows(st, count):
      return ~st.done & (count < gamma)

    def one_round(carry):
      st, buffer_q, count, key = carry
      live = live_rows(st, count)
      key, k_propose, k_verify = jax.random.split(key, 3)
      st, prop, mode, length = self._propose(j - 1, st, k_propose)
      st, _, n_acc, probs = self._check(j, st, prop, mode, length, k_verify, live)
      k = jnp.arange(probs.shape[1])[None, :]
      at = jnp.where(live[:, None] & (k <= n_acc[:, None]), count[:, None] + k, size + 1)
      buffer_q = buffer_q.at[rows, at].set(probs, mode="drop")
      return st, buffer_q, jnp.where(live, count + n_acc + 1, count), key

    st, buffer_q, count, _ = jax.lax.while_loop(lambda c: jnp.any(live_rows(c[0], c[2])), one_round,
                                                (st, buffer_q, count, key))
    return st, _chain_proposal(st.seq, start, count, buffer_q, size), "iid", count

  # --- the target's round -----------------------------------------------------------------------

  def top_round(self, st: LoopState) -> LoopState:
    layout = self.layout
    top, batch = layout.top, st.end.shape[0]
    rows = jnp.arange(batch)
    key, k_propose, k_verify = jax.random.split(st.key, 3)
    live = ~st.done
    if top == 0:  # ar: one token from the target's distribution
      st, emitted, n_acc = self._ar_step(st, k_verify, live)
    else:
      st, prop, mode, length = self._propose(top - 1, st, k_propose)
      st, emitted, n_acc, _ = self._check(top, st, prop, mode, length, k_verify, live)
    k = jnp.arange(emitted.shape[1])[None, :]
    n_emit = jnp.where(live, n_acc + 1, 0)
    is_eos = (emitted == self.eos_id) & (k < n_emit[:, None])
    first_eos = jnp.min(jnp.where(is_eos, k, emitted.shape[1]), axis=1)
    n_emit = jnp.minimum(n_emit, first_eos + 1)
    out = st.out.at[rows[:, None], st.n_out[:, None] + k].set(
        jnp.where(k < n_emit[:, None], emitted, -1), mode="drop")
    n_out = st.n_out + n_emit
    done = st.done | (first_eos < n_emit) | (n_out >= self.max_new_tokens)
    stats = st.stats
    depth = stats.per_depth.shape[0]
    stats = stats.replace(
        rounds=stats.rounds + live.astype(jnp.int32),
        per_depth=stats.per_depth + jnp.sum((jnp.arange(depth)[None, :] < n_acc[:, None]) & live[:, None],
                                            axis=0).astype(jnp.int32))
    return st.replace(out=out, n_out=n_out, done=done, key=key, stats=stats)

  def _ar_step(self, st: LoopState, key, live):
    cache = st.caches[0]
    lead = Lead.of(st.seq, st.end, cache.cached, 1)
    attend = round_attend(cache.recent.lengths, self.width, jnp.ones((1, 1), bool))
    logits, _, recent = forward(self.weights.target, self.layout.target, lead.tokens, lead.positions,
                                cache.recent, attend, context=(cache.long,))
    token = sample(key, logits[:, 0], self.sampling)
    recent = recent.replace(lengths=recent.lengths + live.astype(jnp.int32))
    rows = jnp.arange(token.shape[0])
    seq = st.seq.at[rows, jnp.where(live, st.end, st.seq.shape[1])].set(token, mode="drop")
    st = st.replace(caches=(cache.replace(recent=recent),), seq=seq, end=st.end + live)
    return st, token[:, None], jnp.zeros_like(st.end)

  # --- blocks ---------------------------------------------------------------------------------

  def _reselect(self, st: LoopState) -> LoopState:
    """At a block's end (every level's tokens are in its long cache): a retrieval level with
    `reselect` chooses its chunks again, with the newest committed token's query, once that
    many tokens were committed since its last choice (Retrieval.reselect)."""
    layout = self.layout
    levels = [j for j in range(layout.top)
              if isinstance(layout.cache_kind(j), Retrieval) and layout.cache_kind(j).reselect]
    if not levels:
      return st
    full = st.caches[layout.top].long                       # the target's: every committed token
    last = jnp.take_along_axis(st.seq, jnp.maximum(full.lengths - 1, 0)[:, None], axis=1)[:, 0]
    caches, reselected = list(st.caches), st.stats.reselected
    for j in levels:
      kind, old = layout.cache_kind(j), caches[j].long
      due = jnp.any(~st.done & (full.lengths - old.selected >= kind.reselect))
      new = jax.lax.cond(due, lambda: retrieval.from_full(self.weights.target, layout.target, full, last,
                                                          kind.budget, kind.chunk, old.tail,
                                                          sharding.sequence_shards(layout.mesh)),
                         lambda: old)
      caches[j] = caches[j].replace(long=new)
      reselected = reselected.at[j].add(due.astype(jnp.int32))
    return st.replace(caches=tuple(caches), stats=st.stats.replace(reselected=reselected))

  def run(self, st: LoopState) -> LoopState:
    extent, width = self.layout.round_extent, self.width

    def has_room(st):
      return jnp.all(jnp.stack([jnp.max(c.recent.lengths) + extent <= width
                                for c in st.caches if c is not None]))

    def block(st):
      st = jax.lax.while_loop(lambda s: has_room(s) & ~jnp.all(s.done), self.top_round, st)
      st = st.replace(caches=tuple(c if c is None else c.new_block(width) for c in st.caches))
      return self._reselect(st)

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), block, st)


def _initial_state(layout: Layout, long_caches, start: DecodeStart, max_new_tokens: int) -> LoopState:
  """The loop's state after prefill: the first token sampled, an empty recent cache per level."""
  (first_logits, last_hidden), sampling, eos_id, key = start.first, start.sampling, start.eos_id, start.key
  seq, end = start.seq, start.end
  batch = first_logits.shape[0]
  key, sub = jax.random.split(key)
  first = sample(sub, first_logits, sampling)
  rows = jnp.arange(batch)
  seq = seq.at[rows, end].set(first)
  width = layout.recent_slots
  recent = lambda j, long: sharding.constrain_cache(
      KVCache.init(layout.config(j), batch, width, **dtypes_of(long)), layout.mesh,
      heads=layout.splits_heads(j), slots=False)
  caches = tuple(None if long is None else LevelCache(long, recent(j, long))
                 for j, long in enumerate(long_caches))
  top = layout.top
  depth = 1 if top == 0 else layout.proposal_depth(top - 1)
  zeros = jnp.zeros((top + 1,), jnp.int32)
  features = None
  if layout.reads_features:  # the first token's drafter reads the last prompt token's feature
    ring = jnp.zeros((batch, width, last_hidden.shape[-1]), last_hidden.dtype)
    features = keep_features(ring, last_hidden[:, None], (end - 1)[:, None], jnp.ones((batch, 1), bool))
  return LoopState(
      caches=caches, seq=seq, end=end + 1,
      out=jnp.full((batch, max_new_tokens + layout.max_emitted), -1, jnp.int32).at[:, 0].set(first),
      n_out=jnp.ones((batch,), jnp.int32),
      done=(first == eos_id) | (max_new_tokens <= 1), key=key,
      stats=Stats(rounds=jnp.zeros((batch,), jnp.int32), per_depth=jnp.zeros((depth,), jnp.int32),
                  forwards=zeros, proposed=zeros, accepted=zeros, stopped=zeros,
                  reselected=zeros),
      features=features)


@functools.partial(jax.jit, static_argnames=("layout", "max_new_tokens"), donate_argnames=("long_caches",))
def decode_loop(layout: Layout, weights: Weights, long_caches, start: DecodeStart, max_new_tokens: int):
  """The whole generation after prefill, one program. Returns (tokens [B, N + slack], n_tokens
  [B], Stats, the long caches: returned so that the donated ones are updated in place, not
  copied)."""
  state = _initial_state(layout, long_caches, start, max_new_tokens)
  decoder = _Decoder(layout, weights, start.sampling, start.eos_id, max_new_tokens)
  state = decoder.run(state)
  longs = tuple(None if c is None else c.long for c in state.caches)
  return state.out, jnp.minimum(state.n_out, max_new_tokens), state.stats, longs


@functools.partial(jax.jit, static_argnames=("layout", "max_new_tokens", "j"))
def _level_round(layout: Layout, weights: Weights, long_caches, start: DecodeStart, max_new_tokens: int,
                 j: int, below: Proposal | None):
  """One round of level j alone, from the state after prefill (to time it): the drafter (j = 0)
  proposes; a level j >= 1 verifies a proposal of the level below (the drafter's, `below`, or a
  full buffer) with its forward, and commits. Returns small outputs that depend on all of it."""
  st = _initial_state(layout, long_caches, start, max_new_tokens)
  key = start.key
  decoder = _Decoder(layout, weights, start.sampling, start.eos_id, max_new_tokens)
  if j == 0:
    _, prop, _, _ = decoder._propose(0, st, key)
    return prop
  if j == 1:
    prop, mode = below, layout.stack.drafter.mode
  else:
    size = layout.buffer(j - 1)
    uniform = jnp.full((st.end.shape[0], size + 1, layout.target.vocab_size),
                       1.0 / layout.target.vocab_size, jnp.float32)
    prop = _chain_proposal(st.seq, st.end, jnp.full_like(st.end, size), uniform, size)
    mode = "iid"
  live = jnp.ones_like(st.done)
  length = jnp.full_like(st.end, layout.proposal_depth(j - 1))
  st, emitted, n_acc, _ = decoder._check(j, st, prop, mode, length, key, live)
  return emitted, n_acc, tuple(c.recent for c in st.caches if c is not None)


def _time_levels(programs: programs_lib.Programs, ready: Prefilled, repeats: int = 5) -> list[float]:
  """Seconds of one round of each level (index 0: the drafter's proposal), run alone on the
  state after prefill, the median of `repeats` runs."""
  layout = ready.layout
  below = None
  times = []
  for j in range(layout.top + 1):
    inputs = (ready.weights, ready.long_caches, ready.start, below if j == 1 else None)
    program = programs.get(("level", layout, j, ready.max_new_tokens, programs_lib.shape_key(inputs)),
                           _level_round, layout, inputs[0], inputs[1], inputs[2], ready.max_new_tokens, j,
                           inputs[3])
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
      start = time.perf_counter()
      out = jax.block_until_ready(program(*inputs))
      runs.append(time.perf_counter() - start)
    if j == 0:
      below = out
    times.append(float(np.median(runs[1:])))
  return times


def prefill_levels(layout: Layout, weights: Weights, config: ModelConfig, batch: prefill_lib.PromptBatch,
                 slots: int, tail: int, programs: programs_lib.Programs):
  """Prefills what each level keeps: -> ((first logits [B, V], the last prompt tokens' hidden
  states [B, E] for a feature drafter, else None), long caches per level)."""
  params, mesh = weights.target, layout.mesh
  full = layout.place_long(layout.top, KVCache.init(config, batch.batch, slots))
  first_logits, full, *hidden = prefill_lib.prefill(params, config, full, batch, programs,
                                                    all_hidden=layout.reads_features,
                                                    taps=layout.feature_taps)
  draft_full = None
  if layout.stack.draft_config is not None:
    draft = weights.draft
    draft_batch = dataclasses.replace(batch, tokens=np.asarray(draft.to_draft(batch.tokens)))
    draft_empty = sharding.place_cache(KVCache.init(layout.draft, batch.batch, slots), mesh, heads=False)
    _, draft_full = prefill_lib.prefill(draft.params, layout.draft, draft_empty, draft_batch, programs)
  last_tokens = jnp.asarray(batch.tokens[np.arange(batch.batch), batch.lengths - 1])
  longs = []
  for j in range(layout.top + 1):
    if layout.is_drafter(j) and layout.drafter.prefills_own_cache:  # e.g. EAGLE's, from the prompt's features
      empty = layout.place_long(0, KVCache.init(layout.config(0), batch.batch, slots))
      longs.append(layout.drafter.prefill_cache(weights.draft.params, params, layout.config(0), empty, batch,
                                                hidden[0] if hidden else None, programs))
      continue
    long = derived_long_cache(layout, j, full, draft_full, params, last_tokens, tail)
    # Each level's cache is its own buffer (the decode loop donates them).
    longs.append(jax.tree.map(jnp.copy, long) if any(long is c for c in longs) else long)
  last_hidden = hidden[0][np.arange(batch.batch), batch.lengths - 1] if hidden else None
  return (first_logits, last_hidden), tuple(layout.place_long(j, c) for j, c in enumerate(longs))


def derived_long_cache(layout: Layout, j: int, full: KVCache, draft_full: KVCache | None, params,
                       last_tokens, tail: int):
  """Level j's long cache, made from the prefilled full caches of the target and of the draft
  model (None for a level without one). Traceable: memory_plan takes its shapes with eval_shape."""
  kind = layout.cache_kind(j)
  source = draft_full if layout.weights(j) == "draft" else full
  if kind is None:
    return None
  if isinstance(kind, Full):
    return source
  if isinstance(kind, Streaming):
    shift_freq = jnp.asarray(rope_inv_freq(layout.config(j))) if kind.reindex else None
    return streaming_cache(source, kind.sinks, kind.window, shift_freq)
  return select_retrieval(params, layout.target, full, last_tokens, kind.budget, kind.chunk, tail,
                    sharding.sequence_shards(layout.mesh))


@functools.partial(jax.jit, static_argnums=(1, 2))
def streaming_cache(full: KVCache, sinks: int, window: int, shift_freq) -> StreamingCache:
  """A StreamingLLM cache of `sinks` + `window` slots kept from a prefilled full cache (jitted)."""
  return StreamingCache.from_prefill(full, sinks, window, shift_freq)


@functools.partial(jax.jit, static_argnums=(1, 4, 5, 6, 7))
def select_retrieval(params, config, full, last_tokens, budget: int, chunk: int, tail: int, shards: int):
  """A retrieval cache of `budget` slots (+ `tail`) chosen from a prefilled full cache by its last
  tokens' queries (jitted; shards: the full cache's slot shards, sharding.sequence_shards)."""
  return retrieval.from_full(params, config, full, last_tokens, budget, chunk, tail, shards)


def check_stack(stack: Stack, config: ModelConfig) -> None:
  """Refuses a stack that cannot run on this target (from configs: before any weights load)."""
  if stack.drafter is not None:
    stack.drafter.check(stack.tree, config)
    stack.drafter.check_above(stack.verifiers[0].weights if stack.verifiers else "target")


def prefill(params, config: ModelConfig, prompts, max_new_tokens: int, stack: Stack,
            sampling: SamplingParams | None = None, seed: int = 0, stop_at_eos: bool = True,
            draft: DraftWeights | None = None, programs: programs_lib.Programs | None = None,
            mesh: Mesh | None = None) -> tuple[Prefilled, float]:
  """Checks the stack and prefills every level's long cache from the prompts: (the generation
  ready for `decode`, prefill seconds, compilation included)."""
  programs = programs or programs_lib.shared()
  sampling = sampling or SamplingParams.create()
  check_stack(stack, config)
  if stack.uses_draft_weights and draft is None:
    raise ValueError("a stack with a draft model needs its weights: pass "
                     "draft=DraftWeights.create(params, vocab)")
  if (stack.draft_config is not None and draft.target_ids is None
      and stack.draft_config.vocab_size != config.vocab_size):
    raise ValueError(f"draft and target vocabularies differ: the draft's has "
                     f"{stack.draft_config.vocab_size} tokens, the target's {config.vocab_size}")
  if not stack.uses_draft_weights:
    draft = None
  layout = Layout(stack, config, stack.draft_config, mesh)
  batch = prefill_lib.make_batch(prompts, config, max_new_tokens)
  width = layout.recent_slots
  slots = prefill_lib.cache_slots(batch.tokens.shape[1], max_new_tokens, extra=width)
  sharding.check(config, mesh, batch.batch, slots)
  weights = Weights(sharding.place_params(params, mesh), sharding.replicate(draft, mesh))
  start = time.perf_counter()
  prefilled, longs = prefill_levels(layout, weights, config, batch, slots,
                                  prefill_lib.round_up(max_new_tokens + width, 8), programs)
  # Every level's cache, not only the target's first logits: a draft's prefill still running
  # when the decode clock starts was counted as decoding (a draft stack at 7.5K: 28 tok/s, not 40).
  jax.block_until_ready((prefilled, longs))
  prefill_s = time.perf_counter() - start
  # The token history is as wide as the caches, so that prompts sharing a cache bucket share
  # the decode program too (a width of its own, rounded to 128, doubled the programs compiled).
  seq = np.zeros((batch.batch, slots), np.int32)
  seq[:, :batch.tokens.shape[1]] = batch.tokens
  eos = jnp.int32(config.eos_token_id if stop_at_eos and config.eos_token_id is not None else -1)
  start = DecodeStart(prefilled, sampling, eos, jax.random.key(seed), jnp.asarray(seq), jnp.asarray(batch.lengths))
  return Prefilled(layout, weights, longs, start, max_new_tokens), prefill_s


def decode(ready: Prefilled, programs: programs_lib.Programs | None = None):
  """Runs the decode loop of a prefilled generation: (tokens [B, N + slack], n_tokens [B],
  Stats, the long caches after it). Its caches are donated: a Prefilled decodes once."""
  return decode_program(ready, programs)(ready.weights, ready.long_caches, ready.start)


def decode_program(ready: Prefilled, programs: programs_lib.Programs | None = None):
  """The compiled decode loop for a prefilled generation's layout and shapes (compiled once,
  kept in `programs`), called as program(weights, long_caches, start)."""
  programs = programs or programs_lib.shared()
  inputs = (ready.weights, ready.long_caches, ready.start)
  return programs.get(("engine", ready.layout, ready.max_new_tokens, programs_lib.shape_key(inputs)),
                      decode_loop, ready.layout, *inputs, ready.max_new_tokens)


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             stack: Stack | None = None, tree: TokenTree | DynamicTree | None = None, drafter=None,
             sampling: SamplingParams | None = None, seed: int = 0, stop_at_eos: bool = True,
             draft: DraftWeights | None = None, programs: programs_lib.Programs | None = None,
             time_levels: bool = False, mesh: Mesh | None = None) -> GenerationResult:
  """Generation with any stack (stack.py): by default `ar`; `tree` + `drafter` is shorthand for
  the two-level Stack(drafter, tree). draft: a draft model's weights, for a stack that has one.
  programs: the memo of compiled programs to use and fill (default: programs.shared()).
  time_levels: also time one round of each level alone, after prefill and before decoding (it
  compiles a program per level), and report each level's estimated share of the decode time.
  mesh: the devices to run on (sharding.make_mesh): the target tensor-parallel over `model`, rows
  over `data`, the full caches' slots over `sequence`; the tokens are the same as on one device."""
  if stack is None:
    stack = Stack(drafter, tree)
  programs = programs or programs_lib.shared()
  counts_before = programs.counts()
  with sharding.use(mesh):  # traced under the mesh: attention over a cache split by slot reads it per shard
    ready, prefill_s = prefill(params, config, prompts, max_new_tokens, stack, sampling, seed,
                               stop_at_eos, draft, programs, mesh)
    layout = ready.layout
    prefill_s -= programs.compile_s - counts_before[0]
    round_s = _time_levels(programs, ready) if time_levels and layout.top > 0 else None
    loop = decode_program(ready, programs)   # compiled before the clock starts
    start = time.perf_counter()
    out, n_tokens, stats, _ = loop(ready.weights, ready.long_caches, ready.start)
    out, n_tokens = sharding.fetch(out), sharding.fetch(n_tokens)
    decode_s = time.perf_counter() - start
    stats = jax.tree.map(sharding.fetch, stats)
  speculative = layout.top > 0
  return GenerationResult(
      tokens=[out[b, :n_tokens[b]].tolist() for b in range(len(prompts))],
      prefill_s=prefill_s, decode_s=decode_s, **programs.since(counts_before),
      target_forwards=int(stats.rounds.max()) if speculative else None,
      rounds_per_row=stats.rounds.tolist() if speculative else None,
      accepted_per_depth=stats.per_depth.tolist() if speculative else None,
      levels=level_report(layout, stats, round_s, decode_s) if speculative else None)


def level_report(layout: Layout, stats: Stats, round_s: list[float] | None = None,
                 decode_s: float | None = None) -> list[dict]:
  """Per verifying level: what it was proposed, accepted and how many forwards it ran; `alpha`,
  the per-token acceptance (accepted / (accepted + rounds that stopped short): each token tried
  is accepted, or is the rejection that ends its round; TriForce's "acceptance rate"); with
  round_s (_time_levels), the time of one of its rounds and the share of decode_s its rounds
  took (forwards x round time), and for level 1 the same of the drafter's proposals."""
  names = [str(layout.stack.drafter), *map(str, layout.stack.verifiers), "target"]
  report = []
  for j in range(1, layout.top + 1):
    proposed, accepted, forwards = int(stats.proposed[j]), int(stats.accepted[j]), int(stats.forwards[j])
    tried = accepted + int(stats.stopped[j])
    entry = dict(level=j, name=names[j], proposer=names[j - 1], forwards=forwards,
                 proposed=proposed, accepted=accepted, acceptance=accepted / proposed if proposed else None,
                 alpha=accepted / tried if tried else None)
    kinds = [("reselections", j)] + ([("proposer_reselections", 0)] if j == 1 else [])
    for key, at in kinds:  # the drafter has no entry of its own: level 1 reports for it
      kind = layout.cache_kind(at)
      if isinstance(kind, Retrieval) and kind.reselect:
        entry[key] = int(stats.reselected[at])
    if round_s is not None:
      entry.update(round_ms=1e3 * round_s[j], time_share=forwards * round_s[j] / decode_s)
      if j == 1:  # every round of level 1 verified one proposal of the drafter
        entry.update(proposer_round_ms=1e3 * round_s[0], proposer_time_share=forwards * round_s[0] / decode_s)
    report.append(entry)
  return report
