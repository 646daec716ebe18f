"""The decode loop: one traced program for every stack (stack.py), `ar` to hierarchies, on device.

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

import functools

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax import sharding
from hitree_jax.decode import retrieve
from hitree_jax.cache.full import KVCache, dtypes_of
from hitree_jax.decode.drafters import (DraftInputs, DraftWeights, Proposal, chain_children, round_attend,
                                        tree_attend_mask)
from hitree_jax.decode.features import keep_features
from hitree_jax.decode.levels import Lead, LevelCache, commit, round_mask
from hitree_jax.decode.sampling import SamplingParams, probabilities, sample
from hitree_jax.decode.sizes import StackSizes
from hitree_jax.decode.step_aside import CATCH_UP_CHUNK, Resting
from hitree_jax.cache.kinds import Retrieval
from hitree_jax.decode.verify import verify
from hitree_jax.model.llama import forward
from hitree_jax.tree import shapes as tree_lib
from hitree_jax.tree.shapes import DynamicTree, offer_widths

@flax.struct.dataclass
class Stats:
  rounds: jax.Array     # [B] top rounds while each row was generating
  per_depth: jax.Array  # [D] the target's accepted proposal tokens at each depth, all rows
  forwards: jax.Array   # [K+1] batched forwards of each verifying level (0 for the drafter)
  proposed: jax.Array   # [K+1] tokens proposed to each level on the paths it could accept, live rows
  accepted: jax.Array   # [K+1] of those, accepted
  stopped: jax.Array    # [K+1] row-rounds whose accepted path stopped before the proposal's deepest token
  reselected: jax.Array  # [K+1] times each retrieval level chose its chunks again (Retrieval.reselect)
  aside: jax.Array      # [B] top rounds in which each row offered nothing, stepped aside (step_aside.py)
  stepped_aside: jax.Array  # [B] times each row stepped aside


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
  resting: Resting | None     # with Stack.step_aside: each row's plain rounds left and running acceptance


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


def chain_proposal(seq, start, count, buffer_q, size: int) -> Proposal:
  """An intermediate level's buffer seq[start : start + count] as a chain the level above verifies."""
  index = start[:, None] + jnp.arange(size)[None, :]
  tokens = jnp.take_along_axis(seq, jnp.minimum(index, seq.shape[1] - 1), axis=1)
  chain = tree_lib.chain(size)
  return Proposal(tokens=tokens, q=buffer_q, start=start, depth=jnp.asarray(chain.depth),
                  attend=jnp.asarray(tree_attend_mask(chain)), children=chain_children(count, size))


class Decoder:
  """The traced program for one StackSizes: closures over static sizes, pure in the arrays."""

  def __init__(self, sizes: StackSizes, weights: Weights, sampling: SamplingParams, eos_id,
               max_new_tokens: int):
    self.sizes, self.weights, self.sampling = sizes, weights, sampling
    self.eos_id, self.max_new_tokens = eos_id, max_new_tokens
    self.width = sizes.recent_slots

  # --- one level's forward and verification -------------------------------------------------

  def _level_probs(self, j: int, fed, positions, cache: LevelCache, attend, first: int):
    """Level j's forward over fed [B, T] (target ids) -> (probs [B, T - first, V_target] of the
    positions from `first` on, hidden states [B, T, E] (level 1's with the drafter's taps:
    llama.hidden_states), its recent cache with fed's keys/values written)."""
    sizes = self.sizes
    level = sizes.levels[j]
    config = level.config
    if level.weights == "draft":
      draft = self.weights.draft
      logits, hidden, recent = forward(draft.params, config, draft.to_draft(fed), positions, cache.recent,
                                       attend, context=(cache.long,))
      probs = probabilities(draft.never_other(logits[:, first:]), self.sampling)
      return draft.target_probs(probs, sizes.target.vocab_size), hidden, recent
    taps = sizes.feature_taps if j == 1 else ()
    logits, hidden, recent = forward(self.weights.target, config, fed, positions, cache.recent, attend,
                                     context=(cache.long,), taps=taps)
    return probabilities(logits[:, first:], self.sampling), hidden, recent

  def _verify_and_commit(self, j: int, st: LoopState, prop: Proposal, mode: str, length, key, live,
                         widths: tuple[int, ...] | None = None, resting=None):
    """Level j verifies `prop` with one forward; commits its cache (and a drafter's below);
    writes the emitted tokens after prop.start; rolls the levels below back. With prop.offered,
    the forward is the narrowest of `widths` (default offer_widths) that holds every live row's
    offer. resting [B]: rows that offered nothing, stepping aside, whose drafter's cache is left
    as it was (it catches up later: `_catch_up`).

    Returns (state, emitted [B, D+1], n_accepted [B], probs [B, D+1, V] each emitted token's law).
    """
    sizes = self.sizes
    cache = st.caches[j]
    lead = Lead.of(st.seq, prop.start, cache.cached, sizes.levels[j].lead)
    p = lead.size
    batch = prop.tokens.shape[0]
    depth = jnp.broadcast_to(prop.depth, prop.tokens.shape)
    positions = jnp.concatenate([lead.positions, prop.start[:, None] - 1 + depth], axis=1)
    attend = round_attend(cache.recent.lengths, self.width, round_mask(lead.valid, prop.attend))
    fed = jnp.concatenate([lead.tokens, prop.tokens], axis=1)
    wide = lambda: self._level_probs(j, fed, positions, cache, attend, first=p - 1)  # root, nodes
    if prop.offered is None:
      probs, hidden, recent = wide()
    else:   # the narrowest of offer_widths that holds what every live row offers
      widths = widths or offer_widths(prop.tokens.shape[1])
      needed = jnp.max(jnp.where(live, prop.offered, 0))
      branches = [functools.partial(self._prefix_probs, j, lead, cache, prop, fed, positions, m)
                  for m in widths[:-1]] + [wide]
      probs, hidden, recent = jax.lax.switch(jnp.searchsorted(jnp.asarray(widths), needed), branches)
    tree = self._proposal_tree(j - 1)
    verdict = verify(key, tree, prop.tokens, probs, prop.q, mode, prop.children)
    n_acc = jnp.where(live, verdict.n_accepted, 0)
    caches = list(st.caches)
    caches[j] = cache.replace(recent=commit(recent, lead, verdict.path, n_acc, live,
                                            base=cache.recent.lengths))
    if prop.cache is not None:   # the drafter's own (only its proposals carry one): it keeps what it keeps
      below_lead = Lead.of(st.seq, prop.start, prop.cache.cached, sizes.levels[j - 1].lead)
      drafted = live if resting is None else live & ~resting   # a resting row's falls behind (_catch_up)
      caches[j - 1] = sizes.drafter.commit(prop.cache, below_lead, tree, verdict.path, n_acc, drafted)
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
    if j == 1 and sizes.reads_features:  # the features of what this forward accepted
      k = jnp.arange(path.shape[1])[None, :]
      nodes = jnp.take_along_axis(hidden[:, p:], path[:, :, None], axis=1)
      st = st.replace(features=keep_features(
          st.features, jnp.concatenate([hidden[:, :p], nodes], axis=1),
          jnp.concatenate([lead.positions, prop.start[:, None] + k], axis=1),
          jnp.concatenate([lead.valid, k < n_acc[:, None]], axis=1) & live[:, None]))
    return st, emitted, n_acc, emitted_probs

  def _prefix_probs(self, j: int, lead: Lead, cache: LevelCache, prop: Proposal, fed, positions, m: int):
    """_level_probs of a round whose rows offer at most the proposal's first m nodes: the lead
    (the root last) and those m go through level j, written where the whole round would write
    them, and the other nodes' outputs are zeros (their children masks keep verification from
    reading them)."""
    p = lead.size
    attend = round_attend(cache.recent.lengths, self.width,
                          round_mask(lead.valid, prop.attend[..., :m + 1, :m + 1]))
    probs, hidden, recent = self._level_probs(j, fed[:, :p + m], positions[:, :p + m], cache, attend,
                                              first=p - 1)
    nodes = ((0, 0), (0, prop.tokens.shape[1] - m), (0, 0))
    return jnp.pad(probs, nodes), jnp.pad(hidden, nodes), recent

  def _proposal_tree(self, j: int):
    """The static shape of level j's proposals: the stack's tree, or a chain (a buffer)."""
    return self.sizes.stack.tree if j == 0 else tree_lib.chain(self.sizes.levels[j].buffer)

  # --- proposals ------------------------------------------------------------------------------

  def _propose(self, j: int, st: LoopState, key):
    """-> (state, Proposal, its drawing rule, [B] tokens on its longest path): level j's
    proposal after the root seq[end - 1]."""
    if j > 0:
      return self._fill(j, st, key)
    drafter, tree = self.sizes.stack.drafter, self.sizes.stack.tree
    inputs = self._draft_inputs(st)
    if isinstance(tree, DynamicTree):
      prop = drafter.propose_dynamic(tree, inputs)
    else:
      prop = drafter.propose(key, tree, inputs)
    offered = jnp.full(st.end.shape, tree.max_depth, jnp.int32) if prop.offered is None else prop.offered
    return st, prop, drafter.mode, offered

  def _draft_inputs(self, st: LoopState) -> DraftInputs:
    """What the drafter reads after the root seq[end - 1]: its own cache, or the level above's."""
    sizes = self.sizes
    own = st.caches[0]
    cache = own if own is not None else st.caches[1]
    reader = 0 if own is not None else 1
    return DraftInputs(seq=st.seq, end=st.end, lead=Lead.of(st.seq, st.end, cache.cached, sizes.levels[reader].lead),
                       cache=cache, params=self.weights.target, draft=self.weights.draft,
                       sampling=self.sampling, config=sizes.target, features=st.features)

  def _fill(self, j: int, st: LoopState, key):
    """Level j's rounds until it holds >= gamma_j tokens (rows done stay as they are)."""
    sizes = self.sizes
    size, gamma = sizes.levels[j].buffer, sizes.levels[j].gamma
    batch = st.end.shape[0]
    start = st.end
    buffer_q = jnp.zeros((batch, size + 1, sizes.target.vocab_size), jnp.float32)
    count = jnp.zeros((batch,), jnp.int32)
    rows = jnp.arange(batch)[:, None]

    def live_rows(st, count):
      return ~st.done & (count < gamma)

    def one_round(carry):
      st, buffer_q, count, key = carry
      live = live_rows(st, count)
      key, k_propose, k_verify = jax.random.split(key, 3)
      st, prop, mode, length = self._propose(j - 1, st, k_propose)
      st, _, n_acc, probs = self._verify_and_commit(j, st, prop, mode, length, k_verify, live)
      k = jnp.arange(probs.shape[1])[None, :]
      at = jnp.where(live[:, None] & (k <= n_acc[:, None]), count[:, None] + k, size + 1)
      buffer_q = buffer_q.at[rows, at].set(probs, mode="drop")
      return st, buffer_q, jnp.where(live, count + n_acc + 1, count), key

    st, buffer_q, count, _ = jax.lax.while_loop(lambda c: jnp.any(live_rows(c[0], c[2])), one_round,
                                                (st, buffer_q, count, key))
    return st, chain_proposal(st.seq, start, count, buffer_q, size), "iid", count

  # --- the target's round -----------------------------------------------------------------------

  def top_round(self, st: LoopState) -> LoopState:
    sizes = self.sizes
    top, batch = sizes.top, st.end.shape[0]
    rows = jnp.arange(batch)
    key, k_propose, k_verify = jax.random.split(st.key, 3)
    live = ~st.done
    if top == 0:  # ar: one token from the target's distribution
      st, emitted, n_acc = self._ar_step(st, k_verify, live)
    else:
      widths, resting = None, None
      if st.resting is None:
        st, prop, mode, length = self._propose(top - 1, st, k_propose)
      else:
        resting = st.resting.left > 0
        st, prop, mode, length = self._propose_unless_resting(st, k_propose, jnp.all(resting | ~live), live)
        offered = None if prop.offered is None else prop.offered > 0
        prop, length, widths = self._rest(prop, length, resting)
      st, emitted, n_acc, _ = self._verify_and_commit(top, st, prop, mode, length, k_verify, live, widths,
                                                      resting)
      if st.resting is not None:
        resting, entered = st.resting.after(sizes.stack.step_aside, n_acc, live, offered)
        stats = st.stats.replace(aside=st.stats.aside + (live & (st.resting.left > 0)).astype(jnp.int32),
                                 stepped_aside=st.stats.stepped_aside + entered.astype(jnp.int32))
        st = st.replace(resting=resting, stats=stats)
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

  def _propose_unless_resting(self, st: LoopState, key, all_resting, live):
    """The proposal of the level under the target; when every live row rests, a blank one of the
    same shapes instead, its tree not drafted and no level under the target run. A level with a
    cache of its own (a middle level, a draft model) then falls behind, and catches up a chunk of
    tokens at a time (`_catch_up`). A drafter whose cache is written from the features of what it
    drafts (EAGLE, DFlash) cannot: it drafts as in any round, so that its cache sees it."""
    sizes = self.sizes
    top, drafter = sizes.top, sizes.stack.drafter
    mode = drafter.mode if top == 1 else "iid"   # a middle level's buffer is drawn from its own law
    own_cache = st.caches[0] is not None
    if own_cache and not drafter.keeps_up:
      return self._propose(top - 1, st, key)

    def drafted():   # each level's round needs at most its lead pending
      ready = self._catch_up(st, live, lambda j: sizes.levels[j].lead)
      ready, prop, _, length = self._propose(top - 1, ready, key)
      return ready, prop, length

    _, shapes, length_shape = jax.eval_shape(drafted)

    def blank():
      prop = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
      nodes = prop.tokens.shape[1]
      eye = jnp.broadcast_to(jnp.eye(nodes + 1, dtype=bool), shapes.attend.shape)  # the root sees itself
      prop = prop.replace(start=st.end, attend=eye)
      # behind by b now, b + 1 next round: at most a chunk, or catch up now
      kept = self._catch_up(st, live, lambda j: self.catch_up_chunk)
      if own_cache and top == 1:   # the round's commit leaves it as caught up (resting rows)
        prop = prop.replace(cache=kept.caches[0])
      return kept, prop, jnp.zeros(length_shape.shape, length_shape.dtype)

    st, prop, length = jax.lax.cond(all_resting, blank, drafted)
    return st, prop, mode, length

  @property
  def catch_up_chunk(self) -> int:
    """The tokens a level under the target runs in one forward when it catches up (`_catch_up`):
    at most a round's extent, which has_room keeps free past each level's caught-up length."""
    return min(CATCH_UP_CHUNK, self.sizes.round_extent)

  def _behind(self, st: LoopState, j: int):
    """[B] the tokens before the root that level j does not hold yet (0 for a level in step)."""
    return jnp.maximum(st.end - 1 - st.caches[j].cached, 0)

  def _catch_up(self, st: LoopState, live, allowed) -> LoopState:
    """The levels under the target with caches of their own (each middle level, and a draft
    model), where a live row holds more than allowed(j) tokens pending: each runs the tokens it
    missed before the root, one forward of `catch_up_chunk` slots, and keeps them, as a round
    that accepted nothing would (level 1's features too, for a feature drafter). Its rows'
    resting rounds do not run these levels: they fall behind a token a round, and catch up a
    chunk at a time, or at once before a round that speculates."""
    sizes = self.sizes
    levels = [j for j in range(sizes.top) if st.caches[j] is not None]
    if not levels:
      return st
    batch, size = st.end.shape[0], self.catch_up_chunk
    due = jnp.any(jnp.stack([live & (self._behind(st, j) + 1 > allowed(j)) for j in levels]))

    def run(st):
      nothing = jnp.zeros((batch,), jnp.int32)
      caches, features = list(st.caches), st.features
      for j in levels:
        cache = caches[j]
        lead = Lead.of(st.seq, st.end - 1, cache.cached, size)
        attend = round_attend(cache.recent.lengths, self.width, round_mask(lead.valid, jnp.ones((1, 1), bool)))
        _, hidden, recent = self._level_probs(j, lead.tokens, lead.positions, cache, attend, first=size - 1)
        caches[j] = cache.replace(recent=commit(recent, lead, jnp.zeros((batch, 0), jnp.int32), nothing, live,
                                                base=cache.recent.lengths))
        if j == 1 and sizes.reads_features:
          features = keep_features(features, hidden, lead.positions, lead.valid & live[:, None])
      return st.replace(caches=tuple(caches), features=features)

    return jax.lax.cond(due, run, lambda st: st, st)

  def _rest(self, prop: Proposal, length, resting):
    """The proposal with resting rows [B] offering nothing (no children: the target's token
    alone), verified at the width of the whole proposal, or of the root alone when every live
    row rests (or at a drafter's own offer widths). -> (proposal, length, widths)."""
    batch, nodes = prop.tokens.shape
    tree = self._proposal_tree(self.sizes.top - 1)
    children = prop.children
    if children is None:
      children = jnp.broadcast_to(jnp.asarray(tree.children), (batch, *tree.children.shape))
    offered = jnp.full((batch,), nodes, jnp.int32) if prop.offered is None else prop.offered
    widths = (0, nodes) if prop.offered is None else None
    prop = prop.replace(offered=jnp.where(resting, 0, offered),
                        children=jnp.where(resting[:, None, None], -1, children))
    return prop, jnp.where(resting, 0, length), widths

  def _ar_step(self, st: LoopState, key, live):
    cache = st.caches[0]
    lead = Lead.of(st.seq, st.end, cache.cached, 1)
    attend = round_attend(cache.recent.lengths, self.width, jnp.ones((1, 1), bool))
    logits, _, recent = forward(self.weights.target, self.sizes.target, lead.tokens, lead.positions,
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
    sizes = self.sizes
    levels = [level for level in sizes.levels[:-1] if isinstance(level.cache, Retrieval) and level.cache.reselect]
    if not levels:
      return st
    full = st.caches[sizes.top].long                       # the target's: every committed token
    last = jnp.take_along_axis(st.seq, jnp.maximum(full.lengths - 1, 0)[:, None], axis=1)[:, 0]
    caches, reselected = list(st.caches), st.stats.reselected
    for level in levels:
      j, kind = level.index, level.cache
      old = caches[j].long
      due = jnp.any(~st.done & (full.lengths - old.selected >= kind.reselect))
      new = jax.lax.cond(due, lambda: retrieve.from_full(self.weights.target, sizes.target, full, last,
                                                          kind.budget, kind.chunk, old.tail,
                                                          sharding.sequence_shards(sizes.mesh)),
                         lambda: old)
      caches[j] = caches[j].replace(long=new)
      reselected = reselected.at[j].add(due.astype(jnp.int32))
    return st.replace(caches=tuple(caches), stats=st.stats.replace(reselected=reselected))

  def run(self, st: LoopState) -> LoopState:
    extent, width = self.sizes.round_extent, self.width

    catches_up = self.sizes.stack.step_aside is not None

    def caught_up(st, j):   # a level that fell behind (_catch_up) needs room for what it will catch up
      behind = self._behind(st, j) if catches_up and j < self.sizes.top else 0
      return st.caches[j].recent.lengths + behind

    def has_room(st):
      return jnp.all(jnp.stack([jnp.max(caught_up(st, j)) + extent <= width
                                for j, c in enumerate(st.caches) if c is not None]))

    def block(st):
      st = jax.lax.while_loop(lambda s: has_room(s) & ~jnp.all(s.done), self.top_round, st)
      st = st.replace(caches=tuple(c if c is None else c.new_block(width) for c in st.caches))
      return self._reselect(st)

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), block, st)


def initial_state(sizes: StackSizes, long_caches, start: DecodeStart, max_new_tokens: int) -> LoopState:
  """The loop's state after prefill: the first token sampled, an empty recent cache per level."""
  (first_logits, last_hidden), sampling, eos_id, key = start.first, start.sampling, start.eos_id, start.key
  seq, end = start.seq, start.end
  batch = first_logits.shape[0]
  key, sub = jax.random.split(key)
  first = sample(sub, first_logits, sampling)
  rows = jnp.arange(batch)
  seq = seq.at[rows, end].set(first)
  width = sizes.recent_slots
  recent = lambda level, long: sharding.constrain_cache(
      KVCache.init(level.config, batch, width, **dtypes_of(long)), sizes.mesh,
      heads=level.splits_heads, slots=False)
  caches = tuple(None if long is None else LevelCache(long, recent(level, long))
                 for level, long in zip(sizes.levels, long_caches))
  top = sizes.top
  depth = 1 if top == 0 else sizes.levels[top - 1].proposal_depth
  zeros = jnp.zeros((top + 1,), jnp.int32)
  features = None
  if sizes.reads_features:  # the first token's drafter reads the last prompt token's feature
    ring = jnp.zeros((batch, width, last_hidden.shape[-1]), last_hidden.dtype)
    features = keep_features(ring, last_hidden[:, None], (end - 1)[:, None], jnp.ones((batch, 1), bool))
  return LoopState(
      caches=caches, seq=seq, end=end + 1,
      out=jnp.full((batch, max_new_tokens + sizes.max_emitted), -1, jnp.int32).at[:, 0].set(first),
      n_out=jnp.ones((batch,), jnp.int32),
      done=(first == eos_id) | (max_new_tokens <= 1), key=key,
      stats=Stats(rounds=jnp.zeros((batch,), jnp.int32), per_depth=jnp.zeros((depth,), jnp.int32),
                  forwards=zeros, proposed=zeros, accepted=zeros, stopped=zeros,
                  reselected=zeros, aside=jnp.zeros((batch,), jnp.int32),
                  stepped_aside=jnp.zeros((batch,), jnp.int32)),
      features=features,
      resting=None if sizes.stack.step_aside is None else Resting.start(batch, sizes.stack.step_aside))


def generation(sizes: StackSizes, weights: Weights, long_caches, start: DecodeStart, max_new_tokens: int):
  """The whole generation after prefill, as a function to trace (decode_loop is it jitted; a
  caller that jits it with its own shardings or layouts, docs/results/tpu/tpu_weight_layouts.py,
  takes this). Returns (tokens [B, N + slack], n_tokens [B], Stats, the long caches: returned
  so that the donated ones are updated in place, not copied)."""
  state = initial_state(sizes, long_caches, start, max_new_tokens)
  decoder = Decoder(sizes, weights, start.sampling, start.eos_id, max_new_tokens)
  state = decoder.run(state)
  longs = tuple(None if c is None else c.long for c in state.caches)
  return state.out, jnp.minimum(state.n_out, max_new_tokens), state.stats, longs


# The generation as one program, its long caches donated.
decode_loop = jax.jit(generation, static_argnames=("sizes", "max_new_tokens"), donate_argnames=("long_caches",))


@functools.partial(jax.jit, static_argnames=("sizes", "max_new_tokens", "j"))
def level_round(sizes: StackSizes, weights: Weights, long_caches, start: DecodeStart, max_new_tokens: int,
                 j: int, below: Proposal | None):
  """One round of level j alone, from the state after prefill (to time it): the drafter (j = 0)
  proposes; a level j >= 1 verifies a proposal of the level below (the drafter's, `below`, or a
  full buffer) with its forward, and commits. Returns small outputs that depend on all of it."""
  st = initial_state(sizes, long_caches, start, max_new_tokens)
  key = start.key
  decoder = Decoder(sizes, weights, start.sampling, start.eos_id, max_new_tokens)
  if j == 0:
    _, prop, _, _ = decoder._propose(0, st, key)
    return prop
  if j == 1:
    prop, mode = below, sizes.stack.drafter.mode
  else:
    size = sizes.levels[j - 1].buffer
    uniform = jnp.full((st.end.shape[0], size + 1, sizes.target.vocab_size),
                       1.0 / sizes.target.vocab_size, jnp.float32)
    prop = chain_proposal(st.seq, st.end, jnp.full_like(st.end, size), uniform, size)
    mode = "iid"
  live = jnp.ones_like(st.done)
  length = jnp.full_like(st.end, sizes.levels[j - 1].proposal_depth)
  st, emitted, n_acc, _ = decoder._verify_and_commit(j, st, prop, mode, length, key, live)
  return emitted, n_acc, tuple(c.recent for c in st.caches if c is not None)
