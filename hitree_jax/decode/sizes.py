"""The static sizes of a stack's levels (index 0 = the drafter ... K = the target): each level's
model, long cache and weights, how many tokens it can have pending, its buffer, the recent cache's
width, and the mesh. Hashable: the compiled programs are keyed by it. And a generation's shapes
(decode_shapes): the one function the engine's prefill and memory_plan's abstract arguments share."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from hitree_jax import sharding
from hitree_jax.decode.drafters import Drafter
from hitree_jax.decode.prefill import cache_slots, round_up
from hitree_jax.cache.kinds import Full
from hitree_jax.decode.stack import Stack
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree.shapes import DynamicTree

MIN_RECENT_SLOTS = 32  # a block's recent cache: tokens a level writes before they go to its long one


@dataclasses.dataclass(frozen=True)
class StackSizes:
  """Static sizes of a stack's levels (index 0 = the drafter ... K = the target), and the mesh
  the program is partitioned over (None: one device). (Sizes, not a memory layout.)"""
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
