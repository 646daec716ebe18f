"""Stepping aside (decode/step_aside.py): a row whose drafter stops paying runs plain rounds,
exactly, switches after the rounds the rule states, and comes back."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax import methods
from hitree_jax.decode import engine
from hitree_jax.decode.drafters import DraftWeights, Drafter, ModelDrafter, NGramDrafter, SelfDrafter, _static_proposal
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.decode.step_aside import Resting, StepAside
from hitree_jax.cache.kinds import Full
from hitree_jax.errors import UsageError
from hitree_jax.tree import shapes as tree_lib
from tests.helpers import peaked, tiny_target
from tests.laws import N_SAMPLES, SMALL, chi_square_pvalue, exact_three_token_law

CONFIG = tiny_target()

PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7], [2, 4], [8, 1, 9, 30, 2]]
DEPTH = 3
DRAFTED = []   # one entry per round in which the Oracle drafter ran


@dataclasses.dataclass(frozen=True)
class Oracle(Drafter):
  """Proposes `ar`'s own continuation (every token accepted), except while a row's sequence
  ends in [bad_from, bad_until), where every token it proposes is wrong."""
  answers: tuple   # per row: prompt + ar's tokens
  bad_from: int = 0
  bad_until: int = 10 ** 6

  def check(self, tree, config):
    pass

  def propose(self, key, tree, inp):
    known = jnp.asarray(np.array([list(a) + [0] * (200 - len(a)) for a in self.answers], np.int32))
    at = jnp.minimum(inp.end[:, None] + jnp.arange(tree.size)[None, :], known.shape[1] - 1)
    tokens = jnp.take_along_axis(known, at, axis=1)
    bad = (inp.end >= self.bad_from) & (inp.end < self.bad_until)
    tokens = jnp.where(bad[:, None], (tokens + 1) % CONFIG.vocab_size, tokens)
    jax.debug.callback(lambda: DRAFTED.append(1))
    return _static_proposal(tree, tokens, None, inp)


@pytest.fixture(scope="module")
def params():
  return peaked(CONFIG, 0)


def ar(params, prompts, n):
  return engine.generate(params, CONFIG, prompts, max_new_tokens=n).tokens


def test_a_drafter_that_turns_bad_halfway_is_stepped_around_and_rejoined(params):
  """Good until a row's sequence reaches 20 tokens, wrong until 45, good again: the same tokens
  as `ar`; every row steps aside, comes back to probe, and speculates again once the drafter
  is good (it accepts most of the last stretch's tokens)."""
  n = 60
  expected = ar(params, PROMPTS, n)
  oracle = Oracle(tuple(tuple(p + t) for p, t in zip(PROMPTS, expected)), bad_from=20, bad_until=45)
  rule = StepAside(below=1.0, rounds=4)
  result = engine.generate(params, CONFIG, PROMPTS, stack=Stack(oracle, tree_lib.chain(DEPTH), step_aside=rule),
                           max_new_tokens=n)
  assert result.tokens == expected
  assert all(entries >= 2 for entries in result.stepped_aside_per_row)   # stepped aside, probed, again
  assert all(aside >= rule.rounds for aside in result.aside_per_row)
  # the tokens after the bad stretch came DEPTH + 1 per round again: few rounds for the row's last 25
  for prompt, rounds, aside in zip(PROMPTS, result.rounds_per_row, result.aside_per_row):
    good = (20 - len(prompt) - 1) + (len(prompt) + n - 45)   # tokens emitted while the drafter is good
    assert rounds - aside <= good / (DEPTH + 1) + 2 * rule.rounds + 25 / rule.rounds
  plain = engine.generate(params, CONFIG, PROMPTS, stack=Stack(oracle, tree_lib.chain(DEPTH)), max_new_tokens=n)
  assert plain.tokens == expected and result.aside_per_row is not None and plain.aside_per_row is None


@pytest.mark.parametrize("tree", [tree_lib.chain(DEPTH), tree_lib.kary(2, 2)], ids=["chain", "tree"])
def test_a_drafter_bad_from_the_start_steps_aside_after_the_rounds_the_rule_states(params, tree):
  """Every proposal wrong: a round emits one token. The first step aside comes after exactly
  rounds_to_switch() speculative rounds; then `rounds` plain ones, in which the drafter (which
  keeps nothing between rounds) does not run; then one probe round, which accepts nothing and
  steps aside again, for twice as long."""
  rule = StepAside(below=0.5, rounds=5)
  k = rule.rounds_to_switch()
  # the mean starts at twice the break-even and keeps 3/4 of itself per round that accepts nothing
  assert k == math.floor(math.log(0.5) / math.log(0.75)) + 1 == 3
  assert [rule.rests(f) for f in range(5)] == [5, 10, 20, 40, 40]
  for entries in (1, 3):   # the first token, k rounds, then each entry's plain rounds and the probes between
    aside = sum(rule.rests(f) for f in range(entries))
    n = 1 + k + aside + (entries - 1)
    expected = ar(params, PROMPTS, n)
    oracle = Oracle(tuple(tuple(p + t) for p, t in zip(PROMPTS, expected)))
    DRAFTED.clear()
    result = engine.generate(params, CONFIG, PROMPTS, stack=Stack(oracle, tree, step_aside=rule), max_new_tokens=n)
    assert result.tokens == expected
    assert len(DRAFTED) == k + entries - 1   # the speculative rounds alone (every row rests together)
    assert result.rounds_per_row == [n - 1] * 3   # one token per round
    assert result.stepped_aside_per_row == [entries] * 3
    assert result.aside_per_row == [aside] * 3


@pytest.mark.parametrize("rest", [3, 40], ids=["caught-up-at-the-probe", "caught-up-while-resting"])
def test_a_draft_model_falls_behind_while_its_rows_rest_and_catches_up(params, rest):
  """A draft model with a cache of its own, its rows resting: resting rounds do not run it, and
  it catches up on the tokens it missed, a chunk a forward, before the probe (a rest of 3) or
  while resting too (a rest of 40, longer than a chunk). The draft is the target itself, so a
  cache in step proposes the target's own tokens: every probe after a rest accepts all it
  offers, which it would not if the cache had missed a token. The rule rests after every round
  (its break-even is out of reach), so the rows alternate rests and probes; the tokens are
  `ar`'s."""
  n = 100
  expected = ar(params, PROMPTS, n)
  rule = StepAside(below=100.0, rounds=rest, memory=1)
  result = engine.generate(params, CONFIG, PROMPTS, stack=Stack(ModelDrafter(CONFIG), tree_lib.chain(DEPTH),
                                                                step_aside=rule),
                           draft=DraftWeights(params), max_new_tokens=n)
  assert result.tokens == expected
  assert all(entries >= 2 for entries in result.stepped_aside_per_row)      # rested, probed, rested again
  assert result.aside_per_row[0] == max(result.aside_per_row) > 0           # all rows rest together
  (level,) = result.levels
  assert level["accepted"] == level["proposed"] > 0                        # its cache saw every token


@pytest.mark.parametrize("rest", [3, 40], ids=["caught-up-at-the-probe", "caught-up-while-resting"])
def test_a_hierarchy_steps_aside_and_its_levels_below_catch_up(params, rest):
  """A hierarchy whose levels are all the target (a draft model and a middle level on the
  target's weights as the draft's): every buffer it hands up is `ar`'s. The rule rests after
  every round that speculates. Resting rounds run neither level below the target: they fall
  behind and catch up a chunk of tokens in one forward, before the probe (a rest of 3) or
  while resting too (a rest of 40, longer than a chunk). Every probe accepts all it is offered
  at each level, which it would not if a cache had missed a token."""
  from hitree_jax.decode.step_aside import CATCH_UP_CHUNK
  n = 100
  expected = ar(params, PROMPTS, n)
  rule = StepAside(below=100.0, rounds=rest, memory=1)
  stack = Stack(ModelDrafter(CONFIG), tree_lib.chain(2), (Verifier("draft", Full(), 3),), step_aside=rule)
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=DraftWeights(params), max_new_tokens=n)
  assert result.tokens == expected
  assert all(entries >= 2 for entries in result.stepped_aside_per_row)      # rested, probed, rested again
  assert result.aside_per_row[0] == max(result.aside_per_row) > (CATCH_UP_CHUNK if rest > CATCH_UP_CHUNK else 0)
  middle, top = result.levels
  assert middle["accepted"] == middle["proposed"] > 0 and top["accepted"] == top["proposed"] > 0
  # the middle level verified only in the rounds that speculated: a buffer of at least 3 takes
  # one round of the chain of 2 (3 tokens)
  speculative = [rounds - aside for rounds, aside in zip(result.rounds_per_row, result.aside_per_row)]
  assert middle["forwards"] == max(speculative) < top["forwards"]


@pytest.mark.parametrize("tree", [tree_lib.chain(DEPTH), tree_lib.kary(2, 2)], ids=["chain", "tree"])
def test_a_hierarchy_whose_buffers_do_not_pay_steps_aside(params, tree):
  """The Oracle under a middle level on another model's weights: the target accepts little of
  the middle level's buffers, its rows step aside and rest without filling a buffer (fewer of
  the middle level's rounds than without the rule), and the tokens are `ar`'s."""
  n = 48
  expected = ar(params, PROMPTS, n)
  oracle = Oracle(tuple(tuple(p + t) for p, t in zip(PROMPTS, expected)), bad_from=20, bad_until=45)
  rule = StepAside(below=1.0, rounds=4)
  other = CONFIG.replace(num_layers=1)
  stack = Stack(oracle, tree, (Verifier("draft", Full(), 3),), draft=other, step_aside=rule)
  DRAFTED.clear()
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=DraftWeights(peaked(other, 7)),
                           max_new_tokens=n)
  assert result.tokens == expected
  assert all(entries >= 1 for entries in result.stepped_aside_per_row)
  assert all(aside >= rule.rounds for aside in result.aside_per_row)
  plain = engine.generate(params, CONFIG, PROMPTS, stack=dataclasses.replace(stack, step_aside=None),
                          draft=DraftWeights(peaked(other, 7)), max_new_tokens=n)
  assert plain.tokens == expected
  # resting rounds run neither the middle level's rounds nor the drafter: fewer of both
  assert result.levels[0]["forwards"] < plain.levels[0]["forwards"]


def test_stepping_aside_is_refused_where_it_does_not_apply_and_named_when_bad():
  with pytest.raises(UsageError, match="a stack with a drafter"):
    Stack(step_aside=StepAside(0.5))
  with pytest.raises(UsageError, match="not to retrieval"):
    methods.method("retrieval/aside:0.5")
  assert methods.method("hsd/ngram:3/chain:2+drafts/smollm2-draft.gguf/3/aside:0.5").step_aside == StepAside(0.5)
  assert Stack(NGramDrafter(2), tree_lib.chain(2), (Verifier("target", Full(), 3),),
               step_aside=StepAside(0.5)).step_aside == StepAside(0.5)
  assert methods.method("hsd/ngram:3/chain:2/aside:0.5").step_aside == StepAside(0.5)
  for text, message in (("x", "expected BELOW"), ("0", "below=0.0 must be a positive"), ("1:0", "rounds=0"),
                        ("1:4:0", "memory=0")):
    with pytest.raises(UsageError, match=message):
      StepAside.parse(text)
  assert StepAside.parse("0.5:32") == StepAside(0.5, 32) and str(StepAside(0.5, 32)) == "0.5:32"
  assert StepAside.parse("0.5:16:16") == StepAside(0.5, 16, 16) and str(StepAside(0.5, 16, 16)) == "0.5:16:16"
  assert StepAside(0.5, memory=16).rounds_to_switch() == 11
  with pytest.raises(UsageError, match="expected BELOW"):
    StepAside.parse("0.5:16:16:1")


def test_a_round_that_offered_nothing_is_not_counted():
  """Prompt lookup offers nothing where no suffix matched: that round is a plain one already, so
  it neither lowers the row's mean nor sends it aside; a round that offered and accepted nothing
  does both."""
  rule = StepAside(below=1.0, memory=1)
  live = jnp.array([True, True])
  state = Resting.start(2, rule)
  entries = []
  for _ in range(3):
    state, entered = state.after(rule, jnp.array([0, 0]), live, offered=jnp.array([False, True]))
    entries.append(entered.tolist())
  assert entries == [[False, True], [False, False], [False, False]]   # row 1 then rests
  assert float(state.mean[0]) == 2 * rule.below and state.left.tolist() == [0, rule.rounds - 2]


@pytest.mark.slow
def test_sampling_with_rows_stepping_aside_is_exact():
  """A 1-layer self draft and a rule under which a round that accepts nothing sends the row
  aside for the next: the second round is plain in some rows and speculative in others, and the
  first three tokens follow the target's law."""
  params = jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, peaked(SMALL, 2))
  prompt = [1, 4, 2, 5, 1, 4]
  sampling = SamplingParams.create(1.0, 1.0)
  stack = Stack(SelfDrafter(1, "iid"), tree_lib.chain(2), step_aside=StepAside(below=1.0, rounds=1, memory=1))
  result = engine.generate(params, SMALL, [prompt] * N_SAMPLES, stack=stack, max_new_tokens=3, sampling=sampling,
                           seed=11, stop_at_eos=False)
  assert 0 < sum(result.aside_per_row) < sum(result.rounds_per_row)
  samples = np.array([t[:3] for t in result.tokens])
  assert chi_square_pvalue(samples, exact_three_token_law(params, prompt, sampling)) > 1e-4


@pytest.mark.slow
def test_sampling_while_a_draft_model_falls_behind_is_exact():
  """A draft model (another random model, drawing iid) under a rule that sends every row aside
  after each speculative round: the second round runs with every row resting, the draft not
  run, and the first three tokens still follow the target's law, as they do in rows whose
  first round emitted one token and whose third is the resting round's."""
  params = jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, peaked(SMALL, 2))
  draft_config = SMALL.replace(num_layers=1)
  prompt = [1, 4, 2, 5, 1, 4]
  sampling = SamplingParams.create(1.0, 1.0)
  stack = Stack(ModelDrafter(draft_config, "iid"), tree_lib.chain(2), step_aside=StepAside(below=100.0, rounds=1, memory=1))
  result = engine.generate(params, SMALL, [prompt] * N_SAMPLES, stack=stack, max_new_tokens=3, sampling=sampling,
                           seed=11, stop_at_eos=False, draft=DraftWeights(peaked(draft_config, 7)))
  assert any(len(t) == 3 and rounds == 2 and aside > 0
             for t, rounds, aside in zip(result.tokens, result.rounds_per_row, result.aside_per_row))
  samples = np.array([t[:3] for t in result.tokens])
  assert chi_square_pvalue(samples, exact_three_token_law(params, prompt, sampling)) > 1e-4


def test_sampling_while_a_hierarchy_rests_is_exact():
  """A hierarchy (a 1-layer draft model under a middle level on its weights, drawing iid) under
  a rule that sends every row aside after each speculative round: the second round runs with
  every row resting and the levels below falling behind, and the first three tokens still
  follow the target's law, in the rows whose third token is the resting round's too."""
  params = jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, peaked(SMALL, 2))
  draft_config = SMALL.replace(num_layers=1)
  prompt = [1, 4, 2, 5, 1, 4]
  sampling = SamplingParams.create(1.0, 1.0)
  stack = Stack(ModelDrafter(draft_config, "iid"), tree_lib.chain(2), (Verifier("draft", Full(), 2),),
                step_aside=StepAside(below=100.0, rounds=1, memory=1))
  result = engine.generate(params, SMALL, [prompt] * N_SAMPLES, stack=stack, max_new_tokens=3, sampling=sampling,
                           seed=11, stop_at_eos=False, draft=DraftWeights(peaked(draft_config, 7)))
  assert sum(aside > 0 and rounds == 2 for aside, rounds in zip(result.aside_per_row, result.rounds_per_row)) > 100
  samples = np.array([t[:3] for t in result.tokens])
  assert chi_square_pvalue(samples, exact_three_token_law(params, prompt, sampling)) > 1e-4
