"""Exactness of tree verification, checked statistically against an enumerable target.

The "models" are tables over a 3-token vocabulary: p(. | prefix) and q(. | prefix)
for every prefix up to length 6. A tree is drafted from q (each child-drawing
rule), verified against p, and the process repeats from the emitted tokens until
two tokens exist; the joint distribution of the first two emitted tokens must be
p(x1) p(x2 | x1). A verifier that resamples from the full p after a rejection
(the bias of TriForce's public code) must fail the same test.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hitree_jax.decode import verify as verify_lib
from hitree_jax.tree import shapes as tree_lib

V = 3
MAX_PREFIX = 6
N_ROWS = 20000
TREES = {"chain3": tree_lib.chain(3), "binary2": tree_lib.kary(2, 2),
         "ragged": tree_lib.TokenTree((-1, -1, 0, 0, 1, 2))}


def prefix_offset(length):
  return (V ** length - 1) // (V - 1)


def random_table(rng, concentration):
  n = prefix_offset(MAX_PREFIX + 1)
  return rng.dirichlet([concentration] * V, size=n).astype(np.float32)


def draft_children(rng, q, parent_ctx, n_children, mode):
  """Tokens [B, n_children] drawn from q[parent_ctx] by the mode's rule."""
  dist = q[parent_ctx].copy()                          # [B, V]
  out = np.zeros((len(parent_ctx), n_children), np.int64)
  for r in range(n_children):
    if mode == "deterministic":
      out[:, r] = np.argsort(-dist, axis=1, kind="stable")[:, r]
      continue
    probs = dist / dist.sum(1, keepdims=True)
    u = rng.random(len(parent_ctx))[:, None]
    out[:, r] = np.minimum((u > np.cumsum(probs, 1)).sum(1), V - 1)
    if mode == "without_replacement":
      dist[np.arange(len(dist)), out[:, r]] = 0.0
  return out


def _verify_resampling_from_full_target(*args):
  """`verify` with the middle level's residual replaced by p itself (TriForce's bias).

  The rule is read when `verify` is traced, so it is swapped in only for this function's own
  trace: a jit of it never shares a trace with the exact verifier's, in whatever order they run.
  """
  exact = verify_lib.residual
  verify_lib.residual = lambda p, q: p
  try:
    return verify_lib.verify(*args)
  finally:
    verify_lib.residual = exact


VERIFIERS = {"exact": jax.jit(verify_lib.verify, static_argnums=(1, 5)),
             "biased": jax.jit(_verify_resampling_from_full_target, static_argnums=(1, 5))}


def one_round(rng, key, tree, p, q, ctx_len, ctx_val, mode, greedy=False, verifier="exact"):
  """Drafts `tree` after each row's context, verifies it; returns emitted tokens per row."""
  b, n = len(ctx_len), tree.size
  node_len = np.zeros((b, n + 1), np.int64)
  node_val = np.zeros((b, n + 1), np.int64)
  node_len[:, 0], node_val[:, 0] = ctx_len, ctx_val
  tokens = np.zeros((b, n), np.int64)
  for pos in range(n + 1):                             # parents precede children
    kids = [c for c in tree.children[pos] if c >= 0]
    if not kids:
      continue
    drawn = draft_children(rng, q, prefix_offset(node_len[:, pos]) + node_val[:, pos], len(kids), mode)
    for r, c in enumerate(kids):
      tokens[:, c] = drawn[:, r]
      node_len[:, c + 1] = node_len[:, pos] + 1
      node_val[:, c + 1] = node_val[:, pos] * V + drawn[:, r]
  ctx = prefix_offset(node_len) + node_val             # [B, N+1]
  target = jnp.asarray(p[ctx])
  if greedy:
    target = verify_lib.greedy_probs(jnp.log(target))
  verdict = VERIFIERS[verifier](
      key, tree, jnp.asarray(tokens, jnp.int32), target, jnp.asarray(q[ctx]), mode)
  path, n_acc, nxt = map(np.asarray, (verdict.path, verdict.n_accepted, verdict.next_token))
  emitted = [[int(tokens[i, path[i, j]]) for j in range(n_acc[i])] + [int(nxt[i])] for i in range(b)]
  return emitted


def first_two_tokens(tree, mode, seed, greedy=False, verifier="exact"):
  rng = np.random.default_rng(seed)
  p, q = random_table(rng, 1.0), random_table(rng, 1.0)
  key = jax.random.key(seed)
  zeros = np.zeros(N_ROWS, np.int64)
  emitted = one_round(rng, jax.random.fold_in(key, 0), tree, p, q, zeros, zeros, mode, greedy,
                      verifier)
  need_more = [i for i, e in enumerate(emitted) if len(e) < 2]
  if need_more:
    ctx_len = np.ones(len(need_more), np.int64)
    ctx_val = np.array([emitted[i][0] for i in need_more], np.int64)
    more = one_round(rng, jax.random.fold_in(key, 1), tree, p, q, ctx_len, ctx_val, mode, greedy,
                     verifier)
    for i, e in zip(need_more, more):
      emitted[i] = emitted[i] + e
  pairs = np.array([e[:2] for e in emitted])
  exact = np.array([[p[0, a] * p[prefix_offset(1) + a, b] for b in range(V)] for a in range(V)], np.float64)
  return pairs, exact / exact.sum()


def chi_square_pvalue(pairs, exact):
  counts = np.zeros((V, V))
  np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
  return stats.chisquare(counts.ravel(), exact.ravel() * len(pairs)).pvalue


@pytest.mark.parametrize("mode", verify_lib.MODES)
@pytest.mark.parametrize("tree_name", list(TREES))
def test_sampling_matches_target_distribution(tree_name, mode):
  seed = zlib.crc32(f"{tree_name}/{mode}".encode()) % 1000  # the same under any PYTHONHASHSEED
  pairs, exact = first_two_tokens(TREES[tree_name], mode, seed=seed)
  assert chi_square_pvalue(pairs, exact) > 1e-4


@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_resampling_from_full_target_is_caught(mode):
  pairs, exact = first_two_tokens(TREES["binary2"], mode, seed=3, verifier="biased")
  assert chi_square_pvalue(pairs, exact) < 1e-6
  # The same draws through the exact verifier pass: the failure is the rule's, not the seed's.
  pairs, exact = first_two_tokens(TREES["binary2"], mode, seed=3)
  assert chi_square_pvalue(pairs, exact) > 1e-4


@pytest.mark.parametrize("mode", verify_lib.MODES)
def test_greedy_emits_the_target_argmax_chain(mode):
  pairs, _ = first_two_tokens(TREES["ragged"], mode, seed=5, greedy=True)
  rng = np.random.default_rng(5)
  p = random_table(rng, 1.0)
  a = int(p[0].argmax())
  b = int(p[prefix_offset(1) + a].argmax())
  assert (pairs == [a, b]).all()


def test_residual_guard_keeps_p_when_no_mass_left():
  p = jnp.array([[0.2, 0.8, 0.0]])
  np.testing.assert_allclose(verify_lib.residual(p, p), p)
  np.testing.assert_allclose(verify_lib.residual(p, jnp.array([[0.5, 0.5, 0.0]])), [[0.0, 1.0, 0.0]])


def test_unknown_mode_is_named():
  with pytest.raises(ValueError, match="mode='topk'"):
    verify_lib.verify(jax.random.key(0), TREES["chain3"], jnp.zeros((1, 3), jnp.int32),
                      jnp.ones((1, 4, V)) / V, None, "topk")
