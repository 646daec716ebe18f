"""Training drafts on a tiny teacher's features: the loss falls, resume is exact, a saved draft
loads back into a stack that decodes like `ar`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.decode import engine
from hitree_jax.decode.drafters import DraftWeights
from hitree_jax.decode.stack import Stack
from hitree_jax.heads import eagle, medusa
from hitree_jax.model.llama import with_decode_head
from hitree_jax.heads import saved
from hitree_jax.train import distill, heads
from hitree_jax.tree import shapes as tree_lib
from tests.helpers import TEACHER  # test_distill's; its params and data: conftest's teacher_params and distill_data


TAPS = (0, 1)  # an EAGLE-3 draft's: both of the teacher's layers before its last


def label(tmp_path_factory, params, windows_and_vocab, taps=()):
  """Windows labelled with the teacher's top-8 and its features, in the launcher's way."""
  windows, _, _, vocab = windows_and_vocab
  path = tmp_path_factory.mktemp("labels") / "labels.npz"
  labels = distill.label_windows(path, windows, params, TEACHER, k=8, chunk=16, features=True, taps=taps)
  assert labels["features"].shape == (*windows.shape, (len(taps) + 1) * TEACHER.hidden_size)
  return (labels["tokens"], labels["features"], *distill.sparse_targets(labels["ids"], labels["log_probs"],
                                                                        vocab)), vocab


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, teacher_params, distill_data):
  return label(tmp_path_factory, teacher_params, distill_data)


@pytest.fixture(scope="module")
def labelled_taps(tmp_path_factory, teacher_params, distill_data):
  """The same windows, with the teacher's tapped layers' states before its final ones."""
  return label(tmp_path_factory, teacher_params, distill_data, TAPS)


def setup(kind, vocab):
  """(config, initial params, objective) of a draft of this kind on the tiny teacher."""
  config = eagle.layer_config(TEACHER, vocab.size)
  if kind.startswith("eagle"):
    taps = len(TAPS) if kind == "eagle3" else 0
    return config, eagle.init_params(config, jax.random.key(0), taps), heads.eagle_objective(config, True)
  return config, medusa.init_params(2, TEACHER.hidden_size), heads.medusa_objective(2, True)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_training_lowers_the_loss(tmp_path, teacher_params, request, kind):
  train, vocab = request.getfixturevalue("labelled_taps" if kind == "eagle3" else "labelled")
  config, params, objective = setup(kind, vocab)
  frozen = saved.frozen_arrays(with_decode_head(teacher_params, TEACHER), vocab)
  before, agree_before = distill.evaluate_loss(params, objective, train, 8, frozen)
  params, history = distill.train(tmp_path, config, params, train, None, steps=80, batch=8, lr=1e-2,
                                  warmup=3, seed=0, log_every=20, objective=objective, frozen=frozen)
  after, agree_after = distill.evaluate_loss(params, objective, train, 8, frozen)
  assert [h["step"] for h in history] == [20, 40, 60, 80]
  # Above the floor of the cross-entropy terms (the teacher's entropy: EAGLE has two passes,
  # Medusa's two heads weigh 1 and 0.8), the loss fell: by a fifth for EAGLE; less for heads
  # that must guess the teacher's next tokens without seeing the ones in between.
  probs = train[3]
  entropy = float(np.mean(-np.sum(np.where(probs > 0, probs * np.log(np.maximum(probs, 1e-30)), 0), -1)))
  floor, fall, gain = (2.0 * entropy, 0.8, 0.1) if kind != "medusa" else (1.8 * entropy, 0.95, 0.05)
  assert after - floor < fall * (before - floor) and agree_after > agree_before + gain, (
      before, after, floor, agree_before, agree_after)


def test_interrupted_training_resumes_to_the_same_weights(tmp_path, teacher_params, labelled):
  train, vocab = labelled
  config, params, objective = setup("eagle", vocab)
  frozen = saved.frozen_arrays(with_decode_head(teacher_params, TEACHER), vocab)
  kwargs = dict(batch=8, lr=1e-2, warmup=2, seed=3, save_every=2, log_every=1, objective=objective,
                frozen=frozen)
  straight, _ = distill.train(tmp_path / "a", config, params, train, None, steps=6, **kwargs)
  distill.train(tmp_path / "b", config, params, train, None, steps=6, until=3, **kwargs)
  resumed, history = distill.train(tmp_path / "b", config, params, train, None, steps=6, **kwargs)
  assert [h["step"] for h in history] == [4, 5, 6]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), straight, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_saved_draft_loads_into_a_stack_that_decodes_like_ar(tmp_path, teacher_params, labelled, kind):
  _, vocab = labelled
  _, params, _ = setup(kind, vocab)
  params = jax.tree.map(lambda x: x + 0.01, params)  # not the initial values
  taps = {"taps": list(TAPS)} if kind == "eagle3" else {}
  kind = kind.rstrip("3")
  saved.save(tmp_path / kind, kind, params, TEACHER, vocab, {"command": "test", **taps})
  target = with_decode_head(teacher_params, TEACHER)
  meta, loaded, loaded_vocab = saved.load(tmp_path / kind, target, TEACHER, kind)
  assert meta["kind"] == kind and np.array_equal(loaded_vocab.target_ids, vocab.target_ids)
  assert getattr(saved.drafter(meta, TEACHER), "taps", ()) == tuple(taps.get("taps", ()))
  assert set(loaded) == {*params, "head"}
  for name, value in params.items():
    jax.tree.map(np.testing.assert_array_equal, value, loaded[name])
  stack = Stack(saved.drafter(meta, TEACHER), tree_lib.chain(2))
  prompts = [[5, 9, 3, 17, 1, 30], [7, 7, 8]]
  ar = engine.generate(target, TEACHER, prompts, max_new_tokens=12, stop_at_eos=False)
  sd = engine.generate(target, TEACHER, prompts, max_new_tokens=12, stop_at_eos=False, stack=stack,
                       draft=DraftWeights.create(loaded, loaded_vocab))
  assert sd.tokens == ar.tokens
  other = "medusa" if kind == "eagle" else "eagle"
  with pytest.raises(ValueError, match=f"holds {kind} heads, not {other}"):
    saved.read_meta(tmp_path / kind, other)
  with pytest.raises(ValueError, match="trained for another target: hidden_size 32"):
    saved.check_target(meta, TEACHER.replace(hidden_size=48, head_dim=12), tmp_path / kind)
  with pytest.raises(ValueError, match="another target: qkv_bias False .this target: True."):
    saved.check_target(meta, TEACHER.replace(qkv_bias=True), tmp_path / kind)  # a Qwen2 of its shape
  old_file = {k: v for k, v in meta.items() if not k.endswith("_bias")}  # saved before biases were
  saved.check_target(old_file, TEACHER, tmp_path / kind)
  with pytest.raises(FileNotFoundError, match="expected a folder with heads.json"):
    saved.read_meta(tmp_path / "missing", kind)
  assert jnp.all(jnp.isfinite(loaded["head"]))


@pytest.mark.slow
def test_own_text_is_the_teachers_continuation_of_book_windows(teacher_params, distill_data):
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.train import teacher
  windows = distill_data[0][:5]
  greedy = SamplingParams.create(0.0)
  own = teacher.own_continuations(teacher_params, TEACHER, windows, 16, greedy, batch=4)
  assert own.shape == windows.shape and np.array_equal(own[:, :16], windows[:, :16])
  expected = engine.generate(teacher_params, TEACHER, windows[:, :16], max_new_tokens=windows.shape[1] - 16,
                             sampling=greedy, stop_at_eos=False).tokens
  assert own[:, 16:].tolist() == expected
  assert not np.array_equal(own[:, 16:], windows[:, 16:])  # not the book's text
