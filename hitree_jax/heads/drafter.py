"""Drafts on the target's features as the bottom level of any stack (decode.drafters.Drafter).

The level right above the drafter (the target, or the target over a retrieval
cache) runs one forward per verification anyway; the engine keeps the hidden
states of the tokens that forward accepted in a ring (decode/features.py), so
drafting the next round needs no target forward of its own. A round of `EagleDrafter`:

  1. runs its pending tokens (the sequence since its last round, the root
     last) with their true features f_{i-1}, and commits them to its cache;
  2. grows the tree from the root's predicted feature: each node reads the
     feature its parent predicted, on a scratch cache that sees the committed
     one; nothing of the tree is kept (the next round re-runs what was
     accepted with the target's features).

`MedusaDrafter` reads only the feature of the token before the root: its
head k fills depth k of the tree, the same guesses under every parent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.drafters import (DraftInputs, Drafter, Proposal, check_dynamic_mode, tree_positions,
                                        fill_tree, round_attend, tree_attend_mask)
from hitree_jax.decode.features import feature_at
from hitree_jax.decode.levels import commit, round_mask
from hitree_jax.cache.kinds import Full
from hitree_jax.errors import UsageError
from hitree_jax.heads import dflash, eagle, medusa, published
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree import dynamic as dynamic_tree
from hitree_jax.tree.shapes import DynamicTree, TokenTree


def _target_head_shape(config: ModelConfig, vocab_size: int) -> jax.ShapeDtypeStruct:
  """The target's head on the draft's vocabulary [E, V'], which a feature draft borrows."""
  return jax.ShapeDtypeStruct((config.hidden_size, vocab_size), jnp.dtype(config.dtype))


class FeatureDrafter(Drafter):
  """A drafter on the target's features: what it keeps of a round (the accepted context, written
  with the target's features) is in its cache when it proposes, so committing keeps it as is."""

  def commit(self, cache, lead, tree, path, n_accepted, live):
    del lead, tree, path, n_accepted, live
    return cache


@dataclasses.dataclass(frozen=True)
class EagleDrafter(FeatureDrafter):
  """EAGLE's one-layer feature draft (heads/eagle.py) with a full cache of its own."""
  config: ModelConfig                   # eagle.layer_config: the target's width, one layer
  mode: str = "deterministic"
  target_vocab_size: int | None = None  # set when its vocabulary is a subset (vocab.py)
  cache: Full = Full()
  taps: tuple[int, ...] = ()            # the target's layers it reads beside the final states (EAGLE-3)
  net: object = eagle.EagleNet()        # how a position's state and logits are computed (eagle3.Eagle3Net)

  reads_features = True
  reads_from_above = "features"
  keeps_tree = False            # the accepted path is re-run with the target's features
  needs_draft_weights = True    # its layer and fuse (DraftWeights.params), the target's head
  prefills_own_cache = True     # from the prompt's features

  def __str__(self) -> str:
    return "eagle" if isinstance(self.net, eagle.EagleNet) else "eagle3"

  def level_config(self, target: ModelConfig, draft: ModelConfig | None) -> ModelConfig:
    return self.config

  def prefill_cache(self, draft_params, target_params, config: ModelConfig, empty: KVCache, batch,
                    hidden, programs) -> KVCache:
    tokens, chunk = prefill_lib.chunked_tokens(batch)
    return eagle.prefill(draft_params, config, target_params["embed_tokens"]["embedding"], empty, tokens,
                         hidden, batch.lengths, chunk, programs, self.net)

  def abstract_heads(self, config: ModelConfig) -> dict:
    if not isinstance(self.net, eagle.EagleNet):   # published EAGLE-3: its own lm_head, no "head"
      return self.net.abstract_params(self.config, self._reduced())
    shapes = jax.eval_shape(lambda: eagle.init_params(self.config, jax.random.key(0), len(self.taps)))
    return dict(shapes, head=_target_head_shape(config, self.config.vocab_size))

  def check(self, tree, config: ModelConfig) -> None:
    target_vocab = self.target_vocab_size or self.config.vocab_size
    if target_vocab != config.vocab_size:
      raise UsageError(f"draft and target vocabularies differ: the EAGLE draft's maps onto "
                       f"{target_vocab} tokens, the target has {config.vocab_size}")
    ours = isinstance(self.net, eagle.EagleNet)   # our layer has its target's heads too (EAGLE-3's its own)
    if self.config.hidden_size != config.hidden_size or (ours and self.config.num_heads != config.num_heads):
      raise UsageError(f"the EAGLE draft reads features of width {self.config.hidden_size} "
                       f"({self.config.num_heads} heads); the target's are {config.hidden_size} "
                       f"({config.num_heads} heads): it was trained for another target")
    if self.taps and max(self.taps) >= config.num_layers - 1:
      raise UsageError(f"the EAGLE draft reads layers {list(self.taps)} of its target; this target "
                       f"has {config.num_layers} layers: it was trained for another target")
    check_dynamic_mode(tree, self.mode)

  def _reduced(self) -> bool:
    return self.target_vocab_size is not None

  def _lead_round(self, inp: DraftInputs):
    """Runs and commits the pending tokens: -> (the root's predicted feature [B, E], cache)."""
    lead, cache, draft = inp.lead, inp.cache, inp.draft
    recent = cache.recent
    attend = round_attend(recent.lengths, recent.max_len, round_mask(lead.valid, np.ones((1, 1), bool)))
    out, recent = self.net.features(draft.params, self.config, inp.params["embed_tokens"]["embedding"],
                                    lead.tokens, self.net.fuse(draft.params, feature_at(inp.features, lead.positions - 1)),
                                    lead.positions, recent, attend, context=(cache.long,))
    batch = lead.tokens.shape[0]
    recent = commit(recent, lead, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32),
                    jnp.ones((batch,), bool))
    return out[:, -1], cache.replace(recent=recent)

  def _node_features(self, inp: DraftInputs, cache, scratch, fed, prev, positions, attend, first: int):
    """A forward of tree nodes fed [B, T] (draft ids) on the scratch cache (slot 0, the root's, is
    unused: the root is in the draft's cache) -> (predicted features [B, T, E], logits, scratch)."""
    draft = inp.draft
    tokens = jnp.maximum(draft.to_target(fed), 0)
    out, scratch = self.net.features(draft.params, self.config, inp.params["embed_tokens"]["embedding"],
                                     tokens, prev, positions, scratch, attend.at[..., 0].set(False),
                                     write_at=jnp.full((fed.shape[0],), first, jnp.int32),
                                     context=(cache.long, cache.recent))
    return out, self.net.logits(draft.params, out, self._reduced()), scratch

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    """A static tree, one forward per depth; node i's scratch slot is i + 1."""
    root_feature, cache = self._lead_round(inp)
    batch, n = inp.end.shape[0], tree.size
    parent_slot = np.asarray(tree.parents) + 1
    attend = jnp.broadcast_to(tree_attend_mask(tree)[1:], (batch, n, n + 1))     # nodes over (root, nodes)
    positions = inp.end[:, None] - 1 + jnp.asarray(tree.depth)[None, :]

    def step(state, fed, idx):
      scratch, predicted = state
      if idx[0] == 0:  # the root: predicted by the lead round
        return self.net.logits(inp.draft.params, root_feature[:, None], self._reduced()), state
      nodes = idx - 1
      out, logits, scratch = self._node_features(inp, cache, scratch, fed, predicted[:, parent_slot[nodes]],
                                                 positions[:, nodes], attend[:, nodes], int(idx[0]))
      return logits, (scratch, predicted.at[:, idx].set(out))

    predicted = jnp.zeros((batch, n + 1, self.config.hidden_size), root_feature.dtype)
    state = (KVCache.init(self.config, batch, n + 1), predicted.at[:, 0].set(root_feature))
    tokens, q, _ = fill_tree(key, tree, inp.lead.tokens[:, -1:], step, state, self.config.vocab_size,
                             inp.sampling, self.mode)
    return Proposal(tokens=jnp.maximum(inp.draft.to_target(tokens), 0),
                    q=inp.draft.target_probs(q, self.target_vocab_size), start=inp.end,
                    depth=jnp.asarray(tree.depth), attend=jnp.asarray(tree_attend_mask(tree)),
                    cache=cache)

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    """EAGLE-2's tree, grown from the root's predicted feature (dynamic_tree.grow)."""
    root_feature, cache = self._lead_round(inp)
    base, batch = inp.end - 1, inp.end.shape[0]
    slots = dynamic_tree.scratch_slots(tree)

    def run(state, fed, depth, first, attend, parent_slots):
      scratch, predicted = state
      if depth == 0:
        return self.net.logits(inp.draft.params, root_feature[:, None], self._reduced()), state
      prev = jnp.take_along_axis(predicted, parent_slots[:, :, None], axis=1)
      out, logits, scratch = self._node_features(inp, cache, scratch, fed, prev,
                                                 tree_positions(base, depth, fed), attend, first)
      return logits, (scratch, jax.lax.dynamic_update_slice_in_dim(predicted, out, first, axis=1))

    predicted = jnp.zeros((batch, slots, self.config.hidden_size), root_feature.dtype)
    state = (KVCache.init(self.config, batch, slots), predicted.at[:, 0].set(root_feature))
    tokens, trees = dynamic_tree.grow(tree, inp.draft.to_draft(inp.lead.root), run, state)
    return Proposal(tokens=jnp.maximum(inp.draft.to_target(tokens), 0), q=None, start=inp.end,
                    depth=trees.depth, attend=trees.attend, children=trees.children, cache=cache)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(FeatureDrafter):
  """Medusa's K heads (heads/medusa.py): no cache, no forward; depth k's children are head k's."""
  num_heads: int
  vocab_size: int                       # the heads' (reduced) vocabulary
  mode: str = "deterministic"
  target_vocab_size: int | None = None  # set when its vocabulary is a subset (vocab.py)
  # FasterDecoding's published heads (heads/medusa_format.py): L biased blocks per head and an
  # output matrix of each head's own; ours: one block without bias, and the target's head.
  layers: int = 1
  published: bool = False

  reads_features = True
  reads_from_above = "features"
  needs_draft_weights = True    # its heads (DraftWeights.params), the target's head

  def __str__(self) -> str:
    return f"medusa:{self.num_heads}"

  def abstract_heads(self, config: ModelConfig) -> dict:
    dtype = jnp.dtype(config.dtype)
    k, e = self.num_heads, config.hidden_size
    if self.published:
      shape = lambda *dims: jax.ShapeDtypeStruct(dims, dtype)
      return {"blocks": shape(k, self.layers, e, e), "bias": shape(k, self.layers, e),
              "heads": shape(k, e, self.vocab_size)}
    shapes = jax.eval_shape(lambda: medusa.init_params(k, e, dtype))
    return dict(shapes, head=_target_head_shape(config, self.vocab_size))

  def check(self, tree, config: ModelConfig) -> None:
    target_vocab = self.target_vocab_size or self.vocab_size
    if target_vocab != config.vocab_size:
      raise UsageError(f"draft and target vocabularies differ: the Medusa heads map onto "
                       f"{target_vocab} tokens, the target has {config.vocab_size}")
    if tree.max_depth > self.num_heads:
      raise UsageError(f"a tree of depth {tree.max_depth} needs as many Medusa heads; these "
                       f"have {self.num_heads}")
    check_dynamic_mode(tree, self.mode)

  def _head_logits(self, inp: DraftInputs):
    """[B, K, V'] every head's logits from the feature of the token before the root."""
    feature = feature_at(inp.features, (inp.end - 2)[:, None])[:, 0]
    return medusa.logits(inp.draft.params, feature, self.target_vocab_size is not None)

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    return per_depth_proposal(key, tree, inp, self._head_logits(inp), self.vocab_size, self.mode,
                              self.target_vocab_size)

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    return per_depth_dynamic_proposal(tree, inp, self._head_logits(inp))


def per_depth_proposal(key, tree: TokenTree, inp: DraftInputs, rows, vocab_size: int, mode: str,
                       target_vocab_size: int | None = None, cache=None) -> Proposal:
  """A static tree whose depth-d children are drawn from rows[:, d - 1] [B, K, V'] under every
  parent (Medusa's heads, DFlash's block): the law of a node's children is its depth's."""
  depth = np.concatenate([[0], tree.depth])                     # of the root, then each node

  def step(state, fed, idx):  # the children of slot idx (root 0, node i at i + 1) are row depth's
    del fed
    return rows[:, depth[idx]], state

  tokens, q, _ = fill_tree(key, tree, inp.lead.tokens[:, -1:], step, None, vocab_size, inp.sampling, mode)
  return Proposal(tokens=jnp.maximum(inp.draft.to_target(tokens), 0),
                  q=inp.draft.target_probs(q, target_vocab_size), start=inp.end,
                  depth=jnp.asarray(tree.depth), attend=jnp.asarray(tree_attend_mask(tree)),
                  cache=cache)


def per_depth_dynamic_proposal(tree: DynamicTree, inp: DraftInputs, rows, cache=None) -> Proposal:
  """EAGLE-2's tree grown over per-depth rows [B, K, V'] (per_depth_proposal)."""

  def run(state, fed, depth, first, attend, parents):
    del first, attend, parents
    return jnp.broadcast_to(rows[:, depth, None], (*fed.shape, rows.shape[-1])), state

  tokens, trees = dynamic_tree.grow(tree, inp.draft.to_draft(inp.lead.root), run, None)
  return Proposal(tokens=jnp.maximum(inp.draft.to_target(tokens), 0), q=None, start=inp.end,
                  depth=trees.depth, attend=trees.attend, children=trees.children, cache=cache)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(FeatureDrafter):
  """z-lab's DFlash block draft (heads/dflash.py): each round commits the new context to its own
  cache and runs one forward of its block; depth d's children are block row d's top tokens."""
  config: ModelConfig          # the draft's layers: the target's width and vocabulary
  spec: dflash.BlockSpec
  mode: str = "deterministic"
  cache: Full = Full()

  reads_features = True
  reads_from_above = "features"
  keeps_tree = False            # nothing of the block is kept: the context is the target's
  needs_draft_weights = True    # its layers (DraftWeights.params), the target's embedding and head
  prefills_own_cache = True     # from the prompt's features

  @property
  def taps(self) -> tuple[int, ...]:
    return self.spec.target_layer_ids

  def __str__(self) -> str:
    return f"dflash:{self.spec.block_size}"

  def level_config(self, target: ModelConfig, draft: ModelConfig | None) -> ModelConfig:
    return self.config

  def check(self, tree, config: ModelConfig) -> None:
    if (self.config.hidden_size, self.config.vocab_size) != (config.hidden_size, config.vocab_size):
      raise UsageError(f"the DFlash draft reads features of width {self.config.hidden_size} and "
                       f"proposes among {self.config.vocab_size} tokens; the target's are "
                       f"{config.hidden_size} and {config.vocab_size}: it was trained for another target")
    if max(self.taps) >= config.num_layers:
      raise UsageError(f"the DFlash draft reads layers {list(self.taps)} of its target; this target "
                       f"has {config.num_layers} layers: it was trained for another target")
    if tree.max_depth > self.spec.block_size - 1:
      raise UsageError(f"a tree of depth {tree.max_depth} is deeper than the DFlash draft's block "
                       f"of {self.spec.block_size} proposes (at most {self.spec.block_size - 1})")
    check_dynamic_mode(tree, self.mode)

  def prefill_cache(self, draft_params, target_params, config: ModelConfig, empty: KVCache, batch,
                    hidden, programs) -> KVCache:
    from hitree_jax.decode.programs import shape_key
    args = (draft_params, self.config, empty, hidden, jnp.asarray(batch.lengths, jnp.int32))
    step = programs.get(("dflash_prefill", self.config, shape_key(args)), dflash.prefill, *args)
    return step(draft_params, empty, hidden, args[-1])

  def abstract_heads(self, config: ModelConfig) -> dict:
    c = self.config
    shape = lambda dims: jax.ShapeDtypeStruct(dims, jnp.dtype(config.dtype))
    layer = jax.tree.map(shape, published.layer_shapes(c, c.hidden_size), is_leaf=lambda x: isinstance(x, tuple))
    return {"fc": shape((len(self.taps) * c.hidden_size, c.hidden_size)), "hidden_norm": shape((c.hidden_size,)),
            "norm": shape((c.hidden_size,)), "layers": (layer,) * c.num_layers,
            "head": _target_head_shape(config, c.vocab_size)}

  def _block_rows(self, inp: DraftInputs):
    """Commits the pending tokens' context, then runs the block: -> ([B, block - 1, V], cache)."""
    lead, cache, params = inp.lead, inp.cache, inp.draft.params
    recent = cache.recent
    features = feature_at(inp.features, lead.positions - 1)[..., :len(self.taps) * self.config.hidden_size]
    recent = dflash.write_context(params, self.config, recent, features, lead.positions - 1, recent.lengths)
    batch = lead.tokens.shape[0]
    recent = commit(recent, lead, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32),
                    jnp.ones((batch,), bool))
    long = cache.long
    contexts = ((long.keys, long.values, long.lengths, dflash.first_visible(jnp.zeros_like(long.lengths))),
                (recent.keys, recent.values, recent.lengths, dflash.first_visible(long.next_positions)))
    rows = dflash.block_logits(params, self.config, self.spec, inp.params["embed_tokens"]["embedding"],
                               lead.root, inp.end - 1, contexts)
    return rows, cache.replace(recent=recent)

  def propose(self, key, tree: TokenTree, inp: DraftInputs) -> Proposal:
    rows, cache = self._block_rows(inp)
    return per_depth_proposal(key, tree, inp, rows, self.config.vocab_size, self.mode, cache=cache)

  def propose_dynamic(self, tree: DynamicTree, inp: DraftInputs) -> Proposal:
    rows, cache = self._block_rows(inp)
    return per_depth_dynamic_proposal(tree, inp, rows, cache)
