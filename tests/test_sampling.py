"""Sampling: the distribution `probabilities` returns, that `sample` draws from it,
validation of settings, and that settings are traced values (no recompiles)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from hitree_jax.decode.sampling import SamplingParams, probabilities, sample

N_SAMPLES = 20000
VOCAB = 61

# Jitted once per logits shape (settings are traced), which keeps the file fast; the
# eager path is the same code.
_probabilities = jax.jit(probabilities)
_sample = jax.jit(sample)


def random_logits(seed, shape):
  return np.random.default_rng(seed).normal(0.0, 2.0, size=shape).astype(np.float32)


def softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def reference_probs(logits, temperature, top_k=0, top_p=1.0, top_p_first=False):
  """HF's order on one row: temperature, then top-k, then top-p on the renormalised
  top-k distribution (the smallest prefix of sorted probabilities whose mass reaches p).
  `top_p_first` swaps the two filters (a wrong order, used to show the test can tell)."""
  x = np.asarray(logits, np.float64) / temperature
  vocab = x.size
  order = np.argsort(-x)
  keep = np.ones(vocab, bool)

  def apply_top_k(keep):
    if top_k > 0:
      keep = keep & np.isin(np.arange(vocab), order[:min(top_k, vocab)])
    return keep

  def apply_top_p(keep):
    if top_p < 1.0:
      ranked = [i for i in order if keep[i]]
      probs = softmax(x[ranked])
      cum = np.cumsum(probs)
      n = min(int(np.argmax(cum >= top_p)) + 1 if (cum >= top_p).any() else len(ranked),
              len(ranked))
      keep = np.isin(np.arange(vocab), ranked[:n])
    return keep

  keep = apply_top_k(apply_top_p(keep)) if top_p_first else apply_top_p(apply_top_k(keep))
  out = np.zeros(vocab)
  out[keep] = softmax(x[keep])
  return out


def nucleus_margin(logits, temperature, top_k, top_p):
  """Distance of top_p from the nearest cumulative mass (guards against float-boundary cases)."""
  x = np.sort(np.asarray(logits, np.float64) / temperature)[::-1]
  if top_k > 0:
    x = x[:top_k]
  return np.abs(np.cumsum(softmax(x)) - top_p).min()


def test_greedy_is_argmax_point_mass():
  logits = random_logits(0, (4, 61))
  for params in (SamplingParams.create(), SamplingParams.create(0.0, top_p=0.3, top_k=5)):
    probs = np.asarray(_probabilities(jnp.asarray(logits), params))
    assert probs.dtype == np.float32
    np.testing.assert_array_equal(probs, np.eye(61, dtype=np.float32)[logits.argmax(-1)])
    for seed in range(3):
      tokens = np.asarray(_sample(jax.random.key(seed), jnp.asarray(logits), params))
      assert tokens.dtype == np.int32 and tokens.shape == (4,)
      np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
  logits = random_logits(1, (4, 61))
  probs = np.asarray(_probabilities(jnp.asarray(logits), SamplingParams.create(temperature)))
  np.testing.assert_allclose(probs, softmax(logits / temperature), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("top_k", [1, 5, 60, 61, 100])
def test_top_k_keeps_exactly_the_k_largest(top_k):
  logits = random_logits(2, (4, 61))
  assert all(len(np.unique(row)) == 61 for row in logits)  # no ties
  probs = np.asarray(_probabilities(jnp.asarray(logits), SamplingParams.create(0.8, top_k=top_k)))
  k = min(top_k, 61)
  for row, p in zip(logits, probs):
    kept = np.flatnonzero(p > 0)
    np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-row)[:k]))
    np.testing.assert_allclose(p, reference_probs(row, 0.8, top_k=top_k), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("top_p", [1e-3, 0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
  logits = random_logits(3, (4, 61))
  temperature = 1.2
  probs = np.asarray(_probabilities(jnp.asarray(logits),
                                   SamplingParams.create(temperature, top_p=top_p)))
  for row, p in zip(logits, probs):
    assert nucleus_margin(row, temperature, 0, top_p) > 1e-4
    want = reference_probs(row, temperature, top_p=top_p)
    np.testing.assert_array_equal(p > 0, want > 0)
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)
    # Smallest prefix: the kept mass (before renormalising) reaches p, and dropping
    # the least likely kept token would fall short of it.
    full = softmax(row / temperature)
    kept = np.sort(full[p > 0])
    assert kept.sum() >= top_p and kept[1:].sum() < top_p
  if top_p == 1e-3:
    np.testing.assert_array_equal(probs, np.eye(61)[logits.argmax(-1)])


@pytest.mark.parametrize("top_k,top_p", [(10, 0.6), (3, 0.95), (20, 0.3), (5, 0.8)])
def test_top_k_then_top_p(top_k, top_p):
  logits = random_logits(4, (4, 61))
  temperature = 0.9
  probs = np.asarray(_probabilities(jnp.asarray(logits),
                                   SamplingParams.create(temperature, top_p=top_p, top_k=top_k)))
  order_matters = False
  for row, p in zip(logits, probs):
    assert nucleus_margin(row, temperature, top_k, top_p) > 1e-4
    want = reference_probs(row, temperature, top_k=top_k, top_p=top_p)
    np.testing.assert_array_equal(p > 0, want > 0)
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)
    wrong = reference_probs(row, temperature, top_k=top_k, top_p=top_p, top_p_first=True)
    order_matters |= not np.array_equal(wrong > 0, want > 0)
  if (top_k, top_p) == (5, 0.8):
    assert order_matters  # this case distinguishes HF's order from the reverse one


SAMPLING_CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=0.7, top_k=3),
    "top_p": dict(temperature=1.3, top_p=0.8),
    "both": dict(temperature=1.0, top_k=4, top_p=0.7),
}
SMALL_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.5], np.float32)


@jax.jit
def _draw(keys, logits, params):
  return jax.vmap(sample, in_axes=(0, None, None))(keys, logits, params)


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_samples_follow_probabilities(case):
  settings = SAMPLING_CASES[case]
  params = SamplingParams.create(**settings)
  logits = jnp.asarray(SMALL_LOGITS)
  probs = np.asarray(_probabilities(logits, params), np.float64)
  np.testing.assert_allclose(probs, reference_probs(SMALL_LOGITS, **settings), rtol=1e-5,
                             atol=1e-7)
  keys = jax.random.split(jax.random.key(sorted(SAMPLING_CASES).index(case)), N_SAMPLES)
  tokens = np.asarray(_draw(keys, logits, params))
  counts = np.bincount(tokens, minlength=SMALL_LOGITS.size)
  assert counts.size == SMALL_LOGITS.size and counts.sum() == N_SAMPLES
  support = probs > 0
  assert counts[~support].sum() == 0, f"drew filtered-out tokens: {counts}"
  assert support.sum() >= 2

  def p_value(expected):
    expected = expected[support] / expected[support].sum() * N_SAMPLES
    return scipy.stats.chisquare(counts[support], expected).pvalue

  assert p_value(probs) > 1e-4, (counts, probs * N_SAMPLES)
  # The test has power: a slightly different temperature is rejected.
  shifted = reference_probs(SMALL_LOGITS, **{**settings,
                                             "temperature": settings["temperature"] * 1.25})
  assert p_value(shifted) < 1e-6


@pytest.mark.parametrize("kwargs,named", [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(top_p=0), "top_p=0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(top_k=2.5), "top_k=2.5"),
])
def test_invalid_settings_raise(kwargs, named):
  with pytest.raises(ValueError, match=named.replace(".", r"\.")):
    SamplingParams.create(**kwargs)


def test_changing_settings_does_not_recompile():
  traces = []

  @jax.jit
  def step(key, logits, params):
    traces.append(1)  # runs once per trace
    return sample(key, logits, params), probabilities(logits, params)

  logits = jnp.asarray(random_logits(5, (4, 61)))
  settings = [dict(), dict(temperature=0.8, top_k=5), dict(temperature=1.1, top_p=0.9),
              dict(temperature=0.5, top_k=7, top_p=0.5)]
  results = []
  for s in settings:
    params = SamplingParams.create(**s)
    tokens, probs = step(jax.random.key(0), logits, params)
    results.append(np.asarray(probs))
    np.testing.assert_allclose(results[-1], np.asarray(_probabilities(logits, params)), atol=1e-7)
  assert step._cache_size() == 1 and len(traces) == 1
  # The settings really reached the compiled program (different distributions) ...
  assert len({(r > 0).sum() for r in results}) == len(settings)
  # ... and the counter does count compilations: a new logits shape is a second one.
  step(jax.random.key(0), logits[:1], SamplingParams.create())
  assert step._cache_size() == 2 and len(traces) == 2


def test_draw_never_picks_a_zero_probability_token():
  from hitree_jax.decode.sampling import draw
  probs = jnp.array([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
  tokens = np.asarray(jax.vmap(lambda k: draw(k, probs))(jax.random.split(jax.random.key(0), 4000)))
  assert set(np.unique(tokens[:, 0])) == {1, 3} and (tokens[:, 1] == 4).all()
  assert 0.45 < (tokens[:, 0] == 1).mean() < 0.55
