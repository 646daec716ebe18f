"""The exact laws that sampled generation must follow, and the chi-square test that compares
samples with them: shared by every sampling test (imported from here, never from a test file).
Each law is computed apart from the library's sampling code, from one cache-free forward over
every context of a model whose vocabulary is small enough to enumerate."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.decode.sampling import probabilities
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward

# A 3-layer model of 6 tokens: every three-token continuation can be enumerated.
SMALL = ModelConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None)
N_SAMPLES = 4000   # rows sampled per law test


def exact_three_token_law(params, prompt, sampling, config=SMALL):
  """P(a) P(b | a) P(c | a, b) [V, V, V] from one batched cache-free forward over every context."""
  v, t = config.vocab_size, len(prompt) + 2
  contexts = [[]] + [[a] for a in range(v)] + [[a, b] for a in range(v) for b in range(v)]
  seqs = np.array([prompt + c + [0] * (2 - len(c)) for c in contexts], np.int32)
  cache = KVCache.init(config, len(seqs), t)
  logits, _, _ = jax.jit(forward, static_argnums=1)(
      params, config, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), seqs.shape), cache,
      causal_attend(cache.lengths, t, t))
  last = np.array([len(prompt) - 1 + len(c) for c in contexts])
  probs = np.asarray(probabilities(logits[np.arange(len(seqs)), last], sampling), np.float64)
  first, second, third = probs[0], probs[1:1 + v], probs[1 + v:].reshape(v, v, v)
  return first[:, None, None] * second[:, :, None] * third


def target_law(logits, temperature, top_k):
  """The law sampling must follow, computed apart from sampling.py: softmax(logits / temperature)
  over the top_k most likely tokens (0: all), renormalised."""
  z = np.asarray(logits, np.float64) / temperature
  if top_k:
    z = np.where(z >= np.sort(z, axis=-1)[..., -top_k, None], z, -np.inf)
  p = np.exp(z - z.max(axis=-1, keepdims=True))
  return p / p.sum(axis=-1, keepdims=True)


def exact_joint_law(params, config, prompt, n, temperature, top_k):
  """P(x1 .. xn) [V] * n by the chain rule, from one cache-free forward over every context."""
  v, t = config.vocab_size, len(prompt) + n - 1
  contexts = [list(c) for k in range(n) for c in itertools.product(range(v), repeat=k)]
  seqs = np.array([prompt + c + [0] * (n - 1 - len(c)) for c in contexts], np.int32)
  cache = KVCache.init(config, len(seqs), t)
  logits, _, _ = jax.jit(forward, static_argnums=1)(
      params, config, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), seqs.shape), cache,
      causal_attend(cache.lengths, t, t))
  last = np.array([len(prompt) - 1 + len(c) for c in contexts])
  probs = target_law(np.asarray(logits)[np.arange(len(seqs)), last], temperature, top_k)
  law, start = probs[0], 1
  for k in range(1, n):  # the contexts of length k come in row-major order of [V] * k
    law = law[..., None] * probs[start:start + v ** k].reshape((v,) * k + (v,))
    start += v ** k
  return law


def chi_square_pvalue(samples, law):
  counts = np.zeros_like(law)
  np.add.at(counts, tuple(samples.T), 1)
  expected = law.ravel() / law.sum() * len(samples)
  big = expected >= 5  # pool the rare cells so the chi-square approximation holds
  obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  assert obs[~keep].sum() == 0, "a token sequence of probability zero was generated"
  return stats.chisquare(obs[keep], exp[keep]).pvalue
