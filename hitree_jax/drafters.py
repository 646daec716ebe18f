"""Level-0 proposers: they fill a token tree after the last emitted token.

A drafter is a frozen (hashable, jit-static) description; `propose` is pure.
Each returns the tokens of every tree node and the distribution the children
of each position were drawn from (None for deterministic proposals), which is
what exact verification needs (verify.py).

  SelfDrafter(k):  the target's own first k layers + final norm + LM head.
                   Its keys/values for committed tokens ARE the target's first
                   k layers' cache, so it reads the target's caches and needs
                   no cache (and no weights) of its own.
  ModelDrafter:    a separate (small) model with its own cache, which mirrors
                   the target's: written at the same slots each round and
                   committed with the same accepted path. Its vocabulary may be
                   the target's or a subset of it (vocab.py).
  NGramDrafter(n): copies the continuation of the latest earlier occurrence of
                   the longest (<= n) suffix of prompt + output (a chain).

`propose` returns (tokens [B, N] target ids, q [B, N+1, V] or None, the
drafter's recent cache after the round or None). The self-draft and a draft
model also grow DynamicTrees: `propose_dynamic` returns (tokens, each row's
tree as dynamic_tree.RowTrees, the drafter's recent cache or None).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax import dynamic_tree
from hitree_jax.config import ModelConfig
from hitree_jax.kv_cache import KVCache
from hitree_jax.model import forward, hidden_states
from hitree_jax.sampling import SamplingParams, draw, probabilities
from hitree_jax.tree import DynamicTree, TokenTree
from hitree_jax.vocab import OTHER, spread_probs


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
  max_ngram: int = 3
  mode: str = "deterministic"

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    if isinstance(tree, DynamicTree) or any(p != i - 1 for i, p in enumerate(tree.parents)):
      raise ValueError("the n-gram drafter proposes a chain: use --tree=chain:N (or --method=sd)")
    if self.max_ngram < 1:
      raise ValueError(f"max_ngram={self.max_ngram} must be >= 1")

  def propose(self, key, tree: TokenTree, history, history_len, **unused):
    """history [B, H] (prompt + output, the root token last at history_len - 1) -> tokens [B, N]."""
    del key, unused
    batch, width = history.shape
    rows = jnp.arange(batch)[:, None]
    idx = jnp.arange(width)[None, :]
    best = jnp.full((batch,), -1, jnp.int32)  # end index of the chosen earlier match
    match = idx < history_len[:, None] - 1    # ends strictly before the suffix does
    for n in range(1, self.max_ngram + 1):    # longer suffixes override shorter ones
      j = n - 1                               # the suffix's n-th token from the end must match too
      suffix_tok = jnp.take_along_axis(history, jnp.maximum(history_len - 1 - j, 0)[:, None], axis=1)
      shifted = jnp.take_along_axis(history, jnp.maximum(idx - j, 0).repeat(batch, 0), axis=1)
      match = match & (idx >= j) & (shifted == suffix_tok) & (history_len[:, None] - 1 - j >= 0)
      latest = jnp.max(jnp.where(match, idx, -1), axis=1)
      best = jnp.where(latest >= 0, latest, best)
    take = best[:, None] + 1 + jnp.arange(tree.size)[None, :]
    take = jnp.where((best[:, None] >= 0) & (take < history_len[:, None]), take, history_len[:, None] - 1)
    return history[rows, take].astype(jnp.int32), None, None


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
  num_layers: int
  mode: str = "deterministic"  # children = the draft's top-k; or "iid" / "without_replacement" samples

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    if not 1 <= self.num_layers < config.num_layers:
      raise ValueError(f"self-draft layers={self.num_layers} must be in [1, {config.num_layers})")
    _check_dynamic_mode(tree, self.mode)

  def propose(self, key, tree: TokenTree, *, params, config: ModelConfig, root, positions,
              long: KVCache, recent: KVCache, sampling: SamplingParams, **unused):
    """One draft forward per depth. root [B]; positions [B, N+1]. -> tokens [B, N], q [B, N+1, V]."""
    del unused
    k = self.num_layers
    batch, n = root.shape[0], tree.size
    full_mask = jnp.asarray(tree_attend_mask(tree))                   # [N+1, N+1]

    def step(scratch, fed, pos_idx):
      attend = jnp.broadcast_to(full_mask[pos_idx], (batch, len(pos_idx), n + 1))
      logits, _, scratch = forward(params, config, fed, positions[:, pos_idx], scratch, attend,
                                   write_at=jnp.full((batch,), int(pos_idx[0]), jnp.int32),
                                   context=(_first_layers(long, k), _first_layers(recent, k)))
      return logits, scratch

    scratch = KVCache.init(config.replace(num_layers=k), batch, n + 1)
    tokens, q, _ = fill_tree(key, tree, root, step, scratch, config.vocab_size, sampling, self.mode)
    return tokens, q, None

  def propose_dynamic(self, tree: DynamicTree, *, params, config: ModelConfig, root, base,
                      long: KVCache, recent: KVCache, **unused):
    """A DynamicTree per row, grown on a scratch cache that reads the target's first k layers."""
    del unused
    k = self.num_layers
    context = (_first_layers(long, k), _first_layers(recent, k))

    def run(scratch, fed, depth, first, attend):
      logits, _, scratch = forward(params, config, fed, _positions(base, depth, fed), scratch, attend,
                                   write_at=jnp.full_like(base, first), context=context)
      return logits, scratch

    scratch = KVCache.init(config.replace(num_layers=k), root.shape[0], dynamic_tree.scratch_slots(tree))
    return (*dynamic_tree.grow(tree, root, run, scratch), None)


def _first_layers(cache: KVCache, k: int) -> KVCache:
  """The self-draft's view of a target cache: its first k layers' keys/values."""
  return cache.replace(keys=cache.keys[:k], values=cache.values[:k])


def _positions(base, depth: int, fed):
  return jnp.broadcast_to(base[:, None] + depth, fed.shape)


def _check_dynamic_mode(tree, mode: str) -> None:
  if isinstance(tree, DynamicTree) and mode != "deterministic":
    raise ValueError(f"a dynamic tree proposes the draft's top-{tree.width} tokens at each node: "
                     f"draw mode {mode!r} does not apply (use deterministic)")


def fill_tree(key, tree: TokenTree, root, step, state, vocab_size: int, sampling: SamplingParams,
              mode: str, feed_leaves: bool = False):
  """Fills a tree one depth per draft forward: all nodes of a depth in one batch.

  step(state, fed [B, T], pos_idx [T] tree positions (0 = root)) -> (logits [B, T, V], state).
  feed_leaves: also run the deepest nodes, for their keys/values (a draft with its own cache).
  Returns (tokens [B, N], q [B, N+1, V]: the distribution each position's children came from, state).
  """
  batch, n = root.shape[0], tree.size
  tokens = jnp.zeros((batch, n), jnp.int32)
  q_all = jnp.zeros((batch, n + 1, vocab_size), jnp.float32)
  frontier = (-1,)                                                    # positions-1: the root
  for d, level in enumerate((*tree.level_nodes, ()) if feed_leaves else tree.level_nodes):
    pos_idx = np.array([u + 1 for u in frontier])                     # tree positions fed now
    logits, state = step(state, root[:, None] if d == 0 else tokens[:, pos_idx - 1], pos_idx)
    if not level:
      break                                                           # leaves fed for their K/V
    q = probabilities(logits, sampling)                               # [B, T, V]
    q_all = q_all.at[:, pos_idx].set(q)
    key, sub = jax.random.split(key)
    for t, parent in enumerate(frontier):
      kids = [c for c in tree.children[parent + 1] if c >= 0]
      if kids:
        drawn = draw_children(jax.random.fold_in(sub, t), q[:, t], len(kids), mode, logits[:, t])
        tokens = tokens.at[:, np.array(kids)].set(drawn)
    frontier = level
  return tokens, q_all, state


@flax.struct.dataclass
class DraftWeights:
  """The dynamic inputs of a ModelDrafter (jit arguments, not part of its static description)."""
  params: dict
  target_ids: jax.Array | None = None  # [V'] ReducedVocab.target_ids, or None: same vocabulary
  draft_ids: jax.Array | None = None   # [V] ReducedVocab.draft_ids

  @classmethod
  def create(cls, params, vocab=None) -> "DraftWeights":
    """From a draft's params and its ReducedVocab (None: the target's vocabulary)."""
    if vocab is None:
      return cls(params)
    return cls(params, jnp.asarray(vocab.target_ids), jnp.asarray(vocab.draft_ids))

  def to_draft(self, tokens):
    return tokens if self.draft_ids is None else self.draft_ids[tokens]

  def to_target(self, tokens):
    return tokens if self.target_ids is None else self.target_ids[tokens]


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  config: ModelConfig                  # the draft's
  mode: str = "deterministic"
  target_vocab_size: int | None = None  # set when the draft's vocabulary is a subset (vocab.py)

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    target_vocab = self.target_vocab_size or self.config.vocab_size
    if target_vocab != config.vocab_size:
      raise ValueError(f"draft and target vocabularies differ: the draft's has {target_vocab} "
                       f"tokens, the target's {config.vocab_size}; a draft must use the target's "
                       "tokenizer (or a reduced vocabulary mapped onto it)")
    _check_dynamic_mode(tree, self.mode)

  def propose(self, key, tree: TokenTree, *, root, positions, sampling: SamplingParams,
              draft: DraftWeights, draft_long: KVCache, draft_recent: KVCache, **unused):
    """Like SelfDrafter, on the draft's own caches; also writes the deepest level's keys/values so
    the draft cache holds every tree node and commits with the target's accepted path."""
    del unused
    config = self.config
    width = draft_recent.keys[0].shape[2]
    attend_all = round_attend(draft_recent.lengths, width, tree_attend_mask(tree))  # [B, N+1, W]

    def step(cache, fed, pos_idx):
      logits, _, cache = forward(draft.params, config, fed, positions[:, pos_idx], cache,
                                 attend_all[:, pos_idx], write_at=cache.lengths + int(pos_idx[0]),
                                 context=(draft_long,))
      return self._never_other(draft, logits), cache

    tokens, q_all, draft_recent = fill_tree(key, tree, draft.to_draft(root), step, draft_recent,
                                            config.vocab_size, sampling, self.mode,
                                            feed_leaves=True)
    if draft.target_ids is not None:
      q_all = spread_probs(q_all, draft.target_ids, self.target_vocab_size)
    return draft.to_target(tokens), q_all, draft_recent

  def propose_dynamic(self, tree: DynamicTree, *, root, base, draft: DraftWeights,
                      draft_long: KVCache, draft_recent: KVCache, **unused):
    """A DynamicTree per row, grown on a scratch cache; then one forward of the chosen tree
    writes its keys/values at the target's slots, so the draft cache commits like the target's."""
    del unused
    config = self.config

    def run(scratch, fed, depth, first, attend):
      logits, _, scratch = forward(draft.params, config, fed, _positions(base, depth, fed), scratch,
                                   attend, write_at=jnp.full_like(base, first),
                                   context=(draft_long, draft_recent))
      return self._never_other(draft, logits), scratch

    scratch = KVCache.init(config, root.shape[0], dynamic_tree.scratch_slots(tree))
    root = draft.to_draft(root)
    tokens, trees = dynamic_tree.grow(tree, root, run, scratch)
    fed = jnp.concatenate([root[:, None], tokens], axis=1)
    positions = base[:, None] + jnp.pad(trees.depth, ((0, 0), (1, 0)))
    width = draft_recent.keys[0].shape[2]
    _, draft_recent = hidden_states(draft.params, config, fed, positions, draft_recent,
                                    round_attend(draft_recent.lengths, width, trees.attend),
                                    context=(draft_long,))
    # A token outside a reduced vocabulary is never ranked above a real one; if one still
    # fills a slot (a vocabulary smaller than the width), any target token keeps this exact.
    return jnp.maximum(draft.to_target(tokens), 0), trees, draft_recent

  def _never_other(self, draft: DraftWeights, logits):
    """A reduced vocabulary's OTHER id stands for every token outside it: never proposed."""
    if draft.target_ids is None:
      return logits
    return jnp.where(jnp.arange(self.config.vocab_size) == OTHER, -jnp.inf, logits)


def round_attend(recent_lengths, width: int, tree_mask):
  """[B, N+1, W] mask of a round's root + nodes, written at recent_lengths[b] + 0..N of a
  W-slot recent cache: each sees the committed slots and what tree_mask ([N+1, N+1], or per
  row [B, N+1, N+1]: `tree_attend_mask`) allows among the round's slots."""
  batch, span = recent_lengths.shape[0], tree_mask.shape[-1]
  mask = jnp.broadcast_to(jnp.asarray(tree_mask), (batch, span, span))
  slot = jnp.arange(width)[None, None, :] - recent_lengths[:, None, None]
  in_round = (slot >= 0) & (slot < span)
  own = jnp.take_along_axis(mask, jnp.broadcast_to(jnp.clip(slot, 0, span - 1), (batch, span, width)),
                            axis=2)
  return (slot < 0) | (in_round & own)


def draw_children(key, q, n: int, mode: str, logits=None):
  """n child tokens [B, n] from q [B, V] by the drawing rule `mode` (see verify.py).

  Deterministic children are the draft's top-n by logits when given: the same order as q
  inside q's support, and a real ranking outside it (greedy q is one-hot, so its top-n
  would rank every sibling after the first arbitrarily). Verification of deterministic
  children does not read q, so this is exact."""
  if mode == "deterministic":
    return jax.lax.top_k(q if logits is None else logits, n)[1].astype(jnp.int32)
  if mode == "iid":
    return draw(key, jnp.broadcast_to(q[:, None, :], (q.shape[0], n, q.shape[1])))
  if mode == "without_replacement":  # Gumbel top-k
    gumbel = jax.random.gumbel(key, q.shape)
    return jax.lax.top_k(jnp.log(q) + gumbel, n)[1].astype(jnp.int32)
  raise ValueError(f"mode={mode!r}")


def tree_attend_mask(tree: TokenTree) -> np.ndarray:
  """[N+1, N+1] bool over (root, nodes): each sees the root, its ancestors and itself."""
  n = tree.size
  mask = np.zeros((n + 1, n + 1), bool)
  mask[:, 0] = True
  mask[1:, 1:] = tree.ancestor_mask
  return mask


def parse_draft_spec(spec: str):
  """'ngram' | 'ngram:N' | 'self:K' [',' mode] -> a drafter."""
  name, _, rest = spec.partition(":")
  arg, _, mode = rest.partition(",")
  try:
    if name == "ngram":
      return NGramDrafter(int(arg) if arg else 3)
    if name == "self" and arg:
      return SelfDrafter(int(arg), mode or "deterministic")
  except ValueError:
    pass
  raise ValueError(f"bad draft spec {spec!r}: expected ngram, ngram:N or self:K[,iid|without_replacement|deterministic]")
