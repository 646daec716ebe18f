"""The fastest stack among candidates: HSD's reduction to a shortest path, in polynomial time.

Candidates (`Candidates`): drafters, each with the trees it may propose (a
chain is a tree; Sequoia's tree for a verifier's profile is one more); middle
levels, cheapest first (e.g. the distilled draft, the target over retrieval
caches of several budgets, the draft over StreamingLLM windows); the target;
the gammas a middle level may buffer; and the acceptance of every
(verifier, proposer) pair as a per-rank profile.

Search objective: latency.predict with fixed buffers (HSD's buffer targets):
a middle level's proposal to the level above is exactly its gamma tokens.
Then the time level m takes to fill gamma tokens depends only on what is
directly below it -- (m', gamma') or a drafter's tree -- and on that lower
state's own best fill time:

  F(m, gamma) = min over lower states s of
                rounds(gamma; yields of m verifying s) * (cost_m(L_s + 1) + F(s)),

with L_s = gamma' (or the tree's size) and F(drafter, tree) its proposal's
cost. Every term but F(s) is fixed by (m, gamma, s), so the best F(m, gamma)
uses the best F(s): optimal substructure. States are visited cheapest level
first (a level verifies only cheaper ones), a shortest path over a DAG of
O(levels x gammas + trees) states with O(that^2) edges; the target closes the
path at seconds per token = (cost_K(L_s + 1) + F(s)) / E[yield].
`brute_force` enumerates every stack and agrees (tests/test_planner.py).
The winner is then scored with the exact model (buffer overshoot included).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Sequence

import numpy as np

from hitree_jax.decode import spec
from hitree_jax.planner import latency
from hitree_jax.tree.shapes import TokenTree

# The levels are spec.Level values (the planner's: auto.Space), and the target on top is TARGET.
# Nothing here reads them: any hashable names serve (the tests' are text).
TARGET = "target"
Name = spec.Level | str


@dataclasses.dataclass(frozen=True)
class Drafter:
  name: Name
  trees: tuple[tuple[spec.TreeSpec, TokenTree], ...]   # (its spec, the tree) it may propose
  cost: latency.Cost | None = None          # its forward's cost curve; None: free (n-gram)
  own_cache: bool = True                    # a cache of its own (not the target's first layers')
  keeps_tree: bool = True                   # False: it keeps none of its tree (EAGLE: latency.drafter_lead)


@dataclasses.dataclass(frozen=True)
class Candidates:
  drafters: tuple[Drafter, ...]
  middles: tuple[tuple[Name, latency.Cost], ...]   # cheapest first
  target: latency.Cost
  gammas: tuple[int, ...]
  acceptance: Mapping[tuple[Name, Name], Sequence[float]]  # (verifier, proposer) -> per-rank profile
  overheads: latency.Overheads = latency.Overheads()
  # (verifier, middle level) -> per-token acceptance of the middle level's buffer (default: the
  # per-rank profile's rank 0); under sampling a buffer holds samples, accepted at rate alpha.
  buffer_acceptance: Mapping[tuple[Name, Name], float] | None = None
  # (verifier, drafter) -> latency.accepted_law's `deeper` (default 1: positions alike).
  deeper: Mapping[tuple[Name, Name], float] | None = None
  # (verifier, drafter) -> how often the drafter offers its tree, or the law of how much of its
  # chain (latency.first_round; default 1), the profile then being its acceptance when it does;
  # or its rounds replayed (latency.Replayed).
  offers: Mapping[tuple[Name, Name], float | tuple[float, ...] | latency.Replayed] | None = None
  rows: int = 1   # the batch the costs were timed at: a round runs at its widest row's offer

  def profile(self, verifier: Name, proposer: Name):
    return self.acceptance.get((verifier, proposer))

  def deeper_of(self, verifier: Name, proposer: Name) -> float:
    return 1.0 if self.deeper is None else self.deeper.get((verifier, proposer), 1.0)

  def offer_of(self, verifier: Name, proposer: Name) -> float | tuple[float, ...] | latency.Replayed:
    return 1.0 if self.offers is None else self.offers.get((verifier, proposer), 1.0)

  def of_buffer(self, verifier: Name, proposer: Name) -> float | None:
    if self.buffer_acceptance is not None:
      return self.buffer_acceptance.get((verifier, proposer))
    profile = self.profile(verifier, proposer)
    return None if profile is None else float(profile[0])


@dataclasses.dataclass(frozen=True)
class Plan:
  """A stack, bottom-up: the drafter and its tree, then (middle level, gamma) pairs."""
  drafter: Name
  tree: spec.TreeSpec
  middles: tuple[tuple[Name, int], ...]
  seconds_per_token: float            # the search objective (fixed buffers)
  exact: latency.Prediction | None = None

  def describe(self) -> str:
    return "/".join([f"{self.drafter}:{self.tree}", *(f"{m}:{g}" for m, g in self.middles), TARGET])


def stack_model(c: Candidates, drafter: Drafter, tree: TokenTree,
                middles: Sequence[tuple[Name, int]]) -> latency.StackModel | None:
  """latency.StackModel of a stack, or None when a pair on it has no acceptance profile."""
  names = [drafter.name, *(m for m, _ in middles), TARGET]
  cost_of = dict(c.middles) | {TARGET: c.target}
  acceptance = [c.profile(names[1], names[0]), *(c.of_buffer(v, p) for p, v in zip(names[1:], names[2:]))]
  if any(a is None for a in acceptance):
    return None
  lead = latency.drafter_lead(len(middles) + 1, tree, drafter.own_cache, drafter.keeps_tree)
  return latency.StackModel(tree=tree, draft_seconds=latency.tree_draft_seconds(tree, drafter.cost),
                            draft_pending=latency.draft_pending(drafter.cost, lead),
                            costs=tuple(cost_of[n] for n in names[1:]),
                            acceptance=(tuple(acceptance[0]), *acceptance[1:]),
                            gammas=tuple(g for _, g in middles), overheads=c.overheads,
                            model_drafter=drafter.cost is not None, deeper=c.deeper_of(names[1], names[0]),
                            offer=c.offer_of(names[1], names[0]), rows=c.rows)


def brute_force(c: Candidates, max_middles: int | None = None, fixed_buffers: bool = True) -> Plan:
  """Every stack: each drafter and tree, each ordered subset of middle levels, each gamma."""
  best = None
  limit = len(c.middles) if max_middles is None else max_middles
  for drafter in c.drafters:
    for shape, tree in drafter.trees:
      for n in range(limit + 1):
        for chosen in itertools.combinations([m for m, _ in c.middles], n):
          for gammas in itertools.product(c.gammas, repeat=n):
            middles = tuple(zip(chosen, gammas))
            model = stack_model(c, drafter, tree, middles)
            if model is None:
              continue
            seconds = latency.predict(model, fixed_buffers).seconds_per_token
            if best is None or seconds < best.seconds_per_token:
              best = Plan(drafter.name, shape, middles, seconds)
  return best


def optimize(c: Candidates) -> Plan:
  """The shortest path of the module docstring; the winner scored with the exact model too."""
  best = finalists(c)[0]
  return dataclasses.replace(best, exact=exact(c, best))


def exact(c: Candidates, plan: Plan) -> latency.Prediction:
  """The exact model's prediction for a plan of `c` (buffer overshoot included)."""
  drafter = next(d for d in c.drafters if d.name == plan.drafter)
  return latency.predict(stack_model(c, drafter, dict(drafter.trees)[plan.tree], plan.middles))


def finalists(c: Candidates) -> list[Plan]:
  """The shortest path's last step: for each state the target may verify (a drafter's tree, or a
  middle level's best stack at each gamma), the stack through it, fastest first by the search
  objective. A batch ranks them again by its slowest row (auto.choose)."""
  # States a level may verify: (proposer name, its tree (a drafter) or None (a buffer), the
  # proposal's length, the seconds to make it, the path: (drafter, its tree's spec, middles)).
  over = c.overheads
  lower = []
  for d in c.drafters:
    for shape, tree in d.trees:
      seconds = latency.tree_draft_seconds(tree, d.cost) + (over.propose(tree) if d.cost else 0.0)
      lower.append((d.name, tree, tree.size, seconds, (d.name, shape, ())))

  def verify(verifier, cost, state):
    """(the law of the yield, the seconds) of `verifier`'s round over `state`'s proposal, or None."""
    name, tree, length, _, _ = state
    if tree is not None:
      profile = c.profile(verifier, name)
      return None if profile is None else latency.first_round(
          cost, tree, profile, over, c.deeper_of(verifier, name), c.offer_of(verifier, name), c.rows)
    a = c.of_buffer(verifier, name)   # a buffer of exactly `length` tokens
    return None if a is None else (latency.round_yield(np.eye(length + 1)[-1], a),
                                   cost(length + 1) + over.check(None))

  for name, cost in c.middles:
    found = []
    for gamma in c.gammas:
      options = []
      for state in lower:
        checked = verify(name, cost, state)
        if checked is None:
          continue
        law, seconds = checked   # a middle level's round: its overheads' `middle` too
        options.append((latency.fill(gamma, law, c.rows).rounds * (seconds + over.middle + state[3]), state[4]))
      if options:
        seconds, (dname, shape, middles) = min(options, key=lambda o: o[0])
        found.append((name, None, gamma, seconds, (dname, shape, middles + ((name, gamma),))))
    lower.extend(found)  # levels above may verify this one; it verifies only those before it

  options = []
  for state in lower:
    checked = verify(TARGET, c.target, state)
    if checked is None:
      continue
    law, seconds = checked
    options.append(((seconds + state[3]) / latency.expected(law, float), state[4]))
  return [Plan(dname, shape, middles, seconds)
          for seconds, (dname, shape, middles) in sorted(options, key=lambda o: o[0])]
