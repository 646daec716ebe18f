"""Level-0 proposers: they fill a token tree after the last emitted token.

A drafter is a frozen (hashable, jit-static) description; `propose` is pure.
Each returns the tokens of every tree node and the distribution the children
of each position were drawn from (None for deterministic proposals), which is
what exact verification needs (verify.py).

  SelfDrafter(k):  the target's own first k layers + final norm + LM head.
                   Its keys/values for committed tokens ARE the first k layers
                   of the cache of the level above it (the target's, or the
                   target's retrieval level), so it has no cache or weights of
                   its own: a scratch cache holds the round.
  ModelDrafter:    a separate (small) model with its own cache (full, or
                   StreamingLLM's), written past its committed length each
                   round and committed with the path the level above accepts.
                   Its vocabulary may be the target's or a subset of it (vocab.py).
  NGramDrafter(n): copies the continuation of the latest earlier occurrence of
                   the longest (<= n) suffix of the sequence (a chain), or offers
                   nothing where there is none (Proposal.offered).

Each is a `Drafter` (below): the engine asks a drafter only what that interface
says, never its type, so a new drafter is a subclass and nothing else
(tests/test_drafter_interface.py builds one outside the library).
`propose(key, tree, DraftInputs) -> Proposal` fills a static tree;
`propose_dynamic(tree, DraftInputs)` grows a DynamicTree per row (EAGLE-2).
A drafter's first forward runs its pending tokens (levels.Lead), the root last.
"""

from __future__ import annotations

import abc
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache
from hitree_jax.decode import spec
from hitree_jax.decode.levels import Lead, LevelCache, commit, round_mask
from hitree_jax.decode.sampling import SamplingParams, draw, probabilities
from hitree_jax.cache.kinds import CacheKind, Full, Retrieval
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward, hidden_states
from hitree_jax.model.vocab import mask_other, spread_probs
from hitree_jax.tree import dynamic as dynamic_tree
from hitree_jax.tree.shapes import DynamicTree, TokenTree


@flax.struct.dataclass
class DraftInputs:
  """What the bottom level reads to propose after the sequence's last token (the root)."""
  seq: jax.Array                # [B, H] the sequence so far: prompt, output, buffers above
  end: jax.Array                # [B] its length; the root is seq[end - 1]
  lead: Lead                    # the pending tokens of the cache the drafter writes or reads
  cache: LevelCache | None      # a ModelDrafter's own; a SelfDrafter's: the level above's
  params: dict                  # the target's weights (a SelfDrafter's)
  draft: "DraftWeights | None"  # a ModelDrafter's weights
  sampling: SamplingParams
  config: ModelConfig = flax.struct.field(pytree_node=False)  # the target's
  features: jax.Array | None = None  # [B, L, E] the target's features by position mod L (heads/drafter.py)


@flax.struct.dataclass
class Proposal:
  """A drafted tree (or chain) after the root seq[start - 1], with what verification reads."""
  tokens: jax.Array             # [B, N] target ids
  q: jax.Array | None           # [B, N+1, V]: the law each position's children came from (None: deterministic)
  start: jax.Array              # [B] the sequence end the proposal continues
  depth: jax.Array              # [N] or [B, N]: depth of each node (1 = child of the root)
  attend: jax.Array             # [N+1, N+1] or [B, N+1, N+1] over (root, nodes): drafters.tree_attend_mask
  children: jax.Array | None = None  # [B, N+1, K] each row's own children (None: the static tree's)
  # [B] tokens the drafter offers on its chain, its first nodes (None: the whole tree). A round
  # runs the root and the fewest nodes that hold every live row's offer (offer_widths): where
  # none is offered, the root alone, as an `ar` step does.
  offered: jax.Array | None = None
  cache: LevelCache | None = None    # its own cache after the round (Drafter.commit keeps what it accepts)


class Drafter(abc.ABC):
  """The bottom level of a stack, as the engine sees it. A drafter is a frozen dataclass: it is
  hashable and part of the compiled program's static arguments. The class attributes below are
  the defaults of a drafter that keeps nothing between rounds (the n-gram drafter); a drafter
  that keeps a cache, reads the target's features or needs weights of its own overrides them
  (as dataclass fields or properties)."""

  mode = "deterministic"   # how children are drawn (verify.DrawMode)
  cache = None             # the kind of its long cache (cache/kinds.py: Full, Streaming, Retrieval), or None
  cache_weights = None     # whose forward fills that cache: "draft", "target", or None (its own)
  reads_features = False   # reads the hidden states of the level above's verify forwards
  taps = ()                # ... and those of these target layers beside the final ones (EAGLE-3)
  keeps_tree = True        # False: it keeps none of its tree (the accepted path waits to be re-run)
  needs_draft_weights = False   # generation must be handed DraftWeights (a model's, or heads')
  draft_model = None       # the draft model's config, when its weights are a draft model's
  prefills_own_cache = False    # True: prefill_cache builds its long cache from the prompt
  reads_from_above = None  # "cache" or "features": what it reads of the level above, whose
                           # weights must then be the target's
  keeps_up = False         # True: its own cache is a model's, which catches up on tokens it did not
                           # draft for by running them (loop.Decoder._catch_up): a resting row's

  @abc.abstractmethod
  def check(self, tree: TokenTree | DynamicTree, config: ModelConfig) -> None:
    """Refuses (ValueError, naming the value) a tree or target this drafter cannot serve."""

  def check_above(self, weights: str) -> None:
    """Refuses a level above it, of these weights ("target" or "draft"), that it cannot read."""
    if self.reads_from_above is not None and weights != "target":
      raise UsageError(f"the {self} drafter reads the {self.reads_from_above} of the level above "
                       "it: that level must have the target's weights (e.g. the retrieval level)")

  def level_config(self, target: ModelConfig, draft: ModelConfig | None) -> ModelConfig:
    """The config of the model its long cache belongs to."""
    return draft if self.cache_weights == "draft" else target

  @abc.abstractmethod
  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    """Fills the static tree after the root seq[end - 1]."""

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    """Grows a DynamicTree per row (EAGLE-2); a drafter that cannot refuses it in check."""
    raise NotImplementedError(f"the {self} drafter grows no dynamic tree")

  def prefill_cache(self, draft_params, target_params, config: ModelConfig, empty: KVCache, batch,
                    hidden, programs) -> KVCache:
    """Its long cache of the prompts (prefills_own_cache): batch, a prefill.PromptBatch; hidden,
    the target's features at every prompt position [B, P, E]."""
    raise NotImplementedError(f"the {self} drafter's cache is built from the levels' caches")

  def abstract_heads(self, config: ModelConfig) -> dict | None:
    """Shapes of the weights it is handed when they are not a draft model's (memory_plan),
    with the target's LM head it reads as "head"; None for a draft model's or none."""
    return None

  def commit(self, cache: LevelCache | None, lead: Lead, tree: TokenTree | DynamicTree, path: jax.Array,
             n_accepted: jax.Array, live: jax.Array) -> LevelCache | None:
    """Its own cache (a Proposal's) once the level above accepted n_accepted [B] nodes of the
    tree along path [B, D]; lead: its pending tokens when it proposed; None: it keeps none.
    A draft model's, the default: its round wrote every node but the deepest (a dynamic tree:
    every node) past its length, so the accepted ones it holds are committed, and an accepted
    leaf it did not run waits in its next lead. A drafter that writes in its round only what it
    keeps returns the cache as it is (heads/drafter.FeatureDrafter)."""
    if cache is None:
      return None
    held = jnp.minimum(n_accepted, tree.max_depth if isinstance(tree, DynamicTree) else tree.max_depth - 1)
    return cache.replace(recent=commit(cache.recent, lead, path, held, live))


@dataclasses.dataclass(frozen=True)
class NGramDrafter(Drafter):
  """Prompt lookup: copies what followed the latest earlier occurrence of the sequence's longest
  suffix of min_ngram..max_ngram tokens. A match of n tokens offers at most 2**n of them
  (Proposal.offered): a longer match foretells a longer stretch. Replayed over `ar`'s Spec-Bench
  answers, a chain of 8 so capped and verified at offer_widths kept 11% more tokens per unit of
  forward cost than the whole chain of 4 offered on every match. Where no such suffix occurred
  before it offers nothing, and the level above spends a one-token forward on that round."""
  max_ngram: int = 3
  mode: str = "deterministic"
  min_ngram: int = 1

  def __str__(self) -> str:
    return str(spec.NGram(self.max_ngram, self.min_ngram))

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    if isinstance(tree, DynamicTree) or any(p != i - 1 for i, p in enumerate(tree.parents)):
      raise UsageError("the n-gram drafter proposes a chain: use --tree=chain:N (or --method=sd)")
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise UsageError(f"n-gram lengths {self.min_ngram}..{self.max_ngram}: need 1 <= min <= max")

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    del key
    history, history_len = inp.seq, inp.end
    batch, width = history.shape
    rows = jnp.arange(batch)[:, None]
    idx = jnp.arange(width)[None, :]
    best = jnp.full((batch,), -1, jnp.int32)  # end index of the chosen earlier match
    matched = jnp.zeros((batch,), jnp.int32)  # its length
    match = idx < history_len[:, None] - 1    # ends strictly before the suffix does
    for n in range(1, self.max_ngram + 1):    # longer suffixes override shorter ones
      j = n - 1                               # the suffix's n-th token from the end must match too
      suffix_tok = jnp.take_along_axis(history, jnp.maximum(history_len - 1 - j, 0)[:, None], axis=1)
      shifted = jnp.take_along_axis(history, jnp.maximum(idx - j, 0).repeat(batch, 0), axis=1)
      match = match & (idx >= j) & (shifted == suffix_tok) & (history_len[:, None] - 1 - j >= 0)
      latest = jnp.max(jnp.where(match, idx, -1), axis=1)
      if n >= self.min_ngram:
        best = jnp.where(latest >= 0, latest, best)
        matched = jnp.where(latest >= 0, n, matched)
    take = best[:, None] + 1 + jnp.arange(tree.size)[None, :]
    take = jnp.where((best[:, None] >= 0) & (take < history_len[:, None]), take, history_len[:, None] - 1)
    followed = history_len - 1 - best                                  # tokens after the match
    offered = jnp.where(best >= 0, jnp.minimum(jnp.minimum(tree.size, followed), 2 ** matched), 0)
    prop = _static_proposal(tree, history[rows, take].astype(jnp.int32), None, inp)
    return prop.replace(children=chain_children(offered, tree.size), offered=offered)


def chain_children(count: jax.Array, size: int) -> jax.Array:
  """[B, size+1, 1] a chain's children per row when it holds count [B] of its size nodes:
  position i (the root, then node i-1) has node i as its child while the chain holds it."""
  position = jnp.arange(size + 1)[None, :]
  return jnp.where(position < count[:, None], position, -1)[:, :, None].astype(jnp.int32)


def _static_proposal(tree: TokenTree, tokens, q, inp: DraftInputs, cache=None) -> Proposal:
  """fill_tree runs every node but the deepest ones: a cache holds an accepted path's first D-1."""
  return Proposal(tokens=tokens, q=q, start=inp.end, depth=jnp.asarray(tree.depth),
                  attend=jnp.asarray(tree_attend_mask(tree)), cache=cache)


def _roundtree_positions(inp: DraftInputs, depth) -> jax.Array:
  """[B, P+N]: the lead's positions, then each node's (the root's position + its depth)."""
  depth = jnp.broadcast_to(depth, (inp.end.shape[0], depth.shape[-1]))
  return jnp.concatenate([inp.lead.positions, inp.end[:, None] - 1 + depth], axis=1)


@dataclasses.dataclass(frozen=True)
class SelfDrafter(Drafter):
  num_layers: int
  mode: str = "deterministic"  # children = the draft's top-k; or "iid" / "without_replacement" samples

  reads_from_above = "cache"   # its first layers run over the level above's cache

  def __str__(self) -> str:
    return str(spec.SelfDraft(self.num_layers))

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    if not 1 <= self.num_layers < config.num_layers:
      raise UsageError(f"self-draft layers={self.num_layers} must be in [1, {config.num_layers})")
    check_dynamic_mode(tree, self.mode)

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    """One forward of the first k layers per depth, on a scratch cache of (lead, nodes) that
    reads the level above's cache (its first k layers) as context."""
    k, lead, config = self.num_layers, inp.lead, inp.config
    batch, p = lead.tokens.shape
    mask = round_mask(lead.valid, tree_attend_mask(tree))                         # [B, P+N, P+N]
    positions = _roundtree_positions(inp, jnp.asarray(tree.depth))
    context = (_first_layers(inp.cache.long, k), _first_layers(inp.cache.recent, k))

    def step(scratch, fed, idx):
      logits, _, scratch = forward(inp.params, config, fed, positions[:, idx], scratch, mask[:, idx],
                                   write_at=jnp.full((batch,), int(idx[0]), jnp.int32), context=context)
      return logits, scratch

    scratch = KVCache.init(config.replace(num_layers=k), batch, p + tree.size)
    tokens, q, _ = fill_tree(key, tree, lead.tokens, step, scratch, config.vocab_size,
                             inp.sampling, self.mode)
    return _static_proposal(tree, tokens, q, inp)

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    """A DynamicTree per row, grown on a scratch cache that reads the target's first k layers."""
    k, base, config = self.num_layers, inp.end - 1, inp.config
    context = (_first_layers(inp.cache.long, k), _first_layers(inp.cache.recent, k))

    def run(scratch, fed, depth, first, attend, parents):
      del parents
      logits, _, scratch = forward(inp.params, config, fed, tree_positions(base, depth, fed), scratch, attend,
                                   write_at=jnp.full_like(base, first), context=context)
      return logits, scratch

    scratch = KVCache.init(config.replace(num_layers=k), base.shape[0], dynamic_tree.scratch_slots(tree))
    tokens, trees = dynamic_tree.grow(tree, inp.lead.root, run, scratch)
    return _dynamic_proposal(tokens, trees, inp)


def _dynamic_proposal(tokens, trees: dynamic_tree.RowTrees, inp: DraftInputs, cache=None) -> Proposal:
  return Proposal(tokens=tokens, q=None, start=inp.end, depth=trees.depth, attend=trees.attend,
                  children=trees.children, cache=cache)


def _first_layers(cache: KVCache, k: int) -> KVCache:
  """The self-draft's view of a target cache: its first k layers' keys/values."""
  return cache.replace(keys=cache.keys[:k], values=cache.values[:k])


def tree_positions(base, depth: int, fed):
  """[B, N] positions of the nodes `fed` at one depth of a tree: each row's base + depth."""
  return jnp.broadcast_to(base[:, None] + depth, fed.shape)


def check_dynamic_mode(tree, mode: str) -> None:
  """Refuses a draw mode that a dynamic tree (the draft's top-k at each node) cannot use."""
  if isinstance(tree, DynamicTree) and mode != "deterministic":
    raise UsageError(f"a dynamic tree proposes the draft's top-{tree.width} tokens at each node: "
                     f"draw mode {mode!r} does not apply (use deterministic)")


def fill_tree(key, tree: TokenTree, lead_tokens, step, state, vocab_size: int, sampling: SamplingParams,
              mode: str):
  """Fills a tree one depth per draft forward: all nodes of a depth in one batch.

  The first forward runs the lead tokens [B, P] (pending tokens, the root last); then each
  depth's nodes. step(state, fed [B, T], idx [T] round slots: P lead slots then the nodes)
  -> (logits [B, T, V], state). The deepest nodes are not run: a drafter with a cache of its
  own feeds an accepted leaf with its next round's lead.
  Returns (tokens [B, N], q [B, N+1, V]: the distribution each position's children came from, state).
  """
  batch, p = lead_tokens.shape
  n = tree.size
  tokens = jnp.zeros((batch, n), jnp.int32)
  q_all = jnp.zeros((batch, n + 1, vocab_size), jnp.float32)
  frontier = (-1,)                                                    # node indices; -1: the root
  for d, level in enumerate(tree.level_nodes):
    if d == 0:
      logits, state = step(state, lead_tokens, np.arange(p))
      logits = logits[:, -1:]                                         # the root's
    else:
      logits, state = step(state, tokens[:, np.array(frontier)], p + np.array(frontier))
    if not level:
      break
    q = probabilities(logits, sampling)                               # [B, T, V]
    q_all = q_all.at[:, np.array([u + 1 for u in frontier])].set(q)
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

  def never_other(self, logits):
    """A reduced vocabulary's OTHER id stands for every token outside it: never proposed."""
    if self.target_ids is None:
      return logits
    return mask_other(logits)

  def target_probs(self, probs, target_vocab_size: int):
    """probs [..., V'] over the draft's ids -> [..., V] over the target's."""
    return probs if self.target_ids is None else spread_probs(probs, self.target_ids, target_vocab_size)


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """A model drafting autoregressively over a cache of its own: a separate draft model
  (weights 'draft', full or StreamingLLM cache), or the target itself over a retrieval
  cache (weights 'target': TriForce's "retrieval without hierarchy")."""
  config: ModelConfig                  # the drafting model's
  mode: str = "deterministic"
  target_vocab_size: int | None = None  # set when the draft's vocabulary is a subset (vocab.py)
  cache: CacheKind = Full()            # its long cache
  weights: str = "draft"

  def __str__(self) -> str:
    return f"{self.weights}[{self.cache}]"

  @property
  def cache_weights(self) -> str:
    return self.weights

  @property
  def needs_draft_weights(self) -> bool:
    return self.weights == "draft"

  @property
  def draft_model(self) -> ModelConfig | None:
    return self.config if self.weights == "draft" else None

  def check(self, tree: TokenTree, config: ModelConfig) -> None:
    target_vocab = self.target_vocab_size or self.config.vocab_size
    if target_vocab != config.vocab_size:
      raise UsageError(f"draft and target vocabularies differ: the draft's has {target_vocab} "
                       f"tokens, the target's {config.vocab_size}; a draft must use the target's "
                       "tokenizer (or a reduced vocabulary mapped onto it)")
    if self.weights not in ("draft", "target"):
      raise UsageError(f"a drafter's weights are 'draft' or 'target', not {self.weights!r}")
    if (self.weights == "draft") == isinstance(self.cache, Retrieval):
      raise UsageError("a retrieval cache is the target's (built from its full cache); a draft "
                       "model's cache is full or streaming")
    check_dynamic_mode(tree, self.mode)

  def _weights(self, inp: DraftInputs) -> "DraftWeights":
    return DraftWeights(inp.params) if self.weights == "target" else inp.draft

  keeps_up = True

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    """One draft forward per depth on the draft's own cache (the leaves are not run), which
    commits with the path the level above accepts."""
    config, draft, lead, cache = self.config, self._weights(inp), inp.lead, inp.cache
    recent = cache.recent
    mask = round_mask(lead.valid, tree_attend_mask(tree))
    attend_all = round_attend(recent.lengths, recent.max_len, mask)                 # [B, P+N, W]
    positions = _roundtree_positions(inp, jnp.asarray(tree.depth))
    base = recent.lengths

    def step(recent, fed, idx):
      logits, _, recent = forward(draft.params, config, fed, positions[:, idx], recent,
                                  attend_all[:, idx], write_at=base + int(idx[0]), context=(cache.long,))
      return draft.never_other(logits), recent

    tokens, q_all, recent = fill_tree(key, tree, draft.to_draft(lead.tokens), step, recent,
                                      config.vocab_size, inp.sampling, self.mode)
    q_all = draft.target_probs(q_all, self.target_vocab_size)
    return _static_proposal(tree, draft.to_target(tokens), q_all, inp, cache.replace(recent=recent))

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    """A DynamicTree per row, grown on a scratch cache; then one forward of the chosen tree
    writes its keys/values after the root, so the draft cache commits like a static tree's."""
    config, draft, cache, base = self.config, self._weights(inp), inp.cache, inp.end - 1
    context = (cache.long, cache.recent)

    def run(scratch, fed, depth, first, attend, parents):
      del parents
      logits, _, scratch = forward(draft.params, config, fed, tree_positions(base, depth, fed), scratch,
                                   attend, write_at=jnp.full_like(base, first), context=context)
      return draft.never_other(logits), scratch

    scratch = KVCache.init(config, base.shape[0], dynamic_tree.scratch_slots(tree))
    root = draft.to_draft(inp.lead.root)
    tokens, trees = dynamic_tree.grow(tree, root, run, scratch)
    fed = jnp.concatenate([root[:, None], tokens], axis=1)
    positions = base[:, None] + jnp.pad(trees.depth, ((0, 0), (1, 0)))
    recent = cache.recent
    _, recent = hidden_states(draft.params, config, fed, positions, recent,
                              round_attend(recent.lengths, recent.max_len, trees.attend),
                              context=(cache.long,))
    # A token outside a reduced vocabulary is never ranked above a real one; if one still
    # fills a slot (a vocabulary smaller than the width), any target token keeps this exact.
    return _dynamic_proposal(jnp.maximum(draft.to_target(tokens), 0), trees, inp, cache.replace(recent=recent))


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
