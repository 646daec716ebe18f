"""Hierarchies (TriForce, HiTree, HSD) on tiny random models: greedy equals ar, sampling is exact
at every level, over several top rounds; a biased middle level is caught."""

import jax
import numpy as np
import pytest

from hitree_jax.decode import engine, loop, sizes
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode import verify as verify_lib
from hitree_jax.decode.drafters import DraftWeights, ModelDrafter, NGramDrafter, SelfDrafter
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.model.config import ModelConfig
from tests.helpers import peaked
from hitree_jax.tree import shapes as tree_lib
from tests.laws import chi_square_pvalue, exact_joint_law

CONFIG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None)
DRAFT = CONFIG.replace(num_layers=1)
# Ragged: the retrieval level keeps 16 of up to 50 slots, the streaming draft 4 + 8.
PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7, 2, 9, 4, 6, 1, 8, 3, 5, 7, 11], [2, 4], [8, 1, 9, 30, 2]]
RETRIEVAL = Verifier("target", Retrieval(16, chunk=4), gamma=4)

GREEDY_STACKS = {
    "triforce": Stack(ModelDrafter(DRAFT, cache=Streaming(4, 8)), tree_lib.chain(1),
                      (Verifier("target", Retrieval(16, 4), 6),)),
    "hitree-binary": Stack(ModelDrafter(DRAFT, cache=Streaming(4, 8)), tree_lib.kary(2, 2),
                           (RETRIEVAL,)),
    "hitree-ternary-iid": Stack(ModelDrafter(DRAFT, "iid", cache=Streaming(4, 8)), tree_lib.kary(3, 2),
                                (Verifier("target", Retrieval(16, 4), 12),)),
    "hitree-reindexed-sinks": Stack(ModelDrafter(DRAFT, cache=Streaming(2, 6, reindex=True)),
                                    tree_lib.kary(2, 2), (RETRIEVAL,)),
    "retrieval": Stack(ModelDrafter(CONFIG, cache=Retrieval(16, 4), weights="target"), tree_lib.chain(4)),
    "self-under-retrieval": Stack(SelfDrafter(1), tree_lib.kary(2, 2), (RETRIEVAL,)),
    "4-level": Stack(NGramDrafter(2), tree_lib.chain(2),
                     (Verifier("draft", Full(), 3), Verifier("target", Retrieval(16, 4), 5)), draft=DRAFT),
}


@pytest.fixture(scope="module")
def params():
  return peaked(CONFIG, 0)


@pytest.fixture(scope="module")
def draft():
  return DraftWeights.create(peaked(DRAFT, 1))


@pytest.fixture(scope="module")
def ar_tokens(params):
  return engine.generate(params, CONFIG, PROMPTS, max_new_tokens=30).tokens


# The fast tier (-m "not slow") keeps the stack the project is named for: a streaming draft's tree
# under a retrieval level.
@pytest.mark.parametrize("name", [n if n == "hitree-binary" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in GREEDY_STACKS])
def test_greedy_equals_ar(params, draft, ar_tokens, name):
  stack = GREEDY_STACKS[name]
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=draft, max_new_tokens=30)
  assert result.tokens == ar_tokens
  levels = result.levels
  assert [lv["level"] for lv in levels] == list(range(1, stack.num_levels))
  assert levels[-1]["name"] == "target" and levels[-1]["forwards"] == result.target_forwards
  for lv in levels:
    assert 0 <= lv["accepted"] <= lv["proposed"] and lv["forwards"] > 0
    assert lv["acceptance"] <= lv["alpha"] <= 1  # a round stops at its first rejection
  if stack.verifiers:
    # The middle level ran rounds of its own, more than the target's.
    assert levels[-2]["forwards"] > levels[-1]["forwards"]


ALONE_STACKS = {
    "ar": Stack(),
    "chain": Stack(NGramDrafter(2), tree_lib.chain(4)),
    "tree": Stack(SelfDrafter(1), tree_lib.kary(2, 2)),
    "hierarchy": GREEDY_STACKS["hitree-binary"],
}


@pytest.mark.parametrize("name", list(ALONE_STACKS))
def test_each_row_of_a_ragged_batch_is_what_its_prompt_gives_alone(params, draft, name):
  """Rows of 20, 2 and 5 prompt tokens decoded together: each row's tokens are those of its
  prompt decoded alone (greedy), for `ar`, a chain, a tree and a hierarchy. Under one drafter the
  batch takes the rounds its slowest row takes alone, as the planner charges a batch
  (auto.for_the_batch): the rows in front run on without committing."""
  stack = ALONE_STACKS[name]
  run = lambda prompts: engine.generate(params, CONFIG, prompts, stack=stack, draft=draft, max_new_tokens=30)
  together, alone = run(PROMPTS), [run([p]) for p in PROMPTS]
  assert together.tokens == [one.tokens[0] for one in alone]
  assert len(set(map(tuple, together.tokens))) == len(PROMPTS)   # three different answers, not one repeated
  if stack.drafter is not None and not stack.verifiers:
    forwards = [one.target_forwards for one in alone]
    assert together.target_forwards == max(forwards) and min(forwards) < max(forwards)


@pytest.mark.parametrize("name", ["ar", "chain", "hierarchy"])
def test_caches_sized_for_longer_prompts_give_the_same_tokens_from_one_program(params, draft, name):
  """size_caches_for: two batches whose own sizes fall in different cache buckets (a 300-token
  prompt, 5-token ones), both sized for 400-token prompts, decode what they decode sized for
  themselves, and the second compiles nothing; sized for themselves, it compiles."""
  from hitree_jax.errors import UsageError
  config = CONFIG.replace(max_position_embeddings=1024)
  long_prompt = list(np.random.default_rng(0).integers(1, config.vocab_size, 300))
  batches = ([PROMPTS[2], PROMPTS[2][::-1]], [long_prompt, PROMPTS[2]])
  run = lambda prompts, programs, **sized: engine.generate(params, config, prompts, stack=ALONE_STACKS[name],
                                                           draft=draft, max_new_tokens=30, programs=programs, **sized)
  own, sized = Programs(), Programs()
  for prompts in batches:
    mine, shared = run(prompts, own), run(prompts, sized, size_caches_for=400)
    assert shared.tokens == mine.tokens
  assert shared.compiles + shared.cache_loads == 0 < mine.compiles + mine.cache_loads
  with pytest.raises(UsageError, match="caches sized for 1000-token prompts: with max_new_tokens=30"):
    run(batches[0], sized, size_caches_for=1000)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["triforce", "self-under-retrieval", "4-level"])
def test_bfloat16_keys_keep_every_level_exact(params, draft, name):
  """The target's keys in bfloat16 (--key_dtype) make another target; each stack equals `ar`
  over that target, its retrieval, streaming and self levels reading the same bfloat16 keys."""
  config = CONFIG.replace(key_dtype="bfloat16")
  want = engine.generate(params, config, PROMPTS, max_new_tokens=30).tokens
  result = engine.generate(params, config, PROMPTS, stack=GREEDY_STACKS[name], draft=draft,
                           max_new_tokens=30)
  assert result.tokens == want


@pytest.mark.slow
@pytest.mark.parametrize("name", ["triforce", "4-level"])
def test_level_times_leave_the_output_alone(params, draft, ar_tokens, name):
  """time_levels times one round of each level alone before decoding: same tokens, and every
  level (the drafter's proposals included) gets a round time and a share of the decode time."""
  result = engine.generate(params, CONFIG, PROMPTS, stack=GREEDY_STACKS[name], draft=draft,
                           max_new_tokens=30, time_levels=True)
  assert result.tokens == ar_tokens
  for lv in result.levels:
    assert lv["round_ms"] > 0
    assert lv["time_share"] == pytest.approx(lv["forwards"] * lv["round_ms"] / 1e3 / result.decode_s)
  first = result.levels[0]
  assert first["proposer_round_ms"] > 0
  assert first["proposer_time_share"] == pytest.approx(
      first["forwards"] * first["proposer_round_ms"] / 1e3 / result.decode_s)
  assert "round_ms" not in engine.generate(params, CONFIG, PROMPTS, stack=GREEDY_STACKS[name],
                                           draft=draft, max_new_tokens=30).levels[0]


RESELECTING = {
    "middle": Stack(ModelDrafter(DRAFT, cache=Streaming(4, 8)), tree_lib.kary(2, 2),
                    (Verifier("target", Retrieval(16, 4, reselect=4), 6),)),
    "bottom": Stack(ModelDrafter(CONFIG, cache=Retrieval(16, 4, reselect=4), weights="target"),
                    tree_lib.chain(3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", list(RESELECTING))
def test_retrieval_reselection_keeps_greedy_exact(monkeypatch, params, draft, ar_tokens, where):
  """A retrieval level that chooses its chunks again every 4 committed tokens (each round its
  own block, so every block end may re-select) still gives ar's tokens."""
  monkeypatch.setattr(sizes.StackSizes, "recent_slots", property(lambda self: self.round_extent))
  result = engine.generate(params, CONFIG, PROMPTS, stack=RESELECTING[where], draft=draft,
                           max_new_tokens=30, programs=Programs())
  assert result.tokens == ar_tokens
  level = result.levels[0]
  times = level["reselections"] if where == "middle" else level["proposer_reselections"]
  # 29 tokens after the first: each row asks for a re-selection (of every row) at most once per 4.
  assert 2 <= times <= len(PROMPTS) * (29 // 4)
  assert "reselections" not in result.levels[-1]  # the target's full cache never re-selects


@pytest.mark.slow
def test_retrieval_level_with_the_whole_context_is_the_target(params):
  """A retrieval budget covering the context gives the target's own law, so with the target's
  weights it drafts exactly what the target samples: every proposal is accepted."""
  stack = Stack(ModelDrafter(CONFIG, "iid", cache=Retrieval(64, 4), weights="target"), tree_lib.chain(3))
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, max_new_tokens=24,
                           sampling=SamplingParams.create(1.0), seed=3)
  (target,) = result.levels
  assert target["accepted"] >= 0.99 * target["proposed"]


@pytest.mark.slow
def test_second_generation_compiles_nothing(params, draft):
  stack = GREEDY_STACKS["hitree-binary"]
  engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=draft, max_new_tokens=12)
  again = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=draft, max_new_tokens=12,
                          sampling=SamplingParams.create(0.7, top_p=0.9), seed=5)
  assert again.compiles == again.cache_loads == 0


@pytest.mark.parametrize("stack,message", [
    (Stack(SelfDrafter(1), tree_lib.chain(2), (Verifier("draft", Full(), 2),), draft=DRAFT),
     "the self:1 drafter reads the cache of the level above"),
    (Stack(ModelDrafter(DRAFT, cache=Retrieval(16, 4)), tree_lib.chain(2)), "retrieval cache"),
])
def test_bad_stacks_are_refused(params, draft, stack, message):
  with pytest.raises(ValueError, match=message):
    engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=draft, max_new_tokens=4)


@pytest.mark.parametrize("make,message", [
    (lambda: Stack(NGramDrafter(2), tree_lib.DynamicTree(4, 2, 2), (RETRIEVAL,)), "dynamic tree"),
    (lambda: Stack(NGramDrafter(2), tree_lib.chain(2), (Verifier("draft", Full(), 2),)),
     "draft's config"),
    (lambda: Verifier("target", Retrieval(12, 8), 2), "multiple of chunk"),
    (lambda: Verifier("target", Retrieval(16, 4), 0), "gamma=0"),
    (lambda: Verifier("draft", Retrieval(16, 4), 2), "retrieval cache"),
    (lambda: Stack(None, None, (RETRIEVAL,)), "name a drafter"),
    (lambda: Retrieval(16, 4, reselect=-1), "reselect=-1"),
])
def test_bad_specs_are_refused(make, message):
  with pytest.raises(ValueError, match=message):
    make()


# --- sampling: the joint law of the first N tokens, enumerated exactly -------------------------
# A 4-token vocabulary, a prompt longer than the retrieval budget (the middle level's law is
# not the target's), and a recent cache one round wide, so that every top round is its own
# block: the long caches (retrieval tail, streaming ring, full) are appended between rounds.

TINY = CONFIG.replace(vocab_size=4, max_position_embeddings=97)
TINY_DRAFT = TINY.replace(num_layers=1)
PROMPT = [1, 3, 2, 0, 1, 3, 3, 0, 2, 1]
N_ROWS = 8000
MIDDLE = Verifier("target", Retrieval(8, chunk=2), gamma=3)
EXACT_STACKS = {
    "3-level-chain-iid": (Stack(ModelDrafter(TINY_DRAFT, "iid", cache=Streaming(2, 4)), tree_lib.chain(2),
                                (MIDDLE,)), 1.0, 0, 6),
    "3-level-binary-wor-topk": (Stack(ModelDrafter(TINY_DRAFT, "without_replacement"),
                                      tree_lib.kary(2, 2), (MIDDLE,)), 0.8, 3, 6),
    "3-level-self-deterministic": (Stack(SelfDrafter(1), tree_lib.kary(2, 1), (MIDDLE,)), 1.0, 0, 5),
    "3-level-reselect": (Stack(ModelDrafter(TINY_DRAFT, "iid", cache=Streaming(2, 4)), tree_lib.chain(2),
                               (Verifier("target", Retrieval(8, 2, reselect=2), 3),)), 0.9, 0, 5),
    "4-level": (Stack(ModelDrafter(TINY_DRAFT, "iid", cache=Streaming(2, 4)), tree_lib.chain(1),
                      (Verifier("draft", Full(), 2), Verifier("target", Retrieval(8, 2), 4))), 0.9, 0, 5),
}


def sample_stack(monkeypatch, stack, temperature, top_k, n, seed=13):
  params, draft_params = peaked(TINY, 3), peaked(TINY_DRAFT, 4)
  monkeypatch.setattr(sizes.StackSizes, "recent_slots", property(lambda self: self.round_extent))
  monkeypatch.setattr(prefill_lib, "CACHE_BUCKET", 16)
  result = engine.generate(params, TINY, [PROMPT] * N_ROWS, stack=stack, max_new_tokens=n,
                           draft=DraftWeights.create(draft_params), stop_at_eos=False, seed=seed,
                           programs=Programs(),
                           sampling=SamplingParams.create(temperature, top_k=top_k))
  samples = np.array(result.tokens)
  assert samples.shape == (N_ROWS, n)
  return samples, result, exact_joint_law(params, TINY, PROMPT, n, temperature, top_k)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT_STACKS))
def test_sampling_is_exact_at_every_level(monkeypatch, name):
  stack, temperature, top_k, n = EXACT_STACKS[name]
  samples, result, law = sample_stack(monkeypatch, stack, temperature, top_k, n)
  assert result.target_forwards >= 2  # several top rounds
  middle, top = result.levels[-2], result.levels[-1]
  assert 0 < middle["accepted"] < middle["proposed"]  # the middle level accepts and rejects
  assert 0 < top["accepted"] < top["proposed"]        # and so does the target, of its chains
  assert chi_square_pvalue(samples, law) > 1e-4


def _verify_middle_resampling_from_p(bottom_tree):
  """`verify` whose middle level (the one checking the bottom tree) draws its correction from
  p itself, as TriForce's public code does; the target's verification stays exact."""
  exact = verify_lib.verify

  def verify(key, tree, *args):
    if tree != bottom_tree:
      return exact(key, tree, *args)
    residual = verify_lib.residual
    verify_lib.residual = lambda p, q: p  # read while this call traces
    try:
      return exact(key, tree, *args)
    finally:
      verify_lib.residual = residual

  return verify


@pytest.mark.slow
def test_biased_middle_level_is_caught(monkeypatch):
  stack, temperature, top_k, n = EXACT_STACKS["3-level-chain-iid"]
  monkeypatch.setattr(loop, "verify", _verify_middle_resampling_from_p(stack.tree))
  # A function of its own, so jit traces it afresh with the biased rule, in any test order
  # (the engine's own program may already be traced with the exact one).
  monkeypatch.setattr(engine, "decode_loop", jax.jit(lambda sizes, weights, long_caches, start, max_new_tokens:
                                                     loop.generation(sizes, weights, long_caches, start, max_new_tokens),
                                                     static_argnames=("sizes", "max_new_tokens")))
  samples, _, law = sample_stack(monkeypatch, stack, temperature, top_k, n)
  assert chi_square_pvalue(samples, law) < 1e-6
