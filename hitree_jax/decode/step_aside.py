"""Stepping aside: a row whose drafter stops paying runs plain rounds, then tries again.

Each row keeps a running mean of the tokens the target accepts per speculative round (an
exponential mean, weight 1/`memory` on the newest round; a round in which its drafter offered
nothing, as prompt lookup does without a match, is a plain one and not counted), starting at
twice `below`. When it falls below `below` (the break-even: a wide round must commit that many
more tokens than a plain one to pay for itself), the row's next rounds offer nothing: `rounds`
of them, twice as many after each probe that fails (at most MAX_DOUBLINGS times), `rounds` again
after a round that pays. The target then runs the root alone, the one-token forward of `ar`
(loop.Decoder's narrowest offer width, taken when every live row offers nothing), and the
row's token is the target's, as in any round: the output is unchanged. Afterwards the row
offers again, a probe, with its mean set to `below`: a probe that accepts nothing sends it
aside at once, one that accepts more keeps it speculating.

A round in which every live row rests runs no level under the target. One that keeps nothing
between rounds (n-gram, self, Medusa) needs nothing. One with a cache of its own (a draft
model; in a hierarchy, each middle level) falls behind by a token a round, and catches up in
one forward of up to CATCH_UP_CHUNK tokens, when it is that far behind or before a round that
speculates (loop.Decoder._catch_up). A drafter whose cache is written from what it drafts
(EAGLE, DFlash) cannot: it still drafts, and what is saved is the target's wide forward.

In a hierarchy the row's running mean is of the tokens the target accepts from the buffer
below it. A round in which only some rows rest fills every row's buffer (the rows share the
middle levels' forwards) and offers the target nothing from the resting ones.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.errors import UsageError

MAX_DOUBLINGS = 3   # a drafter that keeps failing is probed every 8 x `rounds` rounds at the rarest
# A hierarchy's levels under the target catch up on the tokens their rows missed resting this
# many a forward, at most a round's extent (loop.Decoder.catch_up_chunk): one forward of each
# level per chunk of resting rounds, not one a round.
CATCH_UP_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class StepAside:
  below: float        # accepted tokens per speculative round under which a row steps aside
  rounds: int = 16    # plain rounds before it offers again
  memory: int = 4     # the running mean's span in rounds (weight 1/memory on the newest)

  def __post_init__(self):
    if not (isinstance(self.below, (int, float)) and 0 < self.below and math.isfinite(self.below)):
      raise UsageError(f"step_aside below={self.below!r} must be a positive number of accepted tokens per round")
    for name in ("rounds", "memory"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"step_aside {name}={value!r} must be a positive integer")

  @classmethod
  def parse(cls, text: str) -> "StepAside":
    """BELOW[:ROUNDS[:MEMORY]], e.g. 0.5, 0.5:32 or 0.5:16:16."""
    below, *rest = text.split(":")
    try:
      if len(rest) > 2:
        raise ValueError
      numbers = float(below), *map(int, rest)
    except ValueError:
      raise UsageError(f"--step_aside={text}: expected BELOW[:ROUNDS[:MEMORY]], accepted tokens per round, "
                       "plain rounds and the running mean's span in rounds (e.g. 0.5, 0.5:32 or 0.5:16:16)") from None
    return cls(*numbers)

  def rounds_to_switch(self, mean: float | None = None) -> int:
    """Speculative rounds that accept nothing before a row whose running mean was `mean`
    (default: where every row starts) steps aside."""
    keep = 1 - 1 / self.memory
    rounds, mean = 1, (2 * self.below if mean is None else mean) * keep
    while mean >= self.below:
      rounds, mean = rounds + 1, mean * keep
    return rounds

  def rests(self, failures: int) -> int:
    """Plain rounds after the first step aside (failures 0) and after each failed probe."""
    return self.rounds * 2 ** min(failures, MAX_DOUBLINGS)

  def __str__(self) -> str:
    return f"{self.below:g}:{self.rounds}" + (f":{self.memory}" if self.memory != StepAside.memory else "")


@flax.struct.dataclass
class Resting:
  """Per row: plain rounds left (0: speculating), the running mean of accepted tokens, and the
  plain rounds its next step aside lasts."""
  left: jax.Array   # [B] int32
  mean: jax.Array   # [B] float32
  rest: jax.Array   # [B] int32

  @classmethod
  def start(cls, batch: int, rule: StepAside) -> "Resting":
    """Every row speculating, its mean at twice the break-even: a drafter that never pays steps
    aside after rule.rounds_to_switch() rounds."""
    return cls(jnp.zeros((batch,), jnp.int32), jnp.full((batch,), 2.0 * rule.below, jnp.float32),
               jnp.full((batch,), rule.rounds, jnp.int32))

  def after(self, rule: StepAside, n_accepted, live, offered=None) -> tuple["Resting", jax.Array]:
    """The state after a round in which live rows accepted n_accepted [B]; and [B] whether each
    row stepped aside in it. offered [B]: whether each row's drafter offered anything (prompt
    lookup offers nothing where no suffix matched); a round offering nothing is a plain one
    already, so it moves neither the mean nor the rest (None: every row offered)."""
    resting = self.left > 0
    speculated = live & ~resting & (True if offered is None else offered)
    mean = jnp.where(speculated, self.mean + (n_accepted - self.mean) / rule.memory, self.mean)
    left = jnp.where(live & resting, self.left - 1, self.left)
    mean = jnp.where(live & resting & (left == 0), rule.below, mean)  # a probe next round
    entered = speculated & (mean < rule.below)
    rest = jnp.where(entered, jnp.minimum(2 * self.rest, rule.rests(MAX_DOUBLINGS)),
                     jnp.where(speculated, rule.rounds, self.rest))   # a round that paid: from the start
    return Resting(jnp.where(entered, self.rest, left), mean, rest), entered
