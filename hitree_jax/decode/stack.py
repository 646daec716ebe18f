"""What a speculative hierarchy is made of: a static description, hashable (jit-static).

A stack is levels M0 < M1 < ... < MK. MK is the target over its full cache
and verifies; M0 (the `drafter`) proposes a chain or a token tree; each
intermediate level (a `Verifier`, listed bottom-up) verifies what the level
below proposed, buffers what it accepts plus its own correction or bonus
token until it holds at least `gamma`, and hands that chain up with its own
distributions (HSD). `ar` is the stack with no drafter; `sd` / `tree` have a
drafter and no verifiers; TriForce and HiTree are [draft (streaming cache),
target over a retrieval cache, target].

Every level that keeps keys/values has a cache kind (cache/kinds.py: `Full`, `Retrieval`,
`Streaming`): the long, read-only part of its cache (see levels.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hitree_jax.cache.kinds import CacheKind, Retrieval
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree import shapes as tree_lib

if TYPE_CHECKING:
  from hitree_jax.decode.drafters import Drafter
  from hitree_jax.decode.step_aside import StepAside


@dataclasses.dataclass(frozen=True)
class Verifier:
  """An intermediate level: `weights` ('target' or 'draft') over a cache of kind `cache`,
  handing up a chain once it holds at least `gamma` tokens."""
  weights: str
  cache: CacheKind
  gamma: int

  def __post_init__(self):
    if self.weights not in ("target", "draft"):
      raise UsageError(f"a level's weights are 'target' or 'draft', not {self.weights!r}")
    if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
      raise UsageError(f"gamma={self.gamma!r} must be a positive integer (tokens a level buffers)")
    if self.weights == "draft" and isinstance(self.cache, Retrieval):
      raise UsageError("a retrieval cache is built from the target's full cache: use it with the "
                       "target's weights")

  def __str__(self) -> str:
    return f"{self.weights}[{self.cache}]/{self.gamma}"


@dataclasses.dataclass(frozen=True)
class Stack:
  """drafter: the bottom level (a drafters.Drafter: n-gram, self, model, EAGLE, Medusa) or None
  for `ar`; tree: what it proposes; verifiers: the intermediate levels, bottom-up; step_aside:
  when a row runs plain rounds because its speculation stops paying (step_aside.py)."""
  drafter: "Drafter | None" = None
  tree: tree_lib.TokenTree | tree_lib.DynamicTree | None = None
  verifiers: tuple[Verifier, ...] = ()
  draft: ModelConfig | None = None  # the draft model's, when only a verifier level uses it
  step_aside: "StepAside | None" = None

  def __post_init__(self):
    object.__setattr__(self, "verifiers", tuple(self.verifiers))
    if (self.drafter is None) != (self.tree is None):
      raise UsageError("a drafter needs a tree (or chain) to propose, and a tree needs a drafter")
    if self.drafter is None and self.verifiers:
      raise UsageError("intermediate levels verify a drafter's proposals: name a drafter")
    if any(v.weights == "draft" for v in self.verifiers) and self.draft_config is None:
      raise UsageError("a level with the draft's weights needs the draft's config: "
                       "Stack(draft=config) or a ModelDrafter at the bottom")
    if self.step_aside is not None and self.drafter is None:
      raise UsageError("stepping aside applies to a stack with a drafter (sd, tree, hsd), not to `ar`")
    if self.verifiers and isinstance(self.tree, tree_lib.DynamicTree):
      raise UsageError("a dynamic tree is grown right under the target; in a hierarchy use a "
                       "static tree (chain:N, kary:KxD, sequoia:B,D) at the bottom")

  @property
  def num_levels(self) -> int:
    return 1 + (self.drafter is not None) + len(self.verifiers)

  @property
  def uses_draft_weights(self) -> bool:
    """Whether generation needs DraftWeights: a draft model's, or a feature draft's (heads/)."""
    # __post_init__: a draft verifier needs the config
    return self.draft_config is not None or (self.drafter is not None and self.drafter.needs_draft_weights)

  @property
  def draft_config(self) -> ModelConfig | None:
    """The draft model's config: a ModelDrafter's on the draft's weights, else `draft`."""
    if self.drafter is not None and self.drafter.draft_model is not None:
      return self.drafter.draft_model
    return self.draft
