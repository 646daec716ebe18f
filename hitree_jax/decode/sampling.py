"""Logits -> the distribution actually sampled from, and keyed sampling.

Settings are pytree leaves (not static), so changing temperature / top-p /
top-k does not recompile. `probabilities` returns the exact distribution a
token is drawn from -- greedy is the point mass on the argmax -- because
speculative verification needs that distribution, not just a sample.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.errors import UsageError


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [] float32; 0 = greedy
  top_p: jax.Array        # [] float32 in (0, 1]; 1 = off
  top_k: jax.Array        # [] int32 >= 0; 0 = off

  @classmethod
  def create(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
    """Validated settings; a bad value raises ValueError naming it."""
    if not 0.0 <= temperature < float("inf"):  # also rejects NaN
      raise UsageError(f"temperature={temperature} must be finite and >= 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
      raise UsageError(f"top_p={top_p} must be in (0, 1]")
    if isinstance(top_k, bool) or not (isinstance(top_k, (int, np.integer)) or
                                       (isinstance(top_k, float) and top_k.is_integer())):
      raise UsageError(f"top_k={top_k} must be a non-negative integer (0 disables it)")
    if not 0 <= top_k < 2**31:
      raise UsageError(f"top_k={top_k} must be a non-negative integer below 2**31 (0 disables it)")
    return cls(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
               top_k=jnp.int32(top_k))

  @property
  def greedy(self) -> jax.Array:
    return self.temperature == 0.0


def _smallest_passing(probs: jax.Array, passes) -> jax.Array:
  """Smallest value v >= 0 with passes(v) true, for passes monotone in v. probs [..., V] -> [..., 1].

  Bisects on the bit patterns of non-negative float32 (ordered like the
  values), so the answer is exact after 32 steps. Each step is one pass over
  the vocabulary: much cheaper on CPU than sorting 49k logits per token.
  """
  as_float = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float32)
  hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True), jnp.int32)
  lo = jnp.zeros_like(hi)

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = passes(as_float(mid))
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
  return as_float(lo)


def _filter_top_k_top_p(probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Zeroes probs [..., V] outside the top-k, then outside the top-p nucleus (HF's order).

  Token x is kept by top-k iff fewer than k tokens are strictly more likely,
  and by top-p iff the mass strictly more likely than x is below top_p.
  """
  def keep_top_k(probs):
    count_above = lambda v: jnp.sum(probs > v, axis=-1, keepdims=True)
    return jnp.where(probs >= _smallest_passing(probs, lambda v: count_above(v) < top_k), probs, 0.0)

  def keep_nucleus(probs):
    total = jnp.sum(probs, axis=-1, keepdims=True)
    mass_above = lambda v: jnp.sum(jnp.where(probs > v, probs, 0.0), axis=-1, keepdims=True)
    threshold = _smallest_passing(probs, lambda v: mass_above(v) < top_p * total)
    return jnp.where(probs >= threshold, probs, 0.0)

  # Each bisection is 32 passes over the vocabulary: skip the one that is off.
  probs = jax.lax.cond(top_k > 0, keep_top_k, lambda p: p, probs)
  return jax.lax.cond(top_p < 1.0, keep_nucleus, lambda p: p, probs)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """float32 probabilities [..., V] that `sample` draws from."""
  logits = logits.astype(jnp.float32)

  def stochastic(logits):
    probs = jax.nn.softmax(logits / jnp.maximum(params.temperature, 1e-6), axis=-1)
    needs_filter = (params.top_k > 0) | (params.top_p < 1.0)
    probs = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda p, k, t: p,
                         probs, params.top_k, params.top_p)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)

  def greedy(logits):
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

  return jax.lax.cond(params.greedy, greedy, stochastic, logits)


def draw(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One token [...] per distribution probs [..., V], by inverting the CDF at one uniform.

  Exact, and 2.5x cheaper on CPU than a Gumbel draw, which needs V random
  numbers per token. A zero-probability token is never drawn (its CDF step is flat).
  """
  cdf = jnp.cumsum(probs, axis=-1)
  u = jax.random.uniform(key, probs.shape[:-1] + (1,)) * cdf[..., -1:]
  # u rounding up to the total would run past the end: clamp to the last possible token.
  last = probs.shape[-1] - 1 - jnp.argmax(jnp.flip(probs > 0, axis=-1), axis=-1)
  return jnp.minimum(jnp.sum(cdf <= u, axis=-1), last).astype(jnp.int32)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """int32 tokens [...] drawn from `probabilities(logits, params)`."""

  def stochastic(logits):
    return draw(key, probabilities(logits, params))

  def greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  return jax.lax.cond(params.greedy, greedy, stochastic, logits.astype(jnp.float32))
