"""The `ar` decoder on a tiny random model: exactness, batching, EOS, compile counts, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward, init_params

CONFIG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_id=None)


@pytest.fixture(scope="module")
def params():
  # A larger init scale than the default makes logits peaked, so greedy paths are not near-ties.
  p = init_params(CONFIG, jax.random.key(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, p)


@jax.jit
def _full_forward_logits(params, seq):
  """Logits [T, V] of one cache-free causal pass over seq [T] (padding beyond is harmless)."""
  t = seq.shape[0]
  cache = KVCache.init(CONFIG, 1, t)
  logits, _, _ = forward(params, CONFIG, seq[None], jnp.arange(t)[None], cache,
                         causal_attend(cache.lengths, t, t))
  return logits[0]


def naive_greedy(params, prompt, n, width=32):
  """Reference: recompute the whole sequence for every new token."""
  seq = list(prompt)
  for _ in range(n):
    padded = np.zeros(width, np.int32)
    padded[:len(seq)] = seq
    seq.append(int(jnp.argmax(_full_forward_logits(params, padded)[len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_matches_naive_reference_in_a_ragged_batch(params):
  prompts = [[3, 5, 7, 11, 13, 17, 19], [2, 4], [8, 1, 9, 30, 2]]
  result = engine.generate(params, CONFIG, prompts, max_new_tokens=12)
  for prompt, got in zip(prompts, result.tokens):
    assert got == naive_greedy(params, prompt, 12)
  alone = engine.generate(params, CONFIG, prompts[1:2], max_new_tokens=12).tokens[0]
  assert alone == result.tokens[1]


def test_stops_at_eos_per_row(params):
  prompts = [[3, 5, 7], [2, 4, 6, 8]]
  free = engine.generate(params, CONFIG, prompts, max_new_tokens=10).tokens
  i = next(i for i in range(1, 10) if free[0][i] not in free[0][:i])  # first new token after the first
  eos = free[0][i]
  stopped = engine.generate(params, CONFIG.replace(eos_token_id=eos), prompts, max_new_tokens=10).tokens
  assert stopped[0] == free[0][:i + 1]
  row1_cut = free[1].index(eos) + 1 if eos in free[1] else 10
  assert stopped[1] == free[1][:row1_cut]
  ignored = engine.generate(params, CONFIG.replace(eos_token_id=eos), prompts, max_new_tokens=10,
                              stop_at_eos=False).tokens
  assert ignored == free


def test_sampling_is_reproducible_from_the_seed(params):
  sampling = SamplingParams.create(temperature=1.0)
  run = lambda seed: engine.generate(params, CONFIG, [[1, 2, 3]], max_new_tokens=24,
                                       sampling=sampling, seed=seed).tokens[0]
  assert run(7) == run(7)
  assert run(7) != run(8)


class CompileCounter:
  """Counts XLA backend compilations (every jitted program or eager op that compiles)."""

  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1


def test_one_compilation_per_generation(params):
  counter = CompileCounter()
  config = CONFIG.replace(num_layers=3)  # a config no other test compiled
  p = init_params(config, jax.random.key(1))
  first = engine.generate(p, config, [[1, 2, 3, 4, 5]], max_new_tokens=64, stop_at_eos=False)
  assert len(first.tokens[0]) == 64
  assert first.compiles + first.cache_loads == 3  # compiled or read from the disk cache: prefill chunk, last-token logits, the whole 64-token decode loop
  before = counter.count
  # Another prompt length in the same shape bucket, other sampling settings, other seed.
  second = engine.generate(p, config, [[9, 8, 7, 6, 5, 4, 3]], max_new_tokens=64,
                             sampling=SamplingParams.create(0.7, 0.9, 10), seed=3, stop_at_eos=False)
  assert second.compiles == second.cache_loads == 0 and second.compile_s == 0.0
  assert counter.count == before, "a second generation of the same shapes compiled something"


@pytest.mark.parametrize("prompts,match", [
    ([], "no prompts"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[[1, 2], [3, 4]]], "prompt 0 must be a flat list"),
    (np.zeros((2, 3, 4), np.int32), "must be \\[batch, length\\]"),
    ([[1, 2, 99]], "token id 99 outside the vocabulary"),
    ([[1.5, 2.0]], "must be integers"),
    ([list(range(1, 50)) * 2], "prompt 0 has 98 tokens; .* 138 > the model's context of 128"),
])
def test_bad_prompts_raise_clear_errors(params, prompts, match):
  with pytest.raises(ValueError, match=match):
    engine.generate(params, CONFIG, prompts, max_new_tokens=40)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.2}, "top_p=1.2"),
    ({"top_k": -3}, "top_k=-3"),
    ({"top_k": 2.5}, "top_k=2.5"),
    ({"top_k": float("inf")}, "top_k=inf"),
    ({"top_k": float("nan")}, "top_k=nan"),
    ({"top_k": 2**40}, "top_k=1099511627776"),
    ({"top_k": True}, "top_k=True"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"temperature": float("nan")}, "temperature=nan"),
])
def test_bad_sampling_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams.create(**kwargs)


def test_missing_model_is_named(tmp_path):
  missing = tmp_path / "no_such_model.gguf"
  with pytest.raises(FileNotFoundError, match="no_such_model.gguf"):
    load_model(str(missing))
  with pytest.raises(ValueError, match="neither"):
    load_model(str(tmp_path))  # exists, but holds no model
