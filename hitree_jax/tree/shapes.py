"""Static token-tree topologies for speculative decoding.

A tree is only a topology: `parents[i]` of each of its N candidate nodes, with
-1 for a child of the root. The root is the last committed token and is not
one of the N nodes. The tree knows nothing about models; drafters and
verifiers read the derived index arrays (attention mask, children, paths,
levels) it exposes.

`TokenTree` holds tuples, not arrays, so it is hashable and can be a static
argument of `jax.jit`: each topology is one compiled program, and equal
topologies built separately share it. The derived arrays are numpy, computed
once per tree and read-only, so a jitted function can close over them as
constants.

Validation only requires that every parent precede its child. The builders
(`chain`, `kary`, `from_acceptance`) further guarantee breadth-first order:
all nodes of depth d come before those of depth d + 1, and siblings are in
rank order. A drafter that fills one depth per forward then writes contiguous
slots per level.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from hitree_jax.errors import UsageError


def _frozen(a: np.ndarray) -> np.ndarray:
  """Cached arrays are shared by every user of the tree: make them read-only."""
  a.setflags(write=False)
  return a


@dataclasses.dataclass(frozen=True)
class TokenTree:
  parents: tuple[int, ...]  # [N]: parent node index, -1 = child of the root

  def __post_init__(self):
    parents = tuple(self.parents)
    for i, p in enumerate(parents):
      if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
        raise UsageError(f"node {i}: parent {p!r} must be an int (-1 = child of the root)")
      if not -1 <= p < i:
        raise UsageError(f"node {i}: parent {p} must be -1 (the root) or an earlier node "
                         f"in 0..{i - 1} (parents must precede their children)")
    if not parents:
      raise UsageError("a token tree needs at least one node")
    # Plain ints, so that equal topologies hash equally whatever int type built them.
    object.__setattr__(self, "parents", tuple(int(p) for p in parents))

  @property
  def size(self) -> int:
    return len(self.parents)

  @functools.cached_property
  def depth(self) -> np.ndarray:
    """[N] int32: 1 for children of the root."""
    depth = np.zeros(self.size, np.int32)
    for i, p in enumerate(self.parents):
      depth[i] = 1 if p < 0 else depth[p] + 1
    return _frozen(depth)

  @property
  def max_depth(self) -> int:
    return int(self.depth.max())

  @functools.cached_property
  def ancestor_mask(self) -> np.ndarray:
    """[N, N] bool: mask[i, j] = j is i or an ancestor of i, i.e. what node i attends to among the nodes."""
    mask = np.zeros((self.size, self.size), bool)
    for i, p in enumerate(self.parents):
      if p >= 0:
        mask[i] = mask[p]  # p < i: its row is already complete
      mask[i, i] = True
    return _frozen(mask)

  @functools.cached_property
  def child_rank(self) -> np.ndarray:
    """[N] int32: index of each node among its siblings (in node order); rank 0 is the draft's top choice."""
    seen = [0] * (self.size + 1)  # children seen so far per parent, root at 0
    rank = np.zeros(self.size, np.int32)
    for i, p in enumerate(self.parents):
      rank[i] = seen[p + 1]
      seen[p + 1] += 1
    return _frozen(rank)

  @property
  def max_branching(self) -> int:
    """Most children of any node, the root included."""
    return int(self.child_rank.max()) + 1

  @functools.cached_property
  def children(self) -> np.ndarray:
    """[N + 1, max_branching] int32, -1 padded: row 0 = the root's children, row i + 1 = node i's."""
    children = np.full((self.size + 1, self.max_branching), -1, np.int32)
    for i, (p, r) in enumerate(zip(self.parents, self.child_rank)):
      children[p + 1, r] = i
    return _frozen(children)

  @functools.cached_property
  def paths(self) -> np.ndarray:
    """[N, max_depth] int32, -1 padded: node indices from the root's child down to the node itself."""
    paths = np.full((self.size, self.max_depth), -1, np.int32)
    for i, (p, d) in enumerate(zip(self.parents, self.depth)):
      if p >= 0:
        paths[i] = paths[p]
      paths[i, d - 1] = i
    return _frozen(paths)

  @functools.cached_property
  def level_nodes(self) -> tuple[tuple[int, ...], ...]:
    """Node indices per depth, in node order: level_nodes[d - 1] holds the nodes of depth d."""
    levels = [[] for _ in range(self.max_depth)]
    for i, d in enumerate(self.depth):
      levels[d - 1].append(i)
    return tuple(map(tuple, levels))


def _check_positive(**values: int) -> None:
  for name, v in values.items():
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise UsageError(f"{name}={v!r} must be a positive integer")


def _from_nested(roots: list) -> TokenTree:
  """Breadth-first TokenTree from nested lists (a node = the list of its children, in rank order)."""
  parents = []
  frontier = [(-1, node) for node in roots]
  while frontier:
    next_frontier = []
    for parent, node in frontier:
      parents.append(parent)
      next_frontier.extend((len(parents) - 1, child) for child in node)
    frontier = next_frontier
  return TokenTree(tuple(parents))


def chain(n: int) -> TokenTree:
  """n nodes, each the child of the previous: plain (non-tree) speculation."""
  _check_positive(n=n)
  return TokenTree(tuple(range(-1, n - 1)))


def offer_widths(size: int) -> tuple[int, ...]:
  """The node counts at which a level verifies a chain of `size` nodes of which a drafter offers
  only the first few (Proposal.offered): none (the root alone), the powers of two below size,
  and all of it. A round runs the narrowest that holds every live row's offer (loop.Decoder)."""
  return (0, *(2 ** k for k in range(1, size.bit_length()) if 2 ** k < size), size)


def kary(k: int, depth: int) -> TokenTree:
  """Full k-ary tree of the given depth (k + k^2 + ... + k^depth nodes), breadth-first.

  HiTree's fixed binary / ternary trees.
  """
  _check_positive(k=k, depth=depth)
  parents, level = [], [-1]
  for _ in range(depth):
    start = len(parents)
    parents.extend(p for p in level for _ in range(k))
    level = list(range(start, len(parents)))
  return TokenTree(tuple(parents))


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's tree, chosen at run time per row (dynamic.py): `budget` nodes.

  The draft grows candidates one depth per forward: the `width` best tokens
  after the root, then, at each further depth, the `width` best children of
  each of the `width` best candidates of the depth before (by cumulative draft
  log-probability). Of all candidates the `budget` most probable form the tree
  the target verifies; a child is never more probable than its parent, so
  they make a tree. Shapes stay static: the budget, not the tree, is fixed.
  """
  budget: int
  max_depth: int
  width: int = 4

  def __post_init__(self):
    _check_positive(budget=self.budget, max_depth=self.max_depth, width=self.width)
    if self.budget > self.pool_size:
      raise UsageError(
          f"dynamic tree: budget={self.budget} nodes do not fit in the {self.pool_size} candidates "
          f"that width={self.width} and depth={self.max_depth} grow (width + (depth - 1) * width^2); "
          "lower the budget or raise the depth or width")

  @property
  def size(self) -> int:
    return self.budget

  @property
  def pool_size(self) -> int:
    return self.width + (self.max_depth - 1) * self.width ** 2

  @functools.cached_property
  def pool_depth(self) -> np.ndarray:
    """[pool_size] int32: the depth of each candidate, candidates in order of depth."""
    sizes = [self.width] + [self.width ** 2] * (self.max_depth - 1)
    return _frozen(np.repeat(np.arange(1, self.max_depth + 1, dtype=np.int32), sizes))


def _check_acceptance(acceptance: Sequence[float]) -> np.ndarray:
  p = np.asarray(acceptance, np.float64)
  if p.ndim != 1 or p.size == 0:
    raise UsageError(f"acceptance must be a non-empty 1-D sequence; got shape {p.shape}")
  if not np.all((p >= 0.0) & (p <= 1.0)):  # also rejects NaN
    raise UsageError(f"acceptance probabilities must lie in [0, 1]; got {p.tolist()}")
  return p


def node_reach(tree: TokenTree, acceptance: Sequence[float]) -> np.ndarray:
  """[N] the probability that each node is reached and accepted, under Sequoia's positional model:
  a node of rank r, acceptance[r] times its parent's (the root's is 1). Ranks past the end of
  `acceptance` are never accepted."""
  p = _check_acceptance(acceptance)
  rank = tree.child_rank
  reach = np.zeros(tree.size)
  for i, parent in enumerate(tree.parents):
    p_rank = p[rank[i]] if rank[i] < p.size else 0.0
    reach[i] = p_rank * (reach[parent] if parent >= 0 else 1.0)
  return reach


def expected_accepted(tree: TokenTree, acceptance: Sequence[float]) -> float:
  """Expected number of accepted nodes under Sequoia's positional-acceptance model: the sum of
  node_reach over the nodes."""
  return float(node_reach(tree, acceptance).sum())


def from_acceptance(acceptance: Sequence[float], budget: int, max_depth: int) -> TokenTree:
  """Sequoia's optimal tree: at most `budget` nodes and depth `max_depth`, maximising `expected_accepted`.

  acceptance[r] is the probability that the rank-r child of a node is
  accepted given its earlier-ranked siblings were rejected; a rank-r child
  exists only if ranks 0..r-1 of the same parent do, and ranks past the end of
  `acceptance` are never used. acceptance[0] must be > 0 (else the best tree
  is empty).

  Recurrence. G[d][n] is the best expected count of the nodes below a node
  (the node itself counts as reached with probability 1) using at most n
  nodes and at most d more levels; G[0][n] = 0 and the answer is
  G[max_depth][budget]. The children of a node are allocated budgets rank by
  rank: H[d][r][n], the best using ranks r, r+1, ... within n nodes, is

    H[d][K][n] = 0
    H[d][r][n] = max(0,                                      # no rank-r child, hence no later ranks
                     max_{1 <= s <= n} p_r * (1 + G[d-1][s-1]) + H[d][r+1][n-s])

  where s is the rank-r child's subtree size (the child plus s - 1 nodes
  below it, which it reaches with probability p_r), and G[d][n] = H[d][0][n].
  Each (d, r) is one max-plus product over budgets, so the cost is
  O(max_depth * K * budget^2) with K = min(len(acceptance), budget), in numpy.

  Ties (equal float scores) go to the tree with the fewest nodes, so a node
  that adds nothing (probability 0 and unlocking no later rank) is never
  added; then to the smallest s, i.e. earlier ranks get the smaller subtrees.
  The DP carries each choice's node count to apply this. The result is
  breadth-first (see the module docstring).
  """
  _check_positive(budget=budget, max_depth=max_depth)
  p = _check_acceptance(acceptance)
  if p[0] <= 0.0:
    raise UsageError(f"acceptance[0]={p[0]} must be > 0: the draft's top choice is never accepted")
  ranks = min(p.size, budget)
  n = np.arange(budget + 1)
  s = np.arange(budget + 1)
  room = s[None, :] <= n[:, None]                         # [n, s]: subtree of size s fits in n
  rest = np.where(room, n[:, None] - s[None, :], 0)        # [n, s]: budget left for later ranks
  g = np.zeros((max_depth + 1, budget + 1))                # [d, n]: G
  g_nodes = np.zeros((max_depth + 1, budget + 1), np.int64)  # [d, n]: nodes G's choice uses
  choice = np.zeros((max_depth + 1, ranks, budget + 1), np.int64)  # [d, r, n] -> s
  for d in range(1, max_depth + 1):
    h_next = np.zeros(budget + 1)  # H[d][ranks][:]
    h_nodes = np.zeros(budget + 1, np.int64)
    for r in reversed(range(ranks)):
      gain = np.zeros(budget + 1)
      gain[1:] = p[r] * (1.0 + g[d - 1][:-1])
      sub_nodes = np.zeros(budget + 1, np.int64)
      sub_nodes[1:] = 1 + g_nodes[d - 1][:-1]
      total = np.where(room, gain[None, :] + h_next[rest], -np.inf)  # [n, s]
      nodes = np.where(room, sub_nodes[None, :] + h_nodes[rest], budget + 1)
      total[:, 0], nodes[:, 0] = 0.0, 0  # s = 0: stop at this rank
      # The tie rule above: best score, then fewest nodes, then smallest s.
      nodes = np.where(total == total.max(axis=1, keepdims=True), nodes, budget + 1)
      choice[d, r] = np.argmin(nodes, axis=1)
      h_next, h_nodes = total[n, choice[d, r]], nodes[n, choice[d, r]]
    g[d], g_nodes[d] = h_next, h_nodes

  def build(budget: int, d: int) -> list:
    """Children (nested lists) of a node with `budget` nodes and d levels below it."""
    children = []
    for r in range(ranks):
      size = int(choice[d, r, budget]) if d > 0 else 0
      if size == 0:
        break
      children.append(build(size - 1, d - 1))
      budget -= size
    return children

  return _from_nested(build(budget, max_depth))


MAX_TREE_NODES = 512  # one round verifies every node: [B, N+1, V] probabilities, N+1 tokens' forward
