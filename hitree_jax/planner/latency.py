"""The expected time per emitted token of a speculation stack, from its levels' costs and acceptance.

A stack is, bottom-up: a drafter proposing a token tree (a chain is a tree),
intermediate levels j = 1 .. K-1 each filling a buffer of at least gamma_j
tokens, and the target K (decode/loop.py). The inputs:

  * cost_j(w): seconds of one forward of level j over w tokens, at the
    context length of interest (planner/profile.py measures it);
  * the drafter's cost of proposing its tree: one forward per depth, over
    that depth's nodes, sum_d cost_0(width_d) (0 for n-gram lookup);
  * acceptance of level j of the level below: a per-rank profile p[r], the
    probability that a node's rank-r child is accepted given its
    earlier-ranked siblings were rejected (Sequoia's model; a chain uses p[0]).

Assumptions (HSD's): acceptance events are independent across positions,
rounds and levels, and each level's buffer is drawn afresh after the level
above rejects (the engine rolls every level below back).

Derivation.

1. One verification of a proposal of L tokens on a path, per-token
   acceptance a: the level accepts k = 0..L tokens with P(k) = a^k (1 - a) for
   k < L and a^L for k = L, then emits one more (the correction or the bonus
   token): the round *yields* k + 1 tokens. For a tree, at most one node per
   depth is accepted, so P(accepted >= d) = sum over the depth-d nodes of the
   product of p[rank] along the node's path (`accepted_law`).

2. A level j >= 1 fills its buffer by rounds until it holds >= gamma_j tokens.
   Each round verifies one fresh proposal of the level below (of random
   length B_{j-1}, see 3), so round yields are i.i.d. with the law
   P(Y = y) = sum_b P(B_{j-1} = b) P(k = y - 1 | L = b). A forward DP over the
   count held, c = 0 .. gamma_j - 1, gives the probability q(c) that the fill
   ever holds exactly c tokens; the expected number of rounds is
   E[N_j] = sum_{c < gamma_j} q(c) (one round leaves each visited state), and
   the final length B_j = c + y for c < gamma_j <= c + y has law
   sum_c q(c) P(Y = B_j - c) (`fill`).

3. A round of level j costs cost_j(B_{j-1} + 1) (the proposal and its root;
   as the engine runs it, a static width: 8. below) plus the time
   level j-1 took to fill that proposal, T_{j-1}. N_j is a stopping time
   whose event {N_j >= i} depends only on rounds before i, so by Wald's
   identity E[T_j] = E[N_j] (E[cost_j(B_{j-1} + 1)] + E[T_{j-1}]), with
   T_0 the drafter's cost of its tree and B_0 its tree (a fixed proposal).

4. A top round costs cost_K(B_{K-1} + 1) + T_{K-1} and emits Y_K tokens.
   Top rounds are i.i.d. cycles, so by the renewal-reward theorem the
   long-run seconds per token are E[top round time] / E[Y_K]
   (`seconds_per_token`).

5. A round is more than its model's forward: the drafter samples at each
depth, a verifier computes its distributions, walks the tree and commits, a
middle level appends to its buffer, and the loop carries its state. On this
engine (SmolLM2, 2K, CPU) that is a few milliseconds a round, more when the
proposal is a tree, so `Overheads` adds seconds per drafter forward, per
verifying round, per round verifying a tree, and per round of a middle level
(profile.round_overheads fits them to whole generations). At 16 rows the
hierarchies' rounds left 23-29 ms each beside their forwards, a single level's
5-19 ms: one term for both had charged every round 23 ms.

6. A drafter that offers its tree only in some rounds (prompt lookup, where an
earlier occurrence of the text's last tokens exists) offers it with
probability `offer`; the level above answers a round without one by a
forward of the root alone, which yields one token (`first_round`). Prompt
lookup offers only the first m tokens of its chain, m by a law the profile
measures, and a round offering m runs the narrowest of `offer_widths` that
holds them. Its hits come in runs, against assumption 1; where the profile
replayed its rounds over the verifier's own text (`Replayed`), a round's
law of what it offers and accepts is that replay's. In a batch, the round
runs at the width of the widest offer among its rows (`widest`).

7. A batch of rows, each with its tokens to commit, ends when its slowest row
does: the rows in front run on without committing. Rows differ (one passage
repeats itself more than another), so the batch takes more rounds than its
mean row: `slowest_of` reads that from the spread of the rounds each profiled
continuation needs (auto.for_the_batch).

8. A forward's width is static (decode/sizes.py): a level verifies a buffer at
its largest size, gamma_j - 1 plus the depth of the proposal below it plus
one, not at the length it holds; and each level's forward carries slots for
its pending tokens, its `lead`: K - j + 1 at level j of K, and a drafter with
a cache of its own runs its lead (K + 1, or K + depth for one that keeps none
of its tree) in its first forward. At 16 rows of 7.5K tokens the target's
forward costs 0.12 s more per token of width, and a stack of two retrieval
levels was predicted 63% too fast without these and item 9
(docs/results/planner/batch_grid_7680_16.md). The search's objective
(`fixed_buffers`) leaves them out: a level's lead depends on the levels
above it, which the bottom-up search has not chosen yet.

9. A middle level fills its buffer for the whole batch: its rounds go on
until every row holds gamma_j tokens, so a batch's fill takes the largest of
its rows' round counts (`fill`, rows), each row's buffer length its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from hitree_jax.errors import UsageError
from hitree_jax.tree.shapes import TokenTree, chain, node_reach, offer_widths

Cost = Callable[[int], float]


def accepted_law(tree: TokenTree, profile: Sequence[float], deeper: float = 1.0) -> np.ndarray:
  """P(the verifier accepts k nodes of `tree`), k = 0 .. depth, under the per-rank profile.
  deeper: the acceptance of a node below depth 1, given its parent's, relative to the profile's
  (1: positions independent and alike; an EAGLE draft's deeper nodes read the features their
  parents predicted, and accept less): a node at depth d is reached deeper^(d-1) times as often."""
  if sum(profile) > 1 + 1e-6:
    raise UsageError(f"a per-rank profile holds the verifier's probabilities of distinct tokens "
                     f"(summing to <= 1), not {list(profile)}")
  reach, depth = node_reach(tree, profile), tree.depth
  at_least = np.ones(tree.max_depth + 1)                      # P(accepted >= d), d = 0 .. depth
  for d in range(1, tree.max_depth + 1):
    at_least[d] = min(reach[depth == d].sum() * deeper ** (d - 1), at_least[d - 1])
  return at_least - np.append(at_least[1:], 0.0)


def tree_yield(tree: TokenTree, profile: Sequence[float], deeper: float = 1.0) -> np.ndarray:
  """The law of the yield (accepted + 1) of verifying `tree`: index y = P(Y = y)."""
  return np.concatenate([[0.0], accepted_law(tree, profile, deeper)])


def chain_law(length: int, a: float) -> np.ndarray:
  """P(k of a chain of `length` accepted), k = 0 .. length, per-token acceptance a."""
  return accepted_law(chain(length), [a]) if length > 0 else np.ones(1)


@dataclasses.dataclass(frozen=True)
class Fill:
  """A level's buffer fill: the expected rounds and the law of the final length B (index b)."""
  rounds: float
  length: np.ndarray


def fill(gamma: int, yield_law: np.ndarray, rows: int = 1) -> Fill:
  """Rounds of i.i.d. yields (yield_law[y] = P(Y = y), y >= 1) until >= gamma tokens are held.
  rows: a batch's fill runs until each of its rows, independent, holds gamma (docstring, 9.): its
  rounds are the expected largest of `rows` rows' counts N, sum over n of P(max N > n)."""
  if gamma < 1:
    raise UsageError(f"gamma={gamma} must be >= 1")
  held = np.zeros(gamma)                                      # P(holding c < gamma after n rounds)
  held[0] = 1.0
  final = np.zeros(gamma + yield_law.size)
  rounds = 0.0
  while held.sum() > 1e-12:                                   # at most gamma rounds: a yield is >= 1
    rounds += 1.0 - (1.0 - held.sum()) ** rows                # P(max N > n)
    after = np.zeros(gamma)
    for c in np.nonzero(held)[0]:
      for y in np.nonzero(yield_law)[0]:
        (after if c + y < gamma else final)[c + y] += held[c] * yield_law[y]
    held = after
  return Fill(rounds=rounds, length=final)


def round_yield(proposal: np.ndarray, acceptance: float) -> np.ndarray:
  """The law of a verifying round's yield (accepted + 1), its proposal's length drawn from
  `proposal` (P(B = b)), chain acceptance a."""
  out = np.zeros(proposal.size + 1)
  for b, pb in enumerate(proposal):
    if pb:
      out[1:b + 2] += pb * chain_law(b, acceptance)
  return out


def expected(law: np.ndarray, f: Callable[[int], float]) -> float:
  return float(sum(p * f(i) for i, p in enumerate(law) if p))


@dataclasses.dataclass(frozen=True)
class Overheads:
  """Seconds a round spends beside its model's forwards (docstring, 5.)."""
  draft_forward: float = 0.0       # per forward of a model drafter (one per depth of its tree)
  verify: float = 0.0              # per verifying round
  tree: float = 0.0                # ... more when the proposal is a tree, not a chain
  middle: float = 0.0              # ... more in a round of a level under the target (a middle level's)

  def propose(self, tree: TokenTree) -> float:
    return self.draft_forward * tree.max_depth

  def check(self, proposal: TokenTree | None) -> float:
    """A verifying round's, its proposal a drafter's tree, or (None) a middle level's buffer."""
    return self.verify + (self.tree if proposal is not None and proposal.max_branching > 1 else 0.0)


@dataclasses.dataclass(frozen=True)
class StackModel:
  """A stack for the model, bottom-up: the drafter's tree, its proposal cost, and per verifying
  level j = 1 .. K its cost curve and acceptance of the level below (level 1: the drafter's
  per-rank profile; above: a chain's per-token acceptance), and gamma_j for j < K."""
  tree: TokenTree
  draft_seconds: float
  costs: tuple[Cost, ...]                 # levels 1 .. K
  acceptance: tuple                       # level 1: per-rank profile; levels 2 .. K: a float
  gammas: tuple[int, ...] = ()            # levels 1 .. K-1
  overheads: Overheads = Overheads()
  model_drafter: bool = True              # its proposal pays Overheads.propose (n-gram lookup: no)
  deeper: float = 1.0                     # accepted_law's, for level 1's verdict on the tree
  offer: float | tuple[float, ...] | Replayed = 1.0  # how often the drafter offers its tree, or the law
                                          # of how much of its chain (first_round; docstring, 6.)
  rows: int = 1                           # the batch: a round runs at its widest row's offer
  draft_pending: float = 0.0              # seconds its first forward spends on its lead past the root
                                          # (`drafter_lead`; docstring, 8.), left out by fixed_buffers


@dataclasses.dataclass(frozen=True)
class Prediction:
  seconds_per_token: float
  tokens_per_target_forward: float
  round_seconds: float                    # a top round: the target's forward and the fill below it
  rounds_per_level: tuple[float, ...]     # expected rounds of each level per top round, 1 .. K


def predict(stack: StackModel, fixed_buffers: bool = False) -> Prediction:
  """The model of the module docstring: seconds per emitted token of `stack`. fixed_buffers:
  every buffer holds exactly gamma tokens (HSD's buffer targets; planner/optimize.py's search
  objective) instead of its law of overshoot, and is verified at that length and its root, the
  drafter's first forward at the root alone (docstring, 8.: the forwards' static widths are left
  out)."""
  if len(stack.costs) != len(stack.gammas) + 1 or len(stack.acceptance) != len(stack.costs):
    raise UsageError("a stack of K verifying levels needs K costs, K acceptances and K - 1 gammas")
  tree, over, levels = stack.tree, stack.overheads, len(stack.costs)
  # Level 1 verifies the drafter's tree: a fixed proposal, when it offers one, behind its lead.
  yield_law, proposal_cost = first_round(stack.costs[0], tree, stack.acceptance[0], over, stack.deeper,
                                         stack.offer, stack.rows, lead=1 if fixed_buffers else levels)
  proposal_cost += over.middle if levels > 1 else 0.0      # level 1 is a middle level
  below_seconds = (stack.draft_seconds + (over.propose(tree) if stack.model_drafter else 0.0)
                   + (0.0 if fixed_buffers else stack.draft_pending))
  rounds, widths = [1.0], static_widths(tree, stack.gammas)
  for j in range(1, levels):                                 # level j fills, level j + 1 verifies
    gamma = stack.gammas[j - 1]
    buffer = fill(gamma, yield_law, stack.rows)
    if fixed_buffers:
      buffer = Fill(buffer.rounds, np.eye(gamma + 1)[-1])
    level_seconds = buffer.rounds * (proposal_cost + below_seconds)
    rounds = [r * buffer.rounds for r in rounds] + [1.0]
    yield_law = round_yield(buffer.length, stack.acceptance[j])
    cost = stack.costs[j]
    verified = expected(buffer.length, lambda b: cost(b + 1)) if fixed_buffers else cost(widths[j])
    proposal_cost = verified + over.check(None) + (over.middle if j < levels - 1 else 0.0)
    below_seconds = level_seconds
  round_seconds = proposal_cost + below_seconds
  tokens = expected(yield_law, float)
  return Prediction(round_seconds / tokens, tokens, round_seconds, tuple(rounds))


@dataclasses.dataclass(frozen=True)
class Replayed:
  """A chain drafter's rounds replayed over the verifier's own text (profile.ngram_rounds):
  rounds[n][m, k] in proportion to how many rounds of its chain of n offered m tokens and had k
  accepted. Prompt lookup hits in runs, so positions taken as independent mispredict it; for a
  chain not replayed, first_round falls back to `offer` (its law of how much it offers) and the
  per-rank profile."""
  rounds: Mapping[int, np.ndarray]
  offer: float | tuple[float, ...] = 1.0

  def of(self, tree: TokenTree) -> np.ndarray | None:
    rounds = self.rounds.get(tree.size) if tree.max_branching <= 1 else None
    return None if rounds is None or rounds.sum() <= 0 else rounds / rounds.sum()


def first_round(cost: Cost, tree: TokenTree, profile: Sequence[float], overheads: Overheads,
                deeper: float = 1.0, offer: float | Sequence[float] | Replayed = 1.0,
                rows: int = 1, lead: int = 1) -> tuple[np.ndarray, float]:
  """(the law of the yield, the expected seconds) of a level verifying a drafter's `tree`
  (profile: its acceptance where offered). `offer`: the probability that the drafter offers the
  whole tree; or, for a chain, the law of how many of its first tokens it offers (index m: the
  share offering m, the last index m or more, as far as the chain goes), a round offering m
  being verified at the narrowest of offer_widths that holds m; or its rounds replayed
  (`Replayed`: the joint law of what a round offers and accepts). A round offering none is a
  forward of the root alone, yielding one token. In a batch of `rows` rows, each row yields by its
  own law, but the round runs at the width its widest offer needs (`widest`): at 512 tokens and 16
  rows, prompt lookup's chain of 6 ran 0.58x `ar` where its rows' own widths predicted 1.12x
  (docs/results/planner/batch_grid_512_replay.md). lead: the level's pending slots, the root last
  (docstring, 8.), in front of what the round verifies."""
  size, length = tree.size, tree.max_depth + 2
  replayed = None
  if isinstance(offer, Replayed):
    replayed, offer = offer.of(tree), offer.offer
  if replayed is not None:
    shares = {m: float(row.sum()) for m, row in enumerate(replayed) if row.sum() > 0}
  elif isinstance(offer, (int, float)):
    if offer >= 1.0:
      return tree_yield(tree, profile, deeper), cost(size + lead) + overheads.check(tree)
    shares = {0: 1.0 - offer, size: offer}
  else:
    shares = {}
    for m, share in enumerate(offer):
      shares[min(m, size)] = shares.get(min(m, size), 0.0) + share
  offered = lambda m: tree if m == size else chain(m)
  law = np.zeros(length)
  for m, share in shares.items():
    if m == 0:
      law[1] += share
    elif replayed is not None:
      law[1:m + 2] += replayed[m, :m + 1]
    else:
      part = tree_yield(offered(m), profile, deeper)
      law[:part.size] += share * part

  def round_seconds(m: int) -> float:
    if m == 0:
      return cost(lead) + overheads.check(None)
    return cost(min(w for w in offer_widths(size) if w >= m) + lead) + overheads.check(offered(m))

  return law, sum(share * round_seconds(m) for m, share in widest(shares, rows).items())


def widest(shares: Mapping[int, float], rows: int) -> dict[int, float]:
  """The law of the largest of `rows` independent draws from `shares` ({m: P(m)})."""
  out, below = {}, 0.0
  for m in sorted(shares):
    at_most = below + shares[m]
    out[m] = at_most ** rows - below ** rows
    below = at_most
  return out


def static_widths(tree: TokenTree, gammas: Sequence[int]) -> tuple[int, ...]:
  """The width of each verifying level's forward, 1 .. K (docstring, 8.): its lead, K - j + 1, and
  the most it may verify: the drafter's tree, then each buffer (gamma_j - 1 and the most a round
  of the level below yields, the depth of its proposal and one)."""
  levels, most, depth = len(gammas) + 1, [tree.size], tree.max_depth
  for gamma in gammas:
    depth += gamma
    most.append(depth)
  return tuple(levels - j + 1 + size for j, size in enumerate(most, 1))


def drafter_lead(levels: int, tree: TokenTree, own_cache: bool = True, keeps_tree: bool = True) -> int:
  """The slots a model drafter's first forward runs under `levels` verifying levels (decode/sizes.py's
  StackSizes._lead): level 1's without a cache of its own (the target's first layers), one more with
  one (an accepted leaf waits for it), its tree's depth more when it keeps none of its tree (EAGLE)."""
  if not own_cache:
    return levels
  return levels + (1 if keeps_tree else tree.max_depth)


def draft_pending(cost: Cost | None, lead: int) -> float:
  """StackModel.draft_pending: a model drafter's first forward over `lead` slots, past the root's."""
  return 0.0 if cost is None else cost(lead) - cost(1)


def tree_draft_seconds(tree: TokenTree, cost: Cost | None) -> float:
  """A model drafter's proposal: one forward per depth over that depth's nodes (the first over
  the root); None: a drafter that costs nothing (n-gram lookup)."""
  if cost is None:
    return 0.0
  widths = [1] + [int((tree.depth == d).sum()) for d in range(1, tree.max_depth)]
  return float(sum(cost(w) for w in widths))


def affine(points: Mapping[int, float]) -> Cost:
  """The least-squares line through measured (width: seconds) points. A forward's cost is close
  to affine in its width over 1..16 tokens, and the fit is steadier than the points, each of
  which carries a machine's timing noise (a few percent here)."""
  w = np.array(sorted(points), np.float64)
  s = np.array([points[k] for k in sorted(points)], np.float64)
  if w.size == 1:
    return lambda width: float(s[0])
  slope, fixed = np.polyfit(w, s, 1)
  return lambda width: float(fixed + slope * width)


@functools.cache
def expected_max_normal(draws: int) -> float:
  """E[max of `draws` independent standard normal draws]: 0 for one, 1.03 for 4, 1.77 for 16."""
  if draws <= 1:
    return 0.0
  x = np.linspace(-12.0, 12.0, 48001)
  cdf = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
  density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
  return float(np.trapezoid(x * draws * density * cdf ** (draws - 1), x))   # the max's density


def slowest_of(rows: int, values: Sequence[float]) -> float:
  """The expected largest of `rows` draws of a quantity measured once per continuation
  (`values`), read as normal: the values' mean plus their spread (n - 1 in the divisor) times the
  expected largest of `rows` standard normal draws. One row, or one value: their mean."""
  v = np.asarray(values, np.float64)
  if rows <= 1 or v.size < 2:
    return float(v.mean())
  return float(v.mean() + v.std(ddof=1) * expected_max_normal(rows))
