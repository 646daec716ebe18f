"""Training EAGLE-3 drafts here (train/eagle3.py) and writing them in vLLM's speculators format
(train/speculators.py): speculators' own class loads what we write and its forward (three
training-time-test steps) gives our chain's logits; our loader reads it back unchanged; a few
training steps lower the loss; the trained draft decodes ar's tokens in a chain and a tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel

from hitree_jax.decode import engine
from hitree_jax.heads import saved
from hitree_jax.model.vocab import ReducedVocab
from hitree_jax.train import distill, eagle3 as train_eagle3, speculators
from hitree_jax.train.teacher import full_sequence
from tests.helpers import hf_llama

E, VOCAB, DRAFT_VOCAB, LAYERS, STEPS = 64, 97, 40, 8, 3
SHAPE = dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """Our load of transformers' tiny random Llama, saved as an HF folder (the verifier's path)."""
  return hf_llama(tmp_path_factory.mktemp("target"), LAYERS, **SHAPE)


@pytest.fixture(scope="module")
def vocab():
  ids = np.sort(np.random.default_rng(0).choice(np.arange(3, VOCAB), DRAFT_VOCAB - 3, replace=False))
  return ReducedVocab(np.array([-1, 0, 1, 2, *ids], np.int32), VOCAB)


@pytest.fixture(scope="module")
def draft(target, vocab):
  """(params, aux layers, net, layer config): a random EAGLE-3 draft at a trained draft's scale."""
  aux = train_eagle3.default_aux_layers(target.config)
  params = train_eagle3.init_params(target.config, target.params, vocab, jax.random.key(1), scale=0.3)
  meta = {"aux_layers": list(aux), "norm_before_residual": False, "norm_output": False,
          "draft_config": {"rms_norm_eps": target.config.rms_norm_eps}}
  from hitree_jax.heads import eagle3
  return params, aux, eagle3.net(meta), train_eagle3.layer_config(target.config)


def features(target, tokens, aux):
  """[B, T, (aux+1)E]: the tapped layers' outputs (the aux layers' inputs), then the final states."""
  taps = tuple(i - 1 for i in aux)
  return full_sequence(target.params, target.config, jnp.asarray(tokens), taps)[1]


def test_speculators_loads_our_export_and_computes_our_chain_logits(target, vocab, draft, tmp_path):
  params, aux, net, layer = draft
  folder = speculators.write_eagle3(tmp_path / "eagle3", params, target.config, vocab, aux, target.path)
  tokens = np.random.default_rng(1).integers(0, VOCAB, size=(1, 12))
  hidden = features(target, tokens, aux)
  embedding = target.params["embed_tokens"]["embedding"]
  ours = train_eagle3.chain_logits(net, params, layer, embedding, tokens, hidden, STEPS)

  config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
  config.transformer_layer_config._attn_implementation = "eager"   # flex attention needs 128-token blocks
  reference = Eagle3DraftModel.from_pretrained(str(folder), config=config).eval()
  assert list(reference.config.eagle_aux_hidden_state_layer_ids) == list(aux)
  # The embedding is not written: speculators takes it from the verifier our config names. It
  # does so where the embedding holds NaN, its mark of "not loaded"; from_pretrained leaves it as
  # torch.empty made it, NaN or not (this test failed once under the whole suite), so it is marked
  # and taken again, as speculators' own loader means to.
  with torch.no_grad():
    reference.embed_tokens.weight.fill_(float("nan"))
  reference.load_verifier_weights()
  np.testing.assert_array_equal(reference.embed_tokens.weight.detach().numpy(), np.asarray(embedding))
  taps = torch.tensor(np.asarray(hidden[..., :len(aux) * E]))
  shifted = torch.cat([torch.zeros(1, 1, len(aux) * E), taps[:, :-1]], dim=1)   # x_p reads the states of p-1
  captured = []
  hook = reference.lm_head.register_forward_hook(lambda m, a, out: captured.append(out[0].detach().numpy()))
  with torch.no_grad():
    reference(hidden_states=shifted, input_ids=torch.tensor(tokens), document_ids=torch.zeros(1, 12, dtype=torch.long),
              ttt_steps=STEPS)
  hook.remove()
  assert len(captured) == STEPS
  for step in range(STEPS):
    mine = np.asarray(ours[step])[0, :, 1:]   # OTHER dropped
    np.testing.assert_allclose(mine, captured[step], atol=1e-4, rtol=1e-4)
    assert len({row.argmax() for row in mine}) > 3   # the logits depend on the context
  # The draft's vocabulary, as speculators maps it back: d2t[d] + d is the target id of draft id d.
  d2t = reference.d2t.numpy()
  np.testing.assert_array_equal(d2t + np.arange(d2t.size), vocab.target_ids[1:])
  np.testing.assert_array_equal(np.flatnonzero(reference.t2d.numpy()), vocab.target_ids[1:])


def test_our_loader_reads_the_export_back_unchanged(target, vocab, draft, tmp_path):
  params, aux, _, _ = draft
  folder = speculators.write_eagle3(tmp_path / "eagle3", params, target.config, vocab, aux, target.path)
  meta, loaded, loaded_vocab = saved.load(str(folder), target.params, target.config, "eagle3")
  assert meta["format"] == "speculators" and meta["aux_layers"] == list(aux)
  assert (loaded_vocab.target_ids == vocab.target_ids).all()
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(loaded) == jax.tree.structure(params)


# ---- training, on conftest's tiny teacher and its learnable windows ----

TEACHER_AUX = (1, 2)   # the inputs of the tiny teacher's layers 1 and 2 (our taps 0 and 1)


@pytest.fixture(scope="module")
def teacher_setup(tmp_path_factory, teacher_params, distill_data):
  """(target params with their head, labelled windows (tokens, features, draft ids, probs), vocab,
  net, layer config)."""
  from hitree_jax.heads import eagle3
  from hitree_jax.model.llama import with_decode_head
  from tests.helpers import TEACHER
  windows, _, _, vocab = distill_data
  labels = distill.label_windows(tmp_path_factory.mktemp("labels") / "labels.npz", windows, teacher_params,
                                 TEACHER, k=8, chunk=16, features=True, taps=tuple(i - 1 for i in TEACHER_AUX))
  train = (labels["tokens"], labels["features"], *distill.sparse_targets(labels["ids"], labels["log_probs"], vocab))
  meta = {"aux_layers": list(TEACHER_AUX), "norm_before_residual": False, "norm_output": False,
          "draft_config": {"rms_norm_eps": TEACHER.rms_norm_eps}}
  return (with_decode_head(teacher_params, TEACHER), train, vocab, eagle3.net(meta),
          train_eagle3.layer_config(TEACHER))


def test_training_along_chains_lowers_every_steps_loss(tmp_path, teacher_setup):
  from tests.helpers import TEACHER
  target, train, vocab, net, layer = teacher_setup
  params = train_eagle3.init_params(TEACHER, target, vocab, jax.random.key(0), aux=len(TEACHER_AUX))
  frozen = {"embedding": target["embed_tokens"]["embedding"]}
  objective = train_eagle3.objective(net, layer, STEPS)
  per_step = train_eagle3.objective(net, layer, 1)   # step 0 alone: a depth-1 draft's loss
  before = [distill.evaluate_loss(params, o, train, 8, frozen) for o in (objective, per_step)]
  trained, history = distill.train(tmp_path, layer, params, train, None, steps=120, batch=8, lr=1e-2,
                                   warmup=3, seed=0, log_every=40, objective=objective, frozen=frozen)
  after = [distill.evaluate_loss(trained, o, train, 8, frozen) for o in (objective, per_step)]
  assert [h["step"] for h in history] == [40, 80, 120]
  assert jax.tree.structure(trained) == jax.tree.structure(params)   # orbax kept the layers' tuple
  # Above the floor (the teacher's entropy, weighted 1 + 0.8 + 0.64 over the steps), the loss fell
  # by more than a fifth, and step 0 agrees with the teacher's top-1 more often.
  probs = train[3]
  entropy = float(np.mean(-np.sum(np.where(probs > 0, probs * np.log(np.maximum(probs, 1e-30)), 0), -1)))
  floor = (1 + 0.8 + 0.64) * entropy
  assert after[0][0] - floor < 0.8 * (before[0][0] - floor), (before, after, floor)
  assert after[1][0] < before[1][0] and after[0][1] > before[0][1] + 0.1, (before, after)


@pytest.mark.slow
def test_a_trained_draft_written_for_speculators_decodes_ar_tokens(tmp_path, teacher_setup):
  """Trained here, written in speculators' format, read back through --draft's grammar: a chain and
  an EAGLE-2 dynamic tree over its draft vocabulary give ar's tokens."""
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.decode.stack import Stack
  from hitree_jax.tree import shapes as tree_lib
  from tests.helpers import TEACHER
  target, train, vocab, net, layer = teacher_setup
  params = train_eagle3.init_params(TEACHER, target, vocab, jax.random.key(0), aux=len(TEACHER_AUX))
  frozen = {"embedding": target["embed_tokens"]["embedding"]}
  trained, _ = distill.train(tmp_path / "run", layer, params, train, None, steps=20, batch=8, lr=1e-2, warmup=3,
                             seed=0, objective=train_eagle3.objective(net, layer, STEPS), frozen=frozen)
  folder = speculators.write_eagle3(tmp_path / "eagle3", trained, TEACHER, vocab, TEACHER_AUX, "teacher")
  meta, loaded, loaded_vocab = saved.load(str(folder), target, TEACHER, "eagle3")
  drafter = saved.drafter(meta, TEACHER)
  assert drafter.taps == (0, 1)
  prompts = [[5, 9, 3, 17, 1, 30], [7, 7, 8]]
  ar = engine.generate(target, TEACHER, prompts, max_new_tokens=24, stop_at_eos=False)
  for tree in (tree_lib.chain(3), tree_lib.DynamicTree(6, 3, 2)):
    sd = engine.generate(target, TEACHER, prompts, max_new_tokens=24, stop_at_eos=False,
                         stack=Stack(drafter, tree), draft=DraftWeights.create(loaded, loaded_vocab))
    assert sd.tokens == ar.tokens
    assert sum(sd.accepted_per_depth) > 0   # the trained draft is accepted somewhere
