"""Token-tree topologies: hand-written small trees, brute-force references on random
trees, and Sequoia's dynamic programme against exhaustive search over all trees.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.decode.drafters import tree_attend_mask
from hitree_jax.tree import dynamic as dynamic_tree
from hitree_jax.tree.shapes import (DynamicTree, TokenTree, chain, expected_accepted, from_acceptance, kary)


def random_parents(rng, n):
  """A random valid topology: each node's parent is the root or any earlier node."""
  return tuple(int(rng.integers(-1, i)) for i in range(n))


def ancestors_by_walking(parents, i):
  """i and its ancestors, found by following parent links."""
  out = []
  while i >= 0:
    out.append(i)
    i = parents[i]
  return out


def ranks_by_scanning(parents):
  return [sum(parents[j] == parents[i] for j in range(i)) for i in range(len(parents))]


def score_by_walking(parents, acceptance):
  """Sequoia's expected accepted count, from first principles."""
  ranks = ranks_by_scanning(parents)
  prob = lambda r: acceptance[r] if r < len(acceptance) else 0.0
  return sum(np.prod([prob(ranks[j]) for j in ancestors_by_walking(parents, i)])
             for i in range(len(parents)))


def all_forests(budget, depth, branching):
  """Every rank-consistent forest (tuple of children, each a forest) with <= budget nodes, <= depth levels."""
  if depth == 0 or budget == 0:
    return [()]
  out = []

  def extend(prefix, left):
    out.append(prefix)
    if len(prefix) == branching:
      return
    for size in range(1, left + 1):
      for sub in all_forests(size - 1, depth - 1, branching):
        if count(sub) == size - 1:  # each forest counted once, by its exact size
          extend(prefix + (sub,), left - size)

  extend((), budget)
  return out


def count(forest):
  return sum(1 + count(child) for child in forest)


def parents_of(forest):
  """Depth-first parents array of a nested forest (any parent-first order is a valid tree)."""
  parents = []

  def add(children, parent):
    for child in children:
      parents.append(parent)
      add(child, len(parents) - 1)

  add(forest, -1)
  return tuple(parents)


def check_bfs_and_rank_rule(tree):
  depth = tree.depth
  assert np.all(np.diff(depth) >= 0), "builders must order nodes breadth-first"
  for row in tree.children:  # ranks are consecutive: -1 padding only at the end of a row
    real = row >= 0
    assert np.all(real[:real.sum()])


def test_chain_by_hand():
  t = chain(3)
  assert t.parents == (-1, 0, 1)
  assert t.size == 3 and t.max_depth == 3 and t.max_branching == 1
  np.testing.assert_array_equal(t.depth, [1, 2, 3])
  np.testing.assert_array_equal(t.children, [[0], [1], [2], [-1]])
  np.testing.assert_array_equal(t.child_rank, [0, 0, 0])
  np.testing.assert_array_equal(t.paths, [[0, -1, -1], [0, 1, -1], [0, 1, 2]])
  np.testing.assert_array_equal(t.ancestor_mask, np.tril(np.ones((3, 3), bool)))
  assert t.level_nodes == ((0,), (1,), (2,))
  assert t.depth.dtype == t.children.dtype == t.paths.dtype == t.child_rank.dtype == np.int32


def test_kary_by_hand():
  t = kary(2, 2)
  assert t.parents == (-1, -1, 0, 0, 1, 1)
  np.testing.assert_array_equal(t.depth, [1, 1, 2, 2, 2, 2])
  np.testing.assert_array_equal(t.children, [[0, 1], [2, 3], [4, 5]] + [[-1, -1]] * 4)
  np.testing.assert_array_equal(t.child_rank, [0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(t.paths, [[0, -1], [1, -1], [0, 2], [0, 3], [1, 4], [1, 5]])
  assert t.level_nodes == ((0, 1), (2, 3, 4, 5))
  expected_mask = np.array([[1, 0, 0, 0, 0, 0],
                            [0, 1, 0, 0, 0, 0],
                            [1, 0, 1, 0, 0, 0],
                            [1, 0, 0, 1, 0, 0],
                            [0, 1, 0, 0, 1, 0],
                            [0, 1, 0, 0, 0, 1]], bool)
  np.testing.assert_array_equal(t.ancestor_mask, expected_mask)


@pytest.mark.parametrize("k,depth", [(1, 4), (2, 3), (3, 2), (3, 3), (4, 1)])
def test_kary_sizes(k, depth):
  t = kary(k, depth)
  assert t.size == sum(k**d for d in range(1, depth + 1))
  assert t.max_depth == depth and t.max_branching == k
  assert [len(level) for level in t.level_nodes] == [k**d for d in range(1, depth + 1)]
  assert t.children.shape == (t.size + 1, k)
  # Every non-leaf has exactly k children; the leaves are the last level.
  leaves = set(t.level_nodes[-1])
  for i in range(t.size):
    assert (t.children[i + 1] >= 0).sum() == (0 if i in leaves else k)
  check_bfs_and_rank_rule(t)


def test_kary_one_is_chain():
  assert kary(1, 5) == chain(5)


def test_non_bfs_tree_by_hand():
  t = TokenTree((-1, 0, -1, 2, 0))  # valid, but not breadth-first
  np.testing.assert_array_equal(t.depth, [1, 2, 1, 2, 2])
  np.testing.assert_array_equal(t.children, [[0, 2], [1, 4], [-1, -1], [3, -1], [-1, -1], [-1, -1]])
  np.testing.assert_array_equal(t.child_rank, [0, 0, 1, 0, 1])
  np.testing.assert_array_equal(t.paths, [[0, -1], [0, 1], [2, -1], [2, 3], [0, 4]])
  assert t.level_nodes == ((0, 2), (1, 3, 4))


@pytest.mark.parametrize("seed", range(8))
def test_derived_arrays_match_brute_force_on_random_trees(seed):
  rng = np.random.default_rng(seed)
  parents = random_parents(rng, int(rng.integers(1, 30)))
  t = TokenTree(parents)
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    mask[i, ancestors_by_walking(parents, i)] = True
  np.testing.assert_array_equal(t.ancestor_mask, mask)
  depth = [len(ancestors_by_walking(parents, i)) for i in range(n)]
  np.testing.assert_array_equal(t.depth, depth)
  assert t.max_depth == max(depth)
  np.testing.assert_array_equal(t.child_rank, ranks_by_scanning(parents))
  for i in range(n):
    path = ancestors_by_walking(parents, i)[::-1]
    np.testing.assert_array_equal(t.paths[i], path + [-1] * (t.max_depth - len(path)))
  for row, parent in enumerate(range(-1, n)):
    kids = [i for i in range(n) if parents[i] == parent]
    np.testing.assert_array_equal(t.children[row], kids + [-1] * (t.max_branching - len(kids)))
  assert t.max_branching == max(max(ranks_by_scanning(parents)) + 1, 1)
  assert t.level_nodes == tuple(tuple(i for i in range(n) if depth[i] == d)
                                for d in range(1, max(depth) + 1))


def test_validation_names_the_node():
  with pytest.raises(ValueError, match="node 2"):
    TokenTree((-1, 0, 3, 1))  # parent after child
  with pytest.raises(ValueError, match="node 1"):
    TokenTree((-1, 1))  # its own parent
  with pytest.raises(ValueError, match="node 3"):
    TokenTree((-1, 0, 1, -2))  # out of range below
  with pytest.raises(ValueError, match="node 0"):
    TokenTree((0,))
  with pytest.raises(ValueError, match="node 1"):
    TokenTree((-1, 0.5))
  with pytest.raises(ValueError, match="at least one node"):
    TokenTree(())
  for bad in (lambda: chain(0), lambda: kary(0, 2), lambda: kary(2, 0)):
    with pytest.raises(ValueError, match="positive"):
      bad()


def test_hashable_static_jit_argument():
  """Equal trees built separately are equal and hash equally: one trace for both."""
  a, b = TokenTree([-1, 0, 0]), TokenTree(np.array([-1, 0, 0]))
  assert a == b and hash(a) == hash(b) and a.parents == (-1, 0, 0)
  assert type(b.parents[1]) is int
  traces = []

  def f(x, tree):
    traces.append(tree)
    return x + jnp.asarray(tree.ancestor_mask.sum(axis=1))

  g = jax.jit(f, static_argnums=1)
  np.testing.assert_array_equal(g(jnp.zeros(3, jnp.int32), a), [1, 2, 2])
  np.testing.assert_array_equal(g(jnp.zeros(3, jnp.int32), b), [1, 2, 2])
  assert len(traces) == 1
  g(jnp.zeros(3, jnp.int32), TokenTree((-1, 0, 1)))
  assert len(traces) == 2
  with pytest.raises(ValueError):
    a.ancestor_mask[0, 0] = False  # cached arrays are shared: read-only


def test_expected_accepted_of_chain_is_sum_of_prefix_products():
  acceptance = [0.7, 0.2, 0.1]
  for n in range(1, 7):
    want = sum(0.7**k for k in range(1, n + 1))
    assert expected_accepted(chain(n), acceptance) == pytest.approx(want, rel=1e-12)


def test_expected_accepted_by_hand_and_validation():
  # kary(2, 2): two roots' children (0.8, 0.3), each with children (0.8, 0.3) times its own.
  assert expected_accepted(kary(2, 2), [0.8, 0.3]) == pytest.approx(1.1 + 1.1 * 1.1)
  # Ranks past the end of the vector are never accepted.
  assert expected_accepted(kary(3, 1), [0.5, 0.25]) == pytest.approx(0.75)
  for bad in ([], [1.2], [0.5, -0.1], [float("nan")]):
    with pytest.raises(ValueError, match="acceptance"):
      expected_accepted(chain(2), bad)


@pytest.mark.parametrize("seed", range(4))
def test_expected_accepted_matches_walking_on_random_trees(seed):
  rng = np.random.default_rng(100 + seed)
  parents = random_parents(rng, 15)
  acceptance = rng.uniform(0, 1, size=3)
  assert expected_accepted(TokenTree(parents), acceptance) == pytest.approx(
      score_by_walking(parents, list(acceptance)), rel=1e-12)


def test_exhaustive_enumeration_is_complete():
  """The reference itself: ordered forests with n nodes are counted by the Catalan numbers."""
  forests = all_forests(6, 6, 6)
  sizes = [count(f) for f in forests]
  assert [sizes.count(n) for n in range(7)] == [1, 1, 2, 5, 14, 42, 132]
  assert len(set(forests)) == len(forests)


ACCEPTANCES = [
    [0.8, 0.5, 0.3, 0.1],     # decreasing
    [0.95],                   # one rank: only chains
    [0.3, 0.6, 0.2],          # not decreasing: rank 1 better than rank 0
    [0.5, 0.0, 0.9],          # a zero rank that unlocks a good one
    [0.5, 0.0, 0.5],          # exact ties between trees of different sizes
    [0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5],
] + [list(np.random.default_rng(s).uniform(0.05, 1.0, size=4)) for s in range(4)] \
  + [sorted(np.random.default_rng(10 + s).uniform(0.0, 1.0, size=3), reverse=True) for s in range(3)]


@pytest.mark.parametrize("acceptance", ACCEPTANCES, ids=lambda a: ",".join(f"{x:.2f}" for x in a))
def test_from_acceptance_matches_exhaustive_search(acceptance):
  for budget, max_depth in itertools.product(range(1, 8), range(1, 5)):
    scored = [(score_by_walking(parents_of(f), acceptance), count(f))
              for f in all_forests(budget, max_depth, len(acceptance))]
    best = max(score for score, _ in scored)
    fewest = min(size for score, size in scored if score >= best - 1e-12)
    tree = from_acceptance(acceptance, budget, max_depth)
    assert tree.size <= budget and tree.max_depth <= max_depth
    assert tree.max_branching <= len(acceptance)
    check_bfs_and_rank_rule(tree)
    assert expected_accepted(tree, acceptance) == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert score_by_walking(tree.parents, acceptance) == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert tree.size == fewest  # tie rule: no node that adds nothing


def test_from_acceptance_special_cases():
  # One rank: the best tree is the longest chain allowed.
  assert from_acceptance([0.6], budget=10, max_depth=4) == chain(4)
  assert from_acceptance([0.6], budget=3, max_depth=8) == chain(3)
  # Zero-probability nodes are ties; the fewest-nodes rule leaves them out.
  assert from_acceptance([0.5, 0.0], budget=6, max_depth=2) == chain(2)
  # Certain acceptance of the top choice: a chain as deep as allowed, then wider.
  assert from_acceptance([1.0, 0.5], budget=3, max_depth=3) == chain(3)
  # Equal scores (0.5 + 0.25 either way): the tree with fewer nodes.
  assert from_acceptance([0.5, 0.0, 0.25], budget=3, max_depth=2) == chain(2)
  # Equal scores, equal sizes: the earlier rank gets the smaller subtree.
  assert from_acceptance([0.5, 0.5], budget=3, max_depth=2) == TokenTree((-1, -1, 1))
  # A zero rank that unlocks a better one is kept, but nothing is put below it.
  tree = from_acceptance([0.5, 0.0, 0.9], budget=7, max_depth=2)
  assert tree.parents[:3] == (-1, -1, -1) and np.all(tree.children[2] == -1)
  # Deterministic.
  acc = [0.7, 0.4, 0.2]
  assert from_acceptance(acc, 20, 5) == from_acceptance(acc, 20, 5)
  with pytest.raises(ValueError, match="acceptance"):
    from_acceptance([0.0, 0.5], 4, 2)
  with pytest.raises(ValueError, match="budget"):
    from_acceptance([0.5], 0, 2)
  with pytest.raises(ValueError, match="max_depth"):
    from_acceptance([0.5], 4, 0)


def test_from_acceptance_large_budget():
  """Sequoia-sized trees: fast, within limits, and never worse than a chain or a k-ary tree."""
  acceptance = [0.75, 0.45, 0.3, 0.2, 0.15, 0.1, 0.08, 0.06]
  tree = from_acceptance(acceptance, budget=128, max_depth=10)
  assert tree.size <= 128 and tree.max_depth <= 10
  check_bfs_and_rank_rule(tree)
  score = expected_accepted(tree, acceptance)
  assert score >= expected_accepted(chain(10), acceptance)
  assert score >= expected_accepted(kary(2, 6), acceptance)  # 126 nodes
  smaller = from_acceptance(acceptance, budget=64, max_depth=10)
  assert score >= expected_accepted(smaller, acceptance)


# --- dynamic (EAGLE-2) trees, chosen at run time ---

def test_dynamic_topology_matches_the_static_tree_arrays():
  rng = np.random.default_rng(3)
  trees = [TokenTree(tuple(random_parents(rng, 9))) for _ in range(4)]
  trees = [t for t in trees if t.max_branching <= 4][:3] + [chain(9)]
  parents = jnp.asarray([t.parents for t in trees])
  attend, children = dynamic_tree.topology(parents, 4, 9)
  for b, t in enumerate(trees):
    np.testing.assert_array_equal(attend[b], tree_attend_mask(t))
    expected = np.full((10, 4), -1)
    expected[:, :t.max_branching] = t.children
    np.testing.assert_array_equal(children[b], expected)


def eagle2_reference(table, root, tree: DynamicTree):
  """Plain-Python EAGLE-2 selection for a draft whose log-probs depend only on the last token:
  the set of kept candidate paths (token tuples)."""
  logp = lambda path: table[path[-1]]
  best = lambda path: sorted(range(table.shape[1]), key=lambda x: (-logp(path)[x], x))[:tree.width]
  pool = [((x,), logp((root,))[x]) for x in best((root,))]
  frontier = pool
  for d in range(1, tree.max_depth):
    children = [(path + (x,), score + logp(path)[x]) for path, score in frontier for x in best(path)]
    pool += children
    frontier = sorted(children, key=lambda c: -c[1])[:tree.width]
  kept = sorted(pool, key=lambda c: -c[1])[:tree.budget]
  return {path for path, _ in kept}


@pytest.mark.parametrize("shape", [(6, 3, 2), (9, 3, 3), (3, 1, 3)])
def test_dynamic_tree_keeps_the_most_probable_candidates(shape):
  tree = DynamicTree(*shape)
  vocab = 11
  rng = np.random.default_rng(sum(shape))
  table = np.asarray(jax.nn.log_softmax(rng.normal(size=(vocab, vocab)) * 3, axis=-1))
  roots = jnp.array([2, 7])

  def run(scratch, fed, depth, first, attend, parents):
    # Each fed token sees its own slot, the root and its ancestors: depth + 1 scratch slots.
    attend, t, parents = np.asarray(attend), fed.shape[1], np.asarray(parents)
    assert attend.shape == (2, t, dynamic_tree.scratch_slots(tree))
    assert (attend.sum(-1) == depth + 1).all() and attend[:, np.arange(t), first + np.arange(t)].all()
    # Its parent's slot: an ancestor's, of the depth before (the root's, slot 0, at depth <= 1).
    assert attend[np.arange(2)[:, None], np.arange(t)[None, :], parents].all()
    assert ((parents == 0) if depth <= 1 else (parents >= 1 + (depth - 2) * tree.width) & (parents < first)).all()
    return jnp.asarray(table)[fed], scratch

  tokens, trees = dynamic_tree.grow(tree, roots, run, None)
  parents, depth = trees.parents, trees.depth
  for b, root in enumerate(roots.tolist()):
    paths = set()
    for i in range(tree.budget):
      p = int(parents[b, i])
      assert p < i and int(depth[b, i]) == (1 if p < 0 else int(depth[b, p]) + 1)
      path, node = [], i
      while node >= 0:
        path.append(int(tokens[b, node]))
        node = int(parents[b, node])
      paths.add(tuple(reversed(path)))
    assert paths == eagle2_reference(table, root, tree)
