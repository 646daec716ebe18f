"""The static sizes of a stack's levels (index 0 = the drafter ... K = the target): each level's
model, long cache and weights, how many tokens it can have pending, its buffer, the recent cache's
width, and the mesh. Hashable: the compiled programs are keyed by it. And a generation's shapes
(decode_shapes): the one function the engine's prefill and memory_plan's abstract arguments share."""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import Mesh

from hitree_jax import sharding
from hitree_jax.decode.drafters import Drafter
from hitree_jax.decode.prefill import cache_slots, round_up
from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.stack import Stack
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree.shapes import DynamicTree

MIN_RECENT_SLOTS = 32  # a block's recent cache: tokens a level writes before they go to its long one


@dataclasses.dataclass(frozen=True)
class LevelPlan:
  """One level of a stack, worked out once (StackSizes.levels): its model and whose weights fill
  its long cache, that cache's kind and axes, and its static sizes. The sizes of a proposal are
  those of the proposals it makes (None for the target, which makes none)."""
  index: int
  config: ModelConfig
  weights: str | None        # whose weights fill its long cache: "target", "draft", None (the drafter's own)
  cache: Full | Streaming | Retrieval | None   # its long cache's kind (None: it keeps none)
  is_drafter: bool
  lead: int                  # most tokens it can have pending (StackSizes._lead)
  gamma: int | None          # a middle level's: the tokens it gathers before it hands them up
  buffer: int | None         # a middle level's buffer slots: it stops at >= gamma, after a round
  proposal_depth: int | None   # most tokens one of its proposals holds on a path
  proposal_size: int | None    # tokens one of its proposals holds
  # Whether its caches are split by KV head over the mesh's `model` axis: those of the target's
  # weights, which are; a draft's where its weights are (sharding.splits).
  splits_heads: bool = False

  def long_axes(self, cache):
    """The logical axes of its long cache: split by KV head (splits_heads), and by slot if it is
    a full cache."""
    return sharding.cache_axes(cache, heads=self.splits_heads, slots=isinstance(self.cache, Full))

  def place_long(self, cache, mesh: Mesh | None):
    """Its long cache on the mesh (long_axes)."""
    if mesh is None or cache is None:
      return cache
    return sharding.place(cache, self.long_axes(cache), mesh)


@dataclasses.dataclass(frozen=True)
class StackSizes:
  """Static sizes of a stack's levels (index 0 = the drafter ... K = the target: `levels`), and
  the mesh the program is partitioned over (None: one device). (Sizes, not a memory layout.)"""
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

  @property
  def reads_features(self) -> bool:
    """Whether the drafter reads the features of the level above's verify forwards."""
    return self.drafter is not None and self.drafter.reads_features

  @property
  def feature_taps(self) -> tuple[int, ...]:
    """The target's layers whose states a feature drafter reads beside the final ones (EAGLE-3)."""
    return () if self.drafter is None else tuple(self.drafter.taps)

  @functools.cached_property
  def levels(self) -> tuple[LevelPlan, ...]:
    """Each level's plan, the drafter's first and the target's last (a frozen value's cache: the
    fields, not this, make its hash)."""
    top, stack = self.top, self.stack
    weights = ["target" if j == top else self.drafter.cache_weights if j == 0 else stack.verifiers[j - 1].weights
               for j in range(top + 1)]
    caches = [Full() if j == top else self.drafter.cache if j == 0 else stack.verifiers[j - 1].cache
              for j in range(top + 1)]
    gammas = [None] + [v.gamma for v in stack.verifiers] + [None] if top else [None]
    buffers, depths, sizes = [], [], []
    for j in range(top):   # a level's buffer holds a round of the proposal below it
      buffers.append(None if j == 0 else gammas[j] - 1 + depths[j - 1] + 1)
      depths.append(stack.tree.max_depth if j == 0 else buffers[j])
      sizes.append(stack.tree.size if j == 0 else buffers[j])
    buffers, depths, sizes = buffers + [None], depths + [None], sizes + [None]
    drafter = lambda j: j == 0 and top > 0
    config = lambda j: (self.drafter.level_config(self.target, self.draft) if drafter(j) else
                        self.draft if weights[j] == "draft" else self.target)
    leads = [self._lead(j, caches) for j in range(top + 1)]
    split = lambda j: weights[j] == "target" or sharding.splits(config(j), self.mesh)
    return tuple(LevelPlan(j, config(j), weights[j], caches[j], drafter(j), leads[j], gammas[j], buffers[j],
                           depths[j], sizes[j], split(j)) for j in range(top + 1))

  @property
  def draft_weights_config(self) -> ModelConfig | None:
    """The shape of the draft weights the stack reads (DraftWeights): a draft model's, or a
    feature drafter's own layers'; None without any."""
    if self.draft is not None:
      return self.draft
    return self.levels[0].config if self.drafter is not None and self.top > 0 else None

  def _lead(self, j: int, caches) -> int:
    """Most pending tokens level j can have: its root, one more for each level above that may
    accept all it was handed, and for a drafter with a static tree the leaf it never runs."""
    if j == 0 and caches[0] is None:
      return self._lead(1, caches)
    if j == 0 and self.top > 0 and not self.drafter.keeps_tree:
      return self.top + self.stack.tree.max_depth  # it keeps none of its tree: the accepted path waits
    if j == 0 and isinstance(self.stack.tree, DynamicTree):
      return self.top  # it runs its whole tree: an accepted leaf is in its cache
    return self.top - j + 1

  @property
  def round_extent(self) -> int:
    """A bound on the slots any level's recent cache can grow by, or write past, in a top round."""
    if self.top == 0:
      return 1
    levels = self.levels
    buffers = sum(level.buffer for level in levels[1:-1])
    widest = max(level.proposal_size for level in levels[:-1])
    return buffers + levels[0].proposal_depth + 1 + levels[0].lead + self.top + widest

  @property
  def recent_slots(self) -> int:
    return max(MIN_RECENT_SLOTS, 4 * self.round_extent)

  @property
  def max_emitted(self) -> int:
    """Most tokens one top round emits."""
    return 1 if self.top == 0 else self.levels[self.top - 1].proposal_depth + 1


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
  """A generation's static shapes, from its stack and lengths alone (decode_shapes)."""
  sizes: StackSizes
  batch: int
  slots: int   # the full caches' slots: the prompt, the new tokens and a recent cache, bucketed
  tail: int    # a derived long cache's slots for the tokens decoded after the prompt

  @property
  def history(self) -> int:
    """The token history's width: as wide as the caches, so that prompts sharing a cache bucket
    share the decode program too (a width of its own, rounded to 128, doubled the programs)."""
    return self.slots


def decode_shapes(stack: Stack, config: ModelConfig, prompt_len: int, max_new_tokens: int, batch: int = 1,
                  mesh: Mesh | None = None) -> DecodeShapes:
  """The shapes of a generation of `max_new_tokens` after prompts of up to `prompt_len` tokens,
  checked against the mesh: what engine.prefill allocates and memory_plan compiles with."""
  sizes = StackSizes(stack, config, stack.draft_config, mesh)
  width = sizes.recent_slots
  slots = cache_slots(prompt_len, max_new_tokens, extra=width)
  sharding.check(config, mesh, batch, slots)
  return DecodeShapes(sizes, batch, slots, round_up(max_new_tokens + width, 8))
