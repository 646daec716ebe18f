"""The planner's latency model against closed forms and a simulation of the engine's rounds, and
its shortest-path search against brute force."""

import types

import jax
import numpy as np
import pytest

from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import init_params
from hitree_jax.planner import latency, optimize, profile
from hitree_jax.tree import shapes


def affine(fixed, per_token):
  return lambda width: fixed + per_token * width


def test_a_chain_is_the_textbook_formula():
  a, gamma, draft = 0.7, 4, 0.003
  target = affine(0.020, 0.001)
  model = latency.StackModel(shapes.chain(gamma), draft, (target,), ([a],))
  expected_tokens = (1 - a ** (gamma + 1)) / (1 - a)
  got = latency.predict(model)
  assert got.tokens_per_target_forward == pytest.approx(expected_tokens)
  assert got.seconds_per_token == pytest.approx((draft + target(gamma + 1)) / expected_tokens)


def test_a_trees_accepted_law_has_sequoias_mean():
  profile = [0.6, 0.25, 0.1]
  for tree in (shapes.kary(3, 2), shapes.from_acceptance(profile, 12, 4), shapes.chain(5)):
    law = latency.accepted_law(tree, profile)
    assert law.sum() == pytest.approx(1.0) and (law >= 0).all()
    assert np.dot(np.arange(law.size), law) == pytest.approx(shapes.expected_accepted(tree, profile))


def test_fill_counts_rounds_and_overshoot():
  # Yields of 1 or 3 tokens, equally likely, until >= 4 are held.
  got = latency.fill(4, np.array([0.0, 0.5, 0.0, 0.5]))
  paths = {}  # (final length, rounds) -> probability, by enumerating every sequence of yields

  def walk(held, p, n):
    if held >= 4:
      paths[(held, n)] = paths.get((held, n), 0.0) + p
      return
    walk(held + 1, p / 2, n + 1)
    walk(held + 3, p / 2, n + 1)

  walk(0, 1.0, 0)
  assert got.rounds == pytest.approx(sum(p * n for (_, n), p in paths.items()))
  for length in range(got.length.size):
    assert got.length[length] == pytest.approx(sum(p for (h, _), p in paths.items() if h == length))


def simulate(rng, draft_length, draft_seconds, levels, top_rounds=20000):
  """The engine's rounds with i.i.d. acceptance. levels: bottom-up (cost, acceptance, gamma), the
  last (the target) with gamma None. Returns (seconds per token, tokens per target forward)."""

  def propose(j):
    if j == 0:
      return draft_seconds, draft_length
    cost, a, gamma = levels[j - 1]
    seconds = held = 0
    while held < gamma:
      below, length = propose(j - 1)
      accepted = 0
      while accepted < length and rng.random() < a:
        accepted += 1
      seconds += below + cost(length + 1)
      held += accepted + 1
    return seconds, held

  seconds = tokens = 0.0
  top_cost, top_a, _ = levels[-1]
  for _ in range(top_rounds):
    below, length = propose(len(levels) - 1)
    accepted = 0
    while accepted < length and rng.random() < top_a:
      accepted += 1
    seconds += below + top_cost(length + 1)
    tokens += accepted + 1
  return seconds / tokens, tokens / top_rounds


@pytest.mark.parametrize("levels", [
    [(affine(0.004, 0.0005), 0.6, 5), (affine(0.030, 0.001), 0.8, None)],                      # triforce-like
    [(affine(0.002, 0.0002), 0.5, 3), (affine(0.006, 0.0005), 0.7, 6),
     (affine(0.030, 0.001), 0.85, None)],                                                       # 4 levels
])
def test_the_model_matches_a_simulation_of_the_rounds(levels):
  draft_length, draft_seconds = 2, 0.001
  simulated, per_forward = simulate(np.random.default_rng(0), draft_length, draft_seconds, levels)
  model = latency.StackModel(shapes.chain(draft_length), draft_seconds, tuple(c for c, _, _ in levels),
                             ([levels[0][1]], *(a for _, a, _ in levels[1:])),
                             tuple(g for _, _, g in levels[:-1]))
  got = latency.predict(model)
  assert got.seconds_per_token == pytest.approx(simulated, rel=0.02)
  assert got.tokens_per_target_forward == pytest.approx(per_forward, rel=0.02)
  # Fixed buffers (the search objective) are an approximation of it, not the same number.
  assert latency.predict(model, fixed_buffers=True).seconds_per_token != pytest.approx(simulated, rel=1e-3)


def random_candidates(rng, n_middles):
  names = [f"m{i}" for i in range(n_middles)]
  per_token = np.sort(rng.uniform(0.0002, 0.004, n_middles))
  middles = tuple((n, affine(10 * p, p)) for n, p in zip(names, per_token))
  drafters = (optimize.Drafter("ngram", (("chain:2", shapes.chain(2)), ("chain:4", shapes.chain(4)))),
              optimize.Drafter("small", (("chain:3", shapes.chain(3)), ("kary:2x2", shapes.kary(2, 2))),
                               affine(0.0005, 0.0001)))
  acceptance = {}
  everyone = ["ngram", "small", *names]
  for i, proposer in enumerate(everyone):
    for verifier in [*everyone[max(i + 1, 2):], "target"]:
      if rng.random() < 0.9:
        acceptance[verifier, proposer] = sorted(rng.uniform(0.05, 0.95, 3), reverse=True)
  return optimize.Candidates(drafters, middles, affine(0.03, 0.002), (2, 4, 7), acceptance)


@pytest.mark.parametrize("seed", range(12))
def test_the_shortest_path_is_the_brute_force_optimum(seed):
  rng = np.random.default_rng(seed)
  candidates = random_candidates(rng, n_middles=1 + seed % 3)
  found = optimize.optimize(candidates)
  best = optimize.brute_force(candidates)
  assert found.seconds_per_token == pytest.approx(best.seconds_per_token, rel=1e-9)
  assert (found.drafter, found.tree, found.middles) == (best.drafter, best.tree, best.middles)
  # The winner is also scored with the exact model (buffer overshoot included).
  drafter = next(d for d in candidates.drafters if d.name == found.drafter)
  model = optimize.stack_model(candidates, drafter, dict(drafter.trees)[found.tree], found.middles)
  assert found.exact == latency.predict(model)


@pytest.fixture(scope="module")
def tiny_pair():
  """A tiny random target and a 1-layer draft of its vocabulary, as loading.LoadedModel-alikes."""
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=1024, eos_token_id=None)
  model = lambda c, seed: types.SimpleNamespace(config=c, params=init_params(c, jax.random.key(seed)), vocab=None)
  return model(config, 0), model(config.replace(num_layers=1), 1)


def test_profile_times_every_kind_of_level_and_is_reused(tmp_path, tiny_pair):
  target, draft = tiny_pair
  names = ["target", "retrieval:64", "self:1", "draft", "draft@streaming:4x28"]
  prompt = list(np.arange(300) % 64)
  key = profile.profile_key("tiny", "tiny-draft")
  measure = lambda: {"300": profile.level_costs(target, draft, names, prompt, widths=[1, 4], repeats=2)}
  got = profile.cached(tmp_path / "p.json", key, measure)
  assert sorted(got["300"]) == sorted(names)
  assert all(set(curve) == {"1", "4"} and all(s > 0 for s in curve.values()) for curve in got["300"].values())

  def must_not_measure():
    raise AssertionError("a stored profile for the same key was measured again")

  assert profile.cached(tmp_path / "p.json", key, must_not_measure) == got
  other = dict(key, jax="0.0")
  assert profile.cached(tmp_path / "p.json", other, lambda: {"x": 1}) == {"x": 1}  # another key: measured
  with pytest.raises(ValueError, match="unknown level 'tree'"):
    profile.level_costs(target, draft, ["tree"], prompt, widths=[1])


def test_pair_acceptance_is_one_for_a_level_and_itself_and_less_for_a_draft(tiny_pair):
  from hitree_jax.decode.sampling import SamplingParams
  target, draft = tiny_pair
  prompt, continuation = list(np.arange(200) % 64), list(np.arange(24) * 7 % 64)
  pairs = [("target", "target"), ("target", "retrieval:256"), ("target", "draft"),
           ("retrieval:64", "draft@streaming:4x28")]
  got = profile.pair_acceptance(target, draft, pairs, prompt, continuation, SamplingParams.create(0.8))
  for same in ("target<-target", "target<-retrieval:256"):   # 256 slots keep the whole context
    assert got[same]["alpha"] == pytest.approx(1.0, abs=1e-5) and got[same]["greedy"] == 1.0
  for pair in ("target<-draft", "retrieval:64<-draft@streaming:4x28"):
    assert 0.0 < got[pair]["alpha"] < 0.99
    assert len(got[pair]["profile"]) == 8 and sum(got[pair]["greedy_profile"]) <= 1.0
    assert got[pair]["greedy_profile"][0] == got[pair]["greedy"]
