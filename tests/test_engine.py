"""Speculative decoding (sd / tree) on a tiny random model: greedy equals ar, sampling is exact."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.cache.full import KVCache
from hitree_jax.decode import engine, sizes, spec
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.drafters import DraftWeights, ModelDrafter, NGramDrafter, SelfDrafter
from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import SamplingParams, probabilities
from hitree_jax.decode.stack import Stack
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import init_params
from hitree_jax.model.vocab import ReducedVocab
from hitree_jax.tree import shapes as tree_lib
from tests.laws import N_SAMPLES, SMALL, chi_square_pvalue, exact_joint_law, exact_three_token_law

CONFIG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None)
PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7], [2, 4], [8, 1, 9, 30, 2]]
SETUPS = {
    "ngram-chain4": (tree_lib.chain(4), NGramDrafter(3)),
    "ngram2to3-chain4": (tree_lib.chain(4), NGramDrafter(3, min_ngram=2)),
    "self1-chain3": (tree_lib.chain(3), SelfDrafter(1)),
    "self2-binary2x2": (tree_lib.kary(2, 2), SelfDrafter(2)),
    "self1-ragged-iid": (tree_lib.TokenTree((-1, -1, 0, 0, 1, 2)), SelfDrafter(1, "iid")),
    "self2-dynamic6x3": (tree_lib.DynamicTree(6, 3, width=2), SelfDrafter(2)),
}


@pytest.fixture(scope="module")
def params():
  p = init_params(CONFIG, jax.random.key(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, p)  # peaked: no greedy near-ties


@pytest.fixture(scope="module")
def ar_tokens(params):
  return engine.generate(params, CONFIG, PROMPTS, max_new_tokens=40).tokens


SLOW_SETUPS = ("self1-ragged-iid", "self2-dynamic6x3")  # > 10 s each on a 2-core CPU


@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SETUPS else s
                                   for s in SETUPS])
def test_greedy_equals_ar(params, ar_tokens, setup):
  tree, drafter = SETUPS[setup]
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree, drafter=drafter, max_new_tokens=40)
  assert result.tokens == ar_tokens
  # Speculation did something: fewer target rounds than tokens after the first, over the rows.
  assert sum(result.rounds_per_row) < sum(len(t) - 1 for t in result.tokens) and result.mean_accepted > 1.0
  # Each round emits its accepted tokens + one; the last round of a row may be cut at max_new_tokens.
  emitted = sum(result.accepted_per_depth) + sum(result.rounds_per_row)
  assert 0 <= emitted - sum(len(t) - 1 for t in result.tokens) <= len(PROMPTS) * tree.max_depth


def model_draft(params, config, vocab: ReducedVocab | None = None, mode="deterministic"):
  """(drafter, weights) of a separate draft model (with a reduced vocabulary: rows of the embedding)."""
  if vocab is None:
    return ModelDrafter(config, mode), DraftWeights(params)
  rows = np.maximum(vocab.target_ids, 0)
  params = dict(params, embed_tokens={"embedding": params["embed_tokens"]["embedding"][rows]})
  if not config.tie_word_embeddings:
    params["lm_head"] = {"kernel": params["lm_head"]["kernel"][:, rows]}
  return (ModelDrafter(config.replace(vocab_size=vocab.size), mode, vocab.target_vocab_size),
          DraftWeights.create(params, vocab))


@pytest.mark.slow
@pytest.mark.parametrize("tree", [tree_lib.chain(3), tree_lib.kary(2, 2), tree_lib.DynamicTree(6, 3, 2)],
                         ids=["chain3", "binary2x2", "dynamic6x3"])
def test_model_drafter_greedy_equals_ar(params, ar_tokens, tree):
  # The target as its own draft accepts every node, so the draft cache's mirrored commits
  # (including the deepest level's keys/values) are exercised in every round.
  drafter, weights = model_draft(params, CONFIG)
  same = engine.generate(params, CONFIG, PROMPTS, tree=tree, drafter=drafter, draft=weights,
                         max_new_tokens=40)
  assert same.tokens == ar_tokens
  assert same.mean_accepted > tree.max_depth + 0.5  # all accepted, bar cut-offs at the end
  # A different, random draft model (2 layers, another width): exact whatever it proposes.
  small = CONFIG.replace(num_layers=2, hidden_size=16, intermediate_size=32, head_dim=4)
  drafter, weights = model_draft(init_params(small, jax.random.key(5)), small)
  other = engine.generate(params, CONFIG, PROMPTS, tree=tree, drafter=drafter, draft=weights,
                          max_new_tokens=40)
  assert other.tokens == ar_tokens


@pytest.mark.slow
def test_reduced_vocabulary_draft_greedy_equals_ar(params, ar_tokens):
  # The target restricted to the tokens of the run (ten of its 53 tokens stay out).
  counts = np.bincount(np.concatenate([*PROMPTS, *ar_tokens]), minlength=CONFIG.vocab_size)
  vocab = ReducedVocab.most_frequent(counts, int(np.sum(counts > 0)) + 1, always=())
  assert vocab.size <= CONFIG.vocab_size - 10
  drafter, weights = model_draft(params, CONFIG, vocab)
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree_lib.chain(3), drafter=drafter,
                           draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  assert result.mean_accepted > 3.5  # it proposes the target's own choices


def test_prefill_time_waits_for_every_levels_cache(params, monkeypatch):
  # Decoding is timed from when prefill returns: the draft's cache must be built by then,
  # or its prefill, still running on the device, is counted as decode time.
  blocked = []
  wait = jax.block_until_ready
  monkeypatch.setattr(engine.jax, "block_until_ready", lambda x: blocked.append(x) or wait(x))
  small = CONFIG.replace(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)
  drafter, weights = model_draft(init_params(small, jax.random.key(5)), small)
  ready, _ = engine.prefill(params, CONFIG, PROMPTS, 8, Stack(drafter, tree_lib.chain(2)), draft=weights,
                            programs=Programs())
  waited = {id(leaf) for x in blocked for leaf in jax.tree.leaves(x)}
  long_caches = [leaf for leaf in jax.tree.leaves(ready.long_caches) if isinstance(leaf, jax.Array)]
  assert len(long_caches) >= 2 * (CONFIG.num_layers + small.num_layers)  # keys and values of both
  assert all(id(leaf) in waited for leaf in long_caches)


def test_draft_with_another_vocabulary_is_refused(params):
  drafter, weights = model_draft(params, CONFIG.replace(vocab_size=50))
  with pytest.raises(ValueError, match="vocabularies differ.*50.*53"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.chain(2), drafter=drafter,
                    draft=weights, max_new_tokens=4)


@pytest.mark.slow
def test_stops_at_eos_like_ar(params, ar_tokens):
  eos = ar_tokens[0][5]
  config = CONFIG.replace(eos_token_id=eos)
  expected = engine.generate(params, config, PROMPTS, max_new_tokens=40).tokens
  got = engine.generate(params, config, PROMPTS, tree=tree_lib.kary(2, 2), drafter=SelfDrafter(2),
                        max_new_tokens=40).tokens
  assert got == expected and got[0][-1] == eos


def test_samples_from_one_prefill_are_generations_at_their_seeds(params):
  """generate_samples decodes each seed from the cache the last sample left: each sample's tokens
  are generate's at its seed (rows of different lengths, EOS stops included), one prefill and
  one decode program serve them all, and greedy decoding is refused."""
  sampling = SamplingParams.create(0.9, 0.95)
  eos = CONFIG.replace(eos_token_id=7)
  seeds = [3, 11, 4]
  alone = [engine.generate(params, eos, PROMPTS, max_new_tokens=24, sampling=sampling, seed=s).tokens for s in seeds]
  assert len({str(tokens) for tokens in alone}) == len(seeds)          # the seeds draw apart
  programs = Programs()
  samples = engine.generate_samples(params, eos, PROMPTS, seeds=seeds, max_new_tokens=24, sampling=sampling,
                                    programs=programs, keep_long_caches=True)
  assert [r.tokens for r in samples] == alone
  assert any(len(row) < 24 for tokens in alone for row in tokens)      # some row stopped at EOS
  assert samples[0].prefill_s > 0 and [r.prefill_s for r in samples[1:]] == [0.0, 0.0]
  assert [r.compiles for r in samples[1:]] == [0, 0]                  # the first's programs serve all
  assert samples[-1].long_caches is not None and samples[0].long_caches is None
  with pytest.raises(engine.UsageError, match="greedy"):
    engine.generate_samples(params, CONFIG, PROMPTS, seeds=seeds, max_new_tokens=8, sampling=SamplingParams.create())


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["self2-binary2x2", "self2-dynamic6x3"])
def test_second_generation_compiles_nothing(params, setup):
  tree, drafter = SETUPS[setup]
  engine.generate(params, CONFIG, [[1, 2, 3]], tree=tree, drafter=drafter, max_new_tokens=16)
  again = engine.generate(params, CONFIG, [[4, 5, 6, 7]], tree=tree, drafter=drafter, max_new_tokens=16,
                          sampling=SamplingParams.create(0.8, 0.9), seed=1)
  assert again.compiles == again.cache_loads == 0


def test_every_program_gets_the_cpu_defaults(params, monkeypatch):
  """Every program of a generation is compiled by compile_lowered, which hands XLA
  programs.CPU_DEFAULTS (an option XLA does not know is refused by name), less what $XLA_FLAGS
  sets."""
  if jax.default_backend() != "cpu":
    pytest.skip("CPU_DEFAULTS are the CPU's")
  compiled = []
  real = programs_lib.compile_lowered
  monkeypatch.setattr(programs_lib, "compile_lowered",
                      lambda lowered, extra=None: compiled.append(extra) or real(lowered, extra))
  result = engine.generate(params, CONFIG, [[1, 2, 3]], tree=tree_lib.chain(2),
                           drafter=SelfDrafter(1), max_new_tokens=4, programs=Programs())
  assert len(compiled) == result.compiles + result.cache_loads >= 3   # prefill, logits, decoding

  monkeypatch.setattr(programs_lib, "CPU_DEFAULTS", {"xla_cpu_not_an_option": 1})
  with pytest.raises(Exception, match="xla_cpu_not_an_option"):
    engine.generate(params, CONFIG, [[1, 2, 3]], max_new_tokens=4, programs=Programs())
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_not_an_option=2")
  assert programs_lib.cpu_options({"xla_extra": True}) == {"xla_extra": True}


def test_bad_drafter_settings_are_named(params):
  with pytest.raises(ValueError, match="chain"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.kary(2, 2), drafter=NGramDrafter(),
                    max_new_tokens=4)
  with pytest.raises(ValueError, match="layers=3"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.chain(2), drafter=SelfDrafter(3),
                    max_new_tokens=4)
  with pytest.raises(ValueError, match="'ngram:3-': expected ngram, ngram:N or ngram:MIN-MAX"):
    spec.parse_level("ngram:3-")
  with pytest.raises(ValueError, match="'self': expected self:K"):
    spec.parse_level("self")
  with pytest.raises(ValueError, match="n-gram lengths 4..3"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.chain(2), drafter=NGramDrafter(3, min_ngram=4),
                    max_new_tokens=4)
  with pytest.raises(ValueError, match="chain"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.DynamicTree(4, 2), drafter=NGramDrafter(),
                    max_new_tokens=4)
  with pytest.raises(ValueError, match="dynamic tree.*draw mode 'iid'"):
    engine.generate(params, CONFIG, [[1, 2]], tree=tree_lib.DynamicTree(4, 2),
                    drafter=SelfDrafter(1, "iid"), max_new_tokens=4)


def test_ngram_drafter_offers_only_what_followed_a_long_enough_match():
  from hitree_jax.decode.drafters import DraftInputs
  seq = jnp.array([[5, 6, 7, 1, 6, 7, 0, 0], [5, 6, 7, 1, 9, 0, 0, 0], [5, 6, 7, 5, 6, 0, 0, 0]])
  inputs = DraftInputs(seq=seq, end=jnp.array([6, 5, 5]), lead=None, cache=None, params=None, draft=None,
                       sampling=None, config=CONFIG)
  tree = tree_lib.chain(4)
  prop = NGramDrafter(3, min_ngram=2).propose(None, tree, inputs)
  # Row 0: "6 7" occurred at 1..2, and 1 6 7 followed (the root itself included); row 1: no
  # earlier "1 9"; row 2: "5 6" at 0..1, and only 7 5 6 follow it in the sequence.
  assert prop.offered.tolist() == [3, 0, 3]
  assert prop.tokens[0, :3].tolist() == [1, 6, 7] and prop.tokens[2, :3].tolist() == [7, 5, 6]
  assert prop.children[:, :, 0].tolist() == [[0, 1, 2, -1, -1], [-1] * 5, [0, 1, 2, -1, -1]]
  # Unigrams allowed, row 1's root 9 never occurred: still nothing.
  assert NGramDrafter(3).propose(None, tree, inputs).offered.tolist() == [3, 0, 3]
  # A match of n tokens offers at most 2**n: "9" alone matched, and five tokens followed it.
  once = DraftInputs(seq=jnp.array([[9, 1, 2, 3, 4, 9, 0, 0]]), end=jnp.array([6]), lead=None, cache=None,
                     params=None, draft=None, sampling=None, config=CONFIG)
  prop = NGramDrafter(3).propose(None, tree, once)
  assert prop.offered.tolist() == [2] and prop.tokens[0, :2].tolist() == [1, 2]
  assert prop.children[0, :, 0].tolist() == [0, 1, -1, -1, -1]
  assert tree_lib.offer_widths(4) == (0, 2, 4) and tree_lib.offer_widths(8) == (0, 2, 4, 8)
  assert tree_lib.offer_widths(6) == (0, 2, 4, 6) and tree_lib.offer_widths(1) == (0, 1)


@pytest.mark.parametrize("offered, width", [([0, 0], 0), ([1, 0], 2), ([2, 1], 2), ([0, 3], 4)])
def test_a_round_runs_the_fewest_nodes_that_hold_the_offers(params, offered, width):
  """Verifying a chain whose rows offer only its first nodes runs the root and the narrowest of
  offer_widths holding them: the same verdicts, tokens and committed cache as the whole
  chain's forward with the same children. The chain holds `ar`'s own next tokens, so each row
  accepts all it offers, and the committed slots of accepted nodes are compared too."""
  from hitree_jax.decode.drafters import chain_children
  from hitree_jax.decode.loop import level_round
  prompts = [[2, 4], [8, 1, 9, 30]]
  greedy = engine.generate(params, CONFIG, prompts, max_new_tokens=6).tokens   # [2, 6]: the root first
  stack = Stack(NGramDrafter(3), tree_lib.chain(4))
  ready, _ = engine.prefill(params, CONFIG, prompts, 8, stack, programs=Programs())
  inputs = (ready.sizes, ready.weights, ready.long_caches, ready.start, 8)
  count = jnp.array(offered, jnp.int32)
  proposal = level_round(*inputs, 0, None)
  proposal = proposal.replace(tokens=jnp.asarray(greedy)[:, 1:5], offered=count, children=chain_children(count, 4))
  assert min(m for m in tree_lib.offer_widths(4) if m >= max(offered)) == width
  narrow = level_round(*inputs, 1, proposal)
  wide = level_round(*inputs, 1, proposal.replace(offered=None))
  (emitted, n_acc, (recent,)), (emitted_w, n_acc_w, (recent_w,)) = narrow, wide
  assert n_acc.tolist() == n_acc_w.tolist() == offered
  for row, n in enumerate(offered):
    assert emitted[row, :n + 1].tolist() == emitted_w[row, :n + 1].tolist() == np.asarray(greedy)[row, 1:n + 2].tolist()
  assert recent.lengths.tolist() == recent_w.lengths.tolist() == [1 + n for n in offered]
  for mine, theirs in zip(recent.keys + recent.values, recent_w.keys + recent_w.values):  # [B, KVH, D, S]
    for row, n in enumerate(offered):
      np.testing.assert_allclose(mine[row, ..., :1 + n], theirs[row, ..., :1 + n], atol=1e-5)


# --- sampling: the joint law of the first three generated tokens, enumerated exactly ---
# Token 1 comes from prefill; tokens 2 and 3 from the first round (depth 1 and 2 of
# the tree, or a correction / bonus token), so every verification step is covered.



@pytest.mark.slow
@pytest.mark.parametrize("tree,drafter,temperature,top_p", [
    (tree_lib.chain(3), NGramDrafter(2), 1.0, 1.0),
    (tree_lib.chain(3), NGramDrafter(4, min_ngram=4), 1.0, 1.0),   # offers nothing: the root alone
    (tree_lib.chain(4), NGramDrafter(1), 1.0, 1.0),   # a unigram offers at most 2: the root and 2 nodes
    (tree_lib.chain(3), SelfDrafter(1, "iid"), 1.0, 1.0),
    (tree_lib.kary(2, 2), SelfDrafter(1, "without_replacement"), 1.0, 1.0),
    (tree_lib.kary(2, 2), SelfDrafter(2, "deterministic"), 0.7, 0.9),
    (tree_lib.TokenTree((-1, -1, 0, 0, 1, 2)), SelfDrafter(1, "iid"), 1.3, 0.95),
    (tree_lib.chain(2), "model-iid", 1.0, 1.0),
    (tree_lib.kary(2, 2), "reduced-wor", 0.8, 0.95),
    (tree_lib.DynamicTree(4, 2, width=2), SelfDrafter(1), 1.0, 1.0),
    (tree_lib.DynamicTree(5, 2, width=3), "model-det", 0.8, 0.9),
], ids=["ngram-chain", "ngram-offers-nothing", "ngram-offers-part", "self-chain-iid", "self-binary-wor", "self-binary-det-topp", "self-ragged-iid",
        "model-chain-iid", "reduced-vocab-binary-wor", "self-dynamic", "model-dynamic-topp"])
def test_sampling_is_exact(tree, drafter, temperature, top_p):
  params = init_params(SMALL, jax.random.key(2))
  params = jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, params)
  prompt = [1, 4, 2, 5, 1, 4]  # repeats, so the n-gram drafter proposes something
  sampling = SamplingParams.create(temperature, top_p)
  weights = None
  if drafter in ("model-iid", "model-det"):   # another random model as the draft
    mode = "iid" if drafter == "model-iid" else "deterministic"
    drafter, weights = model_draft(init_params(SMALL, jax.random.key(7)), SMALL, mode=mode)
  elif drafter == "reduced-wor":  # the target on 4 of its 6 tokens (+ OTHER)
    vocab = ReducedVocab(np.array([-1, 0, 1, 4, 5], np.int32), SMALL.vocab_size)
    drafter, weights = model_draft(params, SMALL, vocab, mode="without_replacement")
  result = engine.generate(params, SMALL, [prompt] * N_SAMPLES, tree=tree, drafter=drafter,
                           draft=weights, max_new_tokens=3, sampling=sampling, seed=11,
                           stop_at_eos=False)
  samples = np.array([t[:3] for t in result.tokens])
  assert chi_square_pvalue(samples, exact_three_token_law(params, prompt, sampling)) > 1e-4


def test_greedy_siblings_are_ranked_by_the_draft_logits():
  from hitree_jax.decode.drafters import draw_children
  logits = jnp.array([[0.1, 3.0, 2.5, -1.0, 2.9]])
  greedy_q = probabilities(logits, SamplingParams.create(0.0))  # one-hot on token 1
  kids = draw_children(jax.random.key(0), greedy_q, 3, "deterministic", logits)
  assert kids.tolist() == [[1, 4, 2]]


# --- sampling over several rounds: the joint law of the first N tokens, enumerated exactly ---
# The short `recent` cache is cut to one round's span, so every round is its own block,
# appended to the long cache before the next round reads it. A target drafting for itself
# (q = p) accepts every node, so each of its rounds ends in a bonus token drawn at a
# full-depth leaf. With top-k the law is the top-k-truncated, temperature-scaled one.

# A config no other test compiles: the engine's programs for it are traced afresh, with the
# patched recent width, and never shared with another test.
TINY = CONFIG.replace(vocab_size=4, max_position_embeddings=97)
N_ROWS_SEVERAL = 8000
APPENDED_WIDTHS = []  # max_len of each short cache appended to a long one, recorded as it runs
KV_APPEND = KVCache.append


def counting_append(self, other):
  """KVCache.append that also records, each time the compiled program runs it, the short
  cache's width: proof that the block-append path really ran."""
  jax.debug.callback(functools.partial(APPENDED_WIDTHS.append, other.max_len))
  return KV_APPEND(self, other)


@pytest.mark.slow
@pytest.mark.parametrize("tree,draft,temperature,top_k,n", [
    (tree_lib.chain(2), SelfDrafter(1, "iid"), 1.0, 2, 7),
    (tree_lib.chain(2), "target-iid", 0.8, 0, 5),
    (tree_lib.kary(2, 2), "target-wor", 0.7, 2, 7),
], ids=["self-chain-iid-topk", "target-chain-iid", "target-binary-wor-topk"])
def test_sampling_is_exact_over_several_rounds(monkeypatch, tree, draft, temperature, top_k, n):
  params = init_params(TINY, jax.random.key(3))
  params = jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, params)
  prompt = [1, 3, 2, 0, 1, 3]
  drafter, weights = draft, None
  if isinstance(draft, str):  # the target as its own draft model, with its own cache
    mode = {"target-iid": "iid", "target-wor": "without_replacement"}[draft]
    drafter, weights = model_draft(params, TINY, mode=mode)
  stack_sizes = sizes.StackSizes(Stack(drafter, tree), TINY, TINY if weights is not None else None)
  span = stack_sizes.round_extent
  # A recent cache just wide enough for one round: every round is its own block.
  monkeypatch.setattr(sizes.StackSizes, "recent_slots", property(lambda self: self.round_extent))
  monkeypatch.setattr(prefill_lib, "CACHE_BUCKET", 16)  # long caches no longer than the run needs
  monkeypatch.setattr(KVCache, "append", counting_append)
  APPENDED_WIDTHS.clear()
  result = engine.generate(params, TINY, [prompt] * N_ROWS_SEVERAL, tree=tree, drafter=drafter,
                           draft=weights, max_new_tokens=n, programs=Programs(), sampling=SamplingParams.create(
                               temperature, top_k=top_k), seed=13, stop_at_eos=False)
  samples = np.array(result.tokens)
  assert samples.shape == (N_ROWS_SEVERAL, n)
  # Several rounds, each its own block: the target's (and a draft model's) recent cache was
  # appended to the long one after every round.
  assert result.target_forwards >= 2
  assert APPENDED_WIDTHS.count(span) == result.target_forwards * (1 if weights is None else 2)
  full_depth, rounds = result.accepted_per_depth[-1], sum(result.rounds_per_row)
  assert full_depth > 0  # some rounds drew their bonus token after the deepest draft node
  if weights is not None:
    assert full_depth > 0.99 * rounds  # the target's own draft is always accepted
  law = exact_joint_law(params, TINY, prompt, n, temperature, top_k)
  assert chi_square_pvalue(samples, law) > 1e-4


def test_programs_compiled_together_run_without_compiling_again():
  """compile_together compiles every ahead_of_time program it is given, once each (a repeat is
  skipped), on threads beside the lowering; calling them afterwards compiles nothing."""
  double = programs_lib.ahead_of_time(jax.jit(lambda x: x * 2))
  shift = programs_lib.ahead_of_time(jax.jit(lambda x: x + 1))
  calls = [(double, jnp.ones(3)), (double, jnp.ones(5)), (shift, jnp.ones(3)), (double, jnp.ones(3))]
  compiled = []
  listener = lambda event, duration, **_: compiled.append(event) if event.endswith("backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    programs_lib.compile_together([call.compiling(x) for call, x in calls])
    assert len(compiled) == 3
    compiled.clear()
    got = [np.asarray(call(x)) for call, x in calls]
    assert compiled == []
    for (call, x), y in zip(calls, got):
      np.testing.assert_array_equal(y, np.asarray(x) * 2 if call is double else np.asarray(x) + 1)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
