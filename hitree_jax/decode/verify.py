"""Verification of drafted token trees against the target: exact, greedy and sampling.

One rule covers chains and trees and every way of drawing children (docs/design.md
says why it is exact). At a node with target distribution p, the children are
tried in order; child x, proposed from distribution q_x, is accepted with
probability min(1, p(x) / q_x(x)); on rejection p <- norm(max(p - q_x, 0)).
If no child is accepted (or the node is a leaf) one token is drawn from the
current p. Each emitted token is then distributed exactly as the target's.

How q_x follows from the draft's distribution q at the node depends on how
the children were drawn:
  "iid":                 q_x = q                (SpecInfer)
  "without_replacement": q_x = q with earlier siblings removed, renormalised (Sequoia)
  "deterministic":       q_x = point mass on x  (top-k or n-gram proposals, EAGLE-2):
                         accept with probability p(x), else p(x) <- 0.
Greedy decoding is the case where p is the point mass on the target's argmax:
the rule then follows the child equal to the argmax and emits the argmax.
"""

from __future__ import annotations

import enum

import flax.struct
import jax
import jax.numpy as jnp

from hitree_jax.decode.sampling import draw
from hitree_jax.errors import UsageError
from hitree_jax.tree.shapes import TokenTree


class DrawMode(enum.StrEnum):
  """How a drafter draws a node's children, and so the q_x its children are verified with (the
  module docstring). A str: equal to, and hashed as, its name in the --levels grammar."""
  IID = "iid"
  WITHOUT_REPLACEMENT = "without_replacement"
  DETERMINISTIC = "deterministic"


MODES = tuple(DrawMode)


@flax.struct.dataclass
class Verdict:
  path: jax.Array        # [B, D] int32: accepted node indices in order, -1 padded
  n_accepted: jax.Array  # [B] int32: accepted draft tokens (length of path)
  next_token: jax.Array  # [B] int32: correction (after a rejection) or bonus (at a leaf) token


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
  """norm(max(p - q, 0)) [..., V]; keeps p where the residual has no mass (a float tie)."""
  r = jnp.maximum(p - q, 0.0)
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def _renormalise(q: jax.Array) -> jax.Array:
  total = jnp.sum(q, axis=-1, keepdims=True)
  return q / jnp.where(total > 0, total, 1.0)


def verify(key: jax.Array, tree: TokenTree, draft_tokens: jax.Array, target_probs: jax.Array,
           draft_probs: jax.Array | None, mode: str, children: jax.Array | None = None) -> Verdict:
  """Accepts a path of the drafted tree and draws the next token, per row.

  draft_tokens [B, N]: the token at each tree node.
  target_probs [B, N+1, V]: the target's distribution after the root (index 0)
    and after each node (index i+1), i.e. what it would emit next there.
  draft_probs [B, N+1, V]: the distribution the children of each position were
    drawn from (unused, may be None, in "deterministic" mode).
  children [B, N+1, K]: each row's own tree (a DynamicTree's, see tree/dynamic.py);
    default: `tree.children`, the same for every row.
  """
  if mode not in MODES:
    raise UsageError(f"mode={str(mode)!r}: expected one of {', '.join(MODES)}")
  batch = draft_tokens.shape[0]
  rows = jnp.arange(batch)
  if children is None:
    children = jnp.broadcast_to(jnp.asarray(tree.children), (batch, *tree.children.shape))
  depth, width = tree.max_depth, children.shape[2]              # children [B, N+1, K]
  keys = jax.random.split(key, depth + 2)

  pos = jnp.zeros((batch,), jnp.int32)                # current position (0 = root)
  stopped = jnp.zeros((batch,), bool)
  p_stop = target_probs[:, 0]                         # distribution to emit from, once stopped
  path = jnp.full((batch, depth), -1, jnp.int32)
  n_accepted = jnp.zeros((batch,), jnp.int32)
  # depth + 1 rounds: the last only finds no children and stops every row still going.
  for d in range(depth + 1):
    p = target_probs[rows, pos]                       # [B, V]
    q = None if draft_probs is None else draft_probs[rows, pos]
    uniforms = jax.random.uniform(keys[d], (batch, width))
    chosen = jnp.full((batch,), -1, jnp.int32)
    for r in range(width if d < depth else 0):
      node = children[rows, pos, r]                   # [B]
      live = (node >= 0) & (chosen < 0) & ~stopped
      x = draft_tokens[rows, jnp.maximum(node, 0)]
      if mode == "deterministic":
        q_x = jax.nn.one_hot(x, p.shape[-1], dtype=p.dtype)
        accept_prob = p[rows, x]
      else:
        q_x = q
        accept_prob = jnp.minimum(1.0, p[rows, x] / jnp.maximum(q[rows, x], 1e-30))
      accept = live & (uniforms[:, r] < accept_prob)
      reject = live & ~accept
      chosen = jnp.where(accept, node, chosen)
      p = jnp.where(reject[:, None], residual(p, q_x), p)
      if mode == "without_replacement":
        q = jnp.where(reject[:, None], _renormalise(q * (1.0 - jax.nn.one_hot(x, q.shape[-1]))), q)
    stop_here = ~stopped & (chosen < 0)
    p_stop = jnp.where(stop_here[:, None], p, p_stop)
    stopped = stopped | stop_here
    if d < depth:
      path = path.at[:, d].set(jnp.where(stopped, -1, chosen))
      n_accepted = n_accepted + (~stopped).astype(jnp.int32)
      pos = jnp.where(stopped, pos, chosen + 1)
  next_token = draw(keys[-1], p_stop)
  return Verdict(path=path, n_accepted=n_accepted, next_token=next_token)


def greedy_probs(logits: jax.Array) -> jax.Array:
  """Point mass on the argmax [..., V]: verification with it is greedy verification."""
  return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
