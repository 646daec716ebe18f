"""The planner's latency model against closed forms and a simulation of the engine's rounds, and
its shortest-path search against brute force."""

import copy
import dataclasses
import json
import math
import pathlib
import types

import jax
import numpy as np
import pytest

from hitree_jax.decode import spec as spec_lib
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import init_params
from hitree_jax.planner import latency, optimize, profile
from hitree_jax.tree import shapes
from tests.helpers import planned_label, real_model_environ, synthetic_profile


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
  # A round's overheads beside the forwards: the drafter's per forward, the verifier's per token.
  over = latency.Overheads(draft_forward=0.0005, verify=0.002, tree=0.007)
  with_overheads = latency.predict(dataclasses.replace(model, overheads=over))
  round_seconds = draft + 0.0005 * gamma + target(gamma + 1) + 0.002
  assert with_overheads.seconds_per_token == pytest.approx(round_seconds / expected_tokens)


def test_a_drafter_offering_nothing_in_some_rounds_pays_a_one_token_forward_there():
  a, gamma, offer = 0.7, 4, 0.6
  target, over = affine(0.020, 0.001), latency.Overheads(verify=0.002)
  model = latency.StackModel(shapes.chain(gamma), 0.0, (target,), ([a],), overheads=over,
                             model_drafter=False, offer=offer)
  chain_tokens = (1 - a ** (gamma + 1)) / (1 - a)
  tokens = offer * chain_tokens + (1 - offer) * 1.0
  seconds = offer * target(gamma + 1) + (1 - offer) * target(1) + 0.002
  got = latency.predict(model)
  assert got.tokens_per_target_forward == pytest.approx(tokens)
  assert got.seconds_per_token == pytest.approx(seconds / tokens)
  # Never offering is plain decoding.
  never = latency.predict(dataclasses.replace(model, offer=0.0))
  assert never.seconds_per_token == pytest.approx(target(1) + 0.002) and never.tokens_per_target_forward == 1.0


def test_a_drafter_offering_part_of_its_chain_pays_the_narrowest_width_that_holds_it():
  """offer as a law of counts: a round offering m of a chain of 8 yields a chain of m's tokens
  and pays a forward of the root and the narrowest of offer_widths (0, 2, 4, 8) holding m."""
  a, law = 0.7, (0.3, 0.2, 0.1, 0.0, 0.25, 0.0, 0.0, 0.0, 0.1, 0.05)   # the last: 9, a chain of 8 holds 8
  target, over = affine(0.020, 0.001), latency.Overheads(verify=0.002)
  model = latency.StackModel(shapes.chain(8), 0.0, (target,), ([a],), overheads=over, model_drafter=False,
                             offer=law)
  chain_tokens = lambda m: (1 - a ** (m + 1)) / (1 - a)
  tokens = 0.3 + 0.2 * chain_tokens(1) + 0.1 * chain_tokens(2) + 0.25 * chain_tokens(4) + 0.15 * chain_tokens(8)
  seconds = 0.3 * target(1) + 0.3 * target(3) + 0.25 * target(5) + 0.15 * target(9) + 0.002
  got = latency.predict(model)
  assert got.tokens_per_target_forward == pytest.approx(tokens)
  assert got.seconds_per_token == pytest.approx(seconds / tokens)
  # All of it in every round is the chain of 8, as offer=1.
  whole = latency.predict(dataclasses.replace(model, offer=(0.0,) * 8 + (1.0,)))
  assert whole == latency.predict(dataclasses.replace(model, offer=1.0))
  # In a batch of two rows, each row yields by its own law, but a round runs at the width of the
  # wider of the two offers: width 8 unless neither offers more than 4 (P = 0.85^2), ...
  pair = latency.predict(dataclasses.replace(model, rows=2))
  widths = {1: 0.3 ** 2, 3: 0.6 ** 2 - 0.3 ** 2, 5: 0.85 ** 2 - 0.6 ** 2, 9: 1 - 0.85 ** 2}
  assert pair.tokens_per_target_forward == pytest.approx(tokens)
  assert pair.seconds_per_token == pytest.approx((sum(p * target(w) for w, p in widths.items()) + 0.002) / tokens)
  assert latency.widest({0: 0.5, 3: 0.5}, 3) == pytest.approx({0: 0.125, 3: 0.875})


def test_the_expected_largest_of_normal_draws():
  """latency.slowest_of reads a batch's slowest row as the largest of normal draws: E[max] of one
  draw is its mean, of two 1/sqrt(pi) sds above it, of 16 as a seeded simulation gives."""
  assert latency.expected_max_normal(1) == 0.0
  assert latency.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-5)
  simulated = np.random.default_rng(0).standard_normal((200_000, 16)).max(axis=1).mean()
  assert latency.expected_max_normal(16) == pytest.approx(simulated, abs=0.01)
  assert latency.slowest_of(1, [10.0, 14.0]) == 12.0 and latency.slowest_of(4, [12.0]) == 12.0
  assert latency.slowest_of(2, [10.0, 14.0]) == pytest.approx(12.0 + math.sqrt(8.0 / math.pi))


def test_a_replayed_chain_yields_its_rounds_law_and_pays_each_rounds_width():
  """latency.Replayed: a chain's rounds[m, k] (offered m, accepted k) are its yield's law and its
  widths' cost as they are, positions not taken as independent; a chain it did not replay falls
  back to the law of what it offers and the per-rank profile."""
  target, over = affine(0.020, 0.001), latency.Overheads(verify=0.002)
  rounds = np.zeros((5, 5))
  rounds[0, 0], rounds[2, 2], rounds[4, 1], rounds[4, 4] = 3.0, 1.0, 2.0, 4.0    # 10 rounds
  replayed = latency.Replayed({4: rounds}, offer=(0.5, 0.0, 0.0, 0.0, 0.5))
  law, seconds = latency.first_round(target, shapes.chain(4), [0.4], over, offer=replayed)
  np.testing.assert_allclose(law, [0, 0.3, 0.2, 0.1, 0, 0.4])
  assert seconds == pytest.approx(0.3 * target(1) + 0.1 * target(3) + 0.6 * target(5) + 0.002)
  # The chain of 3 was not replayed: half the rounds offer it all, at the profile's acceptance.
  fallback, seconds = latency.first_round(target, shapes.chain(3), [0.4], over, offer=replayed)
  np.testing.assert_allclose(fallback, [0, 0.5 + 0.5 * 0.6, 0.5 * 0.4 * 0.6, 0.5 * 0.4 ** 2 * 0.6, 0.5 * 0.4 ** 3])
  assert seconds == pytest.approx(0.5 * target(1) + 0.5 * target(4) + 0.002)
  got = latency.predict(latency.StackModel(shapes.chain(4), 0.0, (target,), ([0.4],), overheads=over,
                                           model_drafter=False, offer=replayed))
  assert got.tokens_per_target_forward == pytest.approx(0.3 + 0.1 * 3 + 0.2 * 2 + 0.4 * 5)


def test_deeper_nodes_of_a_chain_accept_at_the_deeper_rate():
  law = latency.accepted_law(shapes.chain(3), [0.6], deeper=0.8)
  at_least = law[::-1].cumsum()[::-1]                  # P(accepted >= k)
  np.testing.assert_allclose(at_least, [1.0, 0.6, 0.6 ** 2 * 0.8, 0.6 ** 3 * 0.8 ** 2])


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
  # A batch of two rows fills until both hold 4: the larger of two rows' rounds; each row's length
  # is its own.
  rounds = {}
  for (_, n), p in paths.items():
    rounds[n] = rounds.get(n, 0.0) + p
  pair = latency.fill(4, np.array([0.0, 0.5, 0.0, 0.5]), rows=2)
  assert pair.rounds == pytest.approx(sum(p * q * max(n, m) for n, p in rounds.items() for m, q in rounds.items()))
  assert pair.rounds > got.rounds
  np.testing.assert_allclose(pair.length, got.length)


def simulate(rng, draft_length, draft_seconds, levels, rows=1, top_rounds=20000):
  """The engine's rounds with i.i.d. acceptance over a batch of `rows` rows: every forward runs at
  its static width (its lead, K - j + 1 at level j of K, and the most it may verify: the drafter's
  chain, or a buffer of gamma - 1 and the most a round below yields), and a level fills its buffer
  until every row holds gamma tokens (a row already full commits nothing). levels: bottom-up
  (cost, acceptance, gamma), the last (the target) with gamma None. Returns (seconds per token of
  a row, tokens per target forward of a row)."""
  top = len(levels)
  most = [draft_length]
  for _, _, gamma in levels[:-1]:
    most.append(gamma - 1 + most[-1] + 1)
  widths = [top - j + 1 + most[j - 1] for j in range(1, top + 1)]

  def accepted(lengths, a):
    hits = np.cumprod(rng.random((rows, int(lengths.max()) + 1)) < a, axis=1).sum(axis=1)
    return np.minimum(hits, lengths)

  def propose(j):
    if j == 0:
      return draft_seconds, np.full(rows, draft_length)
    cost, a, gamma = levels[j - 1]
    seconds, held = 0.0, np.zeros(rows, int)
    while (held < gamma).any():
      below, lengths = propose(j - 1)
      live = held < gamma
      held[live] += accepted(lengths, a)[live] + 1
      seconds += below + cost(widths[j - 1])
    return seconds, held

  seconds = tokens = 0.0
  top_cost, top_a, _ = levels[-1]
  for _ in range(top_rounds):
    below, lengths = propose(top - 1)
    tokens += float(np.sum(accepted(lengths, top_a) + 1)) / rows
    seconds += below + top_cost(widths[-1])
  return seconds / tokens, tokens / top_rounds


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("levels", [
    [(affine(0.004, 0.0005), 0.6, 5), (affine(0.030, 0.001), 0.8, None)],                      # triforce-like
    [(affine(0.002, 0.0002), 0.5, 3), (affine(0.006, 0.0005), 0.7, 6),
     (affine(0.030, 0.001), 0.85, None)],                                                       # 4 levels
])
def test_the_model_matches_a_simulation_of_the_rounds(levels, rows):
  """latency.predict against the engine's rounds simulated: static widths, and a batch's fill
  lasting until its last row holds gamma (4 rows: more rounds per fill than one row's)."""
  draft_length, draft_seconds = 2, 0.001
  simulated, per_forward = simulate(np.random.default_rng(0), draft_length, draft_seconds, levels, rows,
                                    top_rounds=20000 // rows)
  model = latency.StackModel(shapes.chain(draft_length), draft_seconds, tuple(c for c, _, _ in levels),
                             ([levels[0][1]], *(a for _, a, _ in levels[1:])),
                             tuple(g for _, _, g in levels[:-1]), rows=rows)
  got = latency.predict(model)
  assert got.seconds_per_token == pytest.approx(simulated, rel=0.02)
  assert got.tokens_per_target_forward == pytest.approx(per_forward, rel=0.02)
  # Fixed buffers (the search objective) are an approximation of it, not the same number.
  assert latency.predict(model, fixed_buffers=True).seconds_per_token != pytest.approx(simulated, rel=1e-3)
  if rows > 1:   # the batch's fills take more rounds than a row's alone, and cost more per token
    alone = latency.predict(dataclasses.replace(model, rows=1))
    assert got.rounds_per_level[0] > alone.rounds_per_level[0] * 1.1
    assert got.seconds_per_token > alone.seconds_per_token * 1.05


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
        ranks = np.sort(rng.uniform(0.05, 0.95, 3))[::-1]
        acceptance[verifier, proposer] = list(ranks * min(1.0, rng.uniform(0.3, 1.0) / ranks.sum()))
  overheads = latency.Overheads(*rng.uniform(0.0, 0.003, 4))
  offers = {(verifier, "ngram"): rng.uniform(0.3, 1.0) for verifier in [*everyone, "target"]}
  return optimize.Candidates(drafters, middles, affine(0.03, 0.002), (2, 4, 7), acceptance, overheads,
                             offers=offers)


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


def typed(pairs):
  """(verifier, proposer) pairs of levels from their names in a profile."""
  return [tuple(map(profile.level_named, pair)) for pair in pairs]


def by_name(pairs):
  """(verifier, proposer) pairs of levels by their names in a profile."""
  return [tuple(map(str, pair)) for pair in pairs]


def test_profile_times_every_kind_of_level_and_is_reused(tmp_path, tiny_pair):
  target, draft = tiny_pair
  names = ["target", "retrieval:64", "self:1", "draft", "draft@streaming:4x28"]
  prompt = list(np.arange(300) % 64)
  key = profile.profile_key("tiny", "tiny-draft")
  levels = list(map(profile.level_named, names))
  measure = lambda: {"300": profile.level_costs(target, draft, levels, prompt, widths=[1, 4], repeats=2)}
  got = profile.cached(tmp_path / "p.json", key, measure)
  assert sorted(got["300"]) == sorted(names)
  assert all(set(curve) == {"1", "4"} and all(s > 0 for s in curve.values()) for curve in got["300"].values())

  def must_not_measure():
    raise AssertionError("a stored profile for the same key was measured again")

  assert profile.cached(tmp_path / "p.json", key, must_not_measure) == got
  other = dict(key, jax="0.0")
  assert profile.cached(tmp_path / "p.json", other, lambda: {"x": 1}) == {"x": 1}  # another key: measured
  with pytest.raises(ValueError, match="unknown level 'tree'"):
    profile.level_costs(target, draft, [profile.level_named("tree")], prompt, widths=[1])


def test_a_quick_profile_reads_the_larger_retrieval_budgets_off_the_line_it_times(tiny_pair, monkeypatch):
  """Only the smallest retrieval budget and the target are timed; a larger budget's forward costs
  what the line through them gives at its slots (a full profile times it)."""
  target, draft = tiny_pair
  levels = list(map(profile.level_named, ["retrieval:128", "draft", "retrieval:64", "target"]))
  prompt = list(np.arange(300) % 64)
  assert [str(level) for level in profile.interpolated_budgets(levels)] == ["retrieval:128"]
  assert profile.interpolated_budgets(levels[:3]) == []   # without the target there is no line
  timed, real = [], profile._Levels.timed
  monkeypatch.setattr(profile._Levels, "timed", lambda self, level: timed.append(str(level)) or real(self, level))
  costs = profile.level_costs(target, draft, levels, prompt, widths=[1, 4], repeats=2, interpolate_budgets=True)
  assert sorted(timed) == ["draft", "retrieval:64", "target"] and list(costs) == [str(level) for level in levels]
  low, high = costs["retrieval:64"], costs["target"]
  for w in (1, 4):
    assert costs["retrieval:128"][w] == pytest.approx(low[w] + (128 - 64) / (300 - 64) * (high[w] - low[w]))
  timed.clear()
  profile.level_costs(target, draft, levels, prompt, widths=[1], repeats=2)
  assert sorted(timed) == ["draft", "retrieval:128", "retrieval:64", "target"]


def test_a_torn_profile_is_measured_again_and_an_interrupted_write_keeps_the_old_one(tmp_path, monkeypatch):
  """A profile cut short at any point (a killed writer of an older version), or not a profile at
  all, is measured again with a warning naming the file; a write that dies before its rename
  leaves the stored profile whole."""
  from absl import logging as absl_logging
  path, key = tmp_path / "p.json", profile.profile_key("tiny", "tiny-draft")
  whole = profile.cached(path, key, lambda: {"300": {"target": {"1": 0.5}}})
  text = path.read_text()
  warnings = []
  monkeypatch.setattr(absl_logging, "warning", lambda message, *args: warnings.append(message % args))
  for torn in [text[:1], text[:len(text) // 2], text[:-2], "[]", '{"key": {}}', "\xff\xfe"]:
    path.write_text(torn)
    assert profile.cached(path, key, lambda: whole) == whole
    assert json.loads(path.read_text())["profile"] == whole and warnings[-1].startswith(f"{path} is not a whole")
  assert len(warnings) == 6

  # Another process of a multi-host run measures as process 0 does, and writes nothing.
  monkeypatch.setattr(profile.jax, "process_index", lambda: 1)
  assert profile.cached(tmp_path / "q.json", key, lambda: {"1": {}}) == {"1": {}} and not (tmp_path / "q.json").exists()
  monkeypatch.undo()
  monkeypatch.setattr(absl_logging, "warning", lambda message, *args: warnings.append(message % args))

  def dies(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(profile.os, "replace", dies)
  with pytest.raises(KeyboardInterrupt):
    profile.cached(path, dict(key, jax="other"), lambda: {"1": {}})
  assert path.read_text() == text


def test_a_profile_is_keyed_by_what_the_draft_holds(tmp_path):
  """A draft retrained in place (its path the same, its bytes not) is profiled again; an EAGLE
  draft's folder likewise when a file in it changes; the same bytes keep their profile."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.loading.digest import SAMPLED
  from hitree_jax.planner import auto
  rng = np.random.default_rng(0)
  draft, heads = tmp_path / "d.gguf", tmp_path / "eagle"
  draft.write_bytes(rng.bytes(3 * SAMPLED))
  heads.mkdir()
  (heads / "heads.json").write_text("{}")
  (heads / "weights.safetensors").write_bytes(rng.bytes(1000))
  key = lambda: auto.profile_key("no/model.gguf", str(draft), 512, SamplingParams.create(), "austen", str(heads))
  path, first = tmp_path / "p.json", key()
  profile.cached(path, first, lambda: {"512": {}})
  assert profile.stored(path, key()) == {"512": {}}
  with open(draft, "r+b") as f:   # retrained: its last bytes differ, its size does not
    f.seek(-4, 2)
    f.write(b"next")
  assert key()["contents"] != first["contents"] and profile.stored(path, key()) is None
  profile.cached(path, key(), lambda: {"512": {"again": 1}})
  (heads / "weights.safetensors").write_bytes(rng.bytes(1000))
  assert key()["eagle_contents"] != first["eagle_contents"] and profile.stored(path, key()) is None


def test_pair_acceptance_is_one_for_a_level_and_itself_and_less_for_a_draft(tiny_pair):
  from hitree_jax.decode.sampling import SamplingParams
  target, draft = tiny_pair
  prompt, continuation = list(np.arange(200) % 64), list(np.arange(24) * 7 % 64)
  pairs = [("target", "target"), ("target", "retrieval:256"), ("target", "draft"),
           ("retrieval:64", "draft@streaming:4x28")]
  got = profile.pair_acceptance(target, draft, typed(pairs), prompt, continuation, SamplingParams.create(0.8))
  for same in ("target<-target", "target<-retrieval:256"):   # 256 slots keep the whole context
    assert got[same]["alpha"] == pytest.approx(1.0, abs=1e-5) and got[same]["greedy"] == 1.0
  for pair in ("target<-draft", "retrieval:64<-draft@streaming:4x28"):
    assert 0.0 < got[pair]["alpha"] < 0.99
    assert len(got[pair]["profile"]) == 8 and sum(got[pair]["greedy_profile"]) <= 1.0
    assert got[pair]["greedy_profile"][0] == got[pair]["greedy"]


def test_ngram_proposals_are_the_engines():
  from hitree_jax.decode.drafters import NGramDrafter
  rng = np.random.default_rng(0)
  history = rng.integers(0, 5, 60)                     # a small vocabulary: many repeats
  width = 64
  seq = np.zeros((len(history) - 1, width), np.int32)
  for row, end in enumerate(range(1, len(history))):
    seq[row, :end] = history[:end]
  inputs = types.SimpleNamespace(seq=jax.numpy.asarray(seq), end=jax.numpy.arange(1, len(history)))
  for shortest in (1, 2):
    got = profile.ngram_proposals(history, 1, 3, shortest)
    proposal = NGramDrafter(3, min_ngram=shortest).propose(None, shapes.chain(1), inputs)
    engine = np.where(np.asarray(proposal.offered) > 0, np.asarray(proposal.tokens[:, 0]), -1)
    np.testing.assert_array_equal(got[:-1], engine)   # the last: after all of history
    assert len(got) == len(history) and (got == -1).any() and (got >= 0).any()
    # How many it offers, on a chain long enough for any match (at most 2**3).
    counts = profile.ngram_offers(history, 1, 3, shortest)
    offered = NGramDrafter(3, min_ngram=shortest).propose(None, shapes.chain(8), inputs).offered
    np.testing.assert_array_equal(counts[:-1], np.asarray(offered))
    assert counts.max() == 8 and (counts == 0).any() and len(set(counts.tolist())) > 3


def test_prompt_lookups_acceptance_compares_its_proposal_with_the_targets_for_the_same_token(tiny_pair):
  """Row k of every level is its guess after continuation[k]. On the target's own greedy text,
  prompt lookup's measured greedy acceptance is how often its proposal after continuation[:k+1]
  is continuation[k+1], counted here by hand; on a copy of a random prompt, the token after the
  copied one, not the copied one itself."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  target, _ = tiny_pair
  prompt = list(np.tile(np.arange(3, 19), 8))                     # a repeating prompt: lookups hit
  text = engine.generate(target.params, target.config, [prompt], max_new_tokens=49,
                         stop_at_eos=False).tokens[0]           # greedy: row k's argmax is text[k + 1]
  continuation = text[:48]
  record = profile.pair_acceptance(target, None, typed([("target", "ngram:3")]), prompt, continuation,
                                   SamplingParams.create())["target<-ngram:3"]
  proposals = [profile.ngram_proposals(prompt + text[:k + 1], len(prompt) + k + 1, 3)[0] for k in range(48)]
  aligned = np.mean([proposals[k] == text[k + 1] for k in range(48)])
  assert aligned > 0.2 and record["greedy"] == pytest.approx(aligned)
  assert record["offered"] == pytest.approx(np.mean([p >= 0 for p in proposals])) and record["offered"] > 0
  counts = [profile.ngram_offers(prompt + text[:k + 1], len(prompt) + k + 1, 3)[0] for k in range(48)]
  law = np.bincount(counts, minlength=profile.MAX_OFFERED + 1) / 48
  np.testing.assert_allclose(record["offered_counts"], law)
  assert record["offered_counts"][0] == pytest.approx(1 - record["offered"])
  # A continuation that copies a random prompt: once its last 3 tokens are copied ones, after
  # continuation[k] the lookup proposes continuation[k + 1], the token the verifier's row k predicts.
  prompt = list(np.random.default_rng(0).integers(3, 64, 160))
  copy = prompt[40:88]
  _, ranked = profile._ngram_probs(spec_lib.NGram(3), prompt, copy, 64)
  assert ranked[2:-1, 0].tolist() == copy[3:] != copy[2:-1]   # not the token one early


@pytest.mark.parametrize("size", [2, 4])
def test_prompt_lookups_replayed_rounds_are_the_engines_greedy(tiny_pair, size):
  """Greedy, prompt lookup's rounds replayed over the target's own text are the engine's: as many
  rounds as it runs target forwards, as many accepting at least d tokens at each depth d. The
  replay counts a round only where its chain lies within the continuation: over M + size - 2
  tokens, every round the engine runs for M new tokens."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.decode.drafters import NGramDrafter
  target, _ = tiny_pair
  prompt, new = list(np.tile(np.arange(3, 19), 8)) + [5, 9], 40
  text = engine.generate(target.params, target.config, [prompt], max_new_tokens=new + size,
                         stop_at_eos=False).tokens[0]
  run = engine.generate(target.params, target.config, [prompt], max_new_tokens=new, stop_at_eos=False,
                        drafter=NGramDrafter(3), tree=shapes.chain(size))
  assert run.tokens[0] == text[:new]
  record = profile.pair_acceptance(target, None, typed([("target", "ngram:3")]), prompt, text[:new + size - 2],
                                   SamplingParams.create(), chains=(size,))["target<-ngram:3"]
  rounds = np.asarray(record["rounds"][str(size)])
  assert rounds.sum() == run.target_forwards and 1 < run.target_forwards < new - 1
  at_least = [rounds[:, d:].sum() for d in range(1, size + 1)]
  assert at_least == list(run.accepted_per_depth)


def test_acceptance_over_a_generations_own_cache_of_the_prompt_is_the_same(tiny_pair):
  """A profile reads the target's cache of each prompt from the generation of its continuation
  (engine.generate's keep_long_caches) instead of prefilling it again: decoding wrote past the
  prompt, and every pair's acceptance is as over a fresh prefill."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  target, draft = tiny_pair
  prompt = list(np.arange(300) * 7 % 64)
  run = engine.generate(target.params, target.config, [prompt], max_new_tokens=24, stop_at_eos=False,
                        keep_long_caches=True)
  pairs = typed([("target", "draft"), ("target", "self:1"), ("target", "retrieval:64"), ("target", "ngram:3"),
                 ("retrieval:64", "draft@streaming:4x28")])
  kept = run.long_caches[0]
  assert int(kept.lengths[0]) > len(prompt)                       # decoding wrote past the prompt
  fresh, shared = (profile.pair_acceptance(target, draft, pairs, prompt, run.tokens[0], SamplingParams.create(),
                                           chains=(2,), target_cache=cache) for cache in (None, kept))
  assert fresh.keys() == shared.keys()
  for pair in fresh:
    assert fresh[pair].keys() == shared[pair].keys()
    np.testing.assert_allclose(jax.tree.leaves(shared[pair]), jax.tree.leaves(fresh[pair]), atol=1e-5, err_msg=pair)


def test_acceptance_over_several_samples_of_a_prompt_reads_its_caches_once(tiny_pair):
  """A sampled profile's samples of one prompt (engine.generate_samples, one prefill) share every
  level's cache of it (pair_acceptances): each sample's record is pair_acceptance's over a fresh
  prefill."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  target, draft = tiny_pair
  sampling = SamplingParams.create(0.9, 0.95)
  prompt = list(np.arange(300) * 7 % 64)
  runs = engine.generate_samples(target.params, target.config, [prompt], seeds=[0, 1], max_new_tokens=24,
                                 sampling=sampling, stop_at_eos=False, keep_long_caches=True)
  samples = [run.tokens[0] for run in runs]
  assert samples[0] != samples[1]
  pairs = typed([("target", "draft"), ("target", "retrieval:64"), ("target", "ngram:3"),
                 ("retrieval:64", "draft@streaming:4x28")])
  shared = profile.pair_acceptances(target, draft, pairs, prompt, samples, sampling, chains=(2,),
                                    target_cache=runs[-1].long_caches[0])
  for record, sample in zip(shared, samples):
    fresh = profile.pair_acceptance(target, draft, pairs, prompt, sample, sampling, chains=(2,))
    assert record.keys() == fresh.keys()
    for pair in fresh:
      np.testing.assert_allclose(jax.tree.leaves(record[pair]), jax.tree.leaves(fresh[pair]), atol=1e-5, err_msg=pair)
  assert shared[0] != shared[1]


def test_a_sampled_profile_takes_nine_samples_of_the_text_each_prompt_prefilled_once(tmp_path, monkeypatch,
                                                                                      tiny_pair):
  """Greedy, a profile takes acceptance over one continuation of each passage; sampled, over at
  least auto.SAMPLED_CONTINUATIONS, each passage's samples distinct (at 7,680 tokens, over
  auto.FEW_SAMPLES). Every continuation's acceptance reads the target's cache of its passage from
  the generation (one per passage)."""
  from hitree_jax import tokenizer
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  target, draft = tiny_pair
  target = types.SimpleNamespace(**vars(target), path="tiny")   # the tokenizer's folder: read by no one here
  passages = [list(np.arange(60) * k % 61 + 2) for k in (3, 5, 7)]
  monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
  monkeypatch.setattr(auto, "measured_prompts", lambda tokenizer, text, context: passages)
  seen = {}

  def measure(target, draft, prompts, continuations, sampling, *args, target_caches=None, **kwargs):
    seen.update(prompts=prompts, continuations=continuations, caches=target_caches)
    return synthetic_profile(512)
  monkeypatch.setattr(auto, "measure", measure)
  sampled = SamplingParams.create(0.9, 0.95)
  for sampling, context, count in ((SamplingParams.create(), 512, 3), (sampled, 512, auto.SAMPLED_CONTINUATIONS),
                                   (sampled, 7680, 6)):   # three passages here: two of each
    auto.profiled("smollm2", "drafts/smollm2-draft.gguf", context, sampling, tmp_path, loaded=(target, draft))
    prompts, continuations, caches = seen["prompts"], seen["continuations"], seen["caches"]
    assert len(prompts) == len(continuations) == len(caches) == count
    for passage in passages:
      rows = [i for i, p in enumerate(prompts) if p == passage]
      assert len(rows) == count // 3 and len({id(caches[i]) for i in rows}) == 1
      assert len({tuple(continuations[i]) for i in rows}) == len(rows)     # distinct samples
      assert all(int(caches[i].lengths[0]) >= len(passage) for i in rows)
  assert [auto.sampled_continuations(c) for c in auto.CONTEXTS] == [9, 9, 9, 9, 9, auto.FEW_SAMPLES]


def test_a_replay_under_sampling_accepts_each_offered_token_with_its_probability():
  """Under sampling a round accepts its i-th offered token with the verifier's probability of it:
  a text that repeats its prompt, each token taken with probability a, replays as a chain of
  independent positions at acceptance a, rounds starting wherever the last one left off."""
  a, size, vocab = 0.6, 3, 32
  prompt = list(np.tile(np.arange(8), 6))
  text = list(np.tile(np.arange(8), 40))
  continuation = text[:200]
  probs = np.full((200, vocab), (1 - a) / (vocab - 1))
  probs[np.arange(200), text[1:201]] = a                 # row j: the token after continuation[j]
  rounds = np.asarray(profile.ngram_rounds(spec_lib.NGram(3), prompt, continuation, probs, (size,))[str(size)])
  assert rounds[:size].sum() == 0                               # it always offers the whole chain
  law = rounds[size] / rounds.sum()
  np.testing.assert_allclose(law, latency.chain_law(size, a), atol=1e-6)   # float32 probabilities
  assert rounds.sum() == pytest.approx(197 / latency.expected(latency.tree_yield(shapes.chain(size), [a]), float),
                                       rel=0.02)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_plan_is_the_fastest_stack_of_its_space_and_runs_as_flags(greedy):
  from hitree_jax.planner import auto
  from hitree_jax.methods import Knobs, parse_method
  profile = synthetic_profile()
  choice = auto.choose(profile, greedy)
  # At 512 tokens no retrieval budget of 512 or more is a candidate (it would hold it all).
  assert not {"retrieval:512", "retrieval:1024"} & {level.name for level in choice.levels.levels}
  best = optimize.brute_force(auto.candidates(profile, greedy), max_middles=2, fixed_buffers=True)
  assert choice.best_stack.seconds_per_token <= best.seconds_per_token * (1 + 1e-9)
  assert choice.predicted_tokens_per_s == pytest.approx(
      1 / auto.predict(profile, greedy, choice.levels).seconds_per_token)
  assert choice.predicted_tokens_per_s > choice.ar_tokens_per_s == 20.0
  flags = choice.flags("drafts/smollm2-draft.gguf")
  method = parse_method("hsd", Knobs(draft=flags["draft"], levels=flags["levels"],
                                     acceptance=flags.get("acceptance")), greedy)
  assert str(method.levels).split("+")[1:] == str(choice.levels).split("+")[1:]


def test_an_eagle_draft_is_planned_only_under_the_targets_weights_and_runs_as_flags():
  from hitree_jax.planner import auto
  from hitree_jax.methods import Knobs, parse_method
  space = auto.Space().with_eagle()
  pairs = by_name(space.pairs())
  assert ("target", "eagle") in pairs and ("retrieval:256", "eagle") in pairs
  assert not any(p == "eagle" and v.startswith("draft") for v, p in pairs)
  profile = synthetic_profile(space=space)
  assert auto.EAGLE in [d.name for d in auto.candidates(profile, True).drafters]  # from the profile alone
  choice = auto.choose(profile, True)
  best = optimize.brute_force(auto.candidates(profile, True), max_middles=2, fixed_buffers=True)
  assert choice.best_stack.seconds_per_token <= best.seconds_per_token * (1 + 1e-9)
  assert choice.levels.drafter.kind == "eagle"  # the cheapest and best drafter here
  assert not any(m.kind == "draft" for m, _ in choice.best_stack.middles)
  with pytest.raises(ValueError, match="drafts with an EAGLE draft"):
    choice.flags("drafts/smollm2-draft.gguf")
  flags = choice.flags("drafts/smollm2-draft.gguf", "drafts/smollm2-eagle")
  assert flags["levels"].startswith("eagle:drafts/smollm2-eagle/")
  method = parse_method("hsd", Knobs(draft=flags["draft"], levels=flags["levels"],
                                     acceptance=flags.get("acceptance")), True)
  assert str(method.heads) == "eagle:drafts/smollm2-eagle"
  named = auto.in_profile_names(method.levels, "drafts/smollm2-draft.gguf", "drafts/smollm2-eagle")
  assert named == choice.levels
  assert auto.predict(profile, True, named).seconds_per_token == pytest.approx(
      1 / choice.predicted_tokens_per_s)


def test_a_retrieval_level_drafts_where_it_is_cheap_and_only_for_a_dearer_level():
  """TriForce's two levels, the target over a retrieval cache drafting for the target, are in the
  space: where that level costs a fraction of the target's forward over the whole context (an
  accelerator at long context) and the small drafts are poor, the plan drafts with it, and its
  flags build that stack. It proposes to no cheaper level, and no pair is measured twice."""
  from hitree_jax.cache.kinds import Retrieval
  from hitree_jax.planner import auto
  from hitree_jax.methods import Knobs, parse_method
  space = auto.Space().for_context(2048)
  pairs = by_name(space.pairs())
  assert ("target", "retrieval:1024") in pairs and ("retrieval:1024", "retrieval:256") in pairs
  assert len(pairs) == len(set(pairs))
  for verifier, proposer in pairs:
    if proposer.startswith("retrieval:"):
      assert verifier == "target" or int(verifier.split(":")[1]) > int(proposer.split(":")[1])
  profile = synthetic_profile(2048)
  profile["costs"]["target"] = {w: 8 * s for w, s in profile["costs"]["target"].items()}
  profile["ar_seconds"] = 1.1 * profile["costs"]["target"]["1"]   # `ar` is a step of that target
  for pair, record in profile["acceptance"].items():
    if not pair.split("<-")[1].startswith("retrieval:"):
      ranks = [0.05] + [0.01] * 7
      record.update(alpha=0.05, greedy=0.05, profile=ranks, greedy_profile=ranks)
  choice = auto.choose(profile, True)
  best = optimize.brute_force(auto.candidates(profile, True), max_middles=2, fixed_buffers=True)
  assert choice.best_stack.seconds_per_token <= best.seconds_per_token * (1 + 1e-9)
  assert choice.best_stack.drafter.retrieval is not None, choice.levels
  flags = choice.flags("drafts/smollm2-draft.gguf")
  stack = parse_method("hsd", Knobs(draft=flags["draft"], levels=flags["levels"],
                                    acceptance=flags.get("acceptance")), True).build(
      ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=4096))
  assert stack.drafter.weights == "target" and isinstance(stack.drafter.cache, Retrieval)
  assert stack.drafter.cache.budget == choice.best_stack.drafter.budget


def test_plain_decoding_is_chosen_when_no_stack_beats_it():
  from hitree_jax.planner import auto
  profile = dict(synthetic_profile(), ar_seconds=0.005)
  choice = auto.choose(profile, True)
  assert choice.levels is None and choice.flags("d.gguf") == {"method": "ar"}
  assert choice.predicted_tokens_per_s == 200.0 > 1 / choice.best_stack.exact.seconds_per_token
  # A stack must be predicted min_gain faster than ar: within the model's error, ar stays.
  close = dict(synthetic_profile(), ar_seconds=1.1 * auto.choose(synthetic_profile(), True).best_stack.exact.seconds_per_token)
  assert auto.choose(close, True, min_gain=0.0).levels is not None
  assert auto.choose(close, True, min_gain=0.2).levels is None


def _with_continuations(profile: dict, scales: list[float], tokens: list[int]) -> dict:
  """`profile` with a record per continuation (auto.measure's `per_continuation`): continuation i's
  acceptance is the profile's, each rate scaled by scales[i] (at most 0.99)."""
  each = []
  for scale, n in zip(scales, tokens):
    acceptance = copy.deepcopy(profile["acceptance"])
    for record in acceptance.values():
      for name in ("alpha", "greedy"):
        record[name] = min(0.99, record[name] * scale)
      for name in ("profile", "greedy_profile"):   # rank 0 scaled, the rest within what it leaves
        first, rest = record[name][0], record[name][1:]
        record[name] = [min(0.99, first * scale), *(r * (1 - min(0.99, first * scale)) / (1 - first) for r in rest)]
    each.append({"tokens": n, "acceptance": acceptance})
  return dict(profile, per_continuation=each)


def test_a_batch_ends_with_its_slowest_row():
  """A row commits its own tokens at its own rate, and a batch runs until its slowest row has its
  tokens (tests/test_hierarchy.py's ragged batch). So at B rows a stack's seconds per token grow by
  the expected rounds of the slowest of B rows over those of the mean row, read from the
  profile's continuations (auto.for_the_batch): nothing at one row or where the continuations
  accept alike, more at 16 rows than at 4; `ar` commits a token a step and grows only where the
  answers' lengths differ (chat). A stack predicted 15% over `ar` from the mean alone loses to it."""
  from hitree_jax.planner import auto
  levels = "draft/chain:4"
  mean = synthetic_profile(512)
  alike, spread = _with_continuations(mean, [1.0, 1.0], [128, 128]), _with_continuations(mean, [1.25, 0.6], [128, 128])
  seconds = lambda profile, batch: auto.predict(dict(profile, batch=batch), True, levels).seconds_per_token
  plain = auto.predict(mean, True, levels).seconds_per_token
  assert seconds(spread, 1) == seconds(alike, 16) == seconds(mean, 16) == plain
  rounds = [128 / auto.predict(dict(mean, acceptance=c["acceptance"]), True, levels).tokens_per_target_forward
            for c in spread["per_continuation"]]
  assert rounds[1] > 1.2 * rounds[0]
  for batch in (4, 16):
    assert seconds(spread, batch) == pytest.approx(plain * latency.slowest_of(batch, rounds) / np.mean(rounds))
  assert plain < seconds(spread, 4) < seconds(spread, 16)
  # ar: a step a token, whatever the rows accept; answers of 64 and 192 tokens make a slowest row.
  ar = lambda profile: auto.choose(dict(profile, batch=4), True).ar_tokens_per_s
  assert ar(spread) == pytest.approx(1 / mean["ar_seconds"])
  chat = _with_continuations(mean, [1.0, 1.0], [64, 192])
  assert ar(chat) == pytest.approx(1 / (mean["ar_seconds"] * latency.slowest_of(4, [64, 192]) / 128))
  # The mean predicts the fastest stack 15% over ar; its slowest row of four does not pay.
  best = auto.choose(mean, True).best_stack
  close = lambda profile: dict(profile, batch=4, ar_seconds=1.15 * best.exact.seconds_per_token)
  assert auto.choose(close(alike), True).levels == auto.levels_of(best)
  choice = auto.choose(close(spread), True)
  assert choice.levels is None and choice.best_stack.exact.seconds_per_token > 1.15 * best.exact.seconds_per_token / 1.1


def test_a_batch_ranks_the_stacks_by_their_slowest_row():
  """The search ranks stacks by the mean row; a batch ranks its finalists again by their slowest
  row (auto._fastest_for_the_batch). Here prompt lookup's chain of 2 is fastest for the mean row,
  but its continuations' acceptance spreads, and at 16 rows another stack is faster charged: the
  batch's plan is the fastest of every finalist charged, faster than the mean's winner charged."""
  from hitree_jax.planner import auto
  spread = _with_continuations(synthetic_profile(512), [1.25, 0.6], [128, 128])
  mean_winner = optimize.optimize(auto.candidates(spread, True))
  assert auto.choose(spread, True).best_stack.describe() == mean_winner.describe()   # one row
  batch = dict(spread, batch=16)
  charged = {plan.describe(): auto.predict(batch, True, auto.levels_of(plan)).seconds_per_token
             for plan in optimize.finalists(auto.candidates(batch, True))}
  chosen = auto.choose(batch, True, min_gain=-1.0).best_stack
  assert chosen.describe() != mean_winner.describe()
  assert chosen.exact.seconds_per_token == pytest.approx(min(charged.values()))
  assert chosen.exact.seconds_per_token < 0.97 * charged[mean_winner.describe()]


def _plant(directory, profile, batch, sampling, draft="drafts/smollm2-draft.gguf"):
  """Stores `profile` where auto.plan_for looks for SmolLM2 + its draft at 512 tokens and `batch`."""
  from hitree_jax.planner import auto
  path, key = auto.where_kept("smollm2", draft, 512, sampling, directory, batch=batch)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"key": key, "profile": dict(profile, **({"batch": batch} if batch > 1 else {}))}))
  return path


def _must_not_measure(monkeypatch):
  from hitree_jax.planner import auto
  def fail(*args, **kwargs):
    raise AssertionError("a planted profile was measured again")
  monkeypatch.setattr(auto, "measure", fail)
  monkeypatch.setattr(auto, "measure_costs", fail)


def test_a_batch_is_planned_from_the_profile_measured_at_that_batch(tmp_path, monkeypatch):
  """At batch 4 a round's forward of w tokens is w x 4 tokens: here every forward is bound by its
  arithmetic (its cost w times a token's, as on a small CPU), so no stack pays, though one does at
  batch 1. plan_for reads the profile of the nearest batch size (its own file and key), never
  batch 1's scaled."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy = SamplingParams.create()
  single = synthetic_profile(512)
  batched = synthetic_profile(512)
  batched["costs"] = {name: {w: curve["1"] * int(w) for w in curve} for name, curve in batched["costs"].items()}
  batched["ar_seconds"] = batched["costs"]["target"]["1"]
  paths = {b: _plant(tmp_path, profile, b, greedy) for b, profile in ((1, single), (4, batched))}
  assert paths[1].name == "ctx512-austen-greedy.json" and paths[4].name == "ctx512-austen-greedy-batch4.json"
  _must_not_measure(monkeypatch)
  plan = lambda batch: auto.plan_for("smollm2", "drafts/smollm2-draft.gguf", 500, greedy, tmp_path, batch=batch)
  choice, profile, path = plan(1)
  assert path == paths[1] and choice.levels is not None
  for batch in (3, 4, 5):   # the nearest profiled size by ratio
    choice, profile, path = plan(batch)
    assert path == paths[4] and profile["batch"] == 4 and choice.levels is None
    assert choice.predicted_tokens_per_s == pytest.approx(1 / batched["ar_seconds"])
  assert [auto.nearest_batch(b) for b in (1, 2, 3, 6, 12, 100)] == [1, 2, 4, 8, 16, 64]
  with pytest.raises(ValueError, match="a batch of 0 rows"):
    auto.nearest_batch(0)


def test_a_batch_profile_takes_batch_1s_acceptance_and_names_its_own_timings(tmp_path, monkeypatch):
  """A batch's profile is batch 1's acceptance (each continuation's too) with timings of its own:
  where it fitted its overheads itself, it does not carry batch 1's record of where those came
  from (a profile whose overheads are borrowed lends none, and --full_profile measures it again)."""
  from hitree_jax import loading
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy, draft = SamplingParams.create(), "drafts/smollm2-draft.gguf"
  single = _with_continuations(dict(synthetic_profile(512), overheads_from="overheads.json, shipped"),
                               [1.0, 0.8], [128, 128])
  _plant(tmp_path, single, 1, greedy)
  monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: types.SimpleNamespace(path="smollm2"))
  monkeypatch.setattr(auto, "measured_prompts", lambda tokenizer, text, context: [[1] * 512])
  monkeypatch.setattr("hitree_jax.tokenizer.load_tokenizer", lambda path: None)
  own = {"costs": synthetic_profile(512)["costs"], "ar_seconds": 0.03,
         "overheads": {"draft_forward": 0.001, "verify": 0.004, "tree": 0.002}}
  monkeypatch.setattr(auto, "measure_costs", lambda *args, rows, **kwargs: dict(own, ar_seconds=0.01 * rows))
  batched, _ = auto.profiled("smollm2", draft, 512, greedy, tmp_path, batch=4)
  assert batched["batch"] == 4 and batched["ar_seconds"] == 0.04 and batched["overheads"] == own["overheads"]
  assert "overheads_from" not in batched
  assert batched["acceptance"] == single["acceptance"] and batched["per_continuation"] == single["per_continuation"]


def test_launch_plan_prints_a_plan_per_cell_of_its_grid(tmp_path):
  """launch.plan --prompt_tokens=... --batch_sizes=...: one row per cell, each from its own
  (planted) profile; --out and --predict, which are one plan's, are refused with a grid."""
  import os
  import subprocess
  import sys
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  from tests.helpers import REPO
  greedy = SamplingParams.create()
  single = synthetic_profile(512)
  batched = dict(single, ar_seconds=0.001)   # nothing beats so fast a step
  for batch, planted in ((1, single), (4, batched)):
    _plant(tmp_path, planted, batch, greedy)
  run = lambda *args: subprocess.run([sys.executable, "-m", "launch.plan", "--draft=drafts/smollm2-draft.gguf",
                                      f"--profile_dir={tmp_path}", *args], cwd=REPO, capture_output=True,
                                     text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  proc = run("--prompt_tokens=500", "--batch_sizes=1,4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| 512 |")]
  expected = auto.choose(single, True)
  assert [(r[1], r[2]) for r in rows] == [("1", f"`hsd/{expected.levels}`"), ("4", "`ar`")]
  assert rows[1][3] == rows[1][4] == "1000.0"
  for extra, refusal in (([f"--out={tmp_path / 'p.py'}"], "writes one plan"),
                         (["--predict=draft/chain:2"], "--predict applies to one plan")):
    proc = run("--prompt_tokens=500,2048", "--batch_sizes=1", *extra)
    assert proc.returncode == 2 and refusal in proc.stderr, proc.stderr[-2000:]
  proc = run("--batch_sizes=4,0")
  assert proc.returncode == 2 and "--batch_sizes=4,0: give at least one, each at least 1" in proc.stderr


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_auto_chooses_ar_when_no_drafter_is_ever_accepted(tmp_path, monkeypatch, batch):
  """A planted profile where every pair's acceptance is zero, at each batch size, greedy and
  sampled: no stack commits more than one token per target forward, each pays its drafts and a
  wider verify, so even with no margin (min_gain 0) `ar` is chosen."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  planted = synthetic_profile(512)
  planted["costs"] = {name: {w: s * (1 + 0.3 * (batch - 1) * int(w) / 16) for w, s in curve.items()}
                      for name, curve in planted["costs"].items()}
  planted["ar_seconds"] = planted["costs"]["target"]["1"]   # a step of the target at this batch
  for record in planted["acceptance"].values():
    record.update(alpha=0.0, greedy=0.0, profile=[0.0] * 8, greedy_profile=[0.0] * 8)
  _must_not_measure(monkeypatch)
  for sampling in (SamplingParams.create(), SamplingParams.create(0.6, 0.9)):
    _plant(tmp_path, planted, batch, sampling)
    choice, profile, _ = auto.plan_for("smollm2", "drafts/smollm2-draft.gguf", 512, sampling, tmp_path,
                                       batch=batch, min_gain=0.0)
    assert profile.get("batch", 1) == batch
    assert choice.levels is None and choice.flags("d.gguf") == {"method": "ar"}
    assert choice.best_stack.exact.tokens_per_target_forward == pytest.approx(1.0)


def test_a_new_context_takes_a_rounds_overheads_from_a_stored_profile(tmp_path, monkeypatch):
  """The overheads fitted at 512 tokens serve a profile at 2,048 of the same models, machine,
  sampling, precision and batch (and any text), nearest context first; not another sampling's or
  batch's, not overheads that were themselves borrowed, not a torn file. A stored profile with
  borrowed overheads is kept, unless full=True, which measures it again."""
  from hitree_jax import loading
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy, sampled = SamplingParams.create(), SamplingParams.create(0.6, 0.9)
  draft = "drafts/smollm2-draft.gguf"
  fitted = dict(synthetic_profile(512), overheads={"draft_forward": 0.001, "verify": 0.003, "tree": 0.004})
  source = _plant(tmp_path, fitted, 1, greedy)
  borrowed_path, borrowed_key = auto.where_kept("smollm2", draft, 1024, greedy, tmp_path)   # nearer 2,048
  borrowed_path.write_text(json.dumps({"key": borrowed_key, "profile": dict(
      synthetic_profile(1024), overheads={"draft_forward": 9.0, "verify": 9.0, "tree": 9.0}, overheads_from="x")}))
  (source.parent / "ctx4096-austen-greedy.json").write_text('{"key": {"context": 40')   # torn
  for text in ("austen", "chat"):
    path, key = auto.where_kept("smollm2", draft, 2048, greedy, tmp_path, text)
    assert auto.stored_overheads(path, key) == {"fields": fitted["overheads"], "from": str(source)}
  monkeypatch.setattr(auto, "SHIPPED_OVERHEADS", "none shipped.json")
  for kwargs in (dict(sampling=sampled), dict(sampling=greedy, batch=4)):
    assert auto.stored_overheads(*auto.where_kept("smollm2", draft, 2048, directory=tmp_path, **kwargs)) is None

  def measuring(*args, **kwargs):
    raise RuntimeError("measuring")
  monkeypatch.setattr(loading, "load_model", measuring)
  kept, _ = auto.profiled("smollm2", draft, 1024, greedy, tmp_path)
  assert kept["overheads_from"] == "x"
  with pytest.raises(RuntimeError, match="measuring"):
    auto.profiled("smollm2", draft, 1024, greedy, tmp_path, full=True)


def test_a_plan_under_the_target_steps_aside_at_its_break_even():
  """A plan whose drafter sits right under the target carries the accepted tokens per round under
  which its round loses to a resting one: for a draft model (which catches up a chunk of the
  tokens it missed resting in one forward), its round over a one-token forward and a share of that one; for the target's
  own layers (idle while resting), over `ar`'s step (at least MIN_BELOW). The launchers get it as
  step_aside; prompt lookup right under the target has none."""
  from hitree_jax.planner import auto, optimize
  profile = synthetic_profile(512)
  cost = lambda name, w: profile["costs"][name]["1"] * (1 + 0.08 * (w - 1))   # synthetic_profile's curve
  over = profile["overheads"]
  draft = auto.choose(profile, True, auto.Space(drafters=("draft",), middles=(), chains=(2,), trees=()))
  assert str(draft.levels) == "draft/chain:2"
  from hitree_jax.decode.step_aside import CATCH_UP_CHUNK
  # the draft's first forward runs its lead: the root and a slot for a leaf the target accepted
  proposal = cost("draft", 2) + cost("draft", 1) + 2 * over["draft_forward"]
  caught_up = cost("draft", CATCH_UP_CHUNK) / CATCH_UP_CHUNK
  below = (proposal + cost("target", 3) + over["verify"]) / (caught_up + cost("target", 1) + over["verify"]) - 1
  assert draft.step_aside == pytest.approx(below) and 0.05 < below < 0.5
  assert draft.flags("d.gguf")["step_aside"] == f"{below:.3g}:16:16"
  own = auto.choose(dict(profile, ar_seconds=0.0295), True,
                    auto.Space(drafters=("self:8",), middles=(), chains=(1,), trees=()), min_gain=0.0)
  assert str(own.levels) == "self:8/chain:1"
  assert own.step_aside == pytest.approx(
      (cost("self:8", 1) + over["draft_forward"] + cost("target", 2) + over["verify"]) / 0.0295 - 1)
  lookup = auto.choose(profile, True, auto.Space(drafters=("ngram:3",), middles=(), chains=(3,), trees=()))
  assert str(lookup.levels) == "ngram:3/chain:3" and lookup.step_aside is None
  assert "step_aside" not in lookup.flags("d.gguf")
  # A hierarchy: its top round (the buffer's fill and the target's forward over it) over a resting
  # one, in which the target runs a one-token forward and the middle level a share of the
  # forward in which it catches up a chunk of tokens.
  c = auto.candidates(profile, True)
  deep = optimize.Plan(auto.level_named("ngram:3"), spec_lib.Chain(2), ((auto.level_named("draft"), 3),), 0.01)
  top_round = optimize.exact(c, deep).round_seconds
  assert top_round > cost("target", 4)
  assert auto.step_aside_below(c, deep, 0.02) == pytest.approx(
      top_round / (cost("draft", CATCH_UP_CHUNK) / CATCH_UP_CHUNK + cost("target", 1) + over["verify"]) - 1)
  from hitree_jax.methods import Knobs, parse_method
  below = f"{auto.step_aside_below(c, deep, 0.02):.3g}"
  method = parse_method("hsd", Knobs(draft="drafts/smollm2-draft.gguf", levels=str(auto.levels_of(deep)),
                                     step_aside=below), True)
  assert method.step_aside.below == float(below) and "+" in str(method.levels)   # the launchers take it
  assert auto.choose(dict(profile, ar_seconds=0.001), True).flags("d.gguf") == {"method": "ar"}


def test_a_first_profile_of_the_shipped_models_takes_their_shipped_overheads(tmp_path, monkeypatch):
  """With no profile of these models kept, a round's overheads come from the fit shipped for their
  contents, sampling and batch, named with the machine it was fitted on; a kept profile's own fit
  comes first; none is shipped for another batch or sampling."""
  from hitree_jax import shipped
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy, sampled, other = SamplingParams.create(), SamplingParams.create(0.6, 0.9), SamplingParams.create(0.8)
  draft = "drafts/smollm2-draft.gguf"
  path, key = auto.where_kept("smollm2", draft, 2048, greedy, tmp_path)
  fits = [{"key": auto.shipped_key(auto.where_kept("smollm2", draft, 512, sampling)[1]), "overheads": overheads,
           "measured": {"cpu": "a CPU", "jax": "0.1"}}
          for sampling, overheads in ((greedy, {"verify": 1.0}), (sampled, {"verify": 2.0}))]
  (tmp_path / "drafts").mkdir()
  (tmp_path / "drafts" / "overheads.json").write_text(json.dumps({"fits": fits}))
  monkeypatch.setattr(shipped, "file", lambda folder, name: tmp_path / folder / name)
  source = "overheads.json, shipped: fitted on a CPU with jax 0.1"
  assert auto.stored_overheads(path, key) == {"fields": {"verify": 1.0}, "from": source}
  assert auto.stored_overheads(*auto.where_kept("smollm2", draft, 128, sampled, tmp_path, "chat"))["fields"] == {
      "verify": 2.0}
  for kwargs in (dict(sampling=other), dict(sampling=greedy, batch=4)):
    assert auto.stored_overheads(*auto.where_kept("smollm2", draft, 2048, directory=tmp_path, **kwargs)) is None
  kept = _plant(tmp_path, dict(synthetic_profile(512), overheads={"verify": 3.0}), 1, greedy)
  assert auto.stored_overheads(path, key) == {"fields": {"verify": 3.0}, "from": str(kept)}


def test_a_full_profile_is_measured_again_unless_one_was_kept(tmp_path, monkeypatch):
  """full=True (launch.plan --full_profile) measures again a kept profile timed at the quick widths;
  one kept with every width of FULL_WIDTHS and its own fit serves both."""
  from hitree_jax import loading
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy = SamplingParams.create()

  def measuring(*args, **kwargs):
    raise RuntimeError("measuring")
  monkeypatch.setattr(loading, "load_model", measuring)
  _plant(tmp_path, synthetic_profile(512), 1, greedy)
  assert auto.profiled("smollm2", "drafts/smollm2-draft.gguf", 512, greedy, tmp_path)[0]["costs"]["target"].keys() == {
      "1", "4", "16"}
  with pytest.raises(RuntimeError, match="measuring"):
    auto.profiled("smollm2", "drafts/smollm2-draft.gguf", 512, greedy, tmp_path, full=True)
  _plant(tmp_path, synthetic_profile(512, auto.Space(widths=auto.FULL_WIDTHS)), 1, greedy)
  for full in (True, False):
    kept, _ = auto.profiled("smollm2", "drafts/smollm2-draft.gguf", 512, greedy, tmp_path, full=full)
    assert kept["costs"]["target"].keys() == {"1", "2", "4", "8", "16"}


@pytest.mark.parametrize("draft", ["smollm2-draft", "smollm2-draft-chat"])
def test_the_shipped_drafts_have_their_overheads_shipped(draft):
  """drafts/overheads.json holds a fit for SmolLM2 with each shipped draft as they are now (their
  contents), greedy and at T 0.6 / top-p 0.9: a retrained draft fails here until
  docs/results/planner/shipped_overheads.py fits it again."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  for sampling in (SamplingParams.create(), SamplingParams.create(0.6, 0.9)):
    fit = auto.shipped_overheads(auto.where_kept("smollm2", draft, 512, sampling)[1])
    assert fit is not None and set(fit["fields"]) == {"draft_forward", "verify", "tree", "middle"}
    assert all(0 <= seconds < 0.05 for seconds in fit["fields"].values()), fit


def test_ar_is_read_from_the_continuations_but_their_first():
  """A profile's `ar` seconds per token are the continuations' decoding after the first run's
  (which pays the loop's first execution), each row's first token being the prefill's; answers
  that decoded nothing leave it to be timed."""
  from hitree_jax.decode.result import GenerationResult
  from hitree_jax.planner import auto
  run = lambda tokens, seconds: GenerationResult([list(range(tokens))], 0.1, seconds, 0.0, 0)
  assert auto.ar_from([run(65, 9.0), run(65, 2.0), run(33, 1.2)]) == pytest.approx(3.2 / 96)
  assert auto.ar_from([run(65, 2.0)]) == pytest.approx(2.0 / 64)
  assert auto.ar_from([run(5, 1.0), run(1, 0.0)]) is None


@pytest.mark.slow
def test_borrowed_overheads_are_not_fitted_again(tiny_pair, monkeypatch):
  """measure_costs given another profile's overheads times the forwards and `ar`, not the six
  generations of the fit, and records where the overheads came from."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  target, draft = tiny_pair
  def fit(*args, **kwargs):
    raise AssertionError("borrowed overheads were fitted again")
  monkeypatch.setattr(profile, "round_overheads", fit)
  space = auto.Space(drafters=("draft",), middles=(), chains=(1,), trees=(), gammas=(), widths=(1, 2))
  borrowed = {"draft_forward": 0.001, "verify": 0.002, "tree": 0.003}
  got = auto.measure_costs(target, draft, list(np.arange(40) * 7 % 64), SamplingParams.create(), space, repeats=2,
                           overheads={"fields": borrowed, "from": "elsewhere.json"})
  assert got["overheads"] == borrowed and got["overheads_from"] == "elsewhere.json"
  assert set(got["costs"]) == {"draft", "target"} and got["ar_seconds"] > 0


@pytest.mark.slow
def test_a_batchs_timings_are_measured_at_that_batch(tiny_pair, monkeypatch):
  """measure_costs at 3 rows times every forward, generation and `ar` step with 3 rows (not one
  row's scaled): the forwards' tokens are [3, w], every generation decodes 3 prompts."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  target, draft = tiny_pair
  rows_seen, real_timed, real_generate = set(), profile.timed_forward, engine.generate

  def timed(config):
    run = real_timed(config)
    seen = lambda params, tokens, long: (rows_seen.add(("forward", tokens.shape[0])), run(params, tokens, long))[1]
    seen.compiling = run.compiling   # compiled before it is timed (programs.compile_together)
    return seen

  def generate(params, config, prompts, **kwargs):
    rows_seen.add(("generate", len(prompts)))
    return real_generate(params, config, prompts, **kwargs)

  monkeypatch.setattr(profile, "timed_forward", timed)
  monkeypatch.setattr(engine, "generate", generate)
  space = auto.Space(drafters=("ngram:3", "draft"), middles=("draft@streaming:16x234", "retrieval:256"),
                     chains=(1, 3), trees=("kary:2x2",), gammas=(2, 4), widths=(1, 4))
  got = auto.measure_costs(target, draft, list(np.arange(300) * 7 % 64), SamplingParams.create(), space,
                           repeats=2, rows=3)
  assert rows_seen == {("forward", 3), ("generate", 3)}
  assert set(got["costs"]) == {"draft", "draft@streaming:16x234", "retrieval:256", "target"}
  assert got["ar_seconds"] > 0 and set(got["overheads"]) == {"draft_forward", "verify", "tree", "middle"}


def test_a_sequoia_plan_carries_the_profile_its_tree_came_from():
  from hitree_jax.planner import auto
  from hitree_jax.methods import Knobs, parse_method
  space = auto.Space(drafters=("draft",), middles=(), chains=(), trees=("sequoia:16,5",))
  profile = synthetic_profile(space=space)
  choice = auto.choose(profile, True, space)
  assert str(choice.levels) == "draft/sequoia:16,5" and choice.acceptance is not None
  flags = choice.flags("drafts/smollm2-draft.gguf")
  method = parse_method("hsd", Knobs(draft=flags["draft"], levels=flags["levels"], acceptance=flags["acceptance"]))
  planned = auto.candidates(profile, True, space).drafters[0].trees[0][1]
  assert method.tree.parents == planned.parents


def test_predictions_name_what_the_profile_lacks():
  from hitree_jax.planner import auto
  profile = synthetic_profile()
  assert auto.predict(profile, True, "draft/chain:2").tokens_per_target_forward > 1
  assert auto.predict(profile, True, "draft/kary:3x3").tokens_per_target_forward > 1   # any tree
  with pytest.raises(ValueError, match="no drafter 'eagle'"):
    auto.predict(profile, True, "eagle/chain:2")
  with pytest.raises(ValueError, match="no middle level"):
    auto.predict(profile, True, "draft/chain:1+retrieval:4096/6")
  assert (str(auto.in_profile_names("drafts/smollm2-draft.gguf@streaming:16x234/chain:1+retrieval:512/6",
                                    "drafts/smollm2-draft.gguf"))
          == "draft@streaming:16x234/chain:1+retrieval:512/6")


@pytest.mark.slow
def test_measure_and_choose_on_tiny_models_and_the_plan_is_exact(tiny_pair):
  """The whole planner on tiny models: a profile measured (costs, acceptance with an n-gram,
  overheads fitted to generations, ar), a plan chosen from it, and its greedy tokens = ar's."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  from hitree_jax.methods import Knobs, parse_method
  target, draft = tiny_pair
  space = auto.Space(drafters=("ngram:3", "draft"), middles=("draft@streaming:16x234", "retrieval:256"),
                     chains=(1, 3), trees=("kary:2x2",), gammas=(2, 4), widths=(1, 4))
  prompt = list(np.arange(300) * 7 % 64)
  continuation = engine.generate(target.params, target.config, [prompt], max_new_tokens=16,
                                 stop_at_eos=False).tokens[0]
  second = list(np.arange(300) * 5 % 64)
  profile = auto.measure(target, draft, [prompt, second], [continuation, continuation[::-1]],
                         SamplingParams.create(), space, repeats=2)
  assert profile["passages"] == 2
  assert set(profile["costs"]) == {"draft", "draft@streaming:16x234", "retrieval:256", "target"}
  assert set(profile["overheads"]) == {"draft_forward", "verify", "tree", "middle"}
  # each continuation's own acceptance, whose mean is the profile's (for a batch's slowest row)
  each = profile["per_continuation"]
  assert [c["tokens"] for c in each] == [len(continuation)] * 2 and each[0]["acceptance"] != each[1]["acceptance"]
  for pair, record in profile["acceptance"].items():
    assert record["alpha"] == pytest.approx((each[0]["acceptance"][pair]["alpha"] + each[1]["acceptance"][pair]["alpha"]) / 2)
  ngram = profile["acceptance"]["target<-ngram:3"]
  assert ngram["profile"][1:] == [0.0] * 7 and 0.0 <= ngram["alpha"] <= 1.0
  profile = json.loads(json.dumps(profile))     # as stored
  assert profile["ar_seconds"] > 0
  choice = auto.choose(profile, True, space)   # random tiny models: ar may well win; run the best stack
  method = parse_method("hsd", Knobs(draft="drafts/smollm2-draft.gguf",
                                     levels=str(auto.levels_of(choice.best_stack))), True)
  stack = method.build(target.config, draft.config, None)
  got = engine.generate(target.params, target.config, [prompt], max_new_tokens=24, stack=stack,
                        draft=DraftWeights.create(draft.params), stop_at_eos=False).tokens[0]
  ar = engine.generate(target.params, target.config, [prompt], max_new_tokens=24, stop_at_eos=False).tokens[0]
  assert got == ar


@pytest.mark.slow
def test_plan_writes_a_config_that_generate_runs_and_auto_plans_the_same(tmp_path):
  """launch.plan and --method=auto from stored profiles (made up here: measuring SmolLM2's takes
  minutes), on the real SmolLM2 with its draft and its EAGLE draft: the config runs, auto picks
  the same stack, and both generate ar's greedy tokens. (The draft alone: the plan's config is
  checked by test_auto_with_bfloat16_keys_plans_from_their_own_profile, whose `auto` decodes ar's
  tokens; the draft's own round here was three launcher runs more, half of this test's time.)"""
  import os
  import subprocess
  import sys
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.loading import resolve
  from hitree_jax.planner import auto
  from tests.helpers import REPO
  draft, eagle = "drafts/smollm2-draft.gguf", "drafts/smollm2-eagle"
  model_path, draft_path = str(resolve("smollm2")), str(resolve(draft))
  eagle_path = str((pathlib.Path(REPO) / eagle).resolve())
  greedy = SamplingParams.create()
  env = real_model_environ({**os.environ, "HITREE_PROFILES": str(tmp_path)})
  run = lambda module, *args: subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=REPO,
                                             capture_output=True, text=True, timeout=600, env=env)
  common = ["--text=austen", "--prompt_tokens=500", "--max_new_tokens=12", "--ignore_eos", "--json"]
  ar = run("generate", *common)
  assert ar.returncode == 0, ar.stderr[-3000:]
  ar_tokens = json.loads(ar.stdout.strip().splitlines()[-1])["tokens"]
  space = auto.Space().with_eagle()
  stored = auto.profile_path(tmp_path, model_path, draft_path, 512, greedy, eagle=eagle_path)
  stored.parent.mkdir(parents=True)
  key = auto.profile_key(model_path, draft_path, 512, greedy, "austen", eagle_path)
  stored.write_text(json.dumps({"key": key, "profile": synthetic_profile(512, space)}))
  expected = auto.choose(synthetic_profile(512, space), True)
  assert expected.levels.drafter.kind == "eagle"
  out = tmp_path / "plan.py"
  plan = run("plan", f"--draft={draft}", f"--feature_draft=eagle:{eagle}", "--prompt_tokens=500", f"--out={out}",
             "--predict=draft/chain:2")
  assert plan.returncode == 0, plan.stderr[-3000:]
  assert f"chosen: hsd/{expected.levels}: {expected.predicted_tokens_per_s:.1f} tok/s" in plan.stdout
  assert "hsd/draft/chain:2: " in plan.stdout
  assert json.loads(out.with_suffix(".json").read_text())["flags"]["levels"] == expected.flags(draft, eagle)["levels"]
  records = {}
  for name, args in [("config", [f"--config={out}"]),
                     ("auto", ["--method=auto", f"--draft={draft}", f"--feature_draft=eagle:{eagle}"])]:
    proc = run("generate", *args, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records[name] = json.loads(proc.stdout.strip().splitlines()[-1])
  assert records["auto"]["method"] == f"auto={records['config']['method']}"
  assert records["config"]["method"].endswith(planned_label(expected, draft, eagle))
  assert records["config"]["tokens"] == records["auto"]["tokens"] == ar_tokens


def test_a_profile_is_kept_per_precision_of_the_target():
  """Costs and acceptance depend on the target's dtype and key dtype: each precision has its own
  file and key, float32's unchanged (profiles stored before stay valid); a loaded target of
  another precision than asked is refused before anything is measured."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  greedy = SamplingParams.create()
  where = ("dir", "models/smollm2.gguf", "drafts/smollm2-draft.gguf", 512, greedy)
  assert auto.precision() == auto.precision("float32", "float32") == {}
  keys, weights = auto.precision("float32", "bfloat16"), auto.precision("bfloat16")
  assert keys == {"dtype": "float32", "key_dtype": "bfloat16"}
  assert weights == auto.precision("bfloat16", "bfloat16") == {"dtype": "bfloat16", "key_dtype": None}
  paths = [auto.profile_path(*where, target_precision=p) for p in (None, keys, weights)]
  assert paths[0].name == "ctx512-austen-greedy.json" and len(set(paths)) == 3
  key = lambda p: auto.profile_key(*where[1:], "austen", target_precision=p)
  assert "key_dtype" not in key(None) and key(keys)["key_dtype"] == "bfloat16" != key(weights)["key_dtype"]
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=1024, key_dtype="bfloat16")
  target = types.SimpleNamespace(config=config)
  with pytest.raises(ValueError, match="keys in bfloat16, not the profile's float32 and float32"):
    auto.profiled("smollm2", "drafts/smollm2-draft.gguf", 512, greedy, "dir", loaded=(target, None))


@pytest.mark.slow
def test_auto_with_bfloat16_keys_plans_from_their_own_profile(tmp_path):
  """launch.plan --key_dtype=bfloat16 and `auto` with --key_dtype=bfloat16 (launch.benchmark's,
  which plans as generate's does) read the profile stored for bfloat16 keys (made up here; the
  float32 one is absent, so reading any other would start measuring), the plan's config carries
  the key dtype, and auto's stack generates what ar with bfloat16 keys does."""
  import os
  import subprocess
  import sys
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.loading import resolve
  from hitree_jax.planner import auto
  from tests.helpers import REPO
  draft = "drafts/smollm2-draft.gguf"
  model_path, draft_path = str(resolve("smollm2")), str(resolve(draft))
  keys = auto.precision("float32", "bfloat16")
  greedy = SamplingParams.create()
  stored = auto.profile_path(tmp_path, model_path, draft_path, 512, greedy, target_precision=keys)
  stored.parent.mkdir(parents=True)
  key = auto.profile_key(model_path, draft_path, 512, greedy, "austen", target_precision=keys)
  stored.write_text(json.dumps({"key": key, "profile": synthetic_profile(512)}))
  expected = auto.choose(synthetic_profile(512), True)
  env = real_model_environ({**os.environ, "HITREE_PROFILES": str(tmp_path)})
  run = lambda module, *args: subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=REPO,
                                             capture_output=True, text=True, timeout=600, env=env)
  out = tmp_path / "plan.py"
  plan = run("plan", f"--draft={draft}", "--key_dtype=bfloat16", "--prompt_tokens=500", f"--out={out}")
  assert plan.returncode == 0, plan.stderr[-3000:]
  assert f"profile: {stored}" in plan.stdout and "with keys in bfloat16" in out.read_text()
  assert json.loads(out.with_suffix(".json").read_text())["flags"] == {**expected.flags(draft), **keys}
  # ar and auto in one benchmark, which compares their greedy tokens (and exits 1 if they part)
  bench = tmp_path / "bench.json"
  proc = run("benchmark", "--methods=ar,auto", f"--draft={draft}", "--key_dtype=bfloat16", "--text=austen",
             "--prompt_tokens=500", "--max_new_tokens=12", "--n_prompts=1", "--time_levels=false", f"--out={bench}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "profiling" not in proc.stderr
  record = json.loads(bench.read_text())
  assert record["key_dtype"] == "bfloat16"
  (planned,) = [r for r in record["results"] if r["method"] != "ar"]
  assert planned["method"].endswith(planned_label(expected, draft)) and planned["differs_from_ar"] == []


def test_break_even_is_where_a_middle_level_starts_to_pay():
  from hitree_jax.planner import auto
  profile = synthetic_profile(1024)
  needed = auto.break_even(profile, True, "retrieval:256")
  assert needed is not None and 0.0 < needed < 1.0

  def tops_with(a):
    changed = json.loads(json.dumps(profile))
    changed["acceptance"]["target<-retrieval:256"].update(greedy=a, greedy_profile=[a] + [0.0] * 7)
    plan = auto.choose(changed, True).best_stack
    return bool(plan.middles) and str(plan.middles[-1][0]) == "retrieval:256"

  assert tops_with(min(1.0, needed + 0.02)) and not tops_with(needed - 0.02)
  assert auto.break_even(dict(profile, costs={**profile["costs"], "retrieval:256": profile["costs"]["target"]}),
                         True, "retrieval:256") is None   # as dear as the target: never pays


@pytest.fixture(scope="module")
def eagle_trio():
  """A one-layer tiny target (with its decode head), a random draft model, and EAGLE layers that
  copy the target's (feature_weight 0: the target itself) or also read the features (2.0)."""
  from tests.helpers import HEADS_CONFIG, eagle_draft, target_params
  params = target_params(HEADS_CONFIG)
  target = types.SimpleNamespace(config=HEADS_CONFIG, params=params, vocab=None)
  draft = types.SimpleNamespace(config=HEADS_CONFIG, params=init_params(HEADS_CONFIG, jax.random.key(7)), vocab=None)
  eagles = {}
  for weight in (0.0, 2.0):
    drafter, weights = eagle_draft(params, HEADS_CONFIG, weight)
    eagles[weight] = types.SimpleNamespace(config=drafter.config, params=weights.params, vocab=None, taps=())
  return target, draft, eagles


@pytest.mark.slow
def test_an_eagle_drafts_acceptance_reads_its_verifiers_features(eagle_trio):
  """Against the EAGLE layer run offline over the whole sequence with the target's true features."""
  import jax.numpy as jnp
  from hitree_jax.cache.full import KVCache, causal_attend
  from hitree_jax.decode.sampling import SamplingParams, probabilities
  from hitree_jax.heads import eagle
  from hitree_jax.model.llama import forward
  target, draft, eagles = eagle_trio
  prompt, continuation = [int(x) for x in np.arange(40) * 7 % 53], [int(x) for x in np.arange(20) * 5 % 53]
  sampling = SamplingParams.create(0.8)
  pairs = [("target", "eagle"), ("retrieval:256", "eagle")]
  copy = profile.pair_acceptance(target, draft, typed(pairs), prompt, continuation, sampling, eagles[0.0])
  for pair in ("target<-eagle", "retrieval:256<-eagle"):   # 256 slots hold the whole context
    assert copy[pair]["alpha"] == pytest.approx(1.0, abs=1e-5) and copy[pair]["greedy"] == 1.0
  got = profile.pair_acceptance(target, draft, typed(pairs), prompt, continuation, sampling, eagles[2.0])
  sequence = jnp.asarray([prompt + continuation])
  t, p = sequence.shape[1], len(prompt)
  attend = causal_attend(jnp.zeros((1,), jnp.int32), t, t)
  logits, true, _ = forward(target.params, target.config, sequence, jnp.arange(t)[None],
                            KVCache.init(target.config, 1, t), attend)
  e = eagles[2.0]
  predicted, _ = eagle.features(e.params, e.config, target.params["embed_tokens"]["embedding"], sequence,
                                eagle.shifted(true), jnp.arange(t)[None], KVCache.init(e.config, 1, t), attend)
  q = probabilities(eagle.logits(e.params, predicted, False)[0, p:], sampling)
  expected = float(jnp.sum(jnp.minimum(probabilities(logits[0, p:], sampling), q), axis=-1).mean())
  assert 0.05 < expected < 0.95  # a draft that depends on the features, right some of the time
  assert got["target<-eagle"]["alpha"] == pytest.approx(expected, abs=1e-4)
  assert got["retrieval:256<-eagle"]["alpha"] == pytest.approx(expected, abs=1e-4)
  # As a deeper node it reads the feature it predicted the position before: training's second pass.
  from hitree_jax.train.heads import two_passes
  _, again = two_passes(e.params, e.config, target.params["embed_tokens"]["embedding"], sequence, true)
  p_dist = probabilities(logits[0, p:], sampling)
  accept = jnp.sum(jnp.minimum(p_dist, q), axis=-1)
  deep = jnp.sum(jnp.minimum(p_dist, probabilities(eagle.logits(e.params, again, False)[0, p:], sampling)), -1)
  ratio = float(jnp.sum(accept[:-1] * deep[1:]) / jnp.sum(accept[:-1]) / accept.mean())
  assert ratio != pytest.approx(1.0, abs=0.01)  # it does read them
  assert got["target<-eagle"]["deeper"] == pytest.approx(ratio, rel=1e-3)
  assert copy["target<-eagle"]["deeper"] == pytest.approx(1.0, abs=1e-4)
  assert copy["target<-eagle"]["greedy_deeper"] == 1.0


def test_an_eagle3_drafts_acceptance_reads_its_verifiers_tapped_layers():
  """As above, for a draft that reads the fusion of the target's tapped layers and final states."""
  import jax.numpy as jnp
  from hitree_jax.cache.full import KVCache, causal_attend
  from hitree_jax.decode.sampling import SamplingParams, probabilities
  from hitree_jax.heads import eagle
  from hitree_jax.model.llama import forward
  from tests.helpers import TAPPED, TAPS, eagle3_draft, target_params
  params = target_params(TAPPED, seed=1)
  target = types.SimpleNamespace(config=TAPPED, params=params, vocab=None)
  drafter, weights = eagle3_draft(params, TAPPED, TAPS)
  e = types.SimpleNamespace(config=drafter.config, params=weights.params, vocab=None, taps=TAPS)
  prompt, continuation = [int(x) for x in np.arange(40) * 7 % 53], [int(x) for x in np.arange(20) * 5 % 53]
  sampling = SamplingParams.create(0.8)
  got = profile.pair_acceptance(target, None, typed([("target", "eagle"), ("retrieval:256", "eagle")]), prompt,
                                continuation, sampling, e)
  sequence = jnp.asarray([prompt + continuation])
  t, p = sequence.shape[1], len(prompt)
  attend = causal_attend(jnp.zeros((1,), jnp.int32), t, t)
  logits, true, _ = forward(params, TAPPED, sequence, jnp.arange(t)[None], KVCache.init(TAPPED, 1, t), attend,
                            taps=TAPS)
  predicted, _ = eagle.features(e.params, e.config, params["embed_tokens"]["embedding"], sequence,
                                eagle.shifted(eagle.fuse(e.params, true)), jnp.arange(t)[None],
                                KVCache.init(e.config, 1, t), attend)
  q = probabilities(eagle.logits(e.params, predicted, False)[0, p:], sampling)
  expected = float(jnp.sum(jnp.minimum(probabilities(logits[0, p:], sampling), q), axis=-1).mean())
  assert 0.01 < expected < 0.95   # its random fusion is a poor guess, but not a null one
  assert got["target<-eagle"]["alpha"] == pytest.approx(expected, abs=1e-5)
  assert got["retrieval:256<-eagle"]["alpha"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_measure_with_an_eagle_draft_and_its_plan_is_exact(tmp_path, eagle_trio):
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  from hitree_jax.heads import saved
  from hitree_jax.methods import Knobs, parse_method
  target, draft, eagles = eagle_trio
  space = auto.Space(drafters=("draft",), middles=("retrieval:64",), chains=(1, 2), trees=("kary:2x2",),
                     gammas=(2,), widths=(1, 4))
  prompt = [int(x) for x in np.arange(120) * 7 % 53]
  continuation = engine.generate(target.params, target.config, [prompt], max_new_tokens=12,
                                 stop_at_eos=False).tokens[0]
  measured = auto.measure(target, draft, [prompt], [continuation], SamplingParams.create(), space,
                          repeats=2, eagle=eagles[2.0])
  assert set(measured["costs"]) == {"draft", "eagle", "retrieval:64", "target"}
  assert {"target<-eagle", "retrieval:64<-eagle"} <= set(measured["acceptance"])
  assert "draft<-eagle" not in measured["acceptance"]
  measured = json.loads(json.dumps(measured))
  folder = tmp_path / "eagle"
  saved.save(folder, "eagle", eagles[2.0].params, target.config, None, {})
  for levels in ("eagle/chain:2", "eagle/kary:2x2+retrieval:64/2"):
    assert auto.predict(measured, True, levels, space=space).seconds_per_token > 0
    choice = auto.Choice(None, spec_lib.parse(levels), None, 1.0, 1.0)
    flags = choice.flags("drafts/smollm2-draft.gguf", str(folder))
    method = parse_method("hsd", Knobs(draft=flags["draft"], levels=flags["levels"]), True)
    method = method.load_draft(target.config, target.params)
    got = method.generate(target.params, target.config, [prompt], max_new_tokens=16, stop_at_eos=False)
    ar = engine.generate(target.params, target.config, [prompt], max_new_tokens=16, stop_at_eos=False)
    assert got.tokens == ar.tokens


@pytest.mark.parametrize("spec,options", [
    ("hitree", dict(budget=256)), ("triforce", dict(budget=256)), ("sd", dict(gamma=12)),
    ("tree", dict(tree="kary:2x2")), ("hitree", {})])
def test_a_preset_slower_than_the_plan_is_named_in_one_line(tmp_path, monkeypatch, spec, options):
  """generate's note for a typed preset: from a stored profile (nothing measured), a preset
  predicted below 90% of the planner's choice is named with both speeds; a preset the profile
  cannot predict (retrieval:1024 at 512 tokens holds everything) gets the paper-shape line on a
  CPU only."""
  from hitree_jax import methods
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.planner import auto
  monkeypatch.setenv("HITREE_PROFILES", str(tmp_path))
  draft, sampling, profile = "drafts/smollm2-draft.gguf", SamplingParams.create(), synthetic_profile(512)
  method = methods.method(spec, draft=draft, **options)
  assert methods.preset_advice(method, "smollm2", 512, sampling, on_cpu=False) is None  # no profile yet
  path, key = auto.where_kept("smollm2", draft, 512, sampling)
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps({"key": key, "profile": profile}))
  advice = methods.preset_advice(method, "smollm2", 600, sampling, on_cpu=True)  # 600: nearest is 512
  choice = auto.choose(profile, True)
  try:
    speed = 1 / auto.predict(profile, True, auto.in_profile_names(method.levels, draft), method.tree).seconds_per_token
  except ValueError:
    assert spec == "hitree" and "retrieval:1024" in str(method.levels)
    assert advice.startswith("--method=hitree keeps HiTree's shape from its paper")
    assert methods.preset_advice(method, "smollm2", 512, sampling, on_cpu=False) is None
    return
  if speed >= 0.9 * choice.predicted_tokens_per_s:
    assert advice is None
  else:
    assert advice == (f"--method={method.label} is predicted at {speed:.1f} tok/s here and `ar` at "
                      f"{choice.ar_tokens_per_s:.1f}; --method=auto would run hsd/{choice.levels} at "
                      f"{choice.predicted_tokens_per_s:.1f} (profile {path})")


def test_a_chat_profile_is_measured_on_instructions_in_the_chat_template():
  """auto plans a chat model's prompts (Spec-Bench, generate --text=chat) from a profile measured on
  what it answers: instructions over held-out book passages in the chat template, at the
  profile's context, and at a question's context, instructions with no passage; a book's
  profile on its passages."""
  from hitree_jax.loading import resolve
  from hitree_jax.planner import auto
  from hitree_jax.tokenizer import load_tokenizer
  from hitree_jax.train import corpus, instructions
  tokenizer = load_tokenizer(resolve("smollm2"))
  for context in (512, 128):
    chat = auto.measured_prompts(tokenizer, "chat", context)
    texts = [tokenizer.decode(prompt) for prompt in chat]
    assert all(text.endswith("<|im_start|>assistant\n") for text in texts)
    over_passages, open_ones = chat[:len(instructions.TASKS)], chat[len(instructions.TASKS):]
    assert [len(p) for p in over_passages] == [context] * len(instructions.TASKS)
    assert [[task in text for task in instructions.TASKS] for text in texts[:6]] == np.eye(6, dtype=bool).tolist()
    # the open instructions (no passage) join the profile their length is planned from: 128's
    assert [tokenizer.decode(p) for p in open_ones] == ([] if context == 512 else [
        tokenizer.decode(instructions.chat_prompt(tokenizer, text)) for text in instructions.OPEN_INSTRUCTIONS])
    assert all(auto.nearest_context(len(p)) == 128 for p in open_ones)
  assert auto.nearest_context(85) == 128   # Spec-Bench's median question
  held_out = corpus.split_texts("eval")
  passage = tokenizer.decode(chat[0]).split("\n\n", 2)[-1][:60]
  assert any(passage in text for text in held_out.values())
  books = auto.measured_prompts(tokenizer, "austen", 512)
  assert len(books) == auto.PASSAGES and "<|im_start|>" not in tokenizer.decode(books[0])
  long_books = auto.measured_prompts(tokenizer, "austen", auto.LONG_CONTEXT)
  assert len(long_books) == auto.LONG_PASSAGES < auto.PASSAGES
  assert all(len(p) == auto.LONG_CONTEXT for p in long_books) and long_books[0] != long_books[1]
