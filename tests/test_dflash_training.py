"""Training DFlash block drafts here (train/dflash.py) and writing them in vLLM's speculators format
(train/speculators.py): speculators' own class loads what we write and its training forward (a
block at every anchor of a sequence) gives our blocks' logits; our loader reads the export back
unchanged; a few training steps lower the loss; the trained draft decodes ar's tokens as a
chain and as a tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speculators.models.dflash import DFlashSpeculatorConfig
from speculators.models.dflash.core import DFlashDraftModel

from hitree_jax.decode import engine
from hitree_jax.heads import saved
from hitree_jax.heads.dflash import BlockSpec
from hitree_jax.train import distill, dflash as train_dflash, speculators
from hitree_jax.train.teacher import full_sequence
from tests.helpers import hf_llama

E, VOCAB, LAYERS, BLOCK, TAPS = 64, 97, 6, 4, (1, 3)
SHAPE = dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """Our load of transformers' tiny random Llama (a DFlash draft's layers are Qwen3's whatever its
  target), saved as an HF folder: the verifier speculators reads the embedding and head from."""
  return hf_llama(tmp_path_factory.mktemp("target"), LAYERS, **SHAPE)


@pytest.fixture(scope="module")
def draft(target):
  """(params with the target's head, layer config, block spec): a random two-layer draft."""
  config = train_dflash.layer_config(target.config, 2)
  params = train_dflash.init_params(config, len(TAPS), jax.random.key(1), scale=0.3)
  head = saved.frozen_arrays(target.params, None)["head"]
  return dict(params, head=head), config, BlockSpec(BLOCK, VOCAB - 1, TAPS)


def test_default_target_layers_spread_over_the_target():
  assert train_dflash.default_target_layers(36, 5) == (1, 9, 17, 25, 33)   # Qwen3-8B's published draft
  assert train_dflash.default_target_layers(30, 1) == (15,)
  with pytest.raises(ValueError, match="not distinct; name the ones to read"):
    train_dflash.default_target_layers(5, 3)


def test_speculators_loads_our_export_and_computes_our_blocks(target, draft, tmp_path):
  params, config, spec = draft
  folder = speculators.write_dflash(tmp_path / "dflash", params, target.config, spec, target.path)
  t = 14
  tokens = np.random.default_rng(1).integers(0, VOCAB - 1, size=(1, t))
  features = full_sequence(target.params, target.config, jnp.asarray(tokens), TAPS)[1][..., :len(TAPS) * E]
  at = np.arange(t - BLOCK)[None].astype(np.int32)          # every anchor speculators takes at this length
  embedding = target.params["embed_tokens"]["embedding"]
  ours = np.asarray(train_dflash.anchor_logits(params, config, spec, embedding, jnp.asarray(tokens), features,
                                               jnp.asarray(at)))[0]                      # [A, B-1, V]

  reference_config = DFlashSpeculatorConfig.from_pretrained(str(folder))
  reference_config.transformer_layer_config._attn_implementation = "eager"   # flex attention: 128-token blocks
  reference = DFlashDraftModel.from_pretrained(str(folder), config=reference_config).eval()
  assert list(reference.target_layer_ids) == [i + 1 for i in TAPS] and reference.block_size == BLOCK
  np.testing.assert_array_equal(reference.embed_tokens.weight.detach().numpy(), np.asarray(embedding))
  with torch.no_grad():
    _, logits, _, _, blocks = reference._backbone_forward(
        torch.tensor(np.asarray(features)), torch.tensor(tokens), torch.ones(1, t), torch.zeros(1, t, E),
        torch.zeros(1, t, dtype=torch.long), max_anchors=t - BLOCK)
  np.testing.assert_array_equal(blocks.numpy()[::BLOCK], at[0])
  theirs = logits.numpy().reshape(t - BLOCK, BLOCK, VOCAB)[:, 1:]                       # the root's row is not a guess
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
  assert len({row.argmax() for row in ours[:, 0]}) > 3   # the blocks depend on their context


def test_our_loader_reads_the_export_back_unchanged(target, draft, tmp_path):
  params, _, spec = draft
  folder = speculators.write_dflash(tmp_path / "dflash", params, target.config, spec, target.path)
  meta, loaded, _ = saved.load(str(folder), target.params, target.config, "dflash")
  assert meta["format"] == "speculators" and saved.drafter(meta, target.config).spec == spec
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- training, on conftest's tiny teacher and its learnable windows ----

TEACHER_TAPS, TEACHER_BLOCK = (0, 1), 4


@pytest.fixture(scope="module")
def teacher_setup(tmp_path_factory, teacher_params, distill_data):
  """(target params with their head, labelled windows (tokens, features, anchors, ids, probs), layer
  config, spec)."""
  from hitree_jax.model.llama import with_decode_head
  from tests.helpers import TEACHER
  windows = distill_data[0]
  labels = distill.label_windows(tmp_path_factory.mktemp("labels") / "labels.npz", windows, teacher_params,
                                 TEACHER, k=8, chunk=16, features=True, taps=TEACHER_TAPS)
  at = train_dflash.anchors(len(windows), windows.shape[1], TEACHER_BLOCK, 12, seed=0)
  train = (labels["tokens"], labels["features"][..., :len(TEACHER_TAPS) * TEACHER.hidden_size], at,
           *train_dflash.full_targets(labels["ids"], labels["log_probs"]))
  return (with_decode_head(teacher_params, TEACHER), train, train_dflash.layer_config(TEACHER, 1),
          BlockSpec(TEACHER_BLOCK, TEACHER.vocab_size - 1, TEACHER_TAPS))


def test_anchors_are_distinct_and_leave_room_for_their_block():
  at = train_dflash.anchors(50, 24, 4, 21, seed=3)
  assert at.shape == (50, 21) and at.min() == 0 and at.max() == 20
  assert all(len(set(row)) == 21 for row in at)
  with pytest.raises(ValueError, match="22 anchors per window: expected 1 .. 21"):
    train_dflash.anchors(1, 24, 4, 22, seed=0)


def test_training_lowers_the_blocks_loss(tmp_path, teacher_setup):
  target, train, config, spec = teacher_setup
  params = train_dflash.init_params(config, len(TEACHER_TAPS), jax.random.key(0))
  frozen = saved.frozen_arrays(target, None)
  objective = train_dflash.objective(config, spec)
  before = distill.evaluate_loss(params, objective, train, 8, frozen)
  trained, history = distill.train(tmp_path, config, params, train, None, steps=120, batch=8, lr=1e-2,
                                   warmup=3, seed=0, log_every=40, objective=objective, frozen=frozen)
  after = distill.evaluate_loss(trained, objective, train, 8, frozen)
  assert [h["step"] for h in history] == [40, 80, 120]
  assert jax.tree.structure(trained) == jax.tree.structure(params)
  probs = train[4]
  entropy = float(np.mean(-np.sum(np.where(probs > 0, probs * np.log(np.maximum(probs, 1e-30)), 0), -1)))
  assert after[0] - entropy < 0.8 * (before[0] - entropy) and after[1] > before[1] + 0.1, (before, after, entropy)


@pytest.mark.slow
def test_a_trained_draft_written_for_speculators_decodes_ar_tokens(tmp_path, teacher_setup):
  """Trained here, written in speculators' format, read back through --draft's grammar: the
  block as a chain and as a tree of its rows' top tokens gives ar's tokens."""
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.decode.stack import Stack
  from hitree_jax.tree import shapes as tree_lib
  from tests.helpers import TEACHER
  target, train, config, spec = teacher_setup
  params = train_dflash.init_params(config, len(TEACHER_TAPS), jax.random.key(0))
  frozen = saved.frozen_arrays(target, None)
  trained, _ = distill.train(tmp_path / "run", config, params, train, None, steps=20, batch=8, lr=1e-2, warmup=3,
                             seed=0, objective=train_dflash.objective(config, spec), frozen=frozen)
  folder = speculators.write_dflash(tmp_path / "dflash", trained, TEACHER, spec, "teacher")
  meta, loaded, _ = saved.load(str(folder), target, TEACHER, "dflash")
  drafter = saved.drafter(meta, TEACHER)
  assert drafter.taps == TEACHER_TAPS
  prompts = [[5, 9, 3, 17, 1, 30], [7, 7, 8]]
  ar = engine.generate(target, TEACHER, prompts, max_new_tokens=24, stop_at_eos=False)
  for tree in (tree_lib.chain(TEACHER_BLOCK - 1), tree_lib.kary(2, 2)):
    sd = engine.generate(target, TEACHER, prompts, max_new_tokens=24, stop_at_eos=False,
                         stack=Stack(drafter, tree), draft=DraftWeights.create(loaded, None))
    assert sd.tokens == ar.tokens
    assert sum(sd.accepted_per_depth) > 0
