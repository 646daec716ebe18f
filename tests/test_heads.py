"""The EAGLE feature draft on tiny random models: greedy equals ar, its rounds read the right
features, sampling is exact, and a second generation compiles nothing."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.decode import engine
from hitree_jax.decode.drafters import DraftWeights
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.cache.kinds import Full, Retrieval
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.heads import eagle, medusa
from hitree_jax.heads.drafter import EagleDrafter, MedusaDrafter
from hitree_jax.model.llama import hidden_states, init_params, with_decode_head
from hitree_jax.model.vocab import ReducedVocab
from hitree_jax.tree import shapes as tree_lib
from tests.helpers import HEADS_CONFIG as CONFIG, TAPPED, TAPS, eagle3_draft, eagle_draft, target_params
from tests.laws import N_SAMPLES, SMALL, chi_square_pvalue, exact_three_token_law

PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7], [2, 4], [8, 1, 9, 30, 2]]


@pytest.fixture(scope="module")
def params():
  return target_params(CONFIG)


@pytest.fixture(scope="module")
def ar_tokens(params):
  return engine.generate(params, CONFIG, PROMPTS, max_new_tokens=40).tokens


@pytest.mark.parametrize("tree", [pytest.param(tree_lib.chain(3), marks=pytest.mark.slow), tree_lib.kary(2, 2),
                                  pytest.param(tree_lib.DynamicTree(6, 3, 2), marks=pytest.mark.slow)],
                         ids=["chain3", "binary2x2", "dynamic6x3"])
def test_greedy_equals_ar_and_a_copy_of_the_target_is_always_accepted(params, ar_tokens, tree):
  drafter, weights = eagle_draft(params, CONFIG, 0.0)
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree, drafter=drafter, draft=weights,
                           max_new_tokens=40)
  assert result.tokens == ar_tokens
  # Every round but a row's last (cut at max_new_tokens) accepts the whole greedy path the tree
  # holds: a full-depth one in a static tree; in a dynamic one at least the root's first child
  # (the most probable node; deeper ones of the greedy path may lose their place to siblings).
  rounds = sum(result.rounds_per_row) - len(PROMPTS)
  depth = 0 if isinstance(tree, tree_lib.DynamicTree) else -1
  assert result.accepted_per_depth[depth] >= rounds


def teacher_forced_hits(params, draft: DraftWeights, drafter, sequence, prompt_len):
  """Offline: the EAGLE layer over the whole sequence with the target's true features (no
  cache, no engine); walks chain:1 rounds as verification would: -> tokens accepted."""
  t = len(sequence)
  tokens = jnp.asarray([sequence])
  positions = jnp.arange(t)[None]
  cache = KVCache.init(CONFIG, 1, t)
  attend = causal_attend(cache.lengths, t, t)
  true, _ = hidden_states(params, CONFIG, tokens, positions, cache, attend)
  predicted, _ = eagle.features(draft.params, drafter.config, params["embed_tokens"]["embedding"],
                                tokens, eagle.shifted(true), positions,
                                KVCache.init(drafter.config, 1, t), attend)
  guess = np.asarray(jnp.argmax(eagle.logits(draft.params, predicted, False), axis=-1))[0]
  root, accepted = prompt_len, 0       # the first generated token is the first root
  while root + 1 < t:                  # a round whose root is the last token never runs
    hit = guess[root] == sequence[root + 1]
    accepted += int(hit)
    root += 2 if hit else 1            # accepted + bonus, or the correction
  return accepted


@pytest.mark.slow
def test_each_round_reads_the_targets_features_of_what_it_accepted(params, ar_tokens):
  # The draft depends on the features; chain:1 rounds accept exactly where the EAGLE layer run
  # offline over the sequence with the target's true features predicts the next token.
  drafter, weights = eagle_draft(params, CONFIG, 2.0)
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree_lib.chain(1), drafter=drafter,
                           draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  expected = sum(teacher_forced_hits(params, weights, drafter, prompt + out, len(prompt))
                 for prompt, out in zip(PROMPTS, ar_tokens))
  assert 0 < expected < 40 * len(PROMPTS) // 2  # a draft that is right some of the time
  assert result.accepted_per_depth[0] == expected


@pytest.mark.slow
def test_under_a_retrieval_level(params, ar_tokens):
  drafter, weights = eagle_draft(params, CONFIG, 0.5)
  stack = Stack(drafter, tree_lib.chain(2), (Verifier("target", Retrieval(16, chunk=4), 3),))
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  assert result.levels[0]["accepted"] > 0


@pytest.mark.slow
def test_reduced_vocabulary_and_second_generation_compiles_nothing(params, ar_tokens):
  vocab = ReducedVocab(np.array([-1, *range(0, 53, 2)], np.int32), CONFIG.vocab_size)
  drafter, weights = eagle_draft(params, CONFIG, 0.5, vocab)
  programs = Programs()
  for _ in range(2):
    result = engine.generate(params, CONFIG, PROMPTS, tree=tree_lib.kary(2, 2), drafter=drafter,
                             draft=weights, max_new_tokens=40, programs=programs)
    assert result.tokens == ar_tokens
  assert result.compiles == result.cache_loads == 0 and result.accepted_per_depth[0] > 0


def test_refused_over_a_draft_model_level_or_another_width(params):
  drafter, weights = eagle_draft(params, CONFIG, 0.0)
  stack = Stack(drafter, tree_lib.chain(2), (Verifier("draft", Full(), 3),),
                draft=CONFIG)
  with pytest.raises(ValueError, match="features of the level above"):
    engine.check_stack(stack, CONFIG)
  wide = CONFIG.replace(hidden_size=48, head_dim=12)
  with pytest.raises(ValueError, match="features of width 32"):
    engine.check_stack(Stack(drafter, tree_lib.chain(2)), wide)


@pytest.mark.slow
@pytest.mark.parametrize("tree,mode,temperature,top_p", [
    (tree_lib.chain(2), "iid", 1.0, 1.0),
    (tree_lib.kary(2, 2), "without_replacement", 0.8, 0.95),
    (tree_lib.DynamicTree(5, 2, width=3), "deterministic", 0.8, 0.9),
], ids=["chain-iid", "binary-wor-topp", "dynamic-topp"])
def test_sampling_is_exact(tree, mode, temperature, top_p):
  assert_sampling_is_exact(lambda params, config: eagle_draft(params, config, 1.0, mode=mode), tree,
                           SamplingParams.create(temperature, top_p))


def assert_sampling_is_exact(make_draft, tree, sampling, num_layers: int = 1, control: bool = False):
  """The first 3 tokens of many rows of a 1-layer 6-token target, drafted by make_draft(params,
  config) -> (drafter, weights), follow the exactly enumerated law (chi-square), and the target
  accepts some of the drafts. control: the same drafter under a verification that trusts it
  (`trusting`) must fail the same test, so the test can tell this drafter's law from the target's."""
  config = SMALL.replace(num_layers=num_layers)
  params = with_decode_head(jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x,
                                         init_params(config, jax.random.key(2))), config)
  drafter, weights = make_draft(params, config)
  prompt = [1, 4, 2, 5, 1, 4]
  law = exact_three_token_law(params, prompt, sampling, config)

  def pvalue():
    result = engine.generate(params, config, [prompt] * N_SAMPLES, tree=tree, drafter=drafter,
                             draft=weights, max_new_tokens=3, sampling=sampling, seed=11,
                             stop_at_eos=False, programs=Programs())
    assert result.accepted_per_depth[0] > 0
    return chi_square_pvalue(np.array([t[:3] for t in result.tokens]), law)

  assert pvalue() > 1e-4
  if control:
    from hitree_jax.decode import loop
    with mock.patch.object(loop, "verify", trusting(loop.verify)):
      jax.clear_caches()   # the loop is traced again, with the trusting verification
      with pytest.raises(AssertionError, match="probability zero|pvalue"):
        assert pvalue() > 1e-4, "pvalue"   # a sequence the target never draws is caught too
    jax.clear_caches()


def trusting(verify):
  """`verify` handed a target that agrees with the drafter: at each position with children, a
  point mass on its first child's token, so that child is accepted; the token after the path is
  still the target's. Its output follows the drafter's law along the first children."""
  def trusted(key, tree, draft_tokens, target_probs, draft_probs, mode, children=None):
    batch, _, vocab = target_probs.shape
    if children is None:
      children = jnp.broadcast_to(jnp.asarray(tree.children), (batch, *tree.children.shape))
    first = children[:, :, 0]                                                      # [B, N+1]
    token = jnp.take_along_axis(draft_tokens, jnp.maximum(first, 0), axis=1)
    agreed = jnp.where((first >= 0)[..., None], jax.nn.one_hot(token, vocab, dtype=target_probs.dtype), target_probs)
    return verify(key, tree, draft_tokens, agreed, draft_probs, mode, children)
  return trusted


# --- EAGLE-3: the target's tapped layers beside its final states ---

@pytest.fixture(scope="module")
def tapped():
  """(params, ar's tokens) of a 3-layer target."""
  params = target_params(TAPPED, seed=1)
  return params, engine.generate(params, TAPPED, PROMPTS, max_new_tokens=40).tokens


def test_an_untrained_fusion_reads_the_final_states_alone():
  config = eagle.layer_config(TAPPED, 53)
  params = eagle.init_params(config, jax.random.key(0), taps=2)
  features = jax.random.normal(jax.random.key(1), (2, 5, 3 * config.hidden_size))
  np.testing.assert_array_equal(eagle.fuse(params, features), features[..., 2 * config.hidden_size:])
  assert eagle.fuse(eagle.init_params(config, jax.random.key(0)), features) is features


def tapped_guesses(params, draft: DraftWeights, drafter, sequence, zero_taps=False):
  """Offline: the EAGLE-3 layer's greedy guess after each position of the sequence, reading the
  target's tapped and final states there (llama.hidden_states with taps), fused."""
  t, e = len(sequence), TAPPED.hidden_size
  tokens, positions = jnp.asarray([sequence]), jnp.arange(t)[None]
  attend = causal_attend(jnp.zeros((1,), jnp.int32), t, t)
  true, _ = hidden_states(params, TAPPED, tokens, positions, KVCache.init(TAPPED, 1, t), attend, taps=TAPS)
  assert true.shape == (1, t, (len(TAPS) + 1) * e)
  if zero_taps:
    true = true.at[..., :len(TAPS) * e].set(0.0)
  predicted, _ = eagle.features(draft.params, drafter.config, params["embed_tokens"]["embedding"], tokens,
                                eagle.shifted(eagle.fuse(draft.params, true)), positions,
                                KVCache.init(drafter.config, 1, t), attend)
  return np.asarray(jnp.argmax(eagle.logits(draft.params, predicted, False), axis=-1))[0]


def chain1_accepted(guess, sequence, prompt_len):
  """Tokens chain:1 rounds accept on a sequence, given the draft's guess after each position."""
  root, accepted = prompt_len, 0
  while root + 1 < len(sequence):
    hit = guess[root] == sequence[root + 1]
    accepted += int(hit)
    root += 2 if hit else 1
  return accepted


@pytest.mark.slow
def test_eagle3_rounds_read_the_targets_tapped_layers(tapped):
  params, ar_tokens = tapped
  drafter, weights = eagle3_draft(params, TAPPED, TAPS)
  result = engine.generate(params, TAPPED, PROMPTS, tree=tree_lib.chain(1), drafter=drafter,
                           draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  sequences = [prompt + out for prompt, out in zip(PROMPTS, ar_tokens)]
  expected = sum(chain1_accepted(tapped_guesses(params, weights, drafter, s), s, len(p))
                 for p, s in zip(PROMPTS, sequences))
  assert 0 < expected < 40 * len(PROMPTS) // 2
  assert result.accepted_per_depth[0] == expected
  # and what it reads of the tapped layers matters
  assert any(not np.array_equal(tapped_guesses(params, weights, drafter, s),
                                tapped_guesses(params, weights, drafter, s, zero_taps=True)) for s in sequences)


@pytest.mark.parametrize("tree,verifiers", [
    (tree_lib.chain(3), ()),
    pytest.param(tree_lib.DynamicTree(6, 3, 2), (), marks=pytest.mark.slow),
    pytest.param(tree_lib.chain(2), (Verifier("target", Retrieval(16, chunk=4), 3),), marks=pytest.mark.slow),
], ids=["chain3", "dynamic6x3", "under-retrieval"])
def test_eagle3_greedy_equals_ar(tapped, tree, verifiers):
  params, ar_tokens = tapped
  drafter, weights = eagle3_draft(params, TAPPED, TAPS)
  result = engine.generate(params, TAPPED, PROMPTS, stack=Stack(drafter, tree, verifiers),
                           draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  assert result.levels[0]["accepted"] > 0


def test_eagle3_refuses_a_target_without_its_layers(tapped):
  drafter, _ = eagle3_draft(tapped[0], TAPPED, (0, 2))   # layer 2 is TAPPED's last: not a tap
  with pytest.raises(ValueError, match=r"reads layers \[0, 2\] of its target; this target has 3"):
    engine.check_stack(Stack(drafter, tree_lib.chain(2)), TAPPED)


@pytest.mark.slow
def test_eagle3_sampling_is_exact():
  assert_sampling_is_exact(lambda params, config: eagle3_draft(params, config, (0,), mode="without_replacement"),
                           tree_lib.kary(2, 2), SamplingParams.create(0.8, 0.95), num_layers=2)


# --- Medusa ---

def medusa_draft(target, config, num_heads: int, scale: float, mode="deterministic"):
  """(drafter, weights): random residual blocks on the target's own head."""
  e = config.hidden_size
  blocks = scale * jax.random.normal(jax.random.key(9), (num_heads, e, e)) / np.sqrt(e)
  params = {"blocks": blocks, "head": eagle.head_from_target(target, None)}
  return MedusaDrafter(num_heads, config.vocab_size, mode), DraftWeights(params)


def medusa_hits(params, draft: DraftWeights, sequence, prompt_len):
  """Offline: head 1 on the target's true feature of the token before each chain:1 root."""
  t = len(sequence)
  cache = KVCache.init(CONFIG, 1, t)
  true, _ = hidden_states(params, CONFIG, jnp.asarray([sequence]), jnp.arange(t)[None], cache,
                          causal_attend(cache.lengths, t, t))
  guess = np.asarray(jnp.argmax(medusa.logits(draft.params, true[0], False)[:, 0], axis=-1))
  root, accepted = prompt_len, 0
  while root + 1 < t:
    hit = guess[root - 1] == sequence[root + 1]  # the feature before the root guesses past it
    accepted += int(hit)
    root += 2 if hit else 1
  return accepted


def test_medusa_reads_the_feature_before_the_root(params, ar_tokens):
  drafter, weights = medusa_draft(params, CONFIG, 1, 1.0)
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree_lib.chain(1), drafter=drafter,
                           draft=weights, max_new_tokens=40)
  assert result.tokens == ar_tokens
  expected = sum(medusa_hits(params, weights, prompt + out, len(prompt))
                 for prompt, out in zip(PROMPTS, ar_tokens))
  assert expected > 0
  assert result.accepted_per_depth[0] == expected


@pytest.mark.parametrize("tree", [tree_lib.kary(3, 2), tree_lib.DynamicTree(6, 3, 3)],
                         ids=["ternary2", "dynamic6x3"])
def test_medusa_greedy_equals_ar(params, ar_tokens, tree):
  drafter, weights = medusa_draft(params, CONFIG, 3, 1.0)
  result = engine.generate(params, CONFIG, PROMPTS, tree=tree, drafter=drafter, draft=weights,
                           max_new_tokens=40)
  assert result.tokens == ar_tokens


def test_medusa_needs_a_head_per_depth(params):
  drafter, _ = medusa_draft(params, CONFIG, 2, 1.0)
  with pytest.raises(ValueError, match="depth 3 needs as many Medusa heads"):
    engine.check_stack(Stack(drafter, tree_lib.chain(3)), CONFIG)


@pytest.mark.slow
@pytest.mark.parametrize("tree,mode", [(tree_lib.chain(2), "iid"), (tree_lib.kary(2, 2), "deterministic")],
                         ids=["chain-iid", "binary-det"])
def test_medusa_sampling_is_exact(tree, mode):
  assert_sampling_is_exact(lambda params, config: medusa_draft(params, config, 2, 1.0, mode), tree,
                           SamplingParams.create(0.9, 0.95), control=mode == "iid")


def test_a_cut_heads_json_is_refused_in_one_line(tmp_path):
  import pathlib
  import shutil
  from hitree_jax.errors import UsageError
  from hitree_jax.heads import saved
  folder = tmp_path / "eagle"
  shutil.copytree(pathlib.Path(__file__).resolve().parent.parent / "drafts" / "smollm2-eagle", folder)
  text = (folder / "heads.json").read_text()
  assert saved.read_meta(folder)["kind"] == "eagle"
  for cut in ("", text[:len(text) // 2], "[]"):
    (folder / "heads.json").write_text(cut)
    with pytest.raises(UsageError, match=f"^{folder / 'heads.json'}: not a whole heads.json"):
      saved.read_meta(folder)


# --- published drafters' sampling: DFlash's block and EAGLE-3's layer, random weights ---

def random_like(shapes, seed):
  """Random arrays of abstract shapes: matrices ~ N(0, 1/fan-in), vectors (norms) near 1."""
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  made = [jax.random.normal(k, s.shape) / np.sqrt(s.shape[0]) if len(s.shape) == 2
          else 1 + 0.3 * jax.random.normal(k, s.shape) for k, s in zip(keys, leaves)]
  return jax.tree.unflatten(tree, made)


def dflash_draft(target, config, mode):
  """(drafter, weights): a DFlash block of 4 over the 2-layer target's layer 0, random weights."""
  from hitree_jax.heads import dflash
  from hitree_jax.heads.drafter import DFlashDrafter
  draft_config = config.replace(num_layers=1, qk_norm=True)
  drafter = DFlashDrafter(draft_config, dflash.BlockSpec(4, config.vocab_size - 1, (0,)), mode)
  params = random_like(drafter.abstract_heads(config), 3)
  return drafter, DraftWeights(dict(params, head=eagle.head_from_target(target, None)))


def eagle3_published_draft(target, config, mode):
  """(drafter, weights): a published EAGLE-3 layer over the 2-layer target's layer 0, random weights."""
  from hitree_jax.heads.eagle3 import Eagle3Net
  drafter = EagleDrafter(config.replace(num_layers=1), mode, taps=(0,), net=Eagle3Net(aux=1))
  return drafter, DraftWeights(random_like(drafter.abstract_heads(config), 4))


@pytest.mark.slow
@pytest.mark.parametrize("make", [dflash_draft, eagle3_published_draft], ids=["dflash", "eagle3"])
@pytest.mark.parametrize("tree,mode", [(tree_lib.chain(2), "iid"), (tree_lib.kary(2, 2), "deterministic")],
                         ids=["chain-iid", "binary-det"])
def test_published_drafters_sampling_is_exact(make, tree, mode):
  assert_sampling_is_exact(lambda params, config: make(params, config, mode), tree,
                           SamplingParams.create(0.9, 0.95), num_layers=2, control=mode == "iid")
