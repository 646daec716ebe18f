"""EAGLE-2's dynamic token tree at run time: grow candidates with the draft, keep the best.

`grow` fills a DynamicTree (shapes.py) for every row: one draft forward per
depth over the `width` best candidates of the depth before, writing their
keys/values into a scratch cache whose slots hold, in order, the root and the
expanded candidates of depths 1 .. D-1 (`width` each). The `budget` most
probable candidates become the row's tree, returned as `RowTrees`: the
arrays a verification round reads (node depths, the attention mask and the
children lists, per row), built once by `topology`.

Children are the draft's top-`width` tokens: a deterministic proposal, which
verify.py's "deterministic" rule accepts exactly whatever the tree is.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.tree.shapes import DynamicTree


@flax.struct.dataclass
class RowTrees:
  """Each row's own tree of N nodes, in the arrays that drafting and verification read."""
  parents: jax.Array   # [B, N] node index, -1 = the root; parents before children
  depth: jax.Array     # [B, N] 1 for children of the root
  attend: jax.Array    # [B, N+1, N+1] over (root, nodes): the root, ancestors and itself
  children: jax.Array  # [B, N+1, width] -1 padded, in node order; row 0 the root's


def scratch_slots(tree: DynamicTree) -> int:
  return 1 + (tree.max_depth - 1) * tree.width


def grow(tree: DynamicTree, root, run, scratch):
  """-> (tokens [B, N] draft ids, RowTrees).

  run(scratch, fed [B, T], depth d, first slot, attend [B, T, S], parents [B, T]) -> (logits
  [B, T, V], scratch): a draft forward of tokens at depth d (positions: committed length + d),
  written at scratch slots first..first+T-1, each seeing the scratch slots `attend` allows (and
  committed tokens); `parents` are the scratch slots of their parents (a feature draft reads
  what its parent predicted).
  """
  width, batch = tree.width, root.shape[0]
  n_slots = scratch_slots(tree)
  slot_of = lambda first: jax.nn.one_hot(first + jnp.arange(width), n_slots, dtype=bool)  # [W, S]
  sees = jnp.zeros((batch, 1, n_slots), bool).at[:, :, 0].set(True)                 # the root
  logits, scratch = run(scratch, root[:, None], 0, 0, sees, jnp.zeros((batch, 1), jnp.int32))
  score, token = jax.lax.top_k(_log_probs(logits[:, 0]), width)                      # [B, W]
  pool_score, pool_token, pool_parent = [score], [token], [jnp.full((batch, width), -1, jnp.int32)]
  frontier = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))   # pool indices
  parents = jnp.zeros((batch, width), jnp.int32)                                    # scratch slots
  sees = sees | slot_of(1)[None]                                                    # [B, W, S]
  for d in range(1, tree.max_depth):
    logits, scratch = run(scratch, token, d, 1 + (d - 1) * width, sees, parents)
    child_score, child = jax.lax.top_k(_log_probs(logits), width)                    # [B, W, W]
    child_score = (score[:, :, None] + child_score).reshape(batch, width * width)
    child = child.reshape(batch, width * width)
    first_index = width + (d - 1) * width * width
    pool_score.append(child_score)
    pool_token.append(child)
    pool_parent.append(jnp.repeat(frontier, width, axis=1))
    if d + 1 < tree.max_depth:                       # expand the best `width` of this depth
      score, best = jax.lax.top_k(child_score, width)
      token = jnp.take_along_axis(child, best, axis=1)
      frontier = first_index + best
      parents = (1 + (d - 1) * width + best // width).astype(jnp.int32)
      parent_sees = jnp.take_along_axis(sees, (best // width)[:, :, None], axis=1)
      sees = parent_sees | slot_of(1 + d * width)[None]
  pool_score = jnp.concatenate(pool_score, axis=1)                                   # [B, P]
  # The budget best; ties go to the lower index, and a parent precedes its children, so
  # the kept candidates are closed under taking parents. Sorted: parents before children.
  kept = jnp.sort(jax.lax.top_k(pool_score, tree.budget)[1], axis=1)                 # [B, N]
  tokens = jnp.take_along_axis(jnp.concatenate(pool_token, axis=1), kept, axis=1)
  parent_pool = jnp.take_along_axis(jnp.concatenate(pool_parent, axis=1), kept, axis=1)
  parents = jnp.where(parent_pool < 0, -1,
                      jnp.argmax(kept[:, None, :] == parent_pool[:, :, None], axis=2)).astype(jnp.int32)
  attend, children = topology(parents, width, tree.max_depth)
  return tokens.astype(jnp.int32), RowTrees(parents, jnp.asarray(tree.pool_depth)[kept], attend,
                                            children)


def _log_probs(logits):
  """Candidates are ranked by the draft's own (temperature 1) log-probabilities, kept finite
  so that a masked token (-inf) never makes a score NaN."""
  return jnp.maximum(jax.nn.log_softmax(logits, axis=-1), -1e30)


def topology(parents, width: int, max_depth: int):
  """parents [B, N] (parents before children) -> (attend [B, N+1, N+1] over (root, nodes):
  each sees the root, its ancestors and itself; children [B, N+1, width] -1 padded, in node
  order: row 0 the root's)."""
  batch, n = parents.shape
  own = jnp.broadcast_to(jnp.eye(n, dtype=bool), (batch, n, n))
  ancestors = own
  for _ in range(max_depth - 1):  # ancestors[i] = i | ancestors[parent(i)], one depth per pass
    from_parent = jnp.take_along_axis(ancestors, jnp.maximum(parents, 0)[:, :, None], axis=1)
    ancestors = own | (from_parent & (parents >= 0)[:, :, None])
  attend = jnp.ones((batch, n + 1, n + 1), bool).at[:, 0, 1:].set(False).at[:, 1:, 1:].set(ancestors)
  is_child = (parents[:, None, :] + 1) == jnp.arange(n + 1)[None, :, None]         # [B, N+1, N]
  first = jnp.argsort(~is_child, axis=2, stable=True)[:, :, :width]                 # children first
  children = jnp.where(jnp.take_along_axis(is_child, first, axis=2), first, -1)
  return attend, children.astype(jnp.int32)
